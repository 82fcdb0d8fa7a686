//! Whisper audio encoder: the maths of candle-transformers' `AudioEncoder` (OpenAI's
//! `model.py`), with its hot spots done differently on the CPU.
//!
//! Profiled on candle's encoder, GELU (a single-threaded `tanhf` map) took 14% of the time and
//! the attention softmax's `expf` 11%; here GELU runs on every core with a polynomial `exp`
//! that the compiler vectorises ([`crate::cpu_kernels`]), and attention is one fused pass per
//! (window, head) ([`SelfAttention`]). The attention scale is folded into the query weights at
//! load instead of scaling queries and keys on every pass. Other devices use candle's ops.

use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Module, Result, Shape, Tensor};
use candle_nn::{Conv1d, Conv1dConfig, LayerNorm, Linear, VarBuilder};
use candle_transformers::models::whisper::Config;
use rayon::prelude::*;

use crate::cpu_kernels;

/// Elements per parallel task: large enough to amortise the hand-off.
const CHUNK: usize = 16 * 1024;

fn contiguous_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("expected a contiguous tensor".into()))?;
    Ok(&storage.as_slice::<f32>()?[start..end])
}

struct ParallelGelu;

impl CustomOp1 for ParallelGelu {
    fn name(&self) -> &'static str {
        "parallel-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let src = contiguous_f32(storage, layout)?;
        let mut dst = vec![0f32; src.len()];
        dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| cpu_kernels::gelu_slice(d, s));
        Ok((CpuStorage::F32(dst), layout.shape().clone()))
    }
}

/// Multi-head softmax attention of `q`, `k`, `v`, each `(batch, len, d_model)` with the heads
/// side by side in the last dimension, queries already scaled. Window `b` attends over its
/// first `lens[b]` positions only (all of them without `lens`), so windows of different lengths
/// padded to the longest encode as they would alone; the padding's rows come out zero. Returns
/// `(batch, len, d_model)`.
///
/// candle's ops materialise every head's `len x len` scores twice over (products, then
/// softmax: ~50 MB per layer for 16 short windows) and copy `q`, `k` and `v` into per-head
/// layouts; the fresh pages and the memory traffic cost about a fifth of the encoder at batch 16.
/// Here each (window, head) pair runs on one core with its scores in a buffer that stays in
/// cache, and gemm reads the heads in place through strides.
struct SelfAttention {
    heads: usize,
    lens: Option<Vec<usize>>,
}

/// The output's base pointer, shared by the tasks that write disjoint heads of it.
struct OutPtr(*mut f32);
// SAFETY: each task writes only its own (window, head) block of the buffer, which outlives them.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn at(&self, offset: usize) -> *mut f32 {
        // SAFETY: callers pass offsets inside the buffer.
        unsafe { self.0.add(offset) }
    }
}

impl CustomOp3 for SelfAttention {
    fn name(&self) -> &'static str {
        "fused-self-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = (contiguous_f32(qs, ql)?, contiguous_f32(ks, kl)?, contiguous_f32(vs, vl)?);
        let (b, len, d) = ql.shape().dims3()?;
        if kl.shape() != ql.shape() || vl.shape() != ql.shape() || d % self.heads != 0 {
            candle_core::bail!("self-attention: q {:?}, k {:?}, v {:?}, {} heads", ql.shape(), kl.shape(), vl.shape(), self.heads);
        }
        let (h, hd) = (self.heads, d / self.heads);
        let mut out = vec![0f32; b * len * d];
        let dst = OutPtr(out.as_mut_ptr());
        let d_s = d as isize;
        if let Some(lens) = &self.lens {
            if lens.len() != b || lens.iter().any(|&n| n == 0 || n > len) {
                candle_core::bail!("self-attention: lengths {lens:?} for {b} windows of {len}");
            }
        }
        (0..b * h).into_par_iter().for_each_init(
            || vec![0f32; len * len],
            |scores, pair| {
                let n = self.lens.as_ref().map_or(len, |l| l[pair / h]);
                let n_s = n as isize;
                // Head `hi` of window `bi`: rows of `len`, columns `hi * hd ..` with row stride d;
                // only its first `n` rows take part.
                let base = (pair / h) * len * d + (pair % h) * hd;
                // SAFETY: every pointer and stride stays inside its buffer: q/k/v/out hold
                // `b * len * d` elements and a head spans rows `0..n <= len` and columns
                // `base..base + hd` of its window; `scores` holds `len * len >= n * n`.
                unsafe {
                    // scores (n x n) = q_head (n x hd) . k_headᵀ (hd x n)
                    gemm::gemm(
                        n, n, hd, scores.as_mut_ptr(), 1, n_s, false,
                        q.as_ptr().add(base), 1, d_s,
                        k.as_ptr().add(base), d_s, 1,
                        0.0, 1.0, false, false, false, gemm::Parallelism::None,
                    );
                }
                for row in scores[..n * n].chunks_exact_mut(n) {
                    cpu_kernels::softmax_in_place(row);
                }
                // SAFETY: as above; this task alone writes this head's block of `out`.
                unsafe {
                    // out_head (n x hd) = scores (n x n) . v_head (n x hd)
                    gemm::gemm(
                        n, hd, n, dst.at(base), 1, d_s, false,
                        scores.as_ptr(), 1, n_s,
                        v.as_ptr().add(base), 1, d_s,
                        0.0, 1.0, false, false, false, gemm::Parallelism::None,
                    );
                }
            },
        );
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }
}

fn parallel_gelu(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 {
        x.contiguous()?.apply_op1_no_bwd(&ParallelGelu)
    } else {
        x.gelu()
    }
}

fn layer_norm(size: usize, vb: VarBuilder) -> Result<LayerNorm> {
    Ok(LayerNorm::new(vb.get(size, "weight")?, vb.get(size, "bias")?, 1e-5))
}

fn conv1d(c_in: usize, c_out: usize, stride: usize, vb: VarBuilder) -> Result<Conv1d> {
    let cfg = Conv1dConfig { padding: 1, stride, groups: 1, dilation: 1, cudnn_fwd_algo: None };
    Ok(Conv1d::new(vb.get((c_out, c_in, 3), "weight")?, Some(vb.get(c_out, "bias")?), cfg))
}

struct Block {
    attn_ln: LayerNorm,
    /// Scaled by `head_dim^-0.5` at load (the scale OpenAI splits between queries and keys).
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    mlp_ln: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

/// The encoder of one Whisper model.
pub(crate) struct Encoder {
    conv1: Conv1d,
    conv2: Conv1d,
    /// Sinusoids `(1500, d_model)`.
    positions: Tensor,
    blocks: Vec<Block>,
    ln_post: LayerNorm,
    n_head: usize,
}

/// OpenAI's `sinusoids(length, channels)`.
fn sinusoids(length: usize, channels: usize, device: &candle_core::Device) -> Result<Tensor> {
    let increment = 10000f32.ln() / (channels / 2 - 1) as f32;
    let mut v = vec![0f32; length * channels];
    for t in 0..length {
        for i in 0..channels / 2 {
            let x = t as f32 * (-(i as f32) * increment).exp();
            v[t * channels + i] = x.sin();
            v[t * channels + channels / 2 + i] = x.cos();
        }
    }
    Tensor::from_vec(v, (length, channels), device)
}

impl Encoder {
    /// Loads `conv1`, `conv2`, `layers.N.*` and `layer_norm` from `vb` (the `model.encoder`
    /// prefix of a Hugging Face-named Whisper).
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Encoder> {
        let d = cfg.d_model;
        let n_head = cfg.encoder_attention_heads;
        let scale = ((d / n_head) as f64).powf(-0.5);
        let blocks = (0..cfg.encoder_layers)
            .map(|i| {
                let vb = vb.pp(format!("layers.{i}"));
                let a = vb.pp("self_attn");
                let q = Linear::new(
                    (a.get((d, d), "q_proj.weight")? * scale)?,
                    Some((a.get(d, "q_proj.bias")? * scale)?),
                );
                Ok(Block {
                    attn_ln: layer_norm(d, vb.pp("self_attn_layer_norm"))?,
                    q,
                    k: candle_nn::linear_no_bias(d, d, a.pp("k_proj"))?,
                    v: candle_nn::linear(d, d, a.pp("v_proj"))?,
                    out: candle_nn::linear(d, d, a.pp("out_proj"))?,
                    mlp_ln: layer_norm(d, vb.pp("final_layer_norm"))?,
                    fc1: candle_nn::linear(d, 4 * d, vb.pp("fc1"))?,
                    fc2: candle_nn::linear(4 * d, d, vb.pp("fc2"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Encoder {
            conv1: conv1d(cfg.num_mel_bins, d, 1, vb.pp("conv1"))?,
            conv2: conv1d(d, d, 2, vb.pp("conv2"))?,
            positions: sinusoids(cfg.max_source_positions, d, vb.device())?.to_dtype(vb.dtype())?,
            blocks,
            ln_post: layer_norm(d, vb.pp("layer_norm"))?,
            n_head,
        })
    }

    /// Whether [`Encoder::forward`] takes windows of different lengths in one batch (the CPU in
    /// F32, where attention is [`SelfAttention`]).
    pub fn takes_lengths(&self) -> bool {
        self.positions.device().is_cpu() && self.positions.dtype() == candle_core::DType::F32
    }

    /// Encodes a log-mel `(batch, n_mels, frames)` (`frames` even, at most 3000) into
    /// `(batch, frames / 2, d_model)`. With `lens` (only where [`Encoder::takes_lengths`]),
    /// window `b` is its first `lens[b]` positions (`2 * lens[b]` mel frames, the rest zeros),
    /// and its positions up to there come out as they would alone; the rest is padding.
    pub fn forward(&self, mel: &Tensor, lens: Option<&[usize]>) -> Result<Tensor> {
        let mel = mel.to_dtype(self.positions.dtype())?;
        let x = parallel_gelu(&self.conv1.forward(&mel)?)?;
        let x = parallel_gelu(&self.conv2.forward(&x)?)?;
        let x = x.transpose(1, 2)?;
        let (b, len, d) = x.dims3()?;
        let mut x = x.broadcast_add(&self.positions.narrow(0, 0, len)?)?;
        let (h, hd) = (self.n_head, d / self.n_head);
        let heads = |t: Tensor| t.reshape((b, len, h, hd))?.transpose(1, 2);
        for block in &self.blocks {
            let y = block.attn_ln.forward(&x)?;
            let (q, k, v) = (block.q.forward(&y)?, block.k.forward(&y)?, block.v.forward(&y)?);
            let o = if self.takes_lengths() {
                let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
                q.apply_op3_no_bwd(&k, &v, &SelfAttention { heads: h, lens: lens.map(<[usize]>::to_vec) })?
            } else {
                if lens.is_some() {
                    candle_core::bail!("this encoder takes windows of one length per batch");
                }
                let (q, k_t, v) = (heads(q)?.contiguous()?, heads(k)?.transpose(2, 3)?.contiguous()?, heads(v)?.contiguous()?);
                let w = candle_nn::ops::softmax_last_dim(&q.matmul(&k_t)?)?;
                w.matmul(&v)?.transpose(1, 2)?.flatten_from(2)?
            };
            x = (x + block.out.forward(&o)?)?;
            let y = block.mlp_ln.forward(&x)?;
            x = (&x + block.fc2.forward(&parallel_gelu(&block.fc1.forward(&y)?)?)?)?;
        }
        self.ln_post.forward(&x)
    }
}
