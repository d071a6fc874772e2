//! The CPU GEMMs, batch-invariant: `y [m, n] = x [m, k] · w [n, k]ᵀ` over weights packed in
//! column panels ([`matmul_packed`]), and the weight gradient `dW [n, k] = dyᵀ · x` on
//! row-major operands ([`grad_weight`]).
//!
//! Weights are packed once (at model load) into panels of `NP = 64` output columns:
//! `packed[(p·k + l)·NP + c] = w[p·NP + c, l]` (zero-padded past `n`), so every kernel reads
//! them as contiguous vectors.
//!
//! Reduction order (the contract): every output element is one sequential FMA chain,
//! `acc = 0; for l in 0..k { acc = fma(x[i, l], w[j, l], acc) }` (for `dW[j, l]` the chain
//! runs over the rows `i` of `dy` and `x` in order). Vector lanes hold *different* outputs,
//! never partial sums of one output, so the result of `y[i, j]` does not depend on `m`, the
//! tile it falls in, the thread computing it, or the instruction set (AVX-512, AVX2 and the
//! portable `mul_add` loop agree bitwise): a token's logits are bitwise equal whether it is
//! decoded alone, prefilled in a chunk, or batched with 63 other sequences (what batch
//! invariance and the learner's ℓ = μ check, DESIGN-NOTES §3, rest on; the approach of
//! Thinking Machines' "Defeating Nondeterminism in LLM Inference", 2025).
//!
//! Both GEMMs are one driver over the register tile of [`super::gemm_tile`] (6 rows × 64
//! columns): rayon tasks own (row block, column panel) pairs, panel-major, and sweep their
//! tiles over the reduction in blocks of `KC` steps (each output's chain continued from
//! memory, bitwise the same chain), so the operands of a block stay in L2.

use super::gemm_tile::{self, Isa, Tile, MR, NR};
use rayon::prelude::*;

/// Output columns per packed panel.
pub const NP: usize = NR;
/// Rows of the output per rayon task (8 register tiles).
const MB: usize = 8 * MR;
/// Steps of the reduction per pass over a task's tiles: the `B` rows of a pass (64 KiB) stay
/// in L2 while the tiles sweep them; the next pass continues the chains from the stored
/// outputs, so each output is still one FMA chain in order.
const KC: usize = 256;
/// Row stride (floats) of a transposed `A` above which its blocks are packed (a 4 KiB page).
const PACK_STRIDE: usize = 1024;
/// Multiply-adds below which a GEMM runs on the calling thread.
const INLINE_WORK: usize = 1 << 18;

/// Packs `w [n, k]` (row-major) into column panels; length `n.div_ceil(NP) · k · NP`. Each
/// panel is the transpose of 64 rows of `w`, moved in 16 × 16 register blocks where AVX-512
/// is available (data movement only: the same values as the scalar copy, which does the
/// rest). The optimizer lays out every step like this, so it is on the learner's path.
pub fn pack(w: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert_eq!(w.len(), n * k);
    let mut out = vec![0.0f32; n.div_ceil(NP) * k * NP];
    let wide = wide_pack();
    out.par_chunks_mut(k * NP).enumerate().for_each(|(p, panel)| {
        let live = NP.min(n - p * NP);
        pack_panel(|c| &w[(p * NP + c) * k..(p * NP + c + 1) * k], live, k, panel, wide);
    });
    out
}

/// Whether [`pack_panel`] may move 16 × 16 register blocks (AVX-512 detected).
pub(crate) fn wide_pack() -> bool {
    #[cfg(target_arch = "x86_64")]
    return Isa::detect() == Isa::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// One panel of [`pack`]: `panel [k, NP]` gets the transpose of the `live ≤ NP` rows
/// `row(0..live)` (each `k` long); its columns past `live` are left as they are (zeros in a
/// zeroed buffer). `wide` from [`wide_pack`].
pub(crate) fn pack_panel<'a>(row: impl Fn(usize) -> &'a [f32], live: usize, k: usize, panel: &mut [f32], wide: bool) {
    assert!(live <= NP && panel.len() == k * NP);
    // Columns c0.. of the panel and reduction steps l0.. already moved in blocks.
    let (mut c_done, mut l_done) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if wide && k >= 16 {
        (c_done, l_done) = (live / 16 * 16, k / 16 * 16);
        for c0 in (0..c_done).step_by(16) {
            let rows: [&[f32]; 16] = std::array::from_fn(|i| row(c0 + i));
            for l0 in (0..l_done).step_by(16) {
                // SAFETY: AVX-512 detected (`wide`); rows hold k ≥ l0 + 16 values; the panel
                // holds k·NP ≥ (l0 + 15)·NP + c0 + 16 values.
                unsafe { super::simd::transpose16(&rows, l0, panel.as_mut_ptr().add(l0 * NP + c0), NP) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = wide;
    for c in 0..live {
        let r = row(c);
        let from = if c < c_done { l_done } else { 0 };
        for (l, &v) in r.iter().enumerate().skip(from) {
            panel[l * NP + c] = v;
        }
    }
}

/// Inverse of [`pack`]: `w [n, k]` row-major.
pub fn unpack(packed: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut w = vec![0.0f32; n * k];
    w.par_chunks_mut(k).enumerate().for_each(|(j, row)| {
        let (p, c) = (j / NP, j % NP);
        for (l, v) in row.iter_mut().enumerate() {
            *v = packed[(p * k + l) * NP + c];
        }
    });
    w
}

/// `y [m, n] = x · wᵀ` with `x [m, k]`, `packed` from [`pack`] of `w [n, k]`.
pub fn matmul_packed(x: &[f32], packed: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert!(x.len() == m * k && packed.len() == n.div_ceil(NP) * k * NP);
    // Row i of x is a[i·k ..] (step 1); panel p of the weights is packed[p·k·NP ..], its
    // row l at l·NP.
    // SAFETY: the asserted lengths cover every element the strides name.
    output(m * n, |c| unsafe {
        Gemm { a: x.as_ptr(), a_rs: k, a_ls: 1, b: packed.as_ptr(), b_ps: k * NP, ldb: NP, k, c }.run(m, n)
    })
}

/// A GEMM's `len` outputs, written by `run` (given the buffer's pointer) without a zero fill
/// first: [`Gemm::run`] stores every output of its `rows × cols` in the first reduction block
/// (`accumulate: false`, also when `k = 0`) before anything reads it.
fn output(len: usize, run: impl FnOnce(Out)) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(len);
    run(Out(v.as_mut_ptr()));
    // SAFETY: `run` initialised all `len` elements of the spare capacity (see above).
    unsafe { v.set_len(len) };
    v
}

/// `dW [n, k] = dyᵀ · x` for row-major `dy [m, n]`, `x [m, k]`, `dw [n, k]`: row `j` of the
/// tile operand is column `j` of `dy` (stride `n` over the reduction), the column panels are
/// `x`'s own rows: no transposes, no packing. `dW[j, l]`'s chain runs over `i = 0..m` in order.
pub fn grad_weight(dy: &[f32], x: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert!(dy.len() == m * n && x.len() == m * k);
    // SAFETY: the asserted lengths cover every element the strides name; the last panel's
    // columns past k are masked off by the tile.
    output(n * k, |c| unsafe {
        Gemm { a: dy.as_ptr(), a_rs: 1, a_ls: n, b: x.as_ptr(), b_ps: NP, ldb: k, k: m, c }.run(n, k)
    })
}

/// `dx [m, k] = dy · W` for row-major `dy [m, n]`, `w [n, k]`: the tile operand is `dy`'s
/// rows, the column panels are 64-column strips of `w` read in place (row stride `k`): the
/// weight is never transposed. `dx[i, l]`'s chain runs over `j = 0..n` in order.
pub fn grad_input(dy: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert!(dy.len() == m * n && w.len() == n * k);
    // SAFETY: the asserted lengths cover every element the strides name; the last panel's
    // columns past k are masked off by the tile.
    output(m * k, |c| unsafe {
        Gemm { a: dy.as_ptr(), a_rs: n, a_ls: 1, b: w.as_ptr(), b_ps: NP, ldb: k, k: n, c }.run(m, k)
    })
}

/// The output pointer, shared by tasks that write disjoint tiles of it.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint (row block, panel) tiles of one buffer.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// `c [rows, cols] = A · B` (row-major `c`, `ldc = cols`) over the reduction length `k`:
/// `A[i, l] = a[i·a_rs + l·a_ls]`, and column panel `p` of `B` (columns `p·NP ..`) has its
/// row `l` at `b[p·b_ps + l·ldb ..]`.
struct Gemm {
    a: *const f32,
    a_rs: usize,
    a_ls: usize,
    b: *const f32,
    b_ps: usize,
    ldb: usize,
    k: usize,
    c: Out,
}
// SAFETY: the operands are only read.
unsafe impl Sync for Gemm {}

impl Gemm {
    /// # Safety
    /// Every element named by the strides for `rows × cols` outputs is in bounds (`B`'s last
    /// panel needs only its columns below `cols`).
    unsafe fn run(&self, rows: usize, cols: usize) {
        if rows == 0 || cols == 0 {
            return;
        }
        let (panels, blocks) = (cols.div_ceil(NP), rows.div_ceil(MB));
        let isa = Isa::detect();
        let task = |task: usize| {
            let (p, rb) = (task / blocks, task % blocks);
            let (r0, r1) = (rb * MB, (rb * MB + MB).min(rows));
            // A read across rows with a stride past a page (the weight gradient's dy columns
            // when dy is wide: a TLB miss per step) is first copied into a contiguous
            // [kc][r1 − r0] block.
            let transposed = self.a_rs == 1 && self.a_ls > PACK_STRIDE;
            let mut block = Vec::new();
            for k0 in (0..self.k.div_ceil(KC).max(1)).map(|c| c * KC) {
                let kc = KC.min(self.k - k0);
                let (a, a_rs, a_ls) = if transposed {
                    block.clear();
                    for l in k0..k0 + kc {
                        // SAFETY: row l of the A operand, its columns r0..r1 (caller's bounds).
                        block.extend_from_slice(unsafe {
                            std::slice::from_raw_parts(self.a.add(l * self.a_ls + r0), r1 - r0)
                        });
                    }
                    (block.as_ptr(), 1, r1 - r0)
                } else {
                    (self.a.wrapping_add(r0 * self.a_rs + k0 * self.a_ls), self.a_rs, self.a_ls)
                };
                let mut i = r0;
                while i < r1 {
                    let tile = Tile {
                        a: a.wrapping_add((i - r0) * a_rs),
                        a_rs,
                        a_ls,
                        b: self.b.wrapping_add(p * self.b_ps + k0 * self.ldb),
                        ldb: self.ldb,
                        k: kc,
                        c: self.c.0.wrapping_add(i * cols + p * NP),
                        ldc: cols,
                        rows: (r1 - i).min(MR),
                        cols: NP.min(cols - p * NP),
                        accumulate: k0 > 0,
                    };
                    // SAFETY: the tile lies inside the operands (caller) or `block`, `isa`
                    // was detected, and no other task writes its outputs.
                    unsafe { gemm_tile::run(isa, &tile) };
                    i += tile.rows;
                }
            }
        };
        // Small products (a decode step's projections) run on the calling thread: waking the
        // pool costs more than the work.
        if rows * cols * self.k < INLINE_WORK {
            (0..panels * blocks).for_each(task);
        } else {
            (0..panels * blocks).into_par_iter().for_each(task);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`pack`] (register blocks plus scalar edges) against the layout's definition,
    /// `packed[(p·k + l)·NP + c] = w[p·NP + c, l]` with zeros past `n`, on sizes with partial
    /// 16-blocks and panels in both dimensions; [`unpack`] inverts it.
    #[test]
    fn pack_is_the_panel_layout() {
        for (n, k) in [(150usize, 37usize), (64, 16), (17, 100), (5, 3)] {
            let w: Vec<f32> = (0..n * k).map(|i| i as f32 * 0.5 - 3.0).collect();
            let packed = pack(&w, n, k);
            let mut want = vec![0.0f32; n.div_ceil(NP) * k * NP];
            for j in 0..n {
                for l in 0..k {
                    want[((j / NP) * k + l) * NP + j % NP] = w[j * k + l];
                }
            }
            assert!(packed.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "pack {n} × {k}");
            assert_eq!(unpack(&packed, n, k), w, "unpack {n} × {k}");
        }
    }
}
