//! The UNet's transformer blocks, computed as diffusers computes them: `Transformer2DModel`
//! (group norm, `proj_in`, `BasicTransformerBlock`s, `proj_out`, residual), each block a layer
//! norm and self-attention, a layer norm and cross-attention to the prompt, a layer norm and a
//! GEGLU feed-forward (exact GELU, as PyTorch's `F.gelu`), each with its residual. F32 tensors
//! on the CPU run tern's kernels; anything else (CUDA, other dtypes) runs candle's ops.
//!
//! Why tern's own: candle's blocks run every layer norm, bias, GELU and residual as separate
//! single-threaded passes, transpose the pixels into tokens and back with copies, and score
//! attention for all heads at once in buffers far larger than the cache; SDXL's UNet spent
//! most of a step there. Here the linear layers write their bias and residual in the gemm's
//! pass, `proj_in` and `proj_out` read and write the NCHW image through strides, the row-wise
//! ops run on every core, and attention runs per (image, head, block of queries) with its
//! scores in cache.

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor, D};
use candle_nn::VarBuilder;
use gemm::Parallelism;
use rayon::prelude::*;
use tern_kernels::cpu_kernels;
use tern_kernels::cpu_ops::rows_per_task;
use tern_kernels::f32_linear::{self, Residual};

use super::layers::{on_cpu_f32, values, GroupNorm};

/// Epsilon of the blocks' layer norms (diffusers' `BasicTransformerBlock` default).
const LAYER_NORM_EPS: f64 = 1e-5;

/// Epsilon of the group norm before `proj_in` (diffusers' `Transformer2DModel`).
const GROUP_NORM_EPS: f64 = 1e-6;

/// Queries one attention task scores at once: 128 x 4096 keys of scores is 2 MB.
const QUERIES_PER_TASK: usize = 128;

/// The gemm parallelism of one large product: every thread of the pool.
fn all_threads() -> Parallelism {
    Parallelism::Rayon(rayon::current_num_threads())
}

/// A linear layer, `y = x Wᵀ + b`, with weights `(out, in)`; a 1x1 convolution's
/// `(out, in, 1, 1)` loads as the same layer (SD 1.5's `proj_in` and `proj_out`).
///
/// On the CPU in F32 the weights are kept transposed, `(in, out)`: gemm computes a row-major
/// product as its transpose, where `Wᵀ` is the left operand, and a column-major left operand
/// is packed by plain copies instead of a transposing gather on every call (a tenth of SDXL's
/// step went to that gather).
pub(super) struct Linear {
    /// `(out, in)`, or `(in, out)` where `transposed`.
    weight: Tensor,
    transposed: bool,
    bias: Option<Tensor>,
    c_in: usize,
    c_out: usize,
}

impl Linear {
    pub(super) fn load(vb: VarBuilder, c_in: usize, c_out: usize, bias: bool) -> Result<Linear> {
        let weight = match vb.get((c_out, c_in), "weight") {
            Ok(w) => w,
            Err(_) => vb.get((c_out, c_in, 1, 1), "weight")?.reshape((c_out, c_in))?,
        };
        let bias = if bias { Some(vb.get(c_out, "bias")?) } else { None };
        let transposed = on_cpu_f32(&weight);
        let weight = if transposed { transpose(&weight.contiguous()?)? } else { weight.contiguous()? };
        Ok(Linear { weight, transposed, bias, c_in, c_out })
    }

    /// candle's ops: `x` `(..., c_in)` to `(..., c_out)`.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w_t = if self.transposed { self.weight.clone() } else { self.weight.t()? };
        let y = x.broadcast_matmul(&w_t)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// `x` (rows of `c_in`) times `Wᵀ`, plus the bias and `residual` (rows of `c_out`) when
    /// given, on every core.
    pub(super) fn rows(&self, x: &[f32], residual: Option<&[f32]>) -> Result<Vec<f32>> {
        let rows = x.len() / self.c_in;
        ensure!(rows * self.c_in == x.len(), "{} values are not rows of {}", x.len(), self.c_in);
        let mut out = vec![0f32; rows * self.c_out];
        if let Some(r) = residual {
            ensure!(r.len() == out.len(), "a residual of {} values for {} outputs", r.len(), out.len());
        }
        self.with_values(|weight, bias| self.rows_into(x, weight, bias, residual, &mut out))?;
        Ok(out)
    }

    /// Runs `f` on the weights (`Wᵀ`, `(c_in, c_out)`) and bias values of a layer kept for the
    /// CPU kernels.
    fn with_values<R>(&self, f: impl FnOnce(&[f32], Option<&[f32]>) -> R) -> Result<R> {
        ensure!(self.transposed, "a linear layer's CPU kernel needs its weights transposed");
        let (wg, wl) = self.weight.storage_and_layout();
        let bg = self.bias.as_ref().map(|b| b.storage_and_layout());
        let bias = match &bg {
            Some((g, l)) => Some(values(g, l)?),
            None => None,
        };
        Ok(f(values(&wg, wl)?, bias))
    }

    /// [`Linear::rows`] into `out` (rows x c_out).
    fn rows_into(&self, x: &[f32], weight: &[f32], bias: Option<&[f32]>, residual: Option<&[f32]>, out: &mut [f32]) {
        let residual = residual.map_or(Residual::None, Residual::Add);
        f32_linear::rows_times_transposed(x, self.c_in, weight, self.c_out, bias, residual, out);
    }
}

/// `w` `(rows, cols)` (F32, on the CPU) as `(cols, rows)` ([`f32_linear::transposed`]).
fn transpose(w: &Tensor) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let (g, l) = w.storage_and_layout();
    Ok(Tensor::from_vec(f32_linear::transposed(values(&g, l)?, rows, cols), (cols, rows), w.device())?)
}

/// A layer norm over rows (PyTorch's `LayerNorm`, affine).
pub(super) struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub(super) fn load(vb: VarBuilder, dim: usize, eps: f64) -> Result<LayerNorm> {
        Ok(LayerNorm { weight: vb.get(dim, "weight")?, bias: vb.get(dim, "bias")?, eps })
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype() != DType::F64 {
            return Ok(candle_nn::ops::layer_norm(x, &self.weight, &self.bias, self.eps as f32)?);
        }
        // candle's fused layer norm has no F64 kernel; the tests' reference runs in F64.
        let mean = x.mean_keepdim(D::Minus1)?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        Ok(normed.broadcast_mul(&self.weight)?.broadcast_add(&self.bias)?)
    }

    /// Each row of `x` normalised, on every core.
    pub(super) fn rows(&self, x: &[f32]) -> Result<Vec<f32>> {
        let (wg, wl) = self.weight.storage_and_layout();
        let (bg, bl) = self.bias.storage_and_layout();
        let (gamma, beta) = (values(&wg, wl)?, values(&bg, bl)?);
        let n = gamma.len();
        let mut out = vec![0f32; x.len()];
        let task = rows_per_task(n) * n;
        out.par_chunks_mut(task).zip(x.par_chunks(task)).for_each(|(dst, src)| {
            for (d, s) in dst.chunks_exact_mut(n).zip(src.chunks_exact(n)) {
                cpu_kernels::layer_norm(d, s, gamma, beta, self.eps as f32);
            }
        });
        Ok(out)
    }
}

/// diffusers' `Attention` with `heads` heads: queries from the image's tokens, keys and values
/// from them (self-attention) or from the prompt (cross-attention), no biases but the output's.
struct Attention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    heads: usize,
}

impl Attention {
    fn load(vb: VarBuilder, dim: usize, context_dim: usize, heads: usize) -> Result<Attention> {
        ensure!(dim % heads == 0, "{dim} channels do not split into {heads} heads");
        Ok(Attention {
            to_q: Linear::load(vb.pp("to_q"), dim, dim, false)?,
            to_k: Linear::load(vb.pp("to_k"), context_dim, dim, false)?,
            to_v: Linear::load(vb.pp("to_v"), context_dim, dim, false)?,
            to_out: Linear::load(vb.pp("to_out.0"), dim, dim, true)?,
            heads,
        })
    }

    /// candle's ops: `x` `(b, n, dim)` attending to `context` `(b, m, context_dim)`, plus
    /// `residual`.
    fn forward(&self, x: &Tensor, context: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let (b, n, dim) = x.dims3()?;
        let m = context.dim(1)?;
        let hd = dim / self.heads;
        let split = |t: Tensor, len: usize| t.reshape((b, len, self.heads, hd))?.transpose(1, 2)?.contiguous();
        let q = split(self.to_q.forward(x)?, n)?;
        let k = split(self.to_k.forward(context)?, m)?;
        let v = split(self.to_v.forward(context)?, m)?;
        let scores = (q.matmul(&k.t()?.contiguous()?)? * (1.0 / (hd as f64).sqrt()))?;
        let mixed = candle_nn::ops::softmax_last_dim(&scores)?.matmul(&v)?;
        let mixed = mixed.transpose(1, 2)?.reshape((b, n, dim))?;
        Ok((self.to_out.forward(&mixed)? + residual)?)
    }

    /// [`Attention::forward`] over rows: `x` is `b` images' tokens (rows of `dim`), `context`
    /// `b` prompts' (`x` itself for self-attention), `residual` rows like `x`'s.
    fn rows(&self, x: &[f32], context: Option<&[f32]>, residual: &[f32], b: usize) -> Result<Vec<f32>> {
        let q = self.to_q.rows(x, None)?;
        let context = context.unwrap_or(x);
        let (k, v) = (self.to_k.rows(context, None)?, self.to_v.rows(context, None)?);
        let mixed = attention(&q, &k, &v, b, self.to_q.c_out, self.heads, false);
        drop((q, k, v));
        self.to_out.rows(&mixed, Some(residual))
    }
}

/// Softmax attention of `b` sequences' queries `q` (rows of `dim`, heads side by side) over their
/// own keys `k` and values `v` (rows of `dim`, as many per sequence as `k.len() / b / dim`),
/// scaled by `1/√head_dim`: one task per (sequence, head, block of 128 queries), its scores in
/// cache ([`f32_linear::attend_blocks`]). `causal`: query `i` weighs keys `0..=i` only (CLIP's text encoder), the others get
/// weight 0 exactly, as the reference's additive mask of the dtype's minimum gives them.
pub(super) fn attention(q: &[f32], k: &[f32], v: &[f32], b: usize, dim: usize, heads: usize, causal: bool) -> Vec<f32> {
    let (n, m, hd) = (q.len() / b / dim, k.len() / b / dim, dim / heads);
    let sequences: Vec<((usize, usize), (usize, usize))> = (0..b).map(|i| ((i * n, n), (i * m, m))).collect();
    let mut out = vec![0f32; q.len()];
    f32_linear::attend_blocks(q, k, v, dim, heads, &sequences, 1.0 / (hd as f32).sqrt(), causal, QUERIES_PER_TASK, &mut out);
    out
}

/// diffusers' `FeedForward` with a GEGLU: `proj` to twice the inner width, the first half
/// times the exact GELU of the second, then `out` back to the block's width.
struct FeedForward {
    proj: Linear,
    out: Linear,
    inner: usize,
}

impl FeedForward {
    fn load(vb: VarBuilder, dim: usize) -> Result<FeedForward> {
        let inner = dim * 4;
        Ok(FeedForward {
            proj: Linear::load(vb.pp("net.0.proj"), dim, inner * 2, true)?,
            out: Linear::load(vb.pp("net.2"), inner, dim, true)?,
            inner,
        })
    }

    /// candle's ops, plus `residual`.
    fn forward(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let h = self.proj.forward(x)?;
        let (value, gate) = (h.narrow(D::Minus1, 0, self.inner)?, h.narrow(D::Minus1, self.inner, self.inner)?);
        Ok((self.out.forward(&(value * gate.gelu_erf()?)?)? + residual)?)
    }

    /// [`FeedForward::forward`] over rows.
    fn rows(&self, x: &[f32], residual: &[f32]) -> Result<Vec<f32>> {
        let h = self.proj.rows(x, None)?;
        let n = self.inner;
        let mut gated = vec![0f32; h.len() / 2];
        let task = rows_per_task(2 * n);
        gated.par_chunks_mut(task * n).zip(h.par_chunks(task * 2 * n)).for_each(|(dst, src)| {
            for (d, s) in dst.chunks_exact_mut(n).zip(src.chunks_exact(2 * n)) {
                let (value, gate) = s.split_at(n);
                cpu_kernels::gelu_erf_slice(d, gate);
                d.iter_mut().zip(value).for_each(|(d, v)| *d *= v);
            }
        });
        drop(h);
        self.out.rows(&gated, Some(residual))
    }
}

/// diffusers' `BasicTransformerBlock` (layer norms before each part, no adaptive norms).
struct Block {
    norm1: LayerNorm,
    attn1: Attention,
    norm2: LayerNorm,
    attn2: Attention,
    norm3: LayerNorm,
    ff: FeedForward,
}

impl Block {
    fn load(vb: VarBuilder, dim: usize, context_dim: usize, heads: usize) -> Result<Block> {
        Ok(Block {
            norm1: LayerNorm::load(vb.pp("norm1"), dim, LAYER_NORM_EPS)?,
            attn1: Attention::load(vb.pp("attn1"), dim, dim, heads)?,
            norm2: LayerNorm::load(vb.pp("norm2"), dim, LAYER_NORM_EPS)?,
            attn2: Attention::load(vb.pp("attn2"), dim, context_dim, heads)?,
            norm3: LayerNorm::load(vb.pp("norm3"), dim, LAYER_NORM_EPS)?,
            ff: FeedForward::load(vb.pp("ff"), dim)?,
        })
    }

    /// candle's ops: `x` `(b, n, dim)`, `context` `(b, m, context_dim)`.
    fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let h = self.norm1.forward(x)?;
        let x = self.attn1.forward(&h, &h, x)?;
        let x = self.attn2.forward(&self.norm2.forward(&x)?, context, &x)?;
        self.ff.forward(&self.norm3.forward(&x)?, &x)
    }

    /// [`Block::forward`] over rows: `x` is `b` images' tokens, `context` their prompts'.
    fn rows(&self, x: &[f32], context: &[f32], b: usize) -> Result<Vec<f32>> {
        let x = self.attn1.rows(&self.norm1.rows(x)?, None, x, b)?;
        let x = self.attn2.rows(&self.norm2.rows(&x)?, Some(context), &x, b)?;
        self.ff.rows(&self.norm3.rows(&x)?, &x)
    }
}

/// diffusers' `Transformer2DModel` as SD's UNets use it: group norm, `proj_in` (a linear layer,
/// or a 1x1 convolution where `use_linear_projection` is false: the same product), the blocks
/// over the pixels as tokens, `proj_out`, plus the input.
pub(super) struct Transformer2D {
    norm: GroupNorm,
    proj_in: Linear,
    blocks: Vec<Block>,
    proj_out: Linear,
    channels: usize,
}

impl Transformer2D {
    /// `layers` blocks of `heads` heads over `channels` channels, attending to prompts of
    /// `context_dim`.
    pub(super) fn load(vb: VarBuilder, channels: usize, heads: usize, layers: usize, context_dim: usize, groups: usize) -> Result<Transformer2D> {
        let blocks = (0..layers)
            .map(|i| Block::load(vb.pp(format!("transformer_blocks.{i}")), channels, context_dim, heads))
            .collect::<Result<Vec<_>>>()?;
        Ok(Transformer2D {
            norm: GroupNorm::load(vb.pp("norm"), groups, channels, GROUP_NORM_EPS)?,
            proj_in: Linear::load(vb.pp("proj_in"), channels, channels, true)?,
            blocks,
            proj_out: Linear::load(vb.pp("proj_out"), channels, channels, true)?,
            channels,
        })
    }

    /// `x` `(b, channels, h, w)` attending to `context` `(b, m, context_dim)`; the same shape out.
    pub(super) fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        ensure!(c == self.channels, "a transformer over {} channels was given {c}", self.channels);
        ensure!(context.dim(0)? == b, "{} prompts for {b} images", context.dim(0)?);
        let normed = self.norm.forward(x, false)?;
        if !on_cpu_f32(x) || !on_cpu_f32(context) {
            let tokens = normed.flatten_from(2)?.transpose(1, 2)?.contiguous()?;
            let mut tokens = self.proj_in.forward(&tokens)?;
            for block in &self.blocks {
                tokens = block.forward(&tokens, context)?;
            }
            let out = self.proj_out.forward(&tokens)?.transpose(1, 2)?.reshape((b, c, h, w))?;
            return Ok((out + x)?);
        }
        let n = h * w;
        let x = x.contiguous()?;
        let context = context.contiguous()?;
        let (ng, nl) = normed.storage_and_layout();
        let (cg, cl) = context.storage_and_layout();
        let (xg, xl) = x.storage_and_layout();
        let (normed, context, residual) = (values(&ng, nl)?, values(&cg, cl)?, values(&xg, xl)?);
        let mut tokens = self.pixels_to_tokens(normed, b, n)?;
        for block in &self.blocks {
            tokens = block.rows(&tokens, context, b)?;
        }
        let out = self.tokens_to_pixels(&tokens, residual, b, n)?;
        Ok(Tensor::from_vec(out, (b, c, h, w), x.device())?)
    }

    /// `proj_in` of each image's pixels `(c, n)` read as `n` tokens of `c`: `(b * n, c)` rows.
    fn pixels_to_tokens(&self, pixels: &[f32], b: usize, n: usize) -> Result<Vec<f32>> {
        let c = self.channels;
        let mut out = vec![0f32; b * n * c];
        self.proj_in.with_values(|weight, bias| {
            let bias = bias.expect("proj_in has a bias");
            out.par_chunks_mut(c).for_each(|row| row.copy_from_slice(bias));
            for i in 0..b {
                // SAFETY: image i's pixels are c x n (channel-major) at i * c * n, read as n x c
                // through their strides; its tokens are the n x c rows at i * n * c; `weight` is
                // Wᵀ, c x c.
                unsafe {
                    gemm::gemm(
                        n, c, c,
                        out.as_mut_ptr().add(i * n * c), 1, c as isize, true,
                        pixels.as_ptr().add(i * c * n), n as isize, 1,
                        weight.as_ptr(), 1, c as isize,
                        1.0, 1.0, false, false, false, all_threads(),
                    );
                }
            }
        })?;
        Ok(out)
    }

    /// `proj_out` of the tokens written back as each image's pixels `(c, n)`, plus `residual`
    /// (the block's input, NCHW).
    fn tokens_to_pixels(&self, tokens: &[f32], residual: &[f32], b: usize, n: usize) -> Result<Vec<f32>> {
        let c = self.channels;
        let mut out = vec![0f32; b * c * n];
        self.proj_out.with_values(|weight, bias| {
            let bias = bias.expect("proj_out has a bias");
            out.par_chunks_mut(n).zip(residual.par_chunks(n)).enumerate().for_each(|(row, (dst, r))| {
                let bias = bias[row % c];
                dst.iter_mut().zip(r).for_each(|(d, r)| *d = r + bias);
            });
            for i in 0..b {
                // SAFETY: image i's output is c x n at i * c * n; `weight` is Wᵀ (c x c), read as
                // W through its strides; its tokens are the n x c rows at i * n * c, read as their
                // transpose (c x n).
                unsafe {
                    gemm::gemm(
                        c, n, c,
                        out.as_mut_ptr().add(i * c * n), 1, n as isize, true,
                        weight.as_ptr(), c as isize, 1,
                        tokens.as_ptr().add(i * n * c), c as isize, 1,
                        1.0, 1.0, false, false, false, all_threads(),
                    );
                }
            }
        })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diffusion::layers::tests::{both, max_abs_diff, random};
    use candle_core::DType;
    use std::collections::HashMap;

    /// A transformer's weights: `layers` blocks over `c` channels attending to prompts of `cd`;
    /// `proj_in`/`proj_out` as 1x1 convolutions (SD 1.5) or linear layers (SD 2 and SDXL).
    fn weights(c: usize, cd: usize, layers: usize, conv_projections: bool) -> HashMap<String, Tensor> {
        let mut seed = 10;
        let mut t = HashMap::new();
        let mut put = |name: String, shape: &[usize], scale: f64, offset: f64| {
            seed += 1;
            t.insert(name, ((random(shape, seed) * scale).unwrap() + offset).unwrap());
        };
        let proj: &[usize] = if conv_projections { &[c, c, 1, 1] } else { &[c, c] };
        put("norm.weight".into(), &[c], 0.2, 1.0);
        put("norm.bias".into(), &[c], 0.2, 0.0);
        for p in ["proj_in", "proj_out"] {
            put(format!("{p}.weight"), proj, 0.3, 0.0);
            put(format!("{p}.bias"), &[c], 0.1, 0.0);
        }
        for l in 0..layers {
            let b = format!("transformer_blocks.{l}");
            for n in ["norm1", "norm2", "norm3"] {
                put(format!("{b}.{n}.weight"), &[c], 0.2, 1.0);
                put(format!("{b}.{n}.bias"), &[c], 0.2, 0.0);
            }
            for (a, kv) in [("attn1", c), ("attn2", cd)] {
                put(format!("{b}.{a}.to_q.weight"), &[c, c], 0.3, 0.0);
                put(format!("{b}.{a}.to_k.weight"), &[c, kv], 0.3, 0.0);
                put(format!("{b}.{a}.to_v.weight"), &[c, kv], 0.3, 0.0);
                put(format!("{b}.{a}.to_out.0.weight"), &[c, c], 0.3, 0.0);
                put(format!("{b}.{a}.to_out.0.bias"), &[c], 0.1, 0.0);
            }
            put(format!("{b}.ff.net.0.proj.weight"), &[8 * c, c], 0.3, 0.0);
            put(format!("{b}.ff.net.0.proj.bias"), &[8 * c], 0.1, 0.0);
            put(format!("{b}.ff.net.2.weight"), &[c, 4 * c], 0.1, 0.0);
            put(format!("{b}.ff.net.2.bias"), &[c], 0.1, 0.0);
        }
        t
    }

    /// tern's CPU kernels (F32) against the same layers on candle's ops in F64: odd image sizes,
    /// more queries than one attention task takes, both kinds of projection, and each image of a
    /// batch attending to its own prompt only.
    #[test]
    fn transformer_blocks_match_candles_ops() {
        let (c, cd, heads, groups, m) = (32, 24, 2, 8, 9);
        for (h, w, conv_projections) in [(5, 7, true), (12, 13, false)] {
            let (vb32, vb64) = both(weights(c, cd, 2, conv_projections));
            let fast = Transformer2D::load(vb32, c, heads, 2, cd, groups).unwrap();
            let reference = Transformer2D::load(vb64, c, heads, 2, cd, groups).unwrap();
            let x = random(&[2, c, h, w], 1);
            let context = random(&[2, m, cd], 2);
            let got = fast.forward(&x, &context).unwrap();
            let [x64, context64] = [&x, &context].map(|t| t.to_dtype(DType::F64).unwrap());
            let want = reference.forward(&x64, &context64).unwrap().to_dtype(DType::F32).unwrap();
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 1e-4, "{h}x{w}: {diff}");
            let alone = fast.forward(&x.narrow(0, 1, 1).unwrap(), &context.narrow(0, 1, 1).unwrap()).unwrap();
            let diff = max_abs_diff(&alone, &got.narrow(0, 1, 1).unwrap());
            assert!(diff < 1e-5, "{h}x{w}, alone: {diff}");
        }
    }
}
