//! GGUF parsing and exact dequantization on hand-built files; the Q/K unpermutation.

use engine::convert::gguf::{GgmlType, Gguf, Value};
use engine::convert::unpermute_rows;
use half::f16;

fn string(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// A GGUF v3 file with the given tensors `(name, ggml dims, type id, data)`.
fn gguf_file(tensors: &[(&str, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend(2u64.to_le_bytes());
    string(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    string(&mut b, "llama");
    string(&mut b, "test.list");
    b.extend(9u32.to_le_bytes());
    b.extend(5u32.to_le_bytes()); // i32 elements
    b.extend(2u64.to_le_bytes());
    b.extend((-7i32).to_le_bytes());
    b.extend(9i32.to_le_bytes());
    let mut offset = 0u64;
    let mut data = Vec::new();
    for (name, dims, ty, bytes) in tensors {
        string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        data.extend(bytes);
        while data.len() % 32 != 0 {
            data.push(0);
        }
        offset = data.len() as u64;
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend(data);
    b
}

#[test]
fn dequantizes_q4_1_q8_0_q4_0_and_f32_exactly() {
    // Q4_1: d = 0.5, m = −1; byte j holds (lo = j, hi = 15 − j) → x[j] = 0.5j − 1, x[j+16] = 0.5(15 − j) − 1.
    let mut q41 = Vec::new();
    q41.extend(f16::from_f32(0.5).to_le_bytes());
    q41.extend(f16::from_f32(-1.0).to_le_bytes());
    q41.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    // Q8_0 two blocks: d = 0.25 with q = −16..16, and d = 2 with q = 1.
    let mut q80 = Vec::new();
    q80.extend(f16::from_f32(0.25).to_le_bytes());
    q80.extend((0..32).map(|j| (j as i8 - 16) as u8));
    q80.extend(f16::from_f32(2.0).to_le_bytes());
    q80.extend([1u8; 32]);
    // Q4_0: d = 1; every nibble 3 → x = 3 − 8 = −5.
    let mut q40 = f16::from_f32(1.0).to_le_bytes().to_vec();
    q40.extend([0x33u8; 16]);
    let f32s: Vec<u8> = [1.5f32, -2.25, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let bytes = gguf_file(&[
        ("a", vec![32], 3, q41),
        ("b", vec![32, 2], 8, q80),
        ("c", vec![32], 2, q40),
        ("d", vec![3], 0, f32s),
    ]);
    let path = tests::temp_dir("gguf").join("t.gguf");
    std::fs::write(&path, bytes).unwrap();
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.get("general.architecture"), Some(&Value::Str("llama".into())));
    assert_eq!(g.get("test.list"), Some(&Value::Array(vec![Value::Int(-7), Value::Int(9)])));
    let a = g.tensor("a").unwrap();
    assert_eq!(a.ty, GgmlType::Q4_1);
    let want: Vec<f32> =
        (0..16).map(|j| 0.5 * j as f32 - 1.0).chain((0..16).map(|j| 0.5 * (15 - j) as f32 - 1.0)).collect();
    assert_eq!(g.dequantize(a).unwrap(), want);
    let b = g.tensor("b").unwrap();
    assert_eq!(b.shape(), vec![2, 32]);
    let want: Vec<f32> = (0..32).map(|j| 0.25 * (j - 16) as f32).chain(std::iter::repeat_n(2.0, 32)).collect();
    assert_eq!(g.dequantize(b).unwrap(), want);
    assert_eq!(g.dequantize(g.tensor("c").unwrap()).unwrap(), vec![-5.0; 32]);
    assert_eq!(g.dequantize(g.tensor("d").unwrap()).unwrap(), vec![1.5, -2.25, 3.0]);
}

#[test]
fn rejects_truncated_and_foreign_files() {
    let dir = tests::temp_dir("gguf-bad");
    let p = dir.join("x.gguf");
    std::fs::write(&p, b"GGML....").unwrap();
    assert!(Gguf::open(&p).err().unwrap().to_string().contains("not a GGUF file"));
    let mut bytes = gguf_file(&[("d", vec![3], 0, vec![0; 12])]);
    bytes.truncate(bytes.len() - 40);
    std::fs::write(&p, bytes).unwrap();
    let e = Gguf::open(&p).err().unwrap().to_string();
    assert!(e.contains("x.gguf") && e.contains("`d` extends past the end"), "{e}");
}

#[test]
fn unpermute_inverts_llama_cpp_permute() {
    // llama.cpp convert_hf_to_gguf.py LlamaModel.permute:
    //   w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).reshape(rows, cols)
    // i.e. GGUF row h·D + 2i + s holds HF row h·D + s·D/2 + i.
    let (n_head, d, cols) = (3, 8, 2);
    let rows = n_head * d;
    let hf: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
    let mut permuted = vec![0.0; hf.len()];
    for h in 0..n_head {
        for s in 0..2 {
            for i in 0..d / 2 {
                let (src, dst) = (h * d + s * d / 2 + i, h * d + 2 * i + s);
                permuted[dst * cols..(dst + 1) * cols].copy_from_slice(&hf[src * cols..(src + 1) * cols]);
            }
        }
    }
    assert_eq!(permuted[2 * cols], hf[cols], "GGUF row 2 is HF row 1");
    assert_eq!(unpermute_rows(&permuted, rows, cols, n_head), hf);
}
