//! Whisper audio encoder: the maths of candle-transformers' `AudioEncoder` (OpenAI's
//! `model.py`), with its hot spots done differently on the CPU.
//!
//! Profiled on candle's encoder, GELU (a single-threaded `tanhf` map) took 14% of the time and
//! the attention softmax's `expf` 11%; here GELU runs on every core with a polynomial `exp`
//! that the compiler vectorises ([`crate::cpu_ops`]), and attention is one fused pass per
//! (window, head) ([`self_attention`]). The attention scale is folded into the query weights at
//! load instead of scaling queries and keys on every pass. On CPUs with AVX-512 BF16, the
//! blocks' linear layers can run their products in BF16 ([`crate::bf16_gemm`]), about twice
//! as fast as gemm's F32 there. Other devices use candle's ops.

use candle_core::{Module, Result, Tensor};
use candle_nn::{layer_norm, Conv1d, Conv1dConfig, LayerNorm, VarBuilder};
use candle_transformers::models::whisper::Config;

use super::LAYER_NORM_EPS;
use crate::cpu_ops::{gelu, Gelu};
use crate::linear::{linear, linear_no_bias, Linear};
use crate::self_attention::self_attention;

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

impl Block {
    fn products(&self) -> [&Linear; 6] {
        [&self.q, &self.k, &self.v, &self.out, &self.fc1, &self.fc2]
    }
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
    /// prefix of a Hugging Face-named Whisper). With `bf16_products` (F32 on the CPU), the
    /// blocks' linear layers run in BF16 where the CPU has AVX-512 BF16.
    pub fn load(vb: VarBuilder, cfg: &Config, bf16_products: bool) -> Result<Encoder> {
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
                let product = |l: Linear| if bf16_products { l.in_bf16() } else { Ok(l) };
                Ok(Block {
                    attn_ln: layer_norm(d, LAYER_NORM_EPS, vb.pp("self_attn_layer_norm"))?,
                    q: product(q)?,
                    k: product(linear_no_bias(d, d, a.pp("k_proj"))?)?,
                    v: product(linear(d, d, a.pp("v_proj"))?)?,
                    out: product(linear(d, d, a.pp("out_proj"))?)?,
                    mlp_ln: layer_norm(d, LAYER_NORM_EPS, vb.pp("final_layer_norm"))?,
                    fc1: product(linear(d, 4 * d, vb.pp("fc1"))?)?,
                    fc2: product(linear(4 * d, d, vb.pp("fc2"))?)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Encoder {
            conv1: conv1d(cfg.num_mel_bins, d, 1, vb.pp("conv1"))?,
            conv2: conv1d(d, d, 2, vb.pp("conv2"))?,
            positions: sinusoids(cfg.max_source_positions, d, vb.device())?.to_dtype(vb.dtype())?,
            blocks,
            ln_post: layer_norm(d, LAYER_NORM_EPS, vb.pp("layer_norm"))?,
            n_head,
        })
    }

    /// Bytes the weights take below what F32 would (the BF16-packed layers').
    pub fn bytes_saved(&self) -> usize {
        self.blocks.iter().flat_map(Block::products).map(|l| l.bytes_saved()).sum()
    }

    /// Whether the blocks' products run in BF16.
    pub fn bf16_products(&self) -> bool {
        self.blocks.iter().flat_map(Block::products).any(|l| l.bytes_saved() > 0)
    }

    /// Whether [`Encoder::forward`] takes windows of different lengths in one batch (the CPU in
    /// F32, where attention is [`self_attention`]).
    pub fn takes_lengths(&self) -> bool {
        self.positions.device().is_cpu() && self.positions.dtype() == candle_core::DType::F32
    }

    /// Encodes a log-mel `(batch, n_mels, frames)` (`frames` even, at most 3000) into
    /// `(batch, frames / 2, d_model)`. With `lens` (only where [`Encoder::takes_lengths`]),
    /// window `b` is its first `lens[b]` positions (`2 * lens[b]` mel frames, the rest zeros),
    /// and its positions up to there come out as they would alone; the rest is padding.
    pub fn forward(&self, mel: &Tensor, lens: Option<&[usize]>) -> Result<Tensor> {
        let mel = mel.to_dtype(self.positions.dtype())?;
        let x = gelu(&self.conv1.forward(&mel)?, Gelu::Tanh)?;
        let x = gelu(&self.conv2.forward(&x)?, Gelu::Tanh)?;
        let x = x.transpose(1, 2)?;
        let (b, len, d) = x.dims3()?;
        let mut x = x.broadcast_add(&self.positions.narrow(0, 0, len)?)?;
        let (h, hd) = (self.n_head, d / self.n_head);
        let heads = |t: Tensor| t.reshape((b, len, h, hd))?.transpose(1, 2);
        for block in &self.blocks {
            let y = block.attn_ln.forward(&x)?;
            let (q, k, v) = (block.q.forward(&y)?, block.k.forward(&y)?, block.v.forward(&y)?);
            let o = if self.takes_lengths() {
                self_attention(&q, &k, &v, h, lens, self.bf16_products())?
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
            x = (&x + block.fc2.forward(&gelu(&block.fc1.forward(&y)?, Gelu::Tanh)?)?)?;
        }
        self.ln_post.forward(&x)
    }
}
