//! GGML-quantized weight matrices (the Q4_0, Q4_1 and Q8_0 blocks of GGUF files) and their
//! products with f32 activations on the CPU, computed as llama.cpp computes them: each
//! activation row is quantized to 8-bit blocks, and every 32-value block of a product is an
//! integer dot product, scaled once.
//!
//! candle has SIMD kernels of this kind for Q8_0 weights only, so SmolLM2's Q4_1 weights had to
//! be re-quantized to Q8_0 at load time: 70% more bytes to read per generated token, on a path
//! that is bound by memory bandwidth. Here the weights stay as the file stores them.

use anyhow::{bail, ensure, Result};
use half::f16;
use rayon::prelude::*;

/// Values per quantization block, for every type here.
pub const BLOCK: usize = 32;

/// A GGML block type this module multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QType {
    /// Scale `d` (f16) and 32 four-bit values `q`: `x = d * (q - 8)`.
    Q4_0,
    /// Scale `d` and minimum `m` (f16) and 32 four-bit values: `x = d * q + m`.
    Q4_1,
    /// Scale `d` (f16) and 32 signed bytes: `x = d * q`.
    Q8_0,
}

impl QType {
    /// Bytes per block of 32 values in a GGUF file.
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q8_0 => 34,
        }
    }

    /// Bytes of values per block, without the scales.
    fn packed_bytes(self) -> usize {
        match self {
            QType::Q4_0 | QType::Q4_1 => 16,
            QType::Q8_0 => 32,
        }
    }
}

/// Activation rows quantized to bytes for [`QMatrix::matmul`], block by block: `x ≈ d * qs`,
/// with `s = d * Σ qs` for the weight types that carry an offset. Reused between products to
/// keep its buffers.
#[derive(Default)]
pub struct QuantizedRows {
    blocks_per_row: usize,
    d: Vec<f32>,
    s: Vec<f32>,
    /// The sums as Q8_1 holds them, for Q4_1 ([`quantize_block`]).
    s_f16: Vec<f32>,
    /// An eighth of `s` and of `s_f16` (exact), one per lane of the AVX2 kernel's sums.
    s_eighth: Vec<f32>,
    s_f16_eighth: Vec<f32>,
    qs: Vec<[i8; BLOCK]>,
}

/// One quantized activation row.
#[derive(Clone, Copy)]
struct ActRow<'a> {
    d: &'a [f32],
    s: &'a [f32],
    /// `s / 8`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    s_eighth: &'a [f32],
    qs: &'a [[i8; BLOCK]],
}

impl QuantizedRows {
    /// Quantizes `x`, rows of `cols` values each (`cols` a multiple of [`BLOCK`]).
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        debug_assert!(cols % BLOCK == 0 && x.len() % cols == 0);
        self.blocks_per_row = cols / BLOCK;
        let blocks = x.len() / BLOCK;
        self.d.resize(blocks, 0.0);
        self.s.resize(blocks, 0.0);
        self.s_f16.resize(blocks, 0.0);
        self.s_eighth.resize(blocks, 0.0);
        self.s_f16_eighth.resize(blocks, 0.0);
        self.qs.resize(blocks, [0; BLOCK]);
        for (b, x) in x.chunks_exact(BLOCK).enumerate() {
            (self.d[b], self.s[b], self.s_f16[b]) = quantize_block(x, &mut self.qs[b]);
            (self.s_eighth[b], self.s_f16_eighth[b]) = (self.s[b] * 0.125, self.s_f16[b] * 0.125);
        }
    }

    fn rows(&self) -> usize {
        self.d.len() / self.blocks_per_row.max(1)
    }

    /// Row `i`, with the block sums the products with `qtype` weights take.
    fn row(&self, i: usize, qtype: QType) -> ActRow<'_> {
        let r = i * self.blocks_per_row..(i + 1) * self.blocks_per_row;
        let (s, s_eighth) = if qtype == QType::Q4_1 { (&self.s_f16, &self.s_f16_eighth) } else { (&self.s, &self.s_eighth) };
        ActRow { d: &self.d[r.clone()], s: &s[r.clone()], s_eighth: &s_eighth[r.clone()], qs: &self.qs[r] }
    }
}

/// Rounds one block to bytes; returns `(d, d * Σ qs, f16(d * Σ qs))` as GGML's blocks hold
/// them, so products are llama.cpp's (candle's, ported from it, agree to 1e-6; with F32 scales
/// they moved logits by ~1% of the largest, as far from exact arithmetic as llama.cpp's but
/// elsewhere): `d` rounded to f16 (Q8_0 and Q8_1), the sum with it (Q4_0's offset, through
/// Q8_0's products), and the sum of the unrounded `d` rounded to f16 (Q8_1's, for Q4_1's
/// minimum: where `d` is a coarse subnormal f16 it keeps the larger sum's precision).
fn quantize_block(x: &[f32], qs: &mut [i8; BLOCK]) -> (f32, f32, f32) {
    // Adding 1.5 * 2^23 rounds to the nearest integer without a libm call.
    const ROUND: f32 = 12_582_912.0;
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = (v * inv + ROUND) - ROUND;
        *q = r as i8;
        sum += *q as i32;
    }
    let f16 = |v: f32| half::f16::from_f32(v).to_f32();
    (f16(d), f16(d) * sum as f32, f16(d * sum as f32))
}

/// A weight matrix of `rows` x `cols` values in GGML blocks, held as three arrays: each
/// block's scale and offset as f32 (the offset is `-8 d` for Q4_0 and none for Q8_0) and its
/// packed values. Converting the f16 scales once at load time takes them, and the scalar work
/// around them, out of the products' inner loop.
pub struct QMatrix {
    qtype: QType,
    rows: usize,
    cols: usize,
    scales: Vec<f32>,
    offsets: Vec<f32>,
    packed: Vec<u8>,
}

/// One weight row.
#[derive(Clone, Copy)]
struct WeightRow<'a> {
    scales: &'a [f32],
    /// Empty for Q8_0.
    offsets: &'a [f32],
    packed: &'a [u8],
}

/// Rows taken together by one kernel call: activation rows per weight row (several rows), or
/// weight rows per activation row (one row).
const TILE: usize = 4;
/// Activation rows kept hot in cache while a task walks its weight rows (64 rows of 576 values
/// take 41 KB).
const ROW_GROUP: usize = 64;

impl QMatrix {
    /// `data` holds `rows` rows of `cols / 32` blocks of `qtype` as a GGUF file stores them;
    /// `cols` must be a multiple of 32.
    pub fn new(qtype: QType, rows: usize, cols: usize, data: &[u8]) -> Result<QMatrix> {
        ensure!(cols % BLOCK == 0, "{cols} columns are not a whole number of {BLOCK}-value blocks");
        let blocks = rows * cols / BLOCK;
        let want = blocks * qtype.block_bytes();
        ensure!(data.len() == want, "{qtype:?} matrix of {rows}x{cols} needs {want} bytes, got {}", data.len());
        let mut scales = Vec::with_capacity(blocks);
        let mut offsets = Vec::with_capacity(if qtype == QType::Q8_0 { 0 } else { blocks });
        let mut packed = Vec::with_capacity(blocks * qtype.packed_bytes());
        for block in data.chunks_exact(qtype.block_bytes()) {
            let d = f16_at(block, 0);
            scales.push(d);
            match qtype {
                QType::Q4_0 => offsets.push(-8.0 * d),
                QType::Q4_1 => offsets.push(f16_at(block, 2)),
                QType::Q8_0 => {}
            }
            packed.extend_from_slice(&block[block.len() - qtype.packed_bytes()..]);
        }
        Ok(QMatrix { qtype, rows, cols, scales, offsets, packed })
    }

    /// The rows of `parts` one after the other (same type and width), so that one product
    /// computes them all.
    pub fn stack(parts: Vec<QMatrix>) -> Result<QMatrix> {
        let Some(first) = parts.first() else { bail!("nothing to stack") };
        let (qtype, cols) = (first.qtype, first.cols);
        if let Some(odd) = parts.iter().find(|p| p.qtype != qtype || p.cols != cols) {
            bail!("cannot stack a {:?} matrix of width {} onto {qtype:?} of width {cols}", odd.qtype, odd.cols);
        }
        let mut all = QMatrix { qtype, rows: 0, cols, scales: Vec::new(), offsets: Vec::new(), packed: Vec::new() };
        for p in parts {
            all.rows += p.rows;
            all.scales.extend(p.scales);
            all.offsets.extend(p.offsets);
            all.packed.extend(p.packed);
        }
        Ok(all)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes the arrays take.
    pub fn bytes(&self) -> usize {
        4 * (self.scales.len() + self.offsets.len()) + self.packed.len()
    }

    fn weight_row(&self, r: usize) -> WeightRow<'_> {
        let n = self.cols / BLOCK;
        let blocks = r * n..(r + 1) * n;
        let pb = self.qtype.packed_bytes();
        WeightRow {
            scales: &self.scales[blocks.clone()],
            offsets: if self.offsets.is_empty() { &[] } else { &self.offsets[blocks.clone()] },
            packed: &self.packed[blocks.start * pb..blocks.end * pb],
        }
    }

    /// Row `r` as f32 values into `out` (`cols` long): an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let w = self.weight_row(r);
        let pb = self.qtype.packed_bytes();
        for (b, out) in out.chunks_exact_mut(BLOCK).enumerate() {
            let (d, packed) = (w.scales[b], &w.packed[b * pb..(b + 1) * pb]);
            match self.qtype {
                QType::Q4_0 | QType::Q4_1 => {
                    let m = w.offsets[b];
                    for (j, &q) in packed.iter().enumerate() {
                        out[j] = d * (q & 0x0f) as f32 + m;
                        out[j + 16] = d * (q >> 4) as f32 + m;
                    }
                }
                QType::Q8_0 => {
                    for (o, &q) in out.iter_mut().zip(packed) {
                        *o = d * (q as i8) as f32;
                    }
                }
            }
        }
    }

    /// `out[i * rows + r] = x_i · W_r` for every row `i` of `x` (quantized from rows of `cols`
    /// values); `out` holds `x`'s rows times [`QMatrix::rows`] values. The weight rows are split
    /// between rayon's threads.
    pub fn matmul(&self, x: &QuantizedRows, out: &mut [f32]) {
        let m = x.rows();
        assert_eq!(x.blocks_per_row * BLOCK, self.cols, "activation width");
        assert_eq!(out.len(), m * self.rows, "output size");
        let kernel = Kernel::for_type(self.qtype);
        // A few tasks per thread even out uneven progress; 16 rows at least keep each task
        // worth its scheduling.
        let tasks = rayon::current_num_threads() * 4;
        let rows_per_task = self.rows.div_ceil(tasks).max(16);
        if m == 1 {
            let x = x.row(0, self.qtype);
            out.par_chunks_mut(rows_per_task).enumerate().for_each(|(c, chunk)| {
                let first = c * rows_per_task;
                let done = chunk.len() / TILE * TILE;
                let mut quads = chunk.chunks_exact_mut(TILE);
                for (k, ys) in quads.by_ref().enumerate() {
                    let r = first + k * TILE;
                    let w = |i| self.weight_row(r + i);
                    let dots = kernel.tile([w(0), w(1), w(2), w(3)], [x]);
                    for (y, d) in ys.iter_mut().zip(dots) {
                        *y = d[0];
                    }
                }
                for (j, y) in quads.into_remainder().iter_mut().enumerate() {
                    *y = kernel.tile([self.weight_row(first + done + j)], [x])[0][0];
                }
            });
            return;
        }
        // Products land weight-row-major, each task in its own slice, then are transposed.
        let mut by_weight_row = vec![0f32; self.rows * m];
        by_weight_row.par_chunks_mut(rows_per_task * m).enumerate().for_each(|(c, chunk)| {
            for i0 in (0..m).step_by(ROW_GROUP) {
                let i1 = (i0 + ROW_GROUP).min(m);
                for (j, ys) in chunk.chunks_exact_mut(m).enumerate() {
                    let w = self.weight_row(c * rows_per_task + j);
                    let mut i = i0;
                    while i + TILE <= i1 {
                        let [dots] = kernel.tile([w], [x.row(i, self.qtype), x.row(i + 1, self.qtype), x.row(i + 2, self.qtype), x.row(i + 3, self.qtype)]);
                        ys[i..i + TILE].copy_from_slice(&dots);
                        i += TILE;
                    }
                    for (i, y) in ys.iter_mut().enumerate().take(i1).skip(i) {
                        *y = kernel.tile([w], [x.row(i, self.qtype)])[0][0];
                    }
                }
            }
        });
        for (r, ys) in by_weight_row.chunks_exact(m).enumerate() {
            for (i, &y) in ys.iter().enumerate() {
                out[i * self.rows + r] = y;
            }
        }
    }
}

/// The little-endian f16 at `at` in `bytes`.
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Products of a few weight rows with a few activation rows ([`TILE`] activation rows per
/// weight row in prompts and batches, [`TILE`] weight rows per activation row in a one-request
/// decoding step), for one block type, compiled for the CPU's widest instruction set.
#[derive(Clone, Copy)]
struct Kernel {
    qtype: QType,
    #[cfg(target_arch = "x86_64")]
    avx2: bool,
    #[cfg(target_arch = "x86_64")]
    avx512: bool,
}

impl Kernel {
    fn for_type(qtype: QType) -> Kernel {
        Kernel {
            qtype,
            #[cfg(target_arch = "x86_64")]
            avx2: x86::available(),
            #[cfg(target_arch = "x86_64")]
            avx512: x86_512::available(),
        }
    }

    /// Products of `R` weight rows with `T` activation rows: `out[r][t]`.
    #[inline(always)]
    fn tile<const R: usize, const T: usize>(self, ws: [WeightRow<'_>; R], xs: [ActRow<'_>; T]) -> [[f32; T]; R] {
        #[cfg(target_arch = "x86_64")]
        if self.avx512 {
            // SAFETY: `x86_512::available` found AVX-512 F, BW, VL and VNNI; the rows hold whole
            // blocks of the same count.
            unsafe {
                return match self.qtype {
                    QType::Q4_0 | QType::Q4_1 => x86_512::tile_q4::<R, T>(ws, xs),
                    QType::Q8_0 => x86_512::tile_q8_0::<R, T>(ws, xs),
                };
            }
        }
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: `x86::available` found AVX2 and FMA; the rows hold whole blocks of the
            // same count (checked by `QMatrix::new` and `matmul`).
            unsafe {
                return match self.qtype {
                    QType::Q4_0 | QType::Q4_1 => x86::tile_q4::<R, T>(ws, xs),
                    QType::Q8_0 => x86::tile_q8_0::<R, T>(ws, xs),
                };
            }
        }
        std::array::from_fn(|r| std::array::from_fn(|t| dot_scalar(self.qtype, ws[r], xs[t])))
    }
}

/// The reference: one weight row with one activation row, block by block.
fn dot_scalar(qtype: QType, w: WeightRow<'_>, x: ActRow<'_>) -> f32 {
    let pb = qtype.packed_bytes();
    let mut sum = 0f32;
    for b in 0..w.scales.len() {
        let packed = &w.packed[b * pb..(b + 1) * pb];
        let qs = &x.qs[b];
        let p: i32 = match qtype {
            QType::Q4_0 | QType::Q4_1 => packed
                .iter()
                .enumerate()
                .map(|(j, &q)| (q & 0x0f) as i32 * qs[j] as i32 + (q >> 4) as i32 * qs[j + 16] as i32)
                .sum(),
            QType::Q8_0 => packed.iter().zip(qs).map(|(&q, &v)| (q as i8) as i32 * v as i32).sum(),
        };
        sum += w.scales[b] * x.d[b] * p as f32;
        if let Some(m) = w.offsets.get(b) {
            sum += m * x.s[b];
        }
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{ActRow, WeightRow, BLOCK};
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }

    #[inline(always)]
    unsafe fn sum_lanes(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// `out[r][t] = Σ_b (ws[r].scales[b] xs[t].d[b] P_b + ws[r].offsets[b] xs[t].s[b])`, where
    /// `P_b` is block `b`'s integer product of weight row `r` and activation row `t`: each
    /// weight block is unpacked once for the `T` activation rows, each activation block read
    /// from cache for the `R` weight rows. `Q8` picks signed 8-bit weights (else unsigned 4-bit
    /// pairs, with offsets).
    ///
    /// A block's offset term joins its product term in the running sums (an eighth in each
    /// lane, exact), as the scalar reference adds them: the 4-bit values are unsigned, so the
    /// product terms share a large bias the offsets cancel, and summing each kind alone over
    /// the row before subtracting lost digits where activations are large (SmolLM2's first
    /// position: errors of 4e-4 against 2e-5, and a next-token distribution five times
    /// further from exact).
    #[inline(always)]
    unsafe fn tile<const R: usize, const T: usize, const Q8: bool>(ws: [WeightRow<'_>; R], xs: [ActRow<'_>; T]) -> [[f32; T]; R] {
        let blocks = xs[0].d.len();
        let low = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut even = [[_mm256_setzero_ps(); T]; R];
        let mut odd = [[_mm256_setzero_ps(); T]; R];
        // Block `b` into `acc`: even blocks into one set of registers, odd ones into the other
        // (constant indices keep them in registers), two dependency chains. A macro, not a
        // closure: closures do not inherit the caller's target features.
        macro_rules! block {
            ($b:expr, $acc:expr) => {{
                let b = $b;
                let acc = &mut $acc;
                for r in 0..R {
                    let w = &ws[r];
                    let q = if Q8 {
                        _mm256_loadu_si256(w.packed.as_ptr().add(b * BLOCK) as *const __m256i)
                    } else {
                        let packed = _mm_loadu_si128(w.packed.as_ptr().add(b * 16) as *const __m128i);
                        // Values 0..16 are the low nibbles, 16..32 the high ones.
                        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed), low)
                    };
                    let magnitude = if Q8 { _mm256_sign_epi8(q, q) } else { q };
                    let wd = _mm256_broadcast_ss(w.scales.get_unchecked(b));
                    let offset = if Q8 { wd } else { _mm256_broadcast_ss(w.offsets.get_unchecked(b)) };
                    for t in 0..T {
                        let mut v = _mm256_loadu_si256(xs[t].qs.get_unchecked(b).as_ptr() as *const __m256i);
                        if Q8 {
                            v = _mm256_sign_epi8(v, q);
                        }
                        let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, v), ones);
                        let scale = _mm256_mul_ps(wd, _mm256_broadcast_ss(xs[t].d.get_unchecked(b)));
                        if !Q8 {
                            acc[r][t] = _mm256_fmadd_ps(offset, _mm256_broadcast_ss(xs[t].s_eighth.get_unchecked(b)), acc[r][t]);
                        }
                        acc[r][t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[r][t]);
                    }
                }
            }};
        }
        let mut b = 0;
        while b + 1 < blocks {
            block!(b, even);
            block!(b + 1, odd);
            b += 2;
        }
        if b < blocks {
            block!(b, even);
        }
        // Loops, not `array::from_fn`: its closure would not inherit the target features, and
        // every intrinsic in it would become a function call.
        let mut out = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                out[r][t] = sum_lanes(_mm256_add_ps(even[r][t], odd[r][t]));
            }
        }
        out
    }

    /// [`tile`] for Q4_0 and Q4_1: the 4-bit values are unsigned, as `maddubs` wants its first
    /// operand; the offsets (`-8 d` for Q4_0) come in through the activation blocks' sums.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_q4<const R: usize, const T: usize>(ws: [WeightRow<'_>; R], xs: [ActRow<'_>; T]) -> [[f32; T]; R] {
        tile::<R, T, false>(ws, xs)
    }

    /// [`tile`] for Q8_0: signed times signed, through `maddubs` on |w| and x with w's sign.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_q8_0<const R: usize, const T: usize>(ws: [WeightRow<'_>; R], xs: [ActRow<'_>; T]) -> [[f32; T]; R] {
        tile::<R, T, true>(ws, xs)
    }
}

/// `x86::tile` with 512-bit registers and VNNI's `vpdpbusd` (AVX-512 VNNI: Intel Ice Lake
/// and later, AMD Zen 4 and later): two 32-value blocks per register, and one instruction for
/// the byte products and their sums where AVX2 takes two. On a 2-core Xeon with AMX, decoding
/// SmolLM2 spent ~70% of its time in the AVX2 kernel; this one took it from 117 to 135-137
/// tokens/s (docs/benchmarks.md, eighth round).
#[cfg(target_arch = "x86_64")]
mod x86_512 {
    use super::{ActRow, WeightRow, BLOCK};
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512vnni"))
    }

    /// Lanes 0-7 `v[0]`, lanes 8-15 `v[1]`: the two blocks' scales beside their sums.
    #[inline(always)]
    unsafe fn pair_scales(v: __m128) -> __m512 {
        _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps128_ps512(v))
    }

    /// As [`super::x86::tile`], blocks `b` and `b + 1` in one register (lanes 0-7 and 8-15;
    /// past the last block, zeros), so each (weight row, activation row) pair runs the same
    /// instructions in any tile shape and a row's products do not depend on its neighbours.
    #[inline(always)]
    unsafe fn tile<const R: usize, const T: usize, const Q8: bool>(ws: [WeightRow<'_>; R], xs: [ActRow<'_>; T]) -> [[f32; T]; R] {
        let blocks = xs[0].d.len();
        let low = _mm512_set1_epi8(0x0f);
        // Low nibbles of block b, its high nibbles, then block b + 1's (64-bit lanes).
        let nibble_order = _mm512_set_epi64(7, 6, 3, 2, 5, 4, 1, 0);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut b = 0;
        while b < blocks {
            let two = blocks - b >= 2;
            let (block_mask, packed_mask, scale_mask): (u64, u32, u8) = if two { (u64::MAX, u32::MAX, 0b11) } else { (u32::MAX as u64, 0xffff, 0b01) };
            let mut x = [_mm512_setzero_si512(); T];
            let mut xd = [_mm512_setzero_ps(); T];
            for t in 0..T {
                x[t] = _mm512_maskz_loadu_epi8(block_mask, xs[t].qs.as_ptr().add(b) as *const i8);
                xd[t] = pair_scales(_mm_maskz_loadu_ps(scale_mask, xs[t].d.as_ptr().add(b)));
            }
            for r in 0..R {
                let w = &ws[r];
                let q = if Q8 {
                    _mm512_maskz_loadu_epi8(block_mask, w.packed.as_ptr().add(b * BLOCK) as *const i8)
                } else {
                    let packed = _mm256_maskz_loadu_epi8(packed_mask, w.packed.as_ptr().add(b * 16) as *const i8);
                    let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(packed), _mm256_srli_epi16::<4>(packed));
                    _mm512_and_si512(_mm512_permutexvar_epi64(nibble_order, both), low)
                };
                let wd = pair_scales(_mm_maskz_loadu_ps(scale_mask, w.scales.as_ptr().add(b)));
                for t in 0..T {
                    let dot = if Q8 {
                        // Unsigned |w| times x with w's sign (activations lie within ±127).
                        let negative = _mm512_movepi8_mask(q);
                        let v = _mm512_mask_sub_epi8(x[t], negative, _mm512_setzero_si512(), x[t]);
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q), v)
                    } else {
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x[t])
                    };
                    acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(wd, xd[t]), _mm512_cvtepi32_ps(dot), acc[r][t]);
                }
            }
            b += 2;
        }
        let mut out = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                let offsets = if Q8 { 0.0 } else { offset_sum(ws[r].offsets, xs[t].s) };
                out[r][t] = _mm512_reduce_add_ps(acc[r][t]) + offsets;
            }
        }
        out
    }

    /// `Σ_b offsets[b] sums[b]` in sixteen lanes.
    #[inline(always)]
    unsafe fn offset_sum(offsets: &[f32], sums: &[f32]) -> f32 {
        let mut acc = _mm512_setzero_ps();
        for b in (0..offsets.len()).step_by(16) {
            let mask = if offsets.len() - b >= 16 { 0xffff } else { ((1u32 << (offsets.len() - b)) - 1) as u16 };
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, offsets.as_ptr().add(b)), _mm512_maskz_loadu_ps(mask, sums.as_ptr().add(b)), acc);
        }
        _mm512_reduce_add_ps(acc)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn tile_q4<const R: usize, const T: usize>(ws: [WeightRow<'_>; R], xs: [ActRow<'_>; T]) -> [[f32; T]; R] {
        tile::<R, T, false>(ws, xs)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn tile_q8_0<const R: usize, const T: usize>(ws: [WeightRow<'_>; R], xs: [ActRow<'_>; T]) -> [[f32; T]; R] {
        tile::<R, T, true>(ws, xs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matrix of made-up blocks: scales in [0.01, 0.05), offsets in [-0.3, 0), values
    /// covering their whole range (Q8_0 within ±127, as quantizers write it).
    fn matrix(qtype: QType, rows: usize, cols: usize) -> QMatrix {
        let mut data = Vec::new();
        let mut seed = 12345u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (seed >> 8) as u8
        };
        for _ in 0..rows * cols / BLOCK {
            let mut push_f16 = |v: f32| data.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
            push_f16(0.01 + next() as f32 / 6400.0);
            match qtype {
                QType::Q4_0 => (0..16).for_each(|_| data.push(next())),
                QType::Q4_1 => {
                    push_f16(-(next() as f32) / 850.0);
                    (0..16).for_each(|_| data.push(next()));
                }
                QType::Q8_0 => (0..32).for_each(|_| data.push(((next() % 255) as i32 - 127) as i8 as u8)),
            }
        }
        QMatrix::new(qtype, rows, cols, &data).unwrap()
    }

    /// Every kernel, tile and remainder path against f64 products of the dequantized weights
    /// with the dequantized activations (the same numbers, so only rounding differs), and the
    /// result against the unquantized activations within the 8-bit quantization's error.
    #[test]
    fn products_match_the_dequantized_weights() {
        let cols = 96;
        for qtype in [QType::Q4_0, QType::Q4_1, QType::Q8_0] {
            let w = matrix(qtype, 37, cols);
            for m in [1usize, 3, 4, 7, 70] {
                let x: Vec<f32> = (0..m * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0).collect();
                let mut xq = QuantizedRows::default();
                xq.quantize(&x, cols);
                let mut out = vec![0f32; m * w.rows()];
                w.matmul(&xq, &mut out);
                // Each row's products are the same alone as among others, to the bit.
                let last = m - 1;
                let mut alone = QuantizedRows::default();
                alone.quantize(&x[last * cols..], cols);
                let mut out_alone = vec![0f32; w.rows()];
                w.matmul(&alone, &mut out_alone);
                assert_eq!(out_alone, out[last * w.rows()..], "{qtype:?} m={m}: the last row alone");
                let mut row = vec![0f32; cols];
                for r in 0..w.rows() {
                    w.dequantize_row(r, &mut row);
                    for i in 0..m {
                        let a = xq.row(i, qtype);
                        // Rounding moves each activation by at most half its block's step.
                        let (mut exact, mut from_quantized, mut bound) = (0f64, 0f64, 1e-4);
                        for (k, &wv) in row.iter().enumerate() {
                            let (d, q) = (a.d[k / BLOCK], a.qs[k / BLOCK][k % BLOCK]);
                            from_quantized += wv as f64 * (d * q as f32) as f64;
                            exact += wv as f64 * x[i * cols + k] as f64;
                            bound += (wv.abs() * d) as f64 / 2.0;
                        }
                        let got = out[i * w.rows() + r] as f64;
                        // Q4_1's minimum meets the block sums as Q8_1 rounds them to f16.
                        let rounded_sums: f64 = match qtype {
                            QType::Q4_1 => w.weight_row(r).offsets.iter().zip(a.s).map(|(m, s)| (m * s).abs() as f64 / 2048.0).sum(),
                            _ => 0.0,
                        };
                        assert!((got - from_quantized).abs() < 1e-4 * (1.0 + from_quantized.abs()) + rounded_sums, "{qtype:?} m={m} [{i},{r}]: {got} vs {from_quantized}");
                        assert!((got - exact).abs() <= bound, "{qtype:?} m={m} [{i},{r}]: {got} vs exact {exact}");
                        let scalar = dot_scalar(qtype, w.weight_row(r), a) as f64;
                        assert!((got - scalar).abs() < 1e-4 * (1.0 + scalar.abs()), "{qtype:?} scalar");
                    }
                }
            }
        }
    }

    #[test]
    fn stacking_keeps_rows_in_order_and_refuses_mixed_types() {
        let (a, b) = (matrix(QType::Q4_1, 2, 64), matrix(QType::Q4_1, 3, 64));
        let (mut ra, mut rs) = (vec![0f32; 64], vec![0f32; 64]);
        b.dequantize_row(1, &mut ra);
        let stacked = QMatrix::stack(vec![a, b]).unwrap();
        assert_eq!(stacked.rows(), 5);
        stacked.dequantize_row(3, &mut rs);
        assert_eq!(ra, rs);
        assert!(QMatrix::stack(vec![matrix(QType::Q4_1, 1, 64), matrix(QType::Q8_0, 1, 64)]).is_err());
        assert!(QMatrix::new(QType::Q8_0, 1, 48, &[0; 51]).is_err());
    }
}

