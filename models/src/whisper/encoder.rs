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
use rayon::prelude::*;

use super::LAYER_NORM_EPS;
use crate::bf16_gemm::{self, Bf16Linear};
use crate::cpu_ops::{gelu, Gelu};
use crate::linear::{linear, linear_no_bias, Linear};
use crate::self_attention::self_attention;

fn conv1d(c_in: usize, c_out: usize, stride: usize, vb: VarBuilder) -> Result<Conv1d> {
    let cfg = Conv1dConfig { padding: 1, stride, groups: 1, dilation: 1, cudnn_fwd_algo: None };
    Ok(Conv1d::new(vb.get((c_out, c_in, 3), "weight")?, Some(vb.get(c_out, "bias")?), cfg))
}

/// One of Whisper's convolutions (kernel 3, padding 1) as BF16 products, channels last: output
/// position `t` is the product of input positions `stride t - 1 ..= stride t + 1` side by side
/// (zeros past the ends) with the weights reordered to match. candle's F32 convolution was a
/// sixth of the encoder once its linear layers took BF16 products.
struct Bf16Conv {
    product: Bf16Linear,
    c_in: usize,
    stride: usize,
}

impl Bf16Conv {
    /// `None` where the CPU lacks AVX-512 BF16 or `c_in` is odd (whole BF16 pairs per position).
    fn new(conv: &Conv1d) -> Result<Option<Bf16Conv>> {
        let (c_out, c_in, k) = conv.weight().dims3()?;
        if k != 3 || c_in % 2 != 0 || conv.config().padding != 1 || conv.config().dilation != 1 || conv.config().groups != 1 {
            return Ok(None);
        }
        let weight = conv.weight().permute((0, 2, 1))?.contiguous()?.reshape((c_out, 3 * c_in))?;
        Ok(Bf16Linear::pack(&weight, conv.bias())?.map(|product| Bf16Conv { product, c_in, stride: conv.config().stride }))
    }

    /// `x` `(batch, len, c_in)` F32 on the CPU; returns `(batch, (len - 1) / stride + 1, c_out)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, len, c) = x.dims3()?;
        if c != self.c_in || len == 0 {
            candle_core::bail!("convolution over {c} channels of {len} positions; it takes {}", self.c_in);
        }
        let x = x.contiguous()?;
        let pairs = {
            let (storage, layout) = x.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                candle_core::bail!("BF16 products run on the CPU");
            };
            bf16_gemm::to_bf16_pairs(crate::cpu_ops::contiguous_f32(cpu, layout)?, b * len, c)
        };
        let (per_position, out_len) = (c / 2, (len - 1) / self.stride + 1);
        let mut rows = vec![0u32; b * out_len * 3 * per_position];
        rows.par_chunks_mut(3 * per_position).enumerate().for_each(|(r, row)| {
            let (window, t) = (r / out_len, r % out_len);
            for (k, dst) in row.chunks_exact_mut(per_position).enumerate() {
                // Input position `stride t + k - 1`; outside the window it stays zero.
                if let Some(p) = (t * self.stride + k).checked_sub(1).filter(|&p| p < len) {
                    let from = (window * len + p) * per_position;
                    dst.copy_from_slice(&pairs[from..from + per_position]);
                }
            }
        });
        let out = self.product.pair_rows_times(&rows, b * out_len, true);
        Tensor::from_vec(out, (b, out_len, self.product.d_out()), x.device())
    }
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
    /// Both convolutions as BF16 products, where the blocks take them.
    bf16_convs: Option<(Bf16Conv, Bf16Conv)>,
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
        let conv1 = conv1d(cfg.num_mel_bins, d, 1, vb.pp("conv1"))?;
        let conv2 = conv1d(d, d, 2, vb.pp("conv2"))?;
        // `None` where the CPU lacks AVX-512 BF16, as the blocks then stay F32 too.
        let bf16_convs = if bf16_products { Bf16Conv::new(&conv1)?.zip(Bf16Conv::new(&conv2)?) } else { None };
        Ok(Encoder {
            conv1,
            conv2,
            bf16_convs,
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
        let x = match &self.bf16_convs {
            Some((conv1, conv2)) => {
                let x = gelu(&conv1.forward(&mel.transpose(1, 2)?)?, Gelu::Tanh)?;
                gelu(&conv2.forward(&x)?, Gelu::Tanh)?
            }
            None => {
                let x = gelu(&self.conv1.forward(&mel)?, Gelu::Tanh)?;
                gelu(&self.conv2.forward(&x)?, Gelu::Tanh)?.transpose(1, 2)?
            }
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16_gemm::test_values as values;
    use candle_core::Device;

    /// Channel counts that cross a 32-column block and lengths odd and even, at both strides.
    #[test]
    fn bf16_convolutions_match_candles_f32_ones() {
        if bf16_gemm::skip_without_bf16() {
            return;
        }
        let (b, c_in, c_out) = (2usize, 6usize, 40usize);
        for (stride, len) in [(1usize, 9usize), (1, 10), (2, 10), (2, 4)] {
            let cfg = Conv1dConfig { padding: 1, stride, groups: 1, dilation: 1, cudnn_fwd_algo: None };
            let weight = Tensor::from_vec(values(c_out * c_in * 3, 1), (c_out, c_in, 3), &Device::Cpu).unwrap();
            let bias = Tensor::from_vec(values(c_out, 2), c_out, &Device::Cpu).unwrap();
            let conv = Conv1d::new(weight, Some(bias), cfg);
            let x = Tensor::from_vec(values(b * c_in * len, 3), (b, c_in, len), &Device::Cpu).unwrap();
            let want = conv.forward(&x).unwrap().transpose(1, 2).unwrap().to_vec3::<f32>().unwrap();
            let bf16 = Bf16Conv::new(&conv).unwrap().expect("an even channel count");
            let got = bf16.forward(&x.transpose(1, 2).unwrap()).unwrap().to_vec3::<f32>().unwrap();
            assert_eq!((got.len(), got[0].len(), got[0][0].len()), (b, (len - 1) / stride + 1, c_out));
            for (w, g) in want.iter().flatten().flatten().zip(got.iter().flatten().flatten()) {
                // 18 products of values within 1, each operand rounded to 8 significant bits.
                assert!((w - g).abs() < 0.05, "stride {stride}, length {len}: {g} vs {w}");
            }
        }
    }
}
