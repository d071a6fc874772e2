use std::time::Instant;
fn main() {
    let (n, k) = (
        std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(49152usize),
        std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(576usize),
    );
    let w: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32).collect();
    let x: Vec<f32> = (0..k).map(|i| (i % 3) as f32).collect();
    let mut y = vec![0.0; n];
    let reps = (200_000_000 / (n * k)).max(3);
    for _ in 0..2 {
        kernels::cpu::matmul::matmul_t(&x, &w, &mut y, 1, n, k);
    }
    let t = Instant::now();
    for _ in 0..reps {
        kernels::cpu::matmul::matmul_t(&x, &w, &mut y, 1, n, k);
    }
    let s = t.elapsed().as_secs_f64() / reps as f64;
    println!("{n}x{k}: {:.1} us, {:.1} GB/s", s * 1e6, (n * k * 4) as f64 / s / 1e9);
}
