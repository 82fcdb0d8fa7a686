//! GGML-quantized weight matrices (the Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks
//! of GGUF files) and their products with f32 activations on the CPU, computed as llama.cpp
//! computes them: each activation row is quantized to 8-bit blocks, and every 32-value block of
//! a product is an integer dot product, scaled once.
//!
//! The weights keep the values the file stores, exactly ([`blocks`]): 4- and 5-bit values stay
//! packed with a scale and an offset per 32 values, 8-bit values (and Q6_K's 6-bit ones, widened)
//! as signed bytes. candle multiplies only Q8_0 this way on the CPU, and re-quantizing other types
//! to Q8_0 both moved their values and read more bytes per generated token, on a path bound by
//! memory bandwidth.
//!
//! Activations are quantized per 32 values with an f16 scale, as llama.cpp quantizes them for
//! the 32-value types (Q8_0 and Q8_1); for the K types llama.cpp quantizes per 256 values with an
//! f32 scale (Q8_K), which rounds them more coarsely, so tern's products of K types are slightly
//! closer to exact than llama.cpp's and not equal to them.

mod blocks;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;

use anyhow::{bail, ensure, Result};
use rayon::prelude::*;

/// Values per block of the products, for every type (the K types' 256-value blocks are cut in
/// eight).
pub const BLOCK: usize = 32;

/// A GGML block type this module multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum QType {
    /// Scale `d` (f16) and 32 four-bit values `q`: `x = d * (q - 8)`.
    Q4_0,
    /// Scale `d` and minimum `m` (f16) and 32 four-bit values: `x = d * q + m`.
    Q4_1,
    /// Scale `d` (f16) and 32 five-bit values: `x = d * (q - 16)`.
    Q5_0,
    /// Scale `d` and minimum `m` (f16) and 32 five-bit values: `x = d * q + m`.
    Q5_1,
    /// Scale `d` (f16) and 32 signed bytes: `x = d * q`.
    Q8_0,
    /// 256 values: eight 32-value sub-blocks of four-bit values, each with a 6-bit scale and
    /// minimum, times the block's f16 `d` and `dmin`: `x = d * sc * q - dmin * m`.
    Q4_K,
    /// As Q4_K with five-bit values.
    Q5_K,
    /// 256 values: six-bit values with a signed 8-bit scale per 16, times the block's f16 `d`:
    /// `x = d * sc * (q - 32)`.
    Q6_K,
}

/// How a type's values are held for the products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// Unsigned 4-bit values two a byte (value `j` in byte `j`'s low nibble, `j + 16` in its high
    /// one), a scale and an offset per 32: Q4_0, Q4_1, Q4_K.
    Nibbles,
    /// As [`Form::Nibbles`], with each value's fifth bit in a `u32` per block (bit `j`, value
    /// `j`): Q5_0, Q5_1, Q5_K.
    Nibbles5,
    /// Signed bytes, a scale per 32: Q8_0.
    Bytes,
    /// Signed bytes, a scale per 16: Q6_K.
    Bytes16,
}

// The forms as the kernels' const parameters.
const NIBBLES: u8 = 0;
const NIBBLES5: u8 = 1;
const BYTES: u8 = 2;
const BYTES16: u8 = 3;

impl Form {
    /// Bytes of values per 32-value block.
    fn packed_bytes(self) -> usize {
        match self {
            Form::Nibbles | Form::Nibbles5 => 16,
            Form::Bytes | Form::Bytes16 => 32,
        }
    }

    fn scales_per_block(self) -> usize {
        if self == Form::Bytes16 {
            2
        } else {
            1
        }
    }
}

impl QType {
    /// Values per block in a GGUF file: 32, or 256 for the K types.
    pub fn block_values(self) -> usize {
        match self {
            QType::Q4_K | QType::Q5_K | QType::Q6_K => 256,
            _ => 32,
        }
    }

    /// Bytes per block in a GGUF file.
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q5_0 => 22,
            QType::Q5_1 => 24,
            QType::Q8_0 => 34,
            QType::Q4_K => 144,
            QType::Q5_K => 176,
            QType::Q6_K => 210,
        }
    }

    fn form(self) -> Form {
        match self {
            QType::Q4_0 | QType::Q4_1 | QType::Q4_K => Form::Nibbles,
            QType::Q5_0 | QType::Q5_1 | QType::Q5_K => Form::Nibbles5,
            QType::Q8_0 => Form::Bytes,
            QType::Q6_K => Form::Bytes16,
        }
    }

    /// Whether the minimum meets the activation blocks' sums as Q8_1 holds them (rounded to
    /// f16): llama.cpp multiplies Q4_1 and Q5_1 with Q8_1 activations.
    fn rounded_sums(self) -> bool {
        matches!(self, QType::Q4_1 | QType::Q5_1)
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
    /// The sums as Q8_1 holds them, for Q4_1 and Q5_1 ([`quantize_block`]).
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
        let (s, s_eighth) = if qtype.rounded_sums() { (&self.s_f16, &self.s_f16_eighth) } else { (&self.s, &self.s_eighth) };
        ActRow { d: &self.d[r.clone()], s: &s[r.clone()], s_eighth: &s_eighth[r.clone()], qs: &self.qs[r] }
    }
}

/// Rounds one block to bytes; returns `(d, d * Σ qs, f16(d * Σ qs))` as GGML's blocks hold
/// them, so products are llama.cpp's (candle's, ported from it, agree to 1e-6; with F32 scales
/// they moved logits by ~1% of the largest, as far from exact arithmetic as llama.cpp's but
/// elsewhere): `d` rounded to f16 (Q8_0 and Q8_1), the sum with it (the offsets of Q4_0, Q5_0
/// and the K types), and the sum of the unrounded `d` rounded to f16 (Q8_1's, for Q4_1's and
/// Q5_1's minimum: where `d` is a coarse subnormal f16 it keeps the larger sum's precision).
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

/// A weight matrix of `rows` x `cols` values: one [`Part`] per run of rows of one type (a
/// stack of matrices of different types, as Q4_K_M files mix them, keeps each as stored).
pub struct QMatrix {
    rows: usize,
    cols: usize,
    parts: Vec<Part>,
}

/// Rows of one type, held as arrays: each 32-value block's scale (two for Q6_K) and offset as
/// f32 (the offset is `-8 d` for Q4_0, `-16 d` for Q5_0, none for the signed forms), its packed
/// values, and for the 5-bit types its fifth bits. Converting the f16 scales once at load time
/// takes them, and the scalar work around them, out of the products' inner loop.
struct Part {
    qtype: QType,
    rows: usize,
    scales: Vec<f32>,
    offsets: Vec<f32>,
    packed: Vec<u8>,
    high: Vec<u32>,
}

/// One weight row.
#[derive(Clone, Copy)]
struct WeightRow<'a> {
    scales: &'a [f32],
    /// Empty for the signed forms.
    offsets: &'a [f32],
    packed: &'a [u8],
    /// Empty but for the 5-bit types.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    high: &'a [u32],
}

/// Rows taken together by one kernel call: activation rows per weight row (several rows), or
/// weight rows per activation row (one row).
const TILE: usize = 4;
/// Activation rows kept hot in cache while a task walks its weight rows (64 rows of 576 values
/// take 41 KB).
const ROW_GROUP: usize = 64;

impl QMatrix {
    /// `data` holds `rows` rows of `qtype` blocks as a GGUF file stores them; `cols` must be a
    /// multiple of the type's block (32 values, 256 for the K types).
    pub fn new(qtype: QType, rows: usize, cols: usize, data: &[u8]) -> Result<QMatrix> {
        let per_block = qtype.block_values();
        ensure!(cols % per_block == 0, "{cols} columns are not a whole number of {qtype:?}'s {per_block}-value blocks");
        let want = rows * cols / per_block * qtype.block_bytes();
        ensure!(data.len() == want, "{qtype:?} matrix of {rows}x{cols} needs {want} bytes, got {}", data.len());
        let (form, blocks) = (qtype.form(), rows * cols / BLOCK);
        let mut part = Part {
            qtype,
            rows,
            scales: Vec::with_capacity(blocks * form.scales_per_block()),
            offsets: Vec::with_capacity(if matches!(form, Form::Nibbles | Form::Nibbles5) { blocks } else { 0 }),
            packed: Vec::with_capacity(blocks * form.packed_bytes()),
            high: Vec::with_capacity(if form == Form::Nibbles5 { blocks } else { 0 }),
        };
        for block in data.chunks_exact(qtype.block_bytes()) {
            part.push_file_block(block);
        }
        Ok(QMatrix { rows, cols, parts: vec![part] })
    }

    /// The rows of `parts` one after the other (same width), so that one product computes them
    /// all. Rows of different types stay as they are, each type multiplied by its own kernel.
    pub fn stack(parts: Vec<QMatrix>) -> Result<QMatrix> {
        let Some(first) = parts.first() else { bail!("nothing to stack") };
        let cols = first.cols;
        if let Some(odd) = parts.iter().find(|p| p.cols != cols) {
            bail!("cannot stack a matrix of width {} onto one of width {cols}", odd.cols);
        }
        let mut all = QMatrix { rows: 0, cols, parts: Vec::new() };
        for part in parts.into_iter().flat_map(|m| m.parts) {
            all.rows += part.rows;
            match all.parts.last_mut() {
                Some(last) if last.qtype == part.qtype => {
                    last.rows += part.rows;
                    last.scales.extend(part.scales);
                    last.offsets.extend(part.offsets);
                    last.packed.extend(part.packed);
                    last.high.extend(part.high);
                }
                _ => all.parts.push(part),
            }
        }
        Ok(all)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes the arrays take.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| 4 * (p.scales.len() + p.offsets.len() + p.high.len()) + p.packed.len()).sum()
    }

    /// The part holding row `r`, and the row's index in it.
    fn part_of(&self, mut r: usize) -> (&Part, usize) {
        for part in &self.parts {
            if r < part.rows {
                return (part, r);
            }
            r -= part.rows;
        }
        panic!("row {r} past the matrix's {} rows", self.rows);
    }

    /// Row `r` as f32 values into `out` (`cols` long): an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (part, r) = self.part_of(r);
        let w = part.weight_row(r, self.cols);
        let form = part.qtype.form();
        let pb = form.packed_bytes();
        for (b, out) in out.chunks_exact_mut(BLOCK).enumerate() {
            let packed = &w.packed[b * pb..(b + 1) * pb];
            match form {
                Form::Nibbles | Form::Nibbles5 => {
                    let (d, m, high) = (w.scales[b], w.offsets[b], w.high.get(b).copied().unwrap_or(0));
                    for (j, &q) in packed.iter().enumerate() {
                        let (lo, hi) = nibble_pair(q, high, j);
                        out[j] = d * lo as f32 + m;
                        out[j + 16] = d * hi as f32 + m;
                    }
                }
                Form::Bytes | Form::Bytes16 => {
                    let per = form.scales_per_block();
                    for (j, (o, &q)) in out.iter_mut().zip(packed).enumerate() {
                        *o = w.scales[b * per + j * per / BLOCK] * (q as i8) as f32;
                    }
                }
            }
        }
    }

    /// `out[i * rows + r] = x_i · W_r` for every row `i` of `x` (quantized from rows of `cols`
    /// values); `out` holds `x`'s rows times [`QMatrix::rows`] values. The weight rows are split
    /// between rayon's threads.
    pub fn matmul(&self, x: &QuantizedRows, out: &mut [f32]) {
        assert_eq!(x.blocks_per_row * BLOCK, self.cols, "activation width");
        assert_eq!(out.len(), x.rows() * self.rows, "output size");
        let mut first = 0;
        for part in &self.parts {
            part.matmul(x, self.cols, out, self.rows, first);
            first += part.rows;
        }
    }
}

/// Value `j` and `j + 16` of a 4- or 5-bit block: the nibbles of `q`, the fifth bits from `high`.
#[inline(always)]
fn nibble_pair(q: u8, high: u32, j: usize) -> (u8, u8) {
    ((q & 0x0f) | ((((high >> j) & 1) as u8) << 4), (q >> 4) | ((((high >> (j + 16)) & 1) as u8) << 4))
}

impl Part {
    fn weight_row(&self, r: usize, cols: usize) -> WeightRow<'_> {
        let form = self.qtype.form();
        let n = cols / BLOCK;
        let blocks = r * n..(r + 1) * n;
        let (pb, per) = (form.packed_bytes(), form.scales_per_block());
        WeightRow {
            scales: &self.scales[blocks.start * per..blocks.end * per],
            offsets: if self.offsets.is_empty() { &[] } else { &self.offsets[blocks.clone()] },
            packed: &self.packed[blocks.start * pb..blocks.end * pb],
            high: if self.high.is_empty() { &[] } else { &self.high[blocks] },
        }
    }

    /// This part's products into columns `first..first + rows` of `out` (rows of `stride`).
    fn matmul(&self, x: &QuantizedRows, cols: usize, out: &mut [f32], stride: usize, first: usize) {
        let m = x.rows();
        let kernel = Kernel::for_type(self.qtype);
        // A few tasks per thread even out uneven progress; 16 rows at least keep each task
        // worth its scheduling.
        let tasks = rayon::current_num_threads() * 4;
        let rows_per_task = self.rows.div_ceil(tasks).max(16);
        let row = |r| self.weight_row(r, cols);
        if m == 1 {
            let x = x.row(0, self.qtype);
            out[first..first + self.rows].par_chunks_mut(rows_per_task).enumerate().for_each(|(c, chunk)| {
                let start = c * rows_per_task;
                let done = chunk.len() / TILE * TILE;
                let mut quads = chunk.chunks_exact_mut(TILE);
                for (k, ys) in quads.by_ref().enumerate() {
                    let r = start + k * TILE;
                    let dots = kernel.tile([row(r), row(r + 1), row(r + 2), row(r + 3)], [x]);
                    for (y, d) in ys.iter_mut().zip(dots) {
                        *y = d[0];
                    }
                }
                for (j, y) in quads.into_remainder().iter_mut().enumerate() {
                    *y = kernel.tile([row(start + done + j)], [x])[0][0];
                }
            });
            return;
        }
        // Products land weight-row-major, each task in its own slice, then are transposed.
        let mut by_weight_row = vec![0f32; self.rows * m];
        by_weight_row.par_chunks_mut(rows_per_task * m).enumerate().for_each(|(c, chunk)| {
            for i0 in (0..m).step_by(ROW_GROUP) {
                let i1 = (i0 + ROW_GROUP).min(m);
                // Weight rows in pairs: each activation block loaded for both.
                let (first_row, rows_here) = (c * rows_per_task, chunk.len() / m);
                let mut pairs = chunk.chunks_exact_mut(2 * m);
                for (k, ys) in pairs.by_ref().enumerate() {
                    let (y0, y1) = ys.split_at_mut(m);
                    kernel.weight_rows([row(first_row + 2 * k), row(first_row + 2 * k + 1)], [y0, y1], x, i0..i1);
                }
                let odd = pairs.into_remainder();
                if !odd.is_empty() {
                    kernel.weight_rows([row(first_row + rows_here - 1)], [odd], x, i0..i1);
                }
            }
        });
        for (r, ys) in by_weight_row.chunks_exact(m).enumerate() {
            for (i, &y) in ys.iter().enumerate() {
                out[i * stride + first + r] = y;
            }
        }
    }
}

/// `$module::tile::<R, T, _>` (`R` and `T` in scope) for the weights' form: the kernels take the
/// form as a const parameter.
macro_rules! tile_of_form {
    ($module:ident, $form:expr, $ws:expr, $xs:expr) => {
        match $form {
            Form::Nibbles => $module::tile::<R, T, NIBBLES>($ws, $xs),
            Form::Nibbles5 => $module::tile::<R, T, NIBBLES5>($ws, $xs),
            Form::Bytes => $module::tile::<R, T, BYTES>($ws, $xs),
            Form::Bytes16 => $module::tile::<R, T, BYTES16>($ws, $xs),
        }
    };
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
                return tile_of_form!(x86_512, self.qtype.form(), ws, xs);
            }
        }
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: `x86::available` found AVX2 and FMA; the rows hold whole blocks of the
            // same count (checked by `QMatrix::new` and `matmul`).
            unsafe {
                return tile_of_form!(x86, self.qtype.form(), ws, xs);
            }
        }
        let form = self.qtype.form();
        std::array::from_fn(|r| std::array::from_fn(|t| dot_scalar(form, ws[r], xs[t])))
    }

    /// `ys[r][i] = W_r · x_i` for the activation rows `i` in `rows`, [`TILE`] of them a call.
    fn weight_rows<const R: usize>(self, ws: [WeightRow<'_>; R], mut ys: [&mut [f32]; R], x: &QuantizedRows, rows: std::ops::Range<usize>) {
        let a = |i| x.row(i, self.qtype);
        let mut i = rows.start;
        while i + TILE <= rows.end {
            let dots = self.tile(ws, [a(i), a(i + 1), a(i + 2), a(i + 3)]);
            for (y, d) in ys.iter_mut().zip(dots) {
                y[i..i + TILE].copy_from_slice(&d);
            }
            i += TILE;
        }
        for i in i..rows.end {
            let dots = self.tile(ws, [a(i)]);
            for (y, d) in ys.iter_mut().zip(dots) {
                y[i] = d[0];
            }
        }
    }
}

/// The reference: one weight row with one activation row, block by block.
fn dot_scalar(form: Form, w: WeightRow<'_>, x: ActRow<'_>) -> f32 {
    let pb = form.packed_bytes();
    let mut sum = 0f32;
    for b in 0..x.d.len() {
        let packed = &w.packed[b * pb..(b + 1) * pb];
        let qs = &x.qs[b];
        match form {
            Form::Nibbles | Form::Nibbles5 => {
                let high = w.high.get(b).copied().unwrap_or(0);
                let p: i32 = packed
                    .iter()
                    .enumerate()
                    .map(|(j, &q)| {
                        let (lo, hi) = nibble_pair(q, high, j);
                        lo as i32 * qs[j] as i32 + hi as i32 * qs[j + 16] as i32
                    })
                    .sum();
                sum += w.scales[b] * x.d[b] * p as f32 + w.offsets[b] * x.s[b];
            }
            Form::Bytes => {
                let p: i32 = packed.iter().zip(qs).map(|(&q, &v)| (q as i8) as i32 * v as i32).sum();
                sum += w.scales[b] * x.d[b] * p as f32;
            }
            Form::Bytes16 => {
                let half = |h: usize| -> i32 { (16 * h..16 * h + 16).map(|j| (packed[j] as i8) as i32 * qs[j] as i32).sum() };
                sum += x.d[b] * (w.scales[2 * b] * half(0) as f32 + w.scales[2 * b + 1] * half(1) as f32);
            }
        }
    }
    sum
}

#[cfg(test)]
mod tests;
