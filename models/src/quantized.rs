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
pub(crate) const BLOCK: usize = 32;

/// A GGML block type this module multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QType {
    /// Scale `d` (f16) and 32 four-bit values `q`: `x = d * (q - 8)`.
    Q4_0,
    /// Scale `d` and minimum `m` (f16) and 32 four-bit values: `x = d * q + m`.
    Q4_1,
    /// Scale `d` (f16) and 32 signed bytes: `x = d * q`.
    Q8_0,
}

impl QType {
    /// Bytes per block of 32 values.
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q8_0 => 34,
        }
    }
}

/// One block of an activation row quantized to bytes: `x ≈ d * qs`, with `s = d * Σ qs` for the
/// weight types that carry an offset.
#[derive(Clone, Copy)]
pub(crate) struct ActBlock {
    d: f32,
    s: f32,
    qs: [i8; BLOCK],
}

/// Activation rows quantized for [`QMatrix::matmul`]; reused between products to keep its
/// buffer.
#[derive(Default)]
pub(crate) struct QuantizedRows {
    blocks_per_row: usize,
    blocks: Vec<ActBlock>,
}

impl QuantizedRows {
    /// Quantizes `x`, rows of `cols` values each (`cols` a multiple of [`BLOCK`]).
    pub(crate) fn quantize(&mut self, x: &[f32], cols: usize) {
        debug_assert!(cols % BLOCK == 0 && x.len() % cols == 0);
        self.blocks_per_row = cols / BLOCK;
        self.blocks.clear();
        self.blocks.extend(x.chunks_exact(BLOCK).map(quantize_block));
    }

    fn rows(&self) -> usize {
        self.blocks.len() / self.blocks_per_row.max(1)
    }

    fn row(&self, i: usize) -> &[ActBlock] {
        &self.blocks[i * self.blocks_per_row..(i + 1) * self.blocks_per_row]
    }
}

fn quantize_block(x: &[f32]) -> ActBlock {
    // Adding 1.5 * 2^23 rounds to the nearest integer without a libm call.
    const ROUND: f32 = 12_582_912.0;
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; BLOCK];
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = (v * inv + ROUND) - ROUND;
        *q = r as i8;
        sum += *q as i32;
    }
    ActBlock { d, s: d * sum as f32, qs }
}

/// A weight matrix of `rows` x `cols` values, stored row by row in GGML blocks as in the file.
pub(crate) struct QMatrix {
    qtype: QType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

/// Activation rows multiplied against each weight row while its blocks are unpacked.
const TILE: usize = 4;
/// Activation rows kept hot in cache while a task walks its weight rows (64 rows of 576 values
/// take 46 KB).
const ROW_GROUP: usize = 64;

impl QMatrix {
    /// `data` holds `rows` rows of `cols / 32` blocks of `qtype`; `cols` must be a multiple of 32.
    pub(crate) fn new(qtype: QType, rows: usize, cols: usize, data: Vec<u8>) -> Result<QMatrix> {
        ensure!(cols % BLOCK == 0, "{cols} columns are not a whole number of {BLOCK}-value blocks");
        let want = rows * cols / BLOCK * qtype.block_bytes();
        ensure!(data.len() == want, "{qtype:?} matrix of {rows}x{cols} needs {want} bytes, got {}", data.len());
        Ok(QMatrix { qtype, rows, cols, data })
    }

    /// The rows of `parts` one after the other (same type and width), so that one product
    /// computes them all.
    pub(crate) fn stack(parts: Vec<QMatrix>) -> Result<QMatrix> {
        let Some(first) = parts.first() else { bail!("nothing to stack") };
        let (qtype, cols) = (first.qtype, first.cols);
        if let Some(odd) = parts.iter().find(|p| p.qtype != qtype || p.cols != cols) {
            bail!("cannot stack a {:?} matrix of width {} onto {qtype:?} of width {cols}", odd.qtype, odd.cols);
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let data = parts.into_iter().flat_map(|p| p.data).collect();
        QMatrix::new(qtype, rows, cols, data)
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes the blocks take.
    pub(crate) fn bytes(&self) -> usize {
        self.data.len()
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.qtype.block_bytes()
    }

    fn weight_row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[r * n..(r + 1) * n]
    }

    /// Row `r` as f32 values into `out` (`cols` long): an embedding lookup.
    pub(crate) fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let bytes = self.qtype.block_bytes();
        for (block, out) in self.weight_row(r).chunks_exact(bytes).zip(out.chunks_exact_mut(BLOCK)) {
            let d = f16_at(block, 0);
            match self.qtype {
                QType::Q4_0 | QType::Q4_1 => {
                    let (m, qs) = match self.qtype {
                        QType::Q4_0 => (-8.0 * d, &block[2..18]),
                        _ => (f16_at(block, 2), &block[4..20]),
                    };
                    for (j, &q) in qs.iter().enumerate() {
                        out[j] = d * (q & 0x0f) as f32 + m;
                        out[j + 16] = d * (q >> 4) as f32 + m;
                    }
                }
                QType::Q8_0 => {
                    for (o, &q) in out.iter_mut().zip(&block[2..34]) {
                        *o = d * (q as i8) as f32;
                    }
                }
            }
        }
    }

    /// `out[i * rows + r] = x_i · W_r` for every row `i` of `x` (quantized from rows of `cols`
    /// values); `out` holds `x`'s rows times [`QMatrix::rows`] values. The weight rows are split
    /// between rayon's threads.
    pub(crate) fn matmul(&self, x: &QuantizedRows, out: &mut [f32]) {
        let m = x.rows();
        assert_eq!(x.blocks_per_row * BLOCK, self.cols, "activation width");
        assert_eq!(out.len(), m * self.rows, "output size");
        let kernel = Kernel::for_type(self.qtype);
        // A few tasks per thread even out uneven progress; 16 rows at least keep each task
        // worth its scheduling.
        let tasks = rayon::current_num_threads() * 4;
        let rows_per_task = self.rows.div_ceil(tasks).max(16);
        if m == 1 {
            let xs = [x.row(0)];
            out.par_chunks_mut(rows_per_task).enumerate().for_each(|(c, chunk)| {
                for (j, y) in chunk.iter_mut().enumerate() {
                    *y = kernel.dot1(self.weight_row(c * rows_per_task + j), xs)[0];
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
                        let dots = kernel.dot4(w, [x.row(i), x.row(i + 1), x.row(i + 2), x.row(i + 3)]);
                        ys[i..i + TILE].copy_from_slice(&dots);
                        i += TILE;
                    }
                    for (i, y) in ys.iter_mut().enumerate().take(i1).skip(i) {
                        *y = kernel.dot1(w, [x.row(i)])[0];
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
#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Dot products of one weight row with 1 or [`TILE`] activation rows, for one block type,
/// compiled for the CPU's widest instruction set.
#[derive(Clone, Copy)]
struct Kernel {
    qtype: QType,
    #[cfg(target_arch = "x86_64")]
    avx2: bool,
}

impl Kernel {
    fn for_type(qtype: QType) -> Kernel {
        Kernel {
            qtype,
            #[cfg(target_arch = "x86_64")]
            avx2: x86::available(),
        }
    }

    #[inline(always)]
    fn dot1(self, w: &[u8], xs: [&[ActBlock]; 1]) -> [f32; 1] {
        self.dot(w, xs)
    }

    #[inline(always)]
    fn dot4(self, w: &[u8], xs: [&[ActBlock]; TILE]) -> [f32; TILE] {
        self.dot(w, xs)
    }

    #[inline(always)]
    fn dot<const T: usize>(self, w: &[u8], xs: [&[ActBlock]; T]) -> [f32; T] {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: `x86::available` found AVX2, FMA and F16C; the slices hold whole blocks
            // (checked by `QMatrix::new` and `matmul`).
            unsafe {
                return match self.qtype {
                    QType::Q4_0 => x86::dot_q4::<T, false>(w, xs),
                    QType::Q4_1 => x86::dot_q4::<T, true>(w, xs),
                    QType::Q8_0 => x86::dot_q8_0::<T>(w, xs),
                };
            }
        }
        std::array::from_fn(|t| dot_scalar(self.qtype, w, xs[t]))
    }
}

/// The reference: one weight row with one activation row, block by block.
fn dot_scalar(qtype: QType, w: &[u8], x: &[ActBlock]) -> f32 {
    let mut sum = 0f32;
    for (block, a) in w.chunks_exact(qtype.block_bytes()).zip(x) {
        let d = f16_at(block, 0);
        match qtype {
            QType::Q4_0 | QType::Q4_1 => {
                let (m, qs) = match qtype {
                    QType::Q4_0 => (-8.0 * d, &block[2..18]),
                    _ => (f16_at(block, 2), &block[4..20]),
                };
                let mut p = 0i32;
                for (j, &q) in qs.iter().enumerate() {
                    p += (q & 0x0f) as i32 * a.qs[j] as i32 + (q >> 4) as i32 * a.qs[j + 16] as i32;
                }
                sum += d * a.d * p as f32 + m * a.s;
            }
            QType::Q8_0 => {
                let p: i32 = block[2..34].iter().zip(&a.qs).map(|(&q, &v)| (q as i8) as i32 * v as i32).sum();
                sum += d * a.d * p as f32;
            }
        }
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{ActBlock, BLOCK};
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        })
    }

    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[inline(always)]
    unsafe fn sum_lanes(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// Q4_0 (`OFFSET` false: the offset is `-8 d`) or Q4_1 (`OFFSET` true: the block's `m`).
    /// The 4-bit values are unsigned, as `maddubs` wants its first operand; the offset is
    /// applied once per block through the activation block's sum.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4<const T: usize, const OFFSET: bool>(w: &[u8], xs: [&[ActBlock]; T]) -> [f32; T] {
        let (bytes, head) = if OFFSET { (20, 4) } else { (18, 2) };
        let blocks = w.len() / bytes;
        let low = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut offsets = [0f32; T];
        for b in 0..blocks {
            let p = w.as_ptr().add(b * bytes);
            let d = f16_at(p);
            let m = if OFFSET { f16_at(p.add(2)) } else { -8.0 * d };
            let packed = _mm_loadu_si128(p.add(head) as *const __m128i);
            // Values 0..16 are the low nibbles, 16..32 the high ones.
            let q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed), low);
            for t in 0..T {
                let a = xs[t].get_unchecked(b);
                let v = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, v), ones);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(dot), acc[t]);
                offsets[t] += m * a.s;
            }
        }
        std::array::from_fn(|t| sum_lanes(acc[t]) + offsets[t])
    }

    /// Q8_0: signed times signed, through `maddubs` on |w| and x with w's sign.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0<const T: usize>(w: &[u8], xs: [&[ActBlock]; T]) -> [f32; T] {
        const BYTES: usize = 2 + BLOCK;
        let blocks = w.len() / BYTES;
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..blocks {
            let p = w.as_ptr().add(b * BYTES);
            let d = f16_at(p);
            let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
            let magnitude = _mm256_sign_epi8(q, q);
            for t in 0..T {
                let a = xs[t].get_unchecked(b);
                let v = _mm256_sign_epi8(_mm256_loadu_si256(a.qs.as_ptr() as *const __m256i), q);
                let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, v), ones);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(dot), acc[t]);
            }
        }
        std::array::from_fn(|t| sum_lanes(acc[t]))
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
        QMatrix::new(qtype, rows, cols, data).unwrap()
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
                let mut row = vec![0f32; cols];
                for r in 0..w.rows() {
                    w.dequantize_row(r, &mut row);
                    for i in 0..m {
                        let a = xq.row(i);
                        // Rounding moves each activation by at most half its block's step.
                        let (mut exact, mut from_quantized, mut bound) = (0f64, 0f64, 1e-4);
                        for (k, &wv) in row.iter().enumerate() {
                            let blk = &a[k / BLOCK];
                            from_quantized += wv as f64 * (blk.d * blk.qs[k % BLOCK] as f32) as f64;
                            exact += wv as f64 * x[i * cols + k] as f64;
                            bound += (wv.abs() * blk.d) as f64 / 2.0;
                        }
                        let got = out[i * w.rows() + r] as f64;
                        assert!((got - from_quantized).abs() < 1e-4 * (1.0 + from_quantized.abs()), "{qtype:?} m={m} [{i},{r}]: {got} vs {from_quantized}");
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
        assert!(QMatrix::new(QType::Q8_0, 1, 48, vec![0; 51]).is_err());
    }
}
