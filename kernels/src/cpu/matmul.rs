//! The CPU GEMMs, batch-invariant: `y [m, n] = x [m, k] · w [n, k]ᵀ` over weights packed in
//! column panels ([`matmul_packed`]), the weight gradient `dW [n, k] = dyᵀ · x` in the same
//! layout after two copies ([`grad_weight`]), and `dx = dy · W` from the same panels
//! ([`grad_input`]): the packed weight is the only copy of a linear weight.
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
//! All three are one driver over the register tile of [`super::gemm_tile`] (6 rows × 64
//! columns): rayon tasks own (row block, column panel) pairs, panel-major, and sweep their
//! tiles over the reduction in blocks of `KC` steps (each output's chain continued from
//! memory, bitwise the same chain), so the operands of a block stay in L2.

use super::gemm_tile::{self, Isa, Tile, MR, NR};
use super::simd::wide_transpose;
use super::HostBuf;
use rayon::prelude::*;

/// Output columns per packed panel.
pub const NP: usize = NR;
/// Rows of the output per rayon task, at most (8 register tiles): the rows are split into
/// `rows.div_ceil(MB)` blocks of equal size rounded up to a tile ([`Gemm::run`]), so a
/// 64-row decode batch gets blocks of 36 + 28 rows instead of 48 + 16, tasks of 6 and 4.7 tiles
/// instead of 8 and 2.7 (64-sequence decode steps on 2 threads, 5 alternations: median 122.5 →
/// 112.3 ms per step).
const MB: usize = 8 * MR;
/// Steps of the reduction per pass over a task's tiles: the `B` rows of a pass (32 KiB) stay
/// in L1 (48 KiB on current x86 cores) while the tiles sweep them; the next pass continues the
/// chains from the stored outputs, so each output is still one FMA chain in order. With 256
/// steps (64 KiB, from L2) a learner step at 8 × (128 + 128) tokens took 6.82–6.99 s against
/// 6.54–6.96 s with 128 (both with the tiles' `a` prefetch; 3 alternations, Xeon VM,
/// 2 threads, L1d 48 KiB, L2 2 MiB).
const KC: usize = 128;
/// No lines to prefetch ([`Tile::next_lines`]).
const NO_LINES: (*const f32, usize) = (std::ptr::null(), 0);
/// Multiply-adds below which a GEMM runs on the calling thread.
const INLINE_WORK: usize = 1 << 18;

/// Packs `w [n, k]` (row-major) into column panels; length `n.div_ceil(NP) · k · NP`. Each
/// panel is the transpose of 64 rows of `w`, moved in 16 × 16 register blocks where AVX-512
/// or AVX2 is available (data movement only: the same values as the scalar copy, which does the
/// rest). The optimizer lays out every step like this, so it is on the learner's path.
pub fn pack(w: &[f32], n: usize, k: usize) -> Vec<f32> {
    // SAFETY: pack_into writes every value of the output.
    output(n.div_ceil(NP) * k * NP, |out| unsafe { pack_into(w, n, k, out) })
}

/// [`pack`] into a [`HostBuf::huge`]: a model's weights, which every decode step streams
/// from memory whole (the learner updates them in place, so they live as long as the model).
pub fn pack_weight(w: &[f32], n: usize, k: usize) -> HostBuf {
    // SAFETY: pack_into writes every value of the output.
    unsafe { HostBuf::huge(n.div_ceil(NP) * k * NP, |out| pack_into(w, n, k, Out(out))) }
}

/// [`pack`]'s body: writes all `n.div_ceil(NP) · k · NP` values at `out`.
///
/// # Safety
/// `out` is writable for that many values, which no other thread accesses.
unsafe fn pack_into(w: &[f32], n: usize, k: usize, out: Out) {
    assert_eq!(w.len(), n * k);
    let wide = wide_transpose();
    (0..n.div_ceil(NP)).into_par_iter().for_each(|p| {
        let live = NP.min(n - p * NP);
        let panel = out.at(p * k * NP);
        // SAFETY: panel p's k·NP values, this task's alone: the transpose writes the
        // `live` columns of every row, the loop below the padding columns.
        unsafe {
            transpose_into(|c| &w[(p * NP + c) * k..(p * NP + c + 1) * k], live, k, panel, NP, wide);
            for l in 0..k {
                std::ptr::write_bytes(panel.add(l * NP + live), 0, NP - live);
            }
        }
    });
}

/// One panel of [`pack`]: `panel [k, NP]` gets the transpose of the `live ≤ NP` rows
/// `row(0..live)` (each `k` long); its columns past `live` are left as they are (zeros in a
/// zeroed buffer). `wide` from [`wide_transpose`].
pub(crate) fn pack_panel<'a>(row: impl Fn(usize) -> &'a [f32], live: usize, k: usize, panel: &mut [f32], wide: bool) {
    assert!(live <= NP && panel.len() == k * NP);
    // SAFETY: the panel holds (k − 1)·NP + live values.
    unsafe { transpose_into(row, live, k, panel.as_mut_ptr(), NP, wide) }
}

/// `dst[l·ld + c] = row(c)[l]` for `c < live`, `l < k`: the transpose of `live` rows (each
/// `k` long), moved in 16 × 16 register blocks where `wide` ([`wide_transpose`]) and by a scalar copy
/// for the rest (data movement only: the same values either way).
///
/// # Safety
/// `live ≤ ld`; `dst` is writable at every `l·ld + c` named, and no other thread writes there.
pub(crate) unsafe fn transpose_into<'a>(
    row: impl Fn(usize) -> &'a [f32],
    live: usize,
    k: usize,
    dst: *mut f32,
    ld: usize,
    wide: bool,
) {
    // Columns c0.. of dst and reduction steps l0.. already moved in blocks.
    let (mut c_done, mut l_done) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if wide && k >= 16 {
        (c_done, l_done) = (live / 16 * 16, k / 16 * 16);
        let groups: Vec<[&[f32]; 16]> =
            (0..c_done).step_by(16).map(|c0| std::array::from_fn(|i| row(c0 + i))).collect();
        // Each 16-step band of dst is finished (all its column groups) before the next: with
        // the groups outermost, a panel wider than the caches was written once per group.
        for l0 in (0..l_done).step_by(16) {
            for (g, rows) in groups.iter().enumerate() {
                // SAFETY: a register variant detected (`wide`); rows hold k ≥ l0 + 16 values; dst is
                // writable at (l0 + e)·ld + 16g + i for e, i < 16 (caller).
                unsafe { super::simd::transpose16(rows, l0, dst.add(l0 * ld + 16 * g), ld) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = wide;
    for c in 0..live {
        let r = row(c);
        let from = if c < c_done { l_done } else { 0 };
        for (l, &v) in r.iter().enumerate().take(k).skip(from) {
            // SAFETY: in dst's named range (caller).
            unsafe { *dst.add(l * ld + c) = v };
        }
    }
}

/// Inverse of [`pack`]: `w [n, k]` row-major.
pub fn unpack(packed: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert_eq!(packed.len(), n.div_ceil(NP) * k * NP);
    let wide = wide_transpose();
    output(n * k, |w| {
        (0..n.div_ceil(NP)).into_par_iter().for_each(|p| {
            // SAFETY: rows p·NP .. of the output, this task's alone.
            unsafe {
                unpack_panel(&packed[p * k * NP..(p + 1) * k * NP], NP.min(n - p * NP), k, w.at(p * NP * k), wide)
            };
        });
    })
}

/// Rows `ids` of `w [n, k]` from its [`pack`] layout, row-major `[ids.len(), k]`: row `r`
/// is column `r mod NP` of panel `r / NP` (a stride of `NP` values). A tied embedding's
/// lookup reads its LM head's buffer this way, so the model keeps one copy of the matrix.
pub fn packed_rows(packed: &[f32], n: usize, k: usize, ids: &[u32]) -> Vec<f32> {
    assert_eq!(packed.len(), n.div_ceil(NP) * k * NP);
    let mut y = Vec::with_capacity(ids.len() * k);
    for &r in ids {
        let r = r as usize;
        assert!(r < n, "row {r} of {n}");
        let col = &packed[(r / NP) * k * NP + r % NP..];
        y.extend((0..k).map(|l| col[l * NP]));
    }
    y
}

/// The `live ≤ NP` rows (each `k` long) of one [`pack`] panel into `dst` row-major.
///
/// # Safety
/// `dst` is writable for `live · k` values that no other thread writes.
unsafe fn unpack_panel(panel: &[f32], live: usize, k: usize, dst: *mut f32, wide: bool) {
    assert!(live <= NP && panel.len() == k * NP);
    // dst[c·k + l] = panel[l·NP + c]: the transpose of the panel's k rows (each NP long).
    // SAFETY: forwarded (the caller's dst range).
    unsafe { transpose_into(|l| &panel[l * NP..(l + 1) * NP], k, live, dst, k, wide) }
}

/// `y [m, n] = x · wᵀ` with `x [m, k]`, `packed` from [`pack`] of `w [n, k]`.
pub fn matmul_packed(x: &[f32], packed: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert!(x.len() == m * k && packed.len() == n.div_ceil(NP) * k * NP);
    // Row i of x is a[i·k ..] (step 1); panel p of the weights is packed[p·k·NP ..], its
    // row l at l·NP.
    // SAFETY: the asserted lengths cover every element the strides name.
    output(m * n, |c| unsafe {
        Gemm { a: x.as_ptr(), a_rs: k, a_ks: 0, b: packed.as_ptr(), b_ps: k * NP, ldb: NP, k, c }.run(m, n)
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

/// `dW [n, k] = dyᵀ · x` for row-major `dy [m, n]`, `x [m, k]`, `dw [n, k]`, in the
/// forward's layout: the tile operand is `dyᵀ` (rows contiguous, transposed here in chunks of
/// at most [`DYT_FLOATS`]) and the column panels are `x`'s 64-column strips, each copied
/// into one contiguous `[m, NP]` block (the packing of `xᵀ`). Read in place, both operands
/// have strides past what the hardware prefetchers follow (2 KiB); the two copies move
/// `m·(n + k)` values for `2·m·n·k` flops and the GEMM runs near the forward's speed (1.4–1.9×
/// the in-place version at m = 2048 on the MLP and LM-head shapes). `dW[j, l]`'s chain runs over `i = 0..m` in order.
pub fn grad_weight(dy: &[f32], x: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert!(dy.len() == m * n && x.len() == m * k);
    let strips = column_strips(x, m, k);
    let chunk = (DYT_FLOATS / m.max(1)).clamp(NP, n.max(NP));
    let wide = wide_transpose();
    output(n * k, |c| {
        let mut dyt: Vec<f32> = Vec::with_capacity(chunk.min(n) * m);
        for j0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - j0);
            let t = Out(dyt.as_mut_ptr());
            // dyt [rows, m] = dy[:, j0 .. j0 + rows]ᵀ, 64 rows of dy per task.
            (0..m.div_ceil(NP)).into_par_iter().for_each(|b| {
                let (i0, live) = (b * NP, NP.min(m - b * NP));
                let row = |r: usize| &dy[(i0 + r) * n + j0..(i0 + r) * n + j0 + rows];
                // SAFETY: columns i0 .. i0 + live of the rows × m block, this task's alone.
                unsafe { transpose_into(row, live, rows, t.at(i0), m, wide) };
            });
            // SAFETY: the transpose wrote all rows · m values; `strips` holds k.div_ceil(NP)
            // panels of m·NP (their columns past k are masked off by the tile); the output
            // rows j0 .. j0 + rows are in bounds.
            unsafe {
                dyt.set_len(rows * m);
                let out = Out(c.0.add(j0 * k));
                Gemm { a: dyt.as_ptr(), a_rs: m, a_ks: 0, b: strips.as_ptr(), b_ps: m * NP, ldb: NP, k: m, c: out }
                    .run(rows, k);
            }
        }
    })
}

/// Values of `dyᵀ` transposed at a time by [`grad_weight`] (16 MiB: all of it for the
/// decoder layers at m = 2048, the LM head's in 85 chunks).
const DYT_FLOATS: usize = 1 << 22;

/// `x [m, k]`'s 64-column strips, strip `p` a contiguous `[m, NP]` block
/// (`out[(p·m + i)·NP + c] = x[i, p·NP + c]`, zeros past `k`): the packing of `xᵀ`.
/// Written once, without a zero fill first (the default model's strips are 64-column exact, so
/// zeros would be written only to be overwritten: 200 M values per learner step at m = 2048).
fn column_strips(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k);
    output(k.div_ceil(NP) * m * NP, |out| {
        (0..k.div_ceil(NP)).into_par_iter().for_each(|p| {
            let (c0, live) = (p * NP, NP.min(k - p * NP));
            for i in 0..m {
                // SAFETY: row i of strip p (NP values at (p·m + i)·NP), this task's alone: its
                // live columns copied from x, the rest zeroed, so every value is written.
                unsafe {
                    let row = out.at((p * m + i) * NP);
                    std::ptr::copy_nonoverlapping(x.as_ptr().add(i * k + c0), row, live);
                    std::ptr::write_bytes(row.add(live), 0, NP - live);
                }
            }
        });
    })
}

/// `dx [m, k] = dy · W` for row-major `dy [m, n]` and `packed` from [`pack`] of `w [n, k]`,
/// by whichever of two routes moves fewer values (`dx[i, l]`'s chain runs over `j = 0..n`
/// in order on both, so they agree bitwise):
/// - `n·k ≤ m·(n + k)` (a learner batch): the forward GEMM [`matmul_packed`] over
///   [`pack_transposed`] (`pack(wᵀ)`, `n·k` values moved). At m = 2048 on the default model
///   this replaces transposing `dy` and `dxᵀ` (`m·(n + k)` values) and runs at the forward's
///   speed.
/// - otherwise (few rows): `dxᵀ [k, m] = Wᵀ · dyᵀ` with the weight read in place
///   ([`grad_input_streamed`]).
pub fn grad_input(dy: &[f32], packed: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    match n * k <= m * (n + k) {
        true => grad_input_transposed(dy, packed, m, n, k),
        false => grad_input_streamed(dy, packed, m, n, k),
    }
}

/// [`grad_input`]'s first route: `dy · W` as the forward GEMM over `pack(wᵀ)`.
fn grad_input_transposed(dy: &[f32], packed: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    matmul_packed(dy, &pack_transposed(packed, n, k), m, k, n)
}

/// `pack(wᵀ)` from `packed = pack(w)` for `w [n, k]`: `out[(q·n + j)·NP + c] = w[j, q·NP + c]`
/// (zeros past `k`), length `k.div_ceil(NP) · n · NP`, without a row-major copy: the 64 × 64
/// block of panel `q` at rows `p·NP ..` is contiguous in the output, its transpose is
/// contiguous in `packed` (panel `p`, reduction steps `q·NP ..`), and one task moves each
/// block (16 × 16 register blocks where AVX-512 or AVX2 is available; data movement only).
pub fn pack_transposed(packed: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert_eq!(packed.len(), n.div_ceil(NP) * k * NP);
    let (panels, blocks) = (k.div_ceil(NP), n.div_ceil(NP));
    let wide = wide_transpose();
    output(panels * n * NP, |out| {
        (0..panels * blocks).into_par_iter().for_each(|t| {
            let (q, p) = (t / blocks, t % blocks);
            let (cols, rows) = (NP.min(k - q * NP), NP.min(n - p * NP));
            let src = &packed[(p * k + q * NP) * NP..][..cols * NP];
            let dst = out.at((q * n + p * NP) * NP);
            // SAFETY: block (q, p) of the output, rows × NP values, this task's alone: the
            // transpose writes its `cols` live columns, the loop its padding.
            unsafe {
                transpose_into(|c| &src[c * NP..c * NP + rows], cols, rows, dst, NP, wide);
                for j in 0..rows {
                    std::ptr::write_bytes(dst.add(j * NP + cols), 0, NP - cols);
                }
            }
        });
    })
}

/// [`grad_input`]'s second route, `dxᵀ [k, m] = Wᵀ · dyᵀ`: the tile operand is the weight
/// itself, read in place from its panels (row `l` of `Wᵀ` is contiguous for the 64 reduction
/// steps of each panel, the panels `k·NP` apart), and the column panels are `dyᵀ`'s, packed
/// like a weight (`pack(dy)`: `[n, NP]` blocks of 64 rows of `dy`). Each task streams a
/// block of the weight's rows once for every column panel ([`Gemm::a_ks`]); the small `dxᵀ`
/// is transposed at the end.
fn grad_input_streamed(dy: &[f32], packed: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert!(dy.len() == m * n && packed.len() == n.div_ceil(NP) * k * NP);
    let dyt = pack(dy, m, n);
    // SAFETY: `Wᵀ`'s row l of reduction block p is packed[p·k·NP + l·NP ..][..NP] (the last
    // block's steps past n are not read: the reduction stops at n); dyt holds m.div_ceil(NP)
    // panels of n·NP (columns past m masked off by the tile).
    let dxt = output(k * m, |c| unsafe {
        Gemm { a: packed.as_ptr(), a_rs: NP, a_ks: k * NP, b: dyt.as_ptr(), b_ps: n * NP, ldb: NP, k: n, c }.run(k, m)
    });
    transpose(&dxt, k, m)
}

/// `xᵀ [cols, rows]` of row-major `x [rows, cols]`, 64 rows of `x` per task.
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let wide = wide_transpose();
    output(rows * cols, |t| {
        (0..rows.div_ceil(NP)).into_par_iter().for_each(|b| {
            let (r0, live) = (b * NP, NP.min(rows - b * NP));
            // SAFETY: columns r0 .. r0 + live of the cols × rows output, this task's alone;
            // every output is written by exactly one task.
            unsafe { transpose_into(|r| &x[(r0 + r) * cols..(r0 + r + 1) * cols], live, cols, t.at(r0), rows, wide) };
        });
    })
}

/// Rows per task of a GEMM with a streamed `A` ([`Gemm::a_ks`]): each task streams all of
/// `B` (`dyᵀ`, for the LM head 49,152 × m values) once, so the fewer the tasks the less `B`
/// traffic, while a task's `rows × cols` outputs (continued every 64 steps) should stay in
/// its core's L2. So: the fewest row blocks, a multiple of the thread count, whose outputs
/// fit in [`l2_bytes`]. The LM head's `dx` at m = 1024 took 303–309 ms with blocks of
/// 48 rows (12 tasks) and 227–231 ms with 2 tasks of 288 rows; the MLP's `gate_up` 28.5 →
/// 25.3 ms at m = 2048 (Xeon VM, L2 2 MiB, 2 threads).
fn stream_rows(rows: usize, cols: usize) -> usize {
    let blocks = (rows * cols * size_of::<f32>()).div_ceil(l2_bytes()).next_multiple_of(rayon::current_num_threads());
    rows.div_ceil(blocks).next_multiple_of(MR)
}

/// This CPU's L2 data cache per core, from sysfs (1 MiB where it cannot be read).
fn l2_bytes() -> usize {
    static L2: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *L2.get_or_init(|| {
        let size = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index2/size").unwrap_or_default();
        let size = size.trim();
        let kib = size.strip_suffix('K').and_then(|v| v.parse::<usize>().ok());
        let mib = size.strip_suffix('M').and_then(|v| v.parse::<usize>().ok()).map(|v| v << 10);
        kib.or(mib).map_or(1 << 20, |k| k << 10)
    })
}

/// The output pointer, shared by tasks that write disjoint tiles of it.
#[derive(Clone, Copy)]
struct Out(*mut f32);
impl Out {
    /// The pointer `i` values in (a method, so that closures capture the whole `Out`).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}
// SAFETY: tasks write disjoint (row block, panel) tiles of one buffer.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// `c [rows, cols] = A · B` (row-major `c`, `ldc = cols`) over the reduction length `k`:
/// `A[i, l] = a[i·a_rs + l]` when `a_ks = 0` (contiguous rows), else
/// `A[i, l] = a[(l / NP)·a_ks + i·a_rs + l % NP]` (a packed weight read as `Wᵀ`: its rows are
/// contiguous for `NP` steps at a time); column panel `p` of `B` (columns `p·NP ..`) has its
/// row `l` at `b[p·b_ps + l·ldb ..]`.
struct Gemm {
    a: *const f32,
    a_rs: usize,
    /// Stride between `A`'s reduction blocks of `NP` steps (0: `A`'s rows are contiguous).
    /// Then `A` is the large, streamed operand: a task owns a row block and sweeps every
    /// column panel per reduction block, so each of the weight's values is read from memory
    /// once.
    a_ks: usize,
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
        let isa = Isa::detect();
        // A streamed `A` (a packed weight as `Wᵀ`): reduction blocks of its NP-step runs, and
        // one task per row block over every panel; otherwise one task per (panel, row block).
        let streamed = self.a_ks != 0;
        let mb = match streamed {
            true => stream_rows(rows, cols),
            false => rows.div_ceil(rows.div_ceil(MB)).next_multiple_of(MR),
        };
        let (panels, blocks) = (cols.div_ceil(NP), rows.div_ceil(mb));
        let threads = rayon::current_num_threads();
        // The tasks. A streamed A: one per row block, over every panel. One row block over
        // few panels (a decode step's projections: 9 panels of 64 columns on 2 threads is 5
        // against 4): two tasks per thread, each a contiguous run of 32-column half panels
        // (whole panels where the run covers both halves), so the threads stream equal
        // shares of the weight and each panel row's 256 B are read in one pass. Otherwise
        // one per (panel, row block); consecutive tasks (one thread's share) walk the row
        // blocks of one panel, keeping the panel's `B` in cache while `A` streams, unless all
        // of `B` fits in half of L2 and `A` is the larger: then they walk the panels of one
        // row block (`A`'s block stays in cache, `B` comes from L2), so `A` is read from
        // memory once instead of once per panel (the LM head's weight gradient at m = 158:
        // 78, 91 → 73, 65 ms, 2 alternations).
        let halves = !streamed && blocks == 1 && panels < 8 * threads;
        let units = cols.div_ceil(NP / 2);
        let by_row_block = !streamed && self.k * cols * size_of::<f32>() <= l2_bytes() / 2 && rows > cols;
        let tasks = match (streamed, halves) {
            (true, _) => blocks,
            (false, true) => (2 * threads).min(units),
            (false, false) => panels * blocks,
        };
        // (row block, [(panel, first column in it, width)]) of a task.
        let segments = |task: usize| -> (usize, Vec<(usize, usize, usize)>) {
            let full = |p: usize| (p, 0, NP.min(cols - p * NP));
            match (streamed, halves) {
                (true, _) => (task, (0..panels).map(full).collect()),
                (false, true) => {
                    let (mut u, end) = (task * units / tasks, (task + 1) * units / tasks);
                    let mut segs = Vec::new();
                    while u < end {
                        let (p, c0) = (u / 2, u % 2 * (NP / 2));
                        let step = if c0 == 0 && u + 2 <= end { 2 } else { 1 };
                        segs.push((p, c0, (step * NP / 2).min(cols - p * NP - c0)));
                        u += step;
                    }
                    (0, segs)
                }
                (false, false) if by_row_block => (task / panels, vec![full(task % panels)]),
                (false, false) => (task % blocks, vec![full(task / blocks)]),
            }
        };
        let task = |task: usize| {
            let (rb, segs) = segments(task);
            let (r0, r1) = (rb * mb, (rb * mb + mb).min(rows));
            // The tiles of rows r0..r1 × one segment over reduction steps k0..k0 + kc; the
            // tiles share the prefetch of `next` (lines of the block the task runs next).
            let block = |(p, c0, width): (usize, usize, usize), k0: usize, kc: usize, next: (*const f32, usize)| {
                let a = match streamed {
                    true => self.a.wrapping_add(k0 / NP * self.a_ks + r0 * self.a_rs),
                    false => self.a.wrapping_add(r0 * self.a_rs + k0),
                };
                let tiles = (r1 - r0).div_ceil(MR);
                let mut i = r0;
                while i < r1 {
                    let (next, next_lines) = Tile::next_share(next, (i - r0) / MR, tiles);
                    let tile = Tile {
                        a: a.wrapping_add((i - r0) * self.a_rs),
                        a_rs: self.a_rs,
                        b: self.b.wrapping_add(p * self.b_ps + k0 * self.ldb + c0),
                        ldb: self.ldb,
                        k: kc,
                        c: self.c.0.wrapping_add(i * cols + p * NP + c0),
                        ldc: cols,
                        rows: (r1 - i).min(MR),
                        cols: width,
                        accumulate: k0 > 0,
                        // The first tile over this block of B streams it from memory; the
                        // other tiles (and row blocks) find it in cache. A streamed A's
                        // B is small and stays in cache.
                        prefetch: !streamed && rb == 0 && i == r0,
                        next,
                        next_lines,
                    };
                    // SAFETY: the tile lies inside the operands (caller), `isa`
                    // was detected, and no other task writes its outputs.
                    unsafe { gemm_tile::run(isa, &tile) };
                    i += tile.rows;
                }
            };
            // (first step, steps) of the reduction blocks.
            let k_blocks = |kc: usize| (0..self.k.div_ceil(kc).max(1)).map(move |c| (c * kc, kc.min(self.k - c * kc)));
            match streamed {
                // A streamed A's reduction blocks outermost: each is read from memory once.
                true => k_blocks(NP).for_each(|(k0, kc)| segs.iter().for_each(|&seg| block(seg, k0, kc, NO_LINES))),
                false => {
                    // Each block's tiles prefetch the next block of B (the task's next, or the
                    // next task's first, which this thread usually runs): contiguous `kc`
                    // rows of a whole packed panel. Without it the first tile over a block
                    // waited on memory while the others ran from L2: 64-sequence decode
                    // steps, 4 alternations, 160.7–171.9 → 144.5–162.0 ms (median 377 → 398
                    // tok/s; Zen 4, 2 threads).
                    let blocks: Vec<_> =
                        segs.iter().flat_map(|&seg| k_blocks(KC).map(move |(k0, kc)| (seg, k0, kc))).collect();
                    let lines = |(p, c0, width): (usize, usize, usize), k0: usize, kc: usize| {
                        if width == NP && c0 == 0 && self.ldb == NP {
                            (self.b.wrapping_add(p * self.b_ps + k0 * self.ldb), kc * NP / 16)
                        } else {
                            NO_LINES
                        }
                    };
                    for (j, &(seg, k0, kc)) in blocks.iter().enumerate() {
                        let next = match blocks.get(j + 1) {
                            Some(&(seg, k0, kc)) => lines(seg, k0, kc),
                            None if task + 1 < tasks => lines(segments(task + 1).1[0], 0, KC.min(self.k)),
                            None => NO_LINES,
                        };
                        block(seg, k0, kc, next);
                    }
                }
            }
        };
        // Small products (a decode step's projections) run on the calling thread: waking the
        // pool costs more than the work.
        if rows * cols * self.k < INLINE_WORK {
            (0..tasks).for_each(task);
        } else {
            (0..tasks).into_par_iter().for_each(task);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`pack`] (register blocks plus scalar edges) against the layout's definition,
    /// `packed[(p·k + l)·NP + c] = w[p·NP + c, l]` with zeros past `n`, on sizes with partial
    /// 16-blocks and panels in both dimensions; [`unpack`] inverts it and [`pack_transposed`]
    /// of it is `pack(wᵀ)`, padding included.
    #[test]
    fn pack_is_the_panel_layout() {
        for (n, k) in [(150usize, 37usize), (64, 16), (17, 100), (5, 3), (130, 200)] {
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
            let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
            let (got, want) = (pack_transposed(&packed, n, k), pack(&wt, k, n));
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "pack_transposed {n} × {k}");
            assert_eq!(got.len(), want.len());
        }
    }

    /// Both routes of [`grad_input`] (over [`pack_transposed`], and from the panels in place)
    /// against the contract's chain (`acc = fma(dy[i, j], w[j, l], acc)` over `j = 0..n` in
    /// order), bitwise: partial panels in every dimension, reductions of several panels and a
    /// partial last one, tiny shapes.
    #[test]
    fn grad_input_is_the_sequential_chain() {
        let vals = |len: usize, seed: u32| -> Vec<f32> {
            (0..len as u32).map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect()
        };
        for (m, n, k) in [(150, 200, 70), (3, 5, 7), (1, 1, 1), (70, 64, 130), (7, 300, 49)] {
            let (dy, w) = (vals(m * n, 1), vals(n * k, 2));
            let packed = pack(&w, n, k);
            let routes = [grad_input_transposed(&dy, &packed, m, n, k), grad_input_streamed(&dy, &packed, m, n, k)];
            for (route, got) in routes.iter().enumerate() {
                for i in 0..m {
                    for l in 0..k {
                        let want = (0..n).fold(0.0f32, |acc, j| dy[i * n + j].mul_add(w[j * k + l], acc));
                        assert_eq!(got[i * k + l].to_bits(), want.to_bits(), "{m}x{n}x{k} route {route}: dx[{i}, {l}]");
                    }
                }
            }
        }
    }

    /// [`matmul_packed`] against the contract's chain, bitwise, on each task layout of
    /// [`Gemm::run`]: a single row over half-panel runs (odd panel counts, a last panel
    /// narrower than 32 columns), several row blocks per panel, row-block-major tasks (`B`
    /// small, `A` tall) and several reduction blocks (k > KC).
    #[test]
    fn matmul_packed_is_the_sequential_chain() {
        let vals = |len: usize, seed: u32| -> Vec<f32> {
            (0..len as u32).map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect()
        };
        for (m, n, k) in [(1, 600, 577), (1, 960, 300), (2, 130, 2100), (100, 200, 300), (700, 40, 30), (1, 20, 9)] {
            let (x, w) = (vals(m * k, 1), vals(n * k, 2));
            let got = matmul_packed(&x, &pack(&w, n, k), m, n, k);
            for i in 0..m {
                for j in 0..n {
                    let want = (0..k).fold(0.0f32, |acc, l| x[i * k + l].mul_add(w[j * k + l], acc));
                    assert_eq!(got[i * n + j].to_bits(), want.to_bits(), "{m}x{n}x{k}: y[{i}, {j}]");
                }
            }
        }
    }

    /// [`grad_weight`] against the contract's chain (`acc = fma(dy[i, j], x[i, l], acc)` over
    /// `i = 0..m` in order), bitwise: partial 16 × 16 transpose blocks and panels, several
    /// reduction blocks (m = 300 > KC), tiny shapes, and a `dyᵀ` in two chunks (n past
    /// `DYT_FLOATS / m`).
    #[test]
    fn grad_weight_is_the_sequential_chain() {
        let vals = |len: usize, seed: u32| -> Vec<f32> {
            (0..len as u32).map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect()
        };
        for (m, n, k) in [(300, 150, 100), (3, 5, 7), (1, 1, 1), (64, DYT_FLOATS / 64 + 70, 20)] {
            let (dy, x) = (vals(m * n, 1), vals(m * k, 2));
            let got = grad_weight(&dy, &x, m, n, k);
            for j in 0..n {
                for l in 0..k {
                    let want = (0..m).fold(0.0f32, |acc, i| dy[i * n + j].mul_add(x[i * k + l], acc));
                    assert_eq!(got[j * k + l].to_bits(), want.to_bits(), "{m}x{n}x{k}: dW[{j}, {l}]");
                }
            }
        }
    }
}
