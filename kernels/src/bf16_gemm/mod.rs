//! Matrix products in BF16 on CPUs with AVX-512 BF16 (AMD Zen 4 and later, Intel Cooper Lake,
//! Sapphire Rapids and later): Whisper's linear layers, attention and logits on the CPU.
//!
//! On a 2-core Zen 4, gemm's F32 kernels ran Whisper's encoder at about 110 GFLOP/s, near the
//! F32 peak, and a decoding step of 16 rows was compute-bound in its F32 linear layers and F16
//! logits. `vdpbf16ps` does two products per F32 lane per instruction, and a plain
//! register-blocked kernel ([`products`]) reaches ~200 GFLOP/s on one core. Weights and
//! activations are rounded to BF16 (8 significant bits); sums stay in F32. On the LibriVox test
//! speech, word error rates were the same as F32's (tiny.en 4.2%, base 1.4%).
//!
//! Each output value is summed in the same order whatever rows come with it, so a window
//! batched with others gives the same values as alone.
//!
//! Where the CPU also has AMX (Intel Sapphire Rapids and later), the same products run on its
//! tiles instead ([`amx`]); `TERN_NO_AMX=1` keeps them on AVX-512.

use candle_core::{Result, Tensor};
use rayon::prelude::*;

use crate::cpu_ops::{contiguous_f32, OutPtr};

#[cfg(target_arch = "x86_64")]
mod amx;

/// Output columns per kernel call: two AVX-512 registers of F32 sums.
const NR: usize = 32;
/// Rows per kernel call: 24 accumulators, 2 weight registers and a broadcast fit the 32
/// registers.
const MR: usize = 12;
/// Rows per parallel task: the task's BF16 activations (at most 96 x 1536 x 2 = 288 KB) stay
/// in L2 while the columns pass over them.
const TASK_ROWS: usize = 96;
/// Columns per parallel task: the task's weights (at most 256 x 1536 x 2 = 768 KB) stay in L2.
const TASK_COLS: usize = 256;

/// Whether this CPU runs BF16 products ([`Bf16Linear::pack`] gives `None` where not).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// What runs the products: `Some("AMX")`, `Some("AVX-512 BF16")`, or `None` where
/// [`available`] is false.
pub fn kernel_name() -> Option<&'static str> {
    if !available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    if amx::available() {
        return Some("AMX");
    }
    Some("AVX-512 BF16")
}

/// Two BF16 values in one `u32`, `lo` in the low half (the order `vdpbf16ps` pairs them in).
fn bf16_pair(lo: f32, hi: f32) -> u32 {
    u32::from(bf16_bits(lo)) | (u32::from(bf16_bits(hi)) << 16)
}

/// The right-hand matrix `B` (`k x n`) of BF16 products, laid out for the kernel: for each
/// block of [`NR`] columns, for each pair of rows, the block's [`NR`] pairs side by side
/// (columns past `n`, an odd last row and the pairs up to a multiple of 16, an AMX tile's
/// depth, are zeros).
#[derive(Default)]
pub struct PackedB {
    data: Vec<u32>,
    k: usize,
    n: usize,
}

impl PackedB {
    /// Packs `B[kk][j] = value(kk, j)`.
    pub fn new(k: usize, n: usize, value: impl Fn(usize, usize) -> f32) -> PackedB {
        let mut packed = PackedB::default();
        packed.refill(k, n, value);
        packed
    }

    /// Packs a new matrix into this one's buffer.
    pub fn refill(&mut self, k: usize, n: usize, value: impl Fn(usize, usize) -> f32) {
        (self.k, self.n) = (k, n);
        let (pairs, padded) = (self.pairs(), self.padded_pairs());
        self.data.clear();
        self.data.resize(n.div_ceil(NR) * padded * NR, 0);
        for (block, chunk) in self.data.chunks_exact_mut(padded * NR).enumerate() {
            let cols = (n - block * NR).min(NR);
            for (p, dst) in chunk.chunks_exact_mut(NR).take(pairs).enumerate() {
                for (c, d) in dst[..cols].iter_mut().enumerate() {
                    let j = block * NR + c;
                    let hi = if 2 * p + 1 < k { value(2 * p + 1, j) } else { 0.0 };
                    *d = bf16_pair(value(2 * p, j), hi);
                }
            }
        }
    }

    /// Packs `B[kk][j] = src[j * stride + kk]` (`k x n`): each column is a row of `src`, as
    /// attention's keys are. The same values as [`PackedB::refill`], without a call per value:
    /// each row converts with the vector instruction and its pairs are scattered to their
    /// column. Only where [`available`].
    pub fn refill_columns_of(&mut self, src: &[f32], stride: usize, k: usize, n: usize) {
        assert!(n == 0 || (n - 1) * stride + k <= src.len(), "{n} rows of {k} values, {stride} apart, in {}", src.len());
        self.reset(k, n);
        let (pairs, padded) = (self.pairs(), self.padded_pairs());
        let mut row = vec![0u32; pairs];
        for j in 0..n {
            row_to_bf16(&src[j * stride..j * stride + k], &mut row);
            let column = &mut self.data[(j / NR) * padded * NR + j % NR..];
            for (p, &pair) in row.iter().enumerate() {
                column[p * NR] = pair;
            }
        }
    }

    /// Packs `B[kk][j] = src[kk * stride + j]` (`k x n`): each row is a row of `src`, as
    /// attention's values are. The same values as [`PackedB::refill`]; only where
    /// [`available`].
    pub fn refill_rows_of(&mut self, src: &[f32], stride: usize, k: usize, n: usize) {
        assert!(k == 0 || (k - 1) * stride + n <= src.len(), "{k} rows of {n} values, {stride} apart, in {}", src.len());
        self.reset(k, n);
        let padded = self.padded_pairs();
        let (mut lo, mut hi) = (vec![0u16; n], vec![0u16; n]);
        for p in 0..self.pairs() {
            row_to_bf16_halves(&src[2 * p * stride..2 * p * stride + n], &mut lo);
            if 2 * p + 1 < k {
                row_to_bf16_halves(&src[(2 * p + 1) * stride..(2 * p + 1) * stride + n], &mut hi);
            } else {
                hi.fill(0);
            }
            for (block, (lo, hi)) in lo.chunks(NR).zip(hi.chunks(NR)).enumerate() {
                let dst = &mut self.data[block * padded * NR + p * NR..][..lo.len()];
                for ((d, &l), &h) in dst.iter_mut().zip(lo).zip(hi) {
                    *d = u32::from(l) | (u32::from(h) << 16);
                }
            }
        }
    }

    /// Sizes this matrix to `k x n`, all zeros.
    fn reset(&mut self, k: usize, n: usize) {
        (self.k, self.n) = (k, n);
        let len = n.div_ceil(NR) * self.padded_pairs() * NR;
        self.data.clear();
        self.data.resize(len, 0);
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.n
    }

    /// Pairs of rows (`k / 2`, rounded up): the row length of a left-hand matrix.
    pub fn pairs(&self) -> usize {
        self.k.div_ceil(2)
    }

    /// [`PackedB::pairs`] rounded up to a multiple of 16: the rows a column block holds.
    fn padded_pairs(&self) -> usize {
        self.pairs().div_ceil(16) * 16
    }

    /// Column block `block`.
    fn block(&self, block: usize) -> &[u32] {
        let len = self.padded_pairs() * NR;
        &self.data[block * len..(block + 1) * len]
    }
}

/// `out[r][c0 + j] = Σ a[r] · B[.][c0 + j] (+ bias[c0 + j])` for `rows` rows of BF16 pairs `a`
/// (`b.pairs()` each) and columns `c0..c1` of `b` (`c0` a multiple of [`NR`]); output rows are
/// `ldc` apart from `out`. On the calling thread.
///
/// # Safety
/// The CPU runs AVX-512F and AVX-512 BF16 ([`available`]); `out` has `rows` rows, `ldc` apart,
/// of at least `c1` writable values.
pub unsafe fn products(a: &[u32], rows: usize, b: &PackedB, c0: usize, c1: usize, bias: Option<&[f32]>, out: *mut f32, ldc: usize) {
    debug_assert!(a.len() >= rows * b.pairs() && c0 % NR == 0 && c1 <= b.n);
    #[cfg(target_arch = "x86_64")]
    if amx::available() {
        return amx::products(a, rows, b, c0, c1, bias, out, ldc);
    }
    avx512_products(a, rows, b, c0, c1, bias, out, ldc)
}

/// [`products`] with the AVX-512 kernel.
///
/// # Safety
/// As [`products`].
#[allow(clippy::too_many_arguments)]
unsafe fn avx512_products(a: &[u32], rows: usize, b: &PackedB, c0: usize, c1: usize, bias: Option<&[f32]>, out: *mut f32, ldc: usize) {
    let pairs = b.pairs();
    for c in (c0..c1).step_by(NR) {
        let cols = (c1 - c).min(NR);
        let block = b.block(c / NR);
        let bias = bias.map(|bias| &bias[c..c + cols]);
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(MR);
            kernel::run(n, &a[r * pairs..(r + n) * pairs], pairs, block, out.add(r * ldc + c), ldc, cols, bias);
            r += n;
        }
    }
}

/// Softmax attention of `t` queries (rows of BF16 pairs, `keys.pairs()` each) over packed
/// `keys` (`head_dim x n`) and `values` (`n x head_dim`): scores and softmax in F32 (in
/// `scores`), the weights rounded to BF16 (in `weights`) for the second product, as flash
/// attention does on GPUs. Output rows are `ldc` apart from `out`. On the calling thread.
///
/// # Safety
/// As [`products`]: [`available`], and `out` has `t` rows, `ldc` apart, of `values.cols()`
/// writable values.
#[allow(clippy::too_many_arguments)]
pub unsafe fn attention(queries: &[u32], t: usize, keys: &PackedB, values: &PackedB, scores: &mut Vec<f32>, weights: &mut Vec<u32>, out: *mut f32, ldc: usize) {
    let n = keys.cols();
    scores.resize(t * n, 0.0);
    products(queries, t, keys, 0, n, None, scores.as_mut_ptr(), n);
    let n_pairs = n.div_ceil(2);
    weights.resize(t * n_pairs, 0);
    for (s, w) in scores.chunks_exact_mut(n).zip(weights.chunks_exact_mut(n_pairs)) {
        crate::cpu_kernels::softmax_in_place(s);
        row_to_bf16(s, w);
    }
    products(weights, t, values, 0, values.cols(), None, out, ldc);
}

/// A linear layer `x Wᵀ + b` with `W` held as BF16 (packed as `B = Wᵀ`).
pub struct Bf16Linear {
    weights: PackedB,
    bias: Option<Vec<f32>>,
}

impl Bf16Linear {
    /// Packs `weight` `(d_out, d_in)` and `bias` `(d_out)` (F32 or any dtype candle converts);
    /// `None` where the CPU lacks AVX-512 BF16.
    pub fn pack(weight: &Tensor, bias: Option<&Tensor>) -> Result<Option<Bf16Linear>> {
        if !available() {
            return Ok(None);
        }
        let (d_out, d_in) = weight.dims2()?;
        let w = weight.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let weights = PackedB::new(d_in, d_out, |i, j| w[j * d_in + i]);
        let bias = bias.map(|b| b.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()).transpose()?;
        Ok(Some(Bf16Linear { weights, bias }))
    }

    /// Output width (`d_out`).
    pub fn d_out(&self) -> usize {
        self.weights.n
    }

    /// Number of weights (`d_out x d_in`).
    pub fn weight_count(&self) -> usize {
        self.weights.k * self.weights.n
    }

    /// `x` `(..., d_in)` F32 on the CPU; returns `(..., d_out)`, plus the bias `with_bias`.
    pub fn forward(&self, x: &Tensor, with_bias: bool) -> Result<Tensor> {
        let x = x.contiguous()?;
        let mut dims = x.dims().to_vec();
        let rows = x.elem_count() / self.weights.k.max(1);
        let out = {
            let (storage, layout) = x.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                candle_core::bail!("BF16 products run on the CPU");
            };
            self.rows_times(contiguous_f32(cpu, layout)?, rows, with_bias)
        };
        *dims.last_mut().expect("at least one dimension") = self.weights.n;
        Tensor::from_vec(out, dims, x.device())
    }

    /// `rows` rows of `x` times the weights, plus the bias, split over rayon's threads by
    /// blocks of rows and columns.
    fn rows_times(&self, x: &[f32], rows: usize, with_bias: bool) -> Vec<f32> {
        self.pair_rows_times(&to_bf16_pairs(x, rows, self.weights.k), rows, with_bias)
    }

    /// [`Bf16Linear::forward`] on `rows` rows already in BF16 pairs (`d_in / 2` rounded up
    /// each, as [`to_bf16_pairs`] makes them).
    pub fn pair_rows_times(&self, a: &[u32], rows: usize, with_bias: bool) -> Vec<f32> {
        let (d_out, pairs) = (self.weights.n, self.weights.pairs());
        assert_eq!(a.len(), rows * pairs, "{rows} rows of {pairs} BF16 pairs");
        let bias = if with_bias { self.bias.as_deref() } else { None };
        let mut out = vec![0f32; rows * d_out];
        let out_at = OutPtr(out.as_mut_ptr());
        self.tasks(rows, |(r0, r1), (c0, c1)| {
            // SAFETY: `pack` found the CPU features; rows r0..r1 and columns c0..c1 lie in
            // `out` and belong to this task alone.
            unsafe { products(&a[r0 * pairs..r1 * pairs], r1 - r0, &self.weights, c0, c1, bias, out_at.at(r0 * d_out), d_out) };
        });
        out
    }

    /// Runs `task(rows r0..r1, columns c0..c1)` on rayon's threads for each block of at most
    /// [`TASK_ROWS`] of `rows` rows by [`TASK_COLS`] of the output columns.
    fn tasks(&self, rows: usize, task: impl Fn((usize, usize), (usize, usize)) + Sync) {
        let d_out = self.weights.n;
        let col_tasks = d_out.div_ceil(TASK_COLS);
        (0..rows.div_ceil(TASK_ROWS) * col_tasks).into_par_iter().for_each(|t| {
            let (r0, c0) = ((t / col_tasks) * TASK_ROWS, (t % col_tasks) * TASK_COLS);
            task((r0, (r0 + TASK_ROWS).min(rows)), (c0, (c0 + TASK_COLS).min(d_out)));
        });
    }
}

thread_local! {
    /// Each thread's product tile for [`Bf16Linear::pair_rows_each`], kept between calls.
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Bf16Linear {
    /// The products of `rows` rows of BF16 pairs `a` (as [`Bf16Linear::pair_rows_times`],
    /// bias added) handed to `finish(row, c0, values)` a piece of a row at a time, values
    /// `c0..c0 + values.len()` of that row, right after they are computed and still in cache:
    /// a caller adds them to a residual or applies an activation there instead of in a pass
    /// of its own over a fresh buffer. Each value is handed over exactly once, from one of
    /// rayon's threads; `c0` is a multiple of 256.
    pub fn pair_rows_each(&self, a: &[u32], rows: usize, finish: impl Fn(usize, usize, &mut [f32]) + Sync) {
        let (d_out, pairs) = (self.weights.n, self.weights.pairs());
        assert_eq!(a.len(), rows * pairs, "{rows} rows of {pairs} BF16 pairs");
        self.tasks(rows, |(r0, r1), (c0, c1)| {
            TILE.with_borrow_mut(|tile| {
                // Rows `d_out` apart, so the kernels write column `c` at `c`; only the task's
                // columns are touched.
                if tile.len() < TASK_ROWS * d_out {
                    tile.resize(TASK_ROWS * d_out, 0.0);
                }
                // SAFETY: `pair_rows_each` runs only where `pack` found the CPU's features;
                // the tile holds `r1 - r0 <= TASK_ROWS` rows of `d_out`.
                unsafe { products(&a[r0 * pairs..r1 * pairs], r1 - r0, &self.weights, c0, c1, self.bias.as_deref(), tile.as_mut_ptr(), d_out) };
                for (i, row) in tile.chunks_exact_mut(d_out).take(r1 - r0).enumerate() {
                    finish(r0 + i, c0, &mut row[c0..c1]);
                }
            });
        });
    }
}

/// `rows` rows of `cols` F32 values as rows of BF16 pairs (see [`row_to_bf16`]), on rayon's
/// threads.
pub fn to_bf16_pairs(x: &[f32], rows: usize, cols: usize) -> Vec<u32> {
    let mut out = vec![0u32; rows * cols.div_ceil(2)];
    to_bf16_pairs_into(&x[..rows * cols], cols, &mut out);
    out
}

/// [`to_bf16_pairs`] into `out`: the rows of `x` (`cols` values each), `cols / 2` pairs
/// (rounded up) per row of `out`.
pub fn to_bf16_pairs_into(x: &[f32], cols: usize, out: &mut [u32]) {
    let pairs = cols.div_ceil(2);
    assert_eq!(x.len() / cols.max(1) * pairs, out.len(), "{} values in rows of {cols} into {} pairs", x.len(), out.len());
    out.par_chunks_mut(pairs * 64).zip(x.par_chunks(cols * 64)).for_each(|(dst, src)| {
        for (d, s) in dst.chunks_exact_mut(pairs).zip(src.chunks_exact(cols)) {
            row_to_bf16(s, d);
        }
    });
}

/// One row of F32 values as BF16 pairs in `dst` (`src.len() / 2` rounded up; an odd last
/// value paired with 0), rounded as `vcvtneps2bf16` rounds: to nearest even, subnormals to
/// zero. Only where [`available`].
pub fn row_to_bf16(src: &[f32], dst: &mut [u32]) {
    assert!(available() && dst.len() >= src.len().div_ceil(2), "BF16 conversion of {} values into {} pairs", src.len(), dst.len());
    // SAFETY: checked just above.
    let done = unsafe { kernel::to_bf16(src, dst) };
    for (p, v) in dst.iter_mut().enumerate().take(src.len().div_ceil(2)).skip(done / 2) {
        *v = bf16_pair(src[2 * p], src.get(2 * p + 1).copied().unwrap_or(0.0));
    }
}

/// `dst[i]` = the BF16 bits of `src[i]`, rounded as [`row_to_bf16`] rounds. Only where
/// [`available`].
pub fn row_to_bf16_halves(src: &[f32], dst: &mut [u16]) {
    assert!(available() && dst.len() >= src.len(), "BF16 conversion of {} values into {}", src.len(), dst.len());
    // SAFETY: checked above that the CPU has the instructions and `dst` the room.
    let done = unsafe { kernel::to_bf16_halves(src, dst) };
    for (d, &x) in dst[done..src.len()].iter_mut().zip(&src[done..]) {
        *d = bf16_bits(x);
    }
}

/// `x` rounded to BF16 as the vector conversion rounds it.
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    if x.is_subnormal() {
        return ((bits >> 16) & 0x8000) as u16;
    }
    (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use std::arch::x86_64::*;

    use super::{MR, NR};

    /// Converts the leading multiple of 16 of `src` into BF16 pairs in `dst`; returns how many
    /// values it converted.
    ///
    /// # Safety
    /// The CPU runs AVX-512F and AVX-512 BF16; `dst` holds at least `src.len() / 2` pairs.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn to_bf16(src: &[f32], dst: &mut [u32]) -> usize {
        let n = src.len() / 16 * 16;
        debug_assert!(dst.len() * 2 >= n);
        for i in (0..n).step_by(16) {
            let v: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(src.as_ptr().add(i))));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i / 2).cast(), v);
        }
        n
    }

    /// `out[r][j] = Σ_p a[r][p] · b[p][j] (+ bias[j])` for `n` rows (at most [`MR`]) and the
    /// first `cols` of [`NR`] columns; `a` rows of `pairs` BF16 pairs, `b` the packed block,
    /// `out` rows `ldc` apart.
    ///
    /// # Safety
    /// The CPU runs AVX-512F and AVX-512 BF16; `out` has `n` rows of `cols` writable values.
    /// `dst[i]` = BF16 bits of `src[i]` for the whole 16-value groups; returns how many.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn to_bf16_halves(src: &[f32], dst: &mut [u16]) -> usize {
        let n = src.len() / 16 * 16;
        debug_assert!(dst.len() >= n);
        for i in (0..n).step_by(16) {
            let v: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(src.as_ptr().add(i))));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), v);
        }
        n
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run(n: usize, a: &[u32], pairs: usize, b: &[u32], out: *mut f32, ldc: usize, cols: usize, bias: Option<&[f32]>) {
        macro_rules! rows {
            ($($n:literal)*) => {
                match n {
                    $($n => block::<$n>(a, pairs, b, out, ldc, cols, bias),)*
                    _ => unreachable!("at most {MR} rows"),
                }
            };
        }
        rows!(1 2 3 4 5 6 7 8 9 10 11 12)
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn block<const N: usize>(a: &[u32], pairs: usize, b: &[u32], out: *mut f32, ldc: usize, cols: usize, bias: Option<&[f32]>) {
        debug_assert!(a.len() >= N * pairs && b.len() >= pairs * NR);
        let (a, b) = (a.as_ptr(), b.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        for p in 0..pairs {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(r * pairs + p) as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
            }
        }
        let masks = [mask(cols), mask(cols.saturating_sub(16))];
        let bias = bias.map(|bias| {
            let bias = bias.as_ptr();
            [_mm512_maskz_loadu_ps(masks[0], bias), _mm512_maskz_loadu_ps(masks[1], bias.add(16))]
        });
        for (r, acc) in acc.iter().enumerate() {
            let row = out.add(r * ldc);
            for h in 0..2 {
                let v = match bias {
                    Some(bias) => _mm512_add_ps(acc[h], bias[h]),
                    None => acc[h],
                };
                _mm512_mask_storeu_ps(row.add(16 * h), masks[h], v);
            }
        }
    }

    /// The first `n` (at most 16) lanes.
    fn mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod kernel {
    /// Never called: [`super::available`] is false off x86-64.
    pub(super) unsafe fn to_bf16(_: &[f32], _: &mut [u32]) -> usize {
        unreachable!("BF16 products need x86-64")
    }

    /// Never called: [`super::available`] is false off x86-64.
    pub(super) unsafe fn to_bf16_halves(_: &[f32], _: &mut [u16]) -> usize {
        unreachable!("BF16 products need x86-64")
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run(_: usize, _: &[u32], _: usize, _: &[u32], _: *mut f32, _: usize, _: usize, _: Option<&[f32]>) {
        unreachable!("BF16 products need x86-64")
    }
}

/// Values in [-1, 1) that look random enough to catch an index off by one, for the tests of
/// the BF16 paths against F32 (here and in the models that call these kernels).
#[doc(hidden)]
pub fn test_values(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i + seed) * 7919 % 1013) as f32 / 506.5) - 1.0).collect()
}

/// For the tests of the BF16 paths: whether this CPU lacks them (then the test says it skipped
/// and returns).
#[doc(hidden)]
pub fn skip_without_bf16() -> bool {
    if available() {
        return false;
    }
    eprintln!("skipped: this CPU has no AVX-512 BF16");
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Odd sizes: a last column block of 5, an odd input width, and row counts around the
    /// kernel's 12 and the task's 96.
    /// The packers from rows give the very bits of the per-value one, odd sizes and a stride
    /// wider than a row included, and reusing a matrix leaves nothing of its last contents.
    #[test]
    fn packing_from_rows_matches_packing_value_by_value() {
        if skip_without_bf16() {
            return;
        }
        let stride = 70usize;
        let src = test_values(80 * stride, 5);
        let mut columns = PackedB::new(3, 50, |_, _| 1.0);
        let mut rows = PackedB::new(60, 40, |_, _| 1.0);
        for (k, n) in [(64usize, 37usize), (7, 33), (64, 1), (17, 64)] {
            columns.refill_columns_of(&src, stride, k, n);
            let want = PackedB::new(k, n, |kk, j| src[j * stride + kk]);
            assert_eq!((columns.k, columns.n), (want.k, want.n));
            assert_eq!(columns.data, want.data, "columns of {k} x {n}");
            rows.refill_rows_of(&src, stride, k, n);
            let want = PackedB::new(k, n, |kk, j| src[kk * stride + j]);
            assert_eq!(rows.data, want.data, "rows of {k} x {n}");
        }
    }

    #[test]
    fn bf16_products_match_f64_sums_of_the_rounded_values_and_rows_do_not_depend_on_their_batch() {
        if skip_without_bf16() {
            return;
        }
        let (d_in, d_out) = (77usize, 293usize);
        let w: Vec<f32> = (0..d_out * d_in).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
        let bias: Vec<f32> = (0..d_out).map(|j| j as f32 / 100.0 - 1.0).collect();
        let weight = Tensor::from_vec(w.clone(), (d_out, d_in), &Device::Cpu).unwrap();
        let linear = Bf16Linear::pack(&weight, Some(&Tensor::new(bias.as_slice(), &Device::Cpu).unwrap())).unwrap().unwrap();
        let round = |v: f32| f64::from(half::bf16::from_f32(v).to_f32());
        for rows in [1usize, 11, 12, 13, 97, 200] {
            let x: Vec<f32> = (0..rows * d_in).map(|i| ((i * 13 % 29) as f32 - 14.0) / 3.0).collect();
            let got = linear.forward(&Tensor::from_vec(x.clone(), (rows, d_in), &Device::Cpu).unwrap(), true).unwrap().to_vec2::<f32>().unwrap();
            for r in [0, rows / 2, rows - 1] {
                let alone = linear.rows_times(&x[r * d_in..(r + 1) * d_in], 1, true);
                for j in 0..d_out {
                    assert_eq!(got[r][j].to_bits(), alone[j].to_bits(), "row {r} of {rows}, column {j}: batched vs alone");
                    let exact: f64 = (0..d_in).map(|i| round(x[r * d_in + i]) * round(w[j * d_in + i])).sum::<f64>() + f64::from(bias[j]);
                    assert!((f64::from(got[r][j]) - exact).abs() < 1e-4 * (1.0 + exact.abs()), "row {r}, column {j}: {} vs {exact}", got[r][j]);
                }
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod amx_tests {
    use super::*;

    /// Where the CPU has AMX: the tiles against the AVX-512 kernel on odd shapes (rows around a
    /// tile's 16 and a block's 32, an odd `k` that is no multiple of a tile's depth, a column
    /// range that starts past 0 and ends inside a block, output rows wider than the range).
    #[test]
    fn amx_products_match_the_avx512_kernel() {
        if skip_without_bf16() {
            return;
        }
        if !amx::available() {
            eprintln!("skipped: this CPU has no AMX");
            return;
        }
        let (k, n, ldc) = (77usize, 293usize, 300usize);
        let b = PackedB::new(k, n, |i, j| ((i * 31 + j * 7) % 41) as f32 / 20.0 - 1.0);
        let bias: Vec<f32> = (0..n).map(|j| j as f32 / 50.0).collect();
        for rows in [1usize, 15, 16, 17, 32, 33, 70] {
            let a = to_bf16_pairs(&test_values(rows * k, rows), rows, k);
            for (c0, c1, bias) in [(0, n, Some(bias.as_slice())), (64, 250, None)] {
                let (mut tiles, mut avx) = (vec![f32::NAN; rows * ldc], vec![f32::NAN; rows * ldc]);
                // SAFETY: both kernels' features were found; `rows` rows of `ldc >= n` values.
                unsafe {
                    amx::products(&a, rows, &b, c0, c1, bias, tiles.as_mut_ptr(), ldc);
                    avx512_products(&a, rows, &b, c0, c1, bias, avx.as_mut_ptr(), ldc);
                }
                for (i, (t, v)) in tiles.iter().zip(&avx).enumerate() {
                    let (r, c) = (i / ldc, i % ldc);
                    if (c0..c1).contains(&c) {
                        // Sums of 77 products within 1 in another order.
                        assert!((t - v).abs() < 1e-4, "{rows} rows, row {r}, column {c}: {t} vs {v}");
                    } else {
                        assert!(t.is_nan(), "{rows} rows: column {c} is outside {c0}..{c1} but was written");
                    }
                }
            }
        }
    }
}
