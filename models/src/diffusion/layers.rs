//! The VAE decoder's and the UNet's layers, computed as diffusers computes them: 3x3 and 1x1 convolutions
//! (stride 1, "same" padding, optionally over a nearest-neighbour 2x upsampling of the input),
//! group norm with the SiLU that follows it fused in, and single-head self-attention over an
//! image's pixels. F32 tensors on the CPU run tern's kernels; anything else (CUDA, other
//! dtypes) runs candle's ops.
//!
//! Why tern's own kernels: candle's CPU `conv2d` gathers its im2col matrix one element at a
//! time, copies the input to NHWC and re-lays the kernel out on every call, and multiplies in
//! 512-pixel tiles; a 512x512 SD decode spent 50 s there. Here a band of output rows gets its
//! im2col matrix from whole-row copies (the (channel, kh, kw) row of the matrix is the band's
//! input rows shifted by `kw - 1`, zero at the edges), and one gemm per band writes straight
//! into the NCHW output, whose rows for one output channel are contiguous within a band. The
//! weights need no re-layout: PyTorch's `(c_out, c_in, 3, 3)` is already the gemm's
//! `(c_out, c_in * 9)` matrix.

use anyhow::{bail, ensure, Result};
use candle_core::{DType, Layout, Module, Storage, Tensor};
use candle_nn::VarBuilder;
use gemm::Parallelism;
use rayon::prelude::*;
use tern_kernels::cpu_kernels::{fast_exp, softmax_in_place};
use tern_kernels::cpu_ops::{contiguous_f32, OutPtr};

/// Bytes of im2col matrix one thread fills before its gemm. Small enough that the matrix is
/// still in cache when the gemm packs it (on a 2-core Zen 5, 128 -> 128 channels at 512x512
/// ran at 335 GFLOPS with 1 to 4 MB, 290 with 16 MB), large enough for a few hundred pixels
/// per gemm at 512 channels.
const BAND_BYTES: usize = 4 << 20;

/// Queries one attention task scores at once: 128 x 4096 pixels of scores is 2 MB.
const QUERIES_PER_TASK: usize = 128;

/// Whether `t` runs on tern's CPU kernels (F32 on the CPU) rather than candle's ops.
pub(super) fn on_cpu_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// The values of a contiguous F32 CPU tensor's storage.
pub(super) fn values<'a>(storage: &'a Storage, layout: &Layout) -> Result<&'a [f32]> {
    let Storage::Cpu(cpu) = storage else {
        bail!("expected a CPU tensor");
    };
    Ok(contiguous_f32(cpu, layout)?)
}

/// A convolution with a 3x3 or 1x1 kernel, stride 1 and "same" padding, with a bias.
pub(super) struct Conv2d {
    /// `(c_out, c_in, k, k)`, contiguous.
    weight: Tensor,
    bias: Tensor,
    c_in: usize,
    c_out: usize,
    kernel: usize,
}

impl Conv2d {
    /// `weight` and `bias` from `vb`. A 1x1 kernel may be stored as a `(c_out, c_in)` linear
    /// layer's weight, as the attention projections of diffusers' VAEs are.
    pub(super) fn load(vb: VarBuilder, c_in: usize, c_out: usize, kernel: usize) -> Result<Conv2d> {
        ensure!(kernel == 1 || kernel == 3, "a {kernel}x{kernel} convolution is not supported");
        let weight = match vb.get((c_out, c_in, kernel, kernel), "weight") {
            Ok(w) => w,
            Err(_) if kernel == 1 => vb.get((c_out, c_in), "weight")?.reshape((c_out, c_in, 1, 1))?,
            Err(e) => return Err(e.into()),
        };
        let bias = vb.get(c_out, "bias")?;
        Ok(Conv2d { weight: weight.contiguous()?, bias, c_in, c_out, kernel })
    }

    /// `x` `(b, c_in, h, w)` to `(b, c_out, h, w)`, plus `residual` `(b, c_out, h, w)` when
    /// given (added in the same pass on the CPU).
    pub(super) fn forward(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        self.run(x, false, residual, None)
    }

    /// [`Conv2d::forward`] with `shift` `(b, c_out)` added to every pixel of image `b`'s
    /// channel `c_out` (a UNet resnet's time embedding), in the same pass on the CPU.
    pub(super) fn forward_shifted(&self, x: &Tensor, shift: &Tensor) -> Result<Tensor> {
        self.run(x, false, None, Some(shift))
    }

    /// The convolution of `x` upsampled 2x by nearest neighbour (diffusers' `Upsample2D`):
    /// `(b, c_in, h, w)` to `(b, c_out, 2h, 2w)`. On the CPU the upsampled input is never
    /// materialised: each band expands the few input rows it reads.
    pub(super) fn forward_upsampled(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, true, None, None)
    }

    fn run(&self, x: &Tensor, upsample: bool, residual: Option<&Tensor>, shift: Option<&Tensor>) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        ensure!(c == self.c_in, "a convolution over {} channels was given {c}", self.c_in);
        ensure!(h > 0 && w > 0, "a convolution over an empty {h}x{w} image");
        ensure!(!upsample || self.kernel == 3, "upsampling is fused into 3x3 convolutions only");
        let (oh, ow) = if upsample { (2 * h, 2 * w) } else { (h, w) };
        if let Some(r) = residual {
            ensure!(r.dims4()? == (b, self.c_out, oh, ow), "residual {:?} does not match the output", r.dims());
        }
        if let Some(s) = shift {
            ensure!(s.dims2()? == (b, self.c_out), "shift {:?} for {b} images of {} channels", s.dims(), self.c_out);
        }
        if !on_cpu_f32(x) {
            let x = if upsample { x.upsample_nearest2d(oh, ow)? } else { x.clone() };
            let mut y = x.conv2d(&self.weight, self.kernel / 2, 1, 1, 1)?.broadcast_add(&self.bias.reshape((1, (), 1, 1))?)?;
            if let Some(s) = shift {
                y = y.broadcast_add(&s.reshape((b, self.c_out, 1, 1))?)?;
            }
            return Ok(match residual {
                Some(r) => (y + r)?,
                None => y,
            });
        }
        let x = x.contiguous()?;
        let residual = residual.map(Tensor::contiguous).transpose()?;
        let (xg, xl) = x.storage_and_layout();
        let (wg, wl) = self.weight.storage_and_layout();
        let (bg, bl) = self.bias.storage_and_layout();
        let (src, weight, bias) = (values(&xg, xl)?, values(&wg, wl)?, values(&bg, bl)?);
        // With a shift, each image starts from its own bias: the layer's plus its shift.
        let biases = match shift {
            Some(s) => {
                let s = s.to_dtype(DType::F32)?.to_vec2::<f32>()?;
                s.iter().flat_map(|row| row.iter().zip(bias).map(|(s, b)| s + b)).collect()
            }
            None => Vec::new(),
        };
        let rg = residual.as_ref().map(|r| r.storage_and_layout());
        let residual = match &rg {
            Some((g, l)) => Some(values(g, l)?),
            None => None,
        };
        let (in_size, out_size) = (self.c_in * h * w, self.c_out * oh * ow);
        let mut out = vec![0f32; b * out_size];
        for (i, dst) in out.chunks_exact_mut(out_size).enumerate() {
            let image = ConvImage {
                weight,
                bias: if biases.is_empty() { bias } else { &biases[i * self.c_out..(i + 1) * self.c_out] },
                c_in: self.c_in,
                c_out: self.c_out,
                src: &src[i * in_size..(i + 1) * in_size],
                h,
                w,
                upsample,
                residual: residual.map(|r| &r[i * out_size..(i + 1) * out_size]),
            };
            if self.kernel == 3 {
                image.conv3x3(dst);
            } else {
                image.conv1x1(dst);
            }
        }
        Ok(Tensor::from_vec(out, (b, self.c_out, oh, ow), x.device())?)
    }
}

/// One image's convolution on the CPU.
struct ConvImage<'a> {
    /// `(c_out, c_in * k * k)`.
    weight: &'a [f32],
    bias: &'a [f32],
    c_in: usize,
    c_out: usize,
    /// `(c_in, h, w)`.
    src: &'a [f32],
    h: usize,
    w: usize,
    upsample: bool,
    /// `(c_out, oh, ow)`, added to the output.
    residual: Option<&'a [f32]>,
}

impl ConvImage<'_> {
    fn out_size(&self) -> (usize, usize) {
        if self.upsample {
            (2 * self.h, 2 * self.w)
        } else {
            (self.h, self.w)
        }
    }

    /// Sets output pixels `from..from + n` of every channel to the bias (plus the residual)
    /// before the gemm adds the products to them. `dst` is the whole output, `(c_out, oh, ow)`.
    ///
    /// # Safety
    /// `dst` points at `c_out * oh * ow` values, of which the caller alone writes pixels
    /// `from..from + n` of each channel while this runs.
    unsafe fn start_from_bias(&self, dst: &OutPtr, from: usize, n: usize) {
        let (oh, ow) = self.out_size();
        for (co, &bias) in self.bias.iter().enumerate() {
            let at = co * oh * ow + from;
            let out = dst.slice(at, n);
            match self.residual {
                Some(r) => out.iter_mut().zip(&r[at..at + n]).for_each(|(o, r)| *o = r + bias),
                None => out.fill(bias),
            }
        }
    }

    /// `out = W x + bias (+ residual)`: the input's channels are already the gemm's rows.
    fn conv1x1(&self, out: &mut [f32]) {
        let hw = self.h * self.w;
        let tasks = 4 * rayon::current_num_threads();
        let chunk = hw.div_ceil(tasks).next_multiple_of(64).max(256).min(hw);
        let dst = OutPtr(out.as_mut_ptr());
        (0..hw.div_ceil(chunk)).into_par_iter().for_each(|i| {
            let (from, n) = (i * chunk, chunk.min(hw - i * chunk));
            // SAFETY: each task writes its own pixels `from..from + n` of every channel of
            // `out` (`c_out * hw` values); the source pointers stay inside `src` and `weight`.
            unsafe {
                self.start_from_bias(&dst, from, n);
                gemm::gemm(
                    self.c_out, n, self.c_in,
                    dst.at(from), 1, hw as isize, true,
                    self.weight.as_ptr(), 1, self.c_in as isize,
                    self.src.as_ptr().add(from), 1, hw as isize,
                    1.0, 1.0, false, false, false, Parallelism::None,
                );
            }
        });
    }

    /// `out = W im2col(x) + bias (+ residual)`, one band of output rows per task, each task on
    /// its thread's own im2col matrix.
    fn conv3x3(&self, out: &mut [f32]) {
        let (oh, ow) = self.out_size();
        let k = self.c_in * 9;
        let threads = rayon::current_num_threads();
        // As many bands as keep a band's matrix within BAND_BYTES, at least one per thread and
        // a multiple of the threads, so that no thread is left with a last band alone.
        let fit = (BAND_BYTES / 4 / (k * ow)).max(1);
        let bands = oh.div_ceil(fit).next_multiple_of(threads).min(oh);
        let rows = oh.div_ceil(bands);
        let bands = oh.div_ceil(rows);
        let col_len = k * rows * ow;
        // The (upsampled) input rows one band reads, for one channel at a time.
        let slab_len = if self.upsample { (rows + 2) * ow } else { 0 };
        let per_thread = col_len + slab_len;
        let mut scratch = vec![0f32; threads * per_thread];
        let scratch_at = OutPtr(scratch.as_mut_ptr());
        let dst = OutPtr(out.as_mut_ptr());
        (0..bands).into_par_iter().for_each(|band| {
            // Outside the pool only when rayon did not split the bands at all, so that the
            // calling thread runs them all alone.
            let thread = rayon::current_thread_index().unwrap_or(0) % threads;
            // SAFETY: a thread runs one band at a time (the band waits on no other task), and
            // each thread has its own `per_thread` values of `scratch`, which outlives the tasks.
            let scratch = unsafe { scratch_at.slice(thread * per_thread, per_thread) };
            let (col, slab) = scratch.split_at_mut(col_len);
            let (y0, y1) = (band * rows, ((band + 1) * rows).min(oh));
            let n = (y1 - y0) * ow;
            let col = &mut col[..k * n];
            // Input rows y0 - 1 ..= y1 (within the image) feed output rows y0..y1.
            let (lo, hi) = (y0.saturating_sub(1), (y1 + 1).min(oh));
            for ci in 0..self.c_in {
                let plane = &self.src[ci * self.h * self.w..(ci + 1) * self.h * self.w];
                let rows_in: &[f32] = if self.upsample {
                    for (i, y) in (lo..hi).enumerate() {
                        let from = &plane[(y / 2) * self.w..(y / 2 + 1) * self.w];
                        for (pair, &v) in slab[i * ow..(i + 1) * ow].chunks_exact_mut(2).zip(from) {
                            pair.fill(v);
                        }
                    }
                    &slab[..(hi - lo) * ow]
                } else {
                    &plane[lo * ow..hi * ow]
                };
                im2col_channel(rows_in, lo, oh, ow, y0..y1, &mut col[ci * 9 * n..(ci + 1) * 9 * n]);
            }
            // SAFETY: this task alone writes output rows y0..y1 (pixels y0 * ow .. y1 * ow) of
            // every channel; the gemm reads `col` (k x n) and `weight` (c_out x k) in bounds.
            unsafe {
                self.start_from_bias(&dst, y0 * ow, n);
                gemm::gemm(
                    self.c_out, n, k,
                    dst.at(y0 * ow), 1, (oh * ow) as isize, true,
                    self.weight.as_ptr(), 1, k as isize,
                    col.as_ptr(), 1, n as isize,
                    1.0, 1.0, false, false, false, Parallelism::None,
                );
            }
        });
    }
}

/// The nine im2col rows of one input channel for output rows `band` (each `w` wide): row
/// `kh * 3 + kw` of `col` holds input pixel `(y + kh - 1, x + kw - 1)` at output pixel `(y, x)`,
/// zero outside the image. `rows_in` holds input rows `lo..` of an image `h` rows high.
fn im2col_channel(rows_in: &[f32], lo: usize, h: usize, w: usize, band: std::ops::Range<usize>, col: &mut [f32]) {
    let n = band.len() * w;
    for kh in 0..3 {
        for y in band.clone() {
            let at = (y - band.start) * w;
            let src = (y + kh).checked_sub(1).filter(|&yy| yy < h).map(|yy| &rows_in[(yy - lo) * w..(yy - lo + 1) * w]);
            for kw in 0..3 {
                let dst = &mut col[(kh * 3 + kw) * n + at..(kh * 3 + kw) * n + at + w];
                match (src, kw) {
                    (None, _) => dst.fill(0.0),
                    (Some(s), 0) => {
                        dst[0] = 0.0;
                        dst[1..].copy_from_slice(&s[..w - 1]);
                    }
                    (Some(s), 1) => dst.copy_from_slice(s),
                    (Some(s), _) => {
                        dst[..w - 1].copy_from_slice(&s[1..]);
                        dst[w - 1] = 0.0;
                    }
                }
            }
        }
    }
}

/// Group normalisation (PyTorch's `GroupNorm`, affine), optionally followed by SiLU in the
/// same pass, as every norm of the decoder but the attention's is.
pub(super) struct GroupNorm {
    norm: candle_nn::GroupNorm,
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    channels: usize,
    eps: f64,
}

impl GroupNorm {
    /// `weight` and `bias` (`channels` each) from `vb`.
    pub(super) fn load(vb: VarBuilder, groups: usize, channels: usize, eps: f64) -> Result<GroupNorm> {
        ensure!(groups > 0 && channels % groups == 0, "{channels} channels do not split into {groups} groups");
        let (weight, bias) = (vb.get(channels, "weight")?, vb.get(channels, "bias")?);
        let norm = candle_nn::GroupNorm::new(weight.clone(), bias.clone(), channels, groups, eps)?;
        Ok(GroupNorm { norm, weight, bias, groups, channels, eps })
    }

    /// `x` `(b, channels, h, w)` normalised per (image, group), then SiLU when `silu`.
    pub(super) fn forward(&self, x: &Tensor, silu: bool) -> Result<Tensor> {
        if !on_cpu_f32(x) {
            let y = self.norm.forward(x)?;
            return Ok(if silu { candle_nn::ops::silu(&y)? } else { y });
        }
        let (_, c, h, w) = x.dims4()?;
        ensure!(c == self.channels, "a group norm over {} channels was given {c}", self.channels);
        let x = x.contiguous()?;
        let (xg, xl) = x.storage_and_layout();
        let (wg, wl) = self.weight.storage_and_layout();
        let (bg, bl) = self.bias.storage_and_layout();
        let (src, gamma, beta) = (values(&xg, xl)?, values(&wg, wl)?, values(&bg, bl)?);
        let (hw, per_group) = (h * w, c / self.groups);
        let mut out = vec![0f32; src.len()];
        // Images are groups after groups, so the chunks run over (image, group) in order.
        out.par_chunks_mut(per_group * hw).zip(src.par_chunks(per_group * hw)).enumerate().for_each(|(i, (dst, x))| {
            let (mean, var) = moments(x);
            let rstd = 1.0 / (var + self.eps).sqrt();
            let first = (i % self.groups) * per_group;
            for (j, (dst, x)) in dst.chunks_exact_mut(hw).zip(x.chunks_exact(hw)).enumerate() {
                let scale = gamma[first + j] as f64 * rstd;
                let shift = beta[first + j] as f64 - mean * scale;
                scale_shift(dst, x, scale as f32, shift as f32, silu);
            }
        });
        Ok(Tensor::from_vec(out, x.shape(), x.device())?)
    }
}

/// Values per lane-wise partial sum before it is added to the F64 totals: short enough that
/// F32 partials lose nothing that matters.
const MOMENT_BLOCK: usize = 1024;

/// Mean and (biased) variance of `x`, summed about an estimate of the mean so that a large mean
/// does not cancel the variance away.
#[inline(always)]
fn moments_generic(x: &[f32]) -> (f64, f64) {
    let head = &x[..x.len().min(256)];
    let shift = head.iter().map(|&v| v as f64).sum::<f64>() / head.len().max(1) as f64;
    let shift32 = shift as f32;
    let (mut sum, mut squares) = (0f64, 0f64);
    for block in x.chunks(MOMENT_BLOCK) {
        let (mut s, mut q) = ([0f32; 16], [0f32; 16]);
        let lanes = block.chunks_exact(16);
        let tail = lanes.remainder();
        for lane in lanes {
            for i in 0..16 {
                let d = lane[i] - shift32;
                s[i] += d;
                q[i] += d * d;
            }
        }
        for &v in tail {
            let d = v - shift32;
            s[0] += d;
            q[0] += d * d;
        }
        sum += s.iter().map(|&v| v as f64).sum::<f64>();
        squares += q.iter().map(|&v| v as f64).sum::<f64>();
    }
    let n = x.len().max(1) as f64;
    let mean_shifted = sum / n;
    (shift32 as f64 + mean_shifted, (squares / n - mean_shifted * mean_shifted).max(0.0))
}

/// `dst = x * scale + shift`, then SiLU (`y / (1 + e^-y)`) when `silu`.
#[inline(always)]
fn scale_shift_generic(dst: &mut [f32], x: &[f32], scale: f32, shift: f32, silu: bool) {
    if silu {
        for (d, &v) in dst.iter_mut().zip(x) {
            let y = v * scale + shift;
            *d = y / (1.0 + fast_exp(-y));
        }
    } else {
        for (d, &v) in dst.iter_mut().zip(x) {
            *d = v * scale + shift;
        }
    }
}

/// `fn $name(args) -> ret` running `$generic` compiled for AVX-512 or AVX2 where the CPU has
/// them: the release build targets baseline x86-64, a quarter of AVX-512's width.
macro_rules! widest {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $generic:ident) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $generic($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $generic($($arg),*)
                }
                if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU has the features this version is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}

widest!(
    /// Mean and variance of `x` ([`moments_generic`]).
    fn moments(x: &[f32]) -> (f64, f64) = moments_generic
);
widest!(
    /// [`scale_shift_generic`].
    fn scale_shift(dst: &mut [f32], x: &[f32], scale: f32, shift: f32, silu: bool) = scale_shift_generic
);

/// Single-head self-attention over each image's pixels, diffusers' VAE attention between its
/// projections: for `q`, `k`, `v` `(b, c, h, w)`, `softmax(qᵀ k / √c)` weighs `v`'s pixels;
/// returns `(b, c, h, w)`. Images never attend to each other's pixels.
pub(super) fn attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, c, h, w) = q.dims4()?;
    ensure!(k.dims4()? == (b, c, h, w) && v.dims4()? == (b, c, h, w), "attention over {:?}, {:?}, {:?}", q.dims(), k.dims(), v.dims());
    let t = h * w;
    let scale = 1.0 / (c as f64).sqrt();
    if !on_cpu_f32(q) {
        // diffusers upcasts the softmax from half precision; the products run in F32 too.
        let dtype = q.dtype();
        let upcast = if matches!(dtype, DType::F16 | DType::BF16) { DType::F32 } else { dtype };
        let [q, k, v] = [q, k, v].map(|x| x.to_dtype(upcast).and_then(|x| x.reshape((b, c, t))));
        let scores = (q?.transpose(1, 2)?.contiguous()?.matmul(&k?.contiguous()?)? * scale)?;
        let weights = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = v?.contiguous()?.matmul(&weights.t()?)?;
        return Ok(out.reshape((b, c, h, w))?.to_dtype(dtype)?);
    }
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (qg, ql) = q.storage_and_layout();
    let (kg, kl) = k.storage_and_layout();
    let (vg, vl) = v.storage_and_layout();
    let (qs, ks, vs) = (values(&qg, ql)?, values(&kg, kl)?, values(&vg, vl)?);
    let size = c * t;
    let mut out = vec![0f32; b * size];
    for (i, out) in out.chunks_exact_mut(size).enumerate() {
        let (q, k, v) = (&qs[i * size..(i + 1) * size], &ks[i * size..(i + 1) * size], &vs[i * size..(i + 1) * size]);
        let dst = OutPtr(out.as_mut_ptr());
        (0..t.div_ceil(QUERIES_PER_TASK)).into_par_iter().for_each_init(
            || vec![0f32; QUERIES_PER_TASK * t],
            |scores, task| {
                let (from, n) = (task * QUERIES_PER_TASK, QUERIES_PER_TASK.min(t - task * QUERIES_PER_TASK));
                let scores = &mut scores[..n * t];
                // SAFETY: q, k, v hold c x t values each (channel-major), `scores` n x t; this
                // task alone writes output pixels from..from + n of every channel.
                unsafe {
                    // scores (n x t) = scale * qᵀ[from..from + n] (n x c) . k (c x t)
                    gemm::gemm(
                        n, t, c,
                        scores.as_mut_ptr(), 1, t as isize, false,
                        q.as_ptr().add(from), t as isize, 1,
                        k.as_ptr(), 1, t as isize,
                        0.0, scale as f32, false, false, false, Parallelism::None,
                    );
                }
                for row in scores.chunks_exact_mut(t) {
                    softmax_in_place(row);
                }
                // SAFETY: as above.
                unsafe {
                    // out[:, from..from + n] (c x n) = v (c x t) . scoresᵀ (t x n)
                    gemm::gemm(
                        c, n, t,
                        dst.at(from), 1, t as isize, false,
                        v.as_ptr(), 1, t as isize,
                        scores.as_ptr(), t as isize, 1,
                        0.0, 1.0, false, false, false, Parallelism::None,
                    );
                }
            },
        );
    }
    Ok(Tensor::from_vec(out, (b, c, h, w), q.device())?)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use candle_core::Device;
    use std::collections::HashMap;

    pub(in crate::diffusion) fn random(shape: &[usize], seed: u64) -> Tensor {
        // A small LCG: the test needs varied values, not good randomness.
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    pub(in crate::diffusion) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims());
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// A layer's weights in F32 (tern's kernels) and in F64 (candle's ops, the reference).
    pub(in crate::diffusion) fn both(tensors: HashMap<String, Tensor>) -> (VarBuilder<'static>, VarBuilder<'static>) {
        let f64s = tensors.iter().map(|(k, v)| (k.clone(), v.to_dtype(DType::F64).unwrap())).collect();
        (VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu), VarBuilder::from_tensors(f64s, DType::F64, &Device::Cpu))
    }

    fn conv_weights(c_in: usize, c_out: usize, k: usize) -> HashMap<String, Tensor> {
        HashMap::from([
            ("weight".to_string(), (random(&[c_out, c_in, k, k], 1) * 0.2).unwrap()),
            ("bias".to_string(), random(&[c_out], 2)),
        ])
    }

    #[test]
    fn convolutions_match_candles_at_the_edges_in_bands_upsampled_and_with_a_residual() {
        // Odd sizes, one row and one column, and an image tall enough for several bands.
        for (c_in, c_out, h, w, k) in [(3, 5, 7, 9, 3), (4, 6, 1, 5, 3), (2, 3, 6, 1, 3), (64, 32, 300, 17, 3), (5, 7, 6, 9, 1)] {
            let (vb32, vb64) = both(conv_weights(c_in, c_out, k));
            let (fast, reference) = (Conv2d::load(vb32, c_in, c_out, k).unwrap(), Conv2d::load(vb64, c_in, c_out, k).unwrap());
            let x = random(&[2, c_in, h, w], 3);
            let x64 = x.to_dtype(DType::F64).unwrap();
            let residual = random(&[2, c_out, h, w], 4);
            let got = fast.forward(&x, Some(&residual)).unwrap();
            let want = reference.forward(&x64, Some(&residual.to_dtype(DType::F64).unwrap())).unwrap();
            let diff = max_abs_diff(&got, &want.to_dtype(DType::F32).unwrap());
            assert!(diff < 1e-4, "{c_in}->{c_out} {h}x{w} k{k}: {diff}");
            if k == 3 {
                let got = fast.forward_upsampled(&x).unwrap();
                let want = reference.forward_upsampled(&x64).unwrap().to_dtype(DType::F32).unwrap();
                let diff = max_abs_diff(&got, &want);
                assert!(diff < 1e-4, "upsampled {c_in}->{c_out} {h}x{w}: {diff}");
            }
        }
    }

    #[test]
    fn a_linear_layers_weight_loads_as_a_1x1_convolution() {
        let tensors = HashMap::from([("weight".to_string(), random(&[3, 4], 1)), ("bias".to_string(), random(&[3], 2))]);
        let conv = Conv2d::load(VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu), 4, 3, 1).unwrap();
        assert_eq!(conv.forward(&random(&[1, 4, 2, 2], 3), None).unwrap().dims(), &[1, 3, 2, 2]);
    }

    #[test]
    fn group_norm_with_and_without_silu_matches_candles() {
        let tensors = HashMap::from([("weight".to_string(), random(&[32], 1)), ("bias".to_string(), random(&[32], 2))]);
        let (vb32, vb64) = both(tensors);
        let (fast, reference) = (GroupNorm::load(vb32, 8, 32, 1e-6).unwrap(), GroupNorm::load(vb64, 8, 32, 1e-6).unwrap());
        // An offset mean, which a naive sum of squares would cancel away.
        let x = ((random(&[2, 32, 13, 11], 3) * 3.0).unwrap() + 40.0).unwrap();
        for silu in [false, true] {
            let got = fast.forward(&x, silu).unwrap();
            let want = reference.forward(&x.to_dtype(DType::F64).unwrap(), silu).unwrap().to_dtype(DType::F32).unwrap();
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 1e-4, "silu {silu}: {diff}");
        }
    }

    #[test]
    fn attention_matches_candles_and_keeps_each_image_to_itself() {
        let (q, k, v) = (random(&[2, 16, 9, 37], 1), random(&[2, 16, 9, 37], 2), random(&[2, 16, 9, 37], 3));
        let got = attention(&q, &k, &v).unwrap();
        let [q64, k64, v64] = [&q, &k, &v].map(|x| x.to_dtype(DType::F64).unwrap());
        let want = attention(&q64, &k64, &v64).unwrap().to_dtype(DType::F32).unwrap();
        let diff = max_abs_diff(&got, &want);
        assert!(diff < 1e-5, "{diff}");
        let alone = attention(&q.narrow(0, 1, 1).unwrap(), &k.narrow(0, 1, 1).unwrap(), &v.narrow(0, 1, 1).unwrap()).unwrap();
        assert_eq!(max_abs_diff(&alone, &got.narrow(0, 1, 1).unwrap()), 0.0);
    }
}

