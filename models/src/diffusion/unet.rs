//! The denoising UNet (`UNet2DConditionModel`) as diffusers computes it, on tern's layers:
//! resnets of group norms (SiLU fused) and convolutions with the time embedding added in the
//! convolution's pass ([`super::layers`]), transformer blocks ([`super::transformer`]), and
//! SDXL's `text_time` conditioning (the pooled text embedding and the size numbers added to the
//! time embedding). Only the time embeddings and the downsamplers' stride-2 convolutions run
//! candle's ops (small next to the rest).

use anyhow::{ensure, Result};
use candle_core::{Module, Tensor};
use candle_nn as nn;
use candle_transformers::models::stable_diffusion::embeddings::{TimestepEmbedding, Timesteps};
use candle_transformers::models::stable_diffusion::unet_2d::BlockConfig;

use super::config::UNetConfig;
use super::layers::{Conv2d, GroupNorm};
use super::transformer::Transformer2D;

/// diffusers' `ResnetBlock2D` with a time embedding:
/// `(shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))) + proj(silu(temb)))))) / scale`.
struct Resnet {
    norm1: GroupNorm,
    conv1: Conv2d,
    time_emb_proj: nn::Linear,
    norm2: GroupNorm,
    conv2: Conv2d,
    shortcut: Option<Conv2d>,
    output_scale_factor: f64,
}

/// What every resnet of one block shares: group count, epsilon, time embedding width and output
/// scale.
#[derive(Clone, Copy)]
struct ResnetShape {
    groups: usize,
    eps: f64,
    time_dim: usize,
    output_scale_factor: f64,
}

impl Resnet {
    fn load(vb: nn::VarBuilder, c_in: usize, c_out: usize, shape: ResnetShape) -> Result<Resnet> {
        let ResnetShape { groups, eps, time_dim, output_scale_factor } = shape;
        Ok(Resnet {
            norm1: GroupNorm::load(vb.pp("norm1"), groups, c_in, eps)?,
            conv1: Conv2d::load(vb.pp("conv1"), c_in, c_out, 3)?,
            time_emb_proj: nn::linear(time_dim, c_out, vb.pp("time_emb_proj"))?,
            norm2: GroupNorm::load(vb.pp("norm2"), groups, c_out, eps)?,
            conv2: Conv2d::load(vb.pp("conv2"), c_out, c_out, 3)?,
            shortcut: if c_in == c_out { None } else { Some(Conv2d::load(vb.pp("conv_shortcut"), c_in, c_out, 1)?) },
            output_scale_factor,
        })
    }

    /// `x` `(b, c_in, h, w)` with `temb` the SiLU of the time embedding `(b, time_dim)`.
    fn forward(&self, x: &Tensor, temb: &Tensor) -> Result<Tensor> {
        let shift = self.time_emb_proj.forward(temb)?;
        let h = self.conv1.forward_shifted(&self.norm1.forward(x, true)?, &shift)?;
        let h = self.norm2.forward(&h, true)?;
        let residual = match &self.shortcut {
            Some(shortcut) => shortcut.forward(x, None)?,
            None => x.clone(),
        };
        let y = self.conv2.forward(&h, Some(&residual))?;
        Ok(if self.output_scale_factor == 1.0 { y } else { (y / self.output_scale_factor)? })
    }
}

/// A down block: resnets (each followed by a transformer in `CrossAttnDownBlock2D`), then a
/// stride-2 convolution but in the last block. Every resnet's (or transformer's) output and the
/// downsampler's are kept for the up blocks.
struct Down {
    resnets: Vec<Resnet>,
    attentions: Vec<Transformer2D>,
    downsampler: Option<nn::Conv2d>,
    /// Whether the downsampler pads only right and bottom (`downsample_padding` 0).
    pad_after: bool,
}

impl Down {
    fn forward(&self, x: &Tensor, temb: &Tensor, context: &Tensor, states: &mut Vec<Tensor>) -> Result<Tensor> {
        let mut x = x.clone();
        for (i, resnet) in self.resnets.iter().enumerate() {
            x = resnet.forward(&x, temb)?;
            if let Some(attention) = self.attentions.get(i) {
                x = attention.forward(&x, context)?;
            }
            states.push(x.clone());
        }
        if let Some(conv) = &self.downsampler {
            if self.pad_after {
                x = x.pad_with_zeros(3, 0, 1)?.pad_with_zeros(2, 0, 1)?;
            }
            x = conv.forward(&x)?;
            states.push(x.clone());
        }
        Ok(x)
    }
}

/// An up block: resnets over the input joined with the down blocks' outputs in reverse (each
/// followed by a transformer in `CrossAttnUpBlock2D`), then a 2x nearest upsampling and a 3x3
/// convolution but in the last block.
struct Up {
    resnets: Vec<Resnet>,
    attentions: Vec<Transformer2D>,
    upsampler: Option<Conv2d>,
}

impl Up {
    /// `skips` are this block's share of the down blocks' outputs, the first made first.
    fn forward(&self, x: &Tensor, skips: &[Tensor], temb: &Tensor, context: &Tensor, size: Option<(usize, usize)>) -> Result<Tensor> {
        ensure!(skips.len() == self.resnets.len(), "{} skip connections for {} resnets", skips.len(), self.resnets.len());
        let mut x = x.clone();
        for (i, resnet) in self.resnets.iter().enumerate() {
            x = resnet.forward(&Tensor::cat(&[&x, &skips[skips.len() - 1 - i]], 1)?, temb)?;
            if let Some(attention) = self.attentions.get(i) {
                x = attention.forward(&x, context)?;
            }
        }
        Ok(match (&self.upsampler, size) {
            (None, _) => x,
            (Some(conv), None) => conv.forward_upsampled(&x)?,
            (Some(conv), Some((h, w))) => conv.forward(&x.upsample_nearest2d(h, w)?, None)?,
        })
    }
}

/// SDXL's added conditioning: `add_time_proj` and `add_embedding`.
struct TextTime {
    time_proj: Timesteps,
    embedding: TimestepEmbedding,
}

pub struct UNet {
    conv_in: Conv2d,
    time_proj: Timesteps,
    time_embedding: TimestepEmbedding,
    text_time: Option<TextTime>,
    down: Vec<Down>,
    /// `UNetMidBlock2DCrossAttn`: a resnet, then (transformer, resnet) pairs.
    mid: (Resnet, Vec<(Transformer2D, Resnet)>),
    up: Vec<Up>,
    norm_out: GroupNorm,
    conv_out: Conv2d,
    config: UNetConfig,
}

/// SDXL's extra inputs: (batch, pooled width) text embeddings and (batch, 6) size numbers.
pub struct AddedCondition<'a> {
    pub text_embeds: &'a Tensor,
    pub time_ids: &'a Tensor,
}

impl UNet {
    pub fn load(vs: nn::VarBuilder, config: &UNetConfig) -> Result<UNet> {
        let c = &config.blocks;
        let n = c.blocks.len();
        let first = c.blocks[0].out_channels;
        let last = c.blocks[n - 1];
        let time_dim = first * 4;
        let groups = c.norm_num_groups;
        let shape = ResnetShape { groups, eps: c.norm_eps, time_dim, output_scale_factor: 1.0 };
        let transformers = |vb: nn::VarBuilder, count: usize, channels: usize, heads: usize, layers: usize| {
            (0..count)
                .map(|i| Transformer2D::load(vb.pp(format!("attentions.{i}")), channels, heads, layers, c.cross_attention_dim, groups))
                .collect::<Result<Vec<_>>>()
        };
        let conv_in = Conv2d::load(vs.pp("conv_in"), config.in_channels, first, 3)?;
        let time_proj = Timesteps::new(first, c.flip_sin_to_cos, c.freq_shift);
        let time_embedding = TimestepEmbedding::new(vs.pp("time_embedding"), first, time_dim)?;
        let text_time = match config.text_time {
            None => None,
            Some((per_number, input)) => Some(TextTime {
                time_proj: Timesteps::new(per_number, c.flip_sin_to_cos, c.freq_shift),
                embedding: TimestepEmbedding::new(vs.pp("add_embedding"), input, time_dim)?,
            }),
        };
        let mut down = Vec::with_capacity(n);
        for (i, &BlockConfig { out_channels, use_cross_attn, attention_head_dim }) in c.blocks.iter().enumerate() {
            let vb = vs.pp(format!("down_blocks.{i}"));
            let mut c_in = if i > 0 { c.blocks[i - 1].out_channels } else { first };
            let mut resnets = Vec::with_capacity(c.layers_per_block);
            for j in 0..c.layers_per_block {
                resnets.push(Resnet::load(vb.pp(format!("resnets.{j}")), c_in, out_channels, shape)?);
                c_in = out_channels;
            }
            let attentions = match use_cross_attn {
                Some(layers) => transformers(vb.clone(), c.layers_per_block, out_channels, attention_head_dim, layers)?,
                None => Vec::new(),
            };
            let downsampler = match i < n - 1 {
                true => {
                    let conv = nn::Conv2dConfig { stride: 2, padding: c.downsample_padding, ..Default::default() };
                    Some(nn::conv2d(out_channels, out_channels, 3, conv, vb.pp("downsamplers.0.conv"))?)
                }
                false => None,
            };
            down.push(Down { resnets, attentions, downsampler, pad_after: c.downsample_padding == 0 });
        }
        let mid_vb = vs.pp("mid_block");
        let mid_shape = ResnetShape { output_scale_factor: c.mid_block_scale_factor, ..shape };
        let width = last.out_channels;
        let mid_layers = last.use_cross_attn.unwrap_or(1);
        let mid = (
            Resnet::load(mid_vb.pp("resnets.0"), width, width, mid_shape)?,
            vec![(
                Transformer2D::load(mid_vb.pp("attentions.0"), width, last.attention_head_dim, mid_layers, c.cross_attention_dim, groups)?,
                Resnet::load(mid_vb.pp("resnets.1"), width, width, mid_shape)?,
            )],
        );
        let mut up = Vec::with_capacity(n);
        for i in 0..n {
            let BlockConfig { out_channels, use_cross_attn, attention_head_dim } = c.blocks[n - 1 - i];
            let prev_out = if i > 0 { c.blocks[n - i].out_channels } else { last.out_channels };
            let in_channels = c.blocks[if i == n - 1 { 0 } else { n - i - 2 }].out_channels;
            let vb = vs.pp(format!("up_blocks.{i}"));
            let layers = c.layers_per_block + 1;
            let resnets = (0..layers)
                .map(|j| {
                    let skip = if j == layers - 1 { in_channels } else { out_channels };
                    let input = if j == 0 { prev_out } else { out_channels };
                    Resnet::load(vb.pp(format!("resnets.{j}")), input + skip, out_channels, shape)
                })
                .collect::<Result<Vec<_>>>()?;
            let attentions = match use_cross_attn {
                Some(per_block) => transformers(vb.clone(), layers, out_channels, attention_head_dim, per_block)?,
                None => Vec::new(),
            };
            let upsampler = match i < n - 1 {
                true => Some(Conv2d::load(vb.pp("upsamplers.0.conv"), out_channels, out_channels, 3)?),
                false => None,
            };
            up.push(Up { resnets, attentions, upsampler });
        }
        let norm_out = GroupNorm::load(vs.pp("conv_norm_out"), groups, first, c.norm_eps)?;
        let conv_out = Conv2d::load(vs.pp("conv_out"), first, config.out_channels, 3)?;
        Ok(UNet { conv_in, time_proj, time_embedding, text_time, down, mid, up, norm_out, conv_out, config: config.clone() })
    }

    /// The model's prediction for `xs` (batch, channels, h, w) at `timestep` (the same for every
    /// row), attending to `context` (batch, 77, width); SDXL models need `added`.
    pub fn forward(&self, xs: &Tensor, timestep: f64, context: &Tensor, added: Option<AddedCondition<'_>>) -> Result<Tensor> {
        let c = &self.config.blocks;
        let (batch, _, height, width) = xs.dims4()?;
        let n = c.blocks.len();
        let factor = 1usize << (n - 1);
        let odd_size = height % factor != 0 || width % factor != 0;
        let xs = if c.center_input_sample { ((xs * 2.0)? - 1.0)? } else { xs.clone() };
        let t = (Tensor::ones(batch, xs.dtype(), xs.device())? * timestep)?;
        let mut emb = self.time_embedding.forward(&self.time_proj.forward(&t)?)?;
        match (&self.text_time, added) {
            (Some(tt), Some(added)) => {
                let ids = added.time_ids.flatten_all()?.to_dtype(xs.dtype())?;
                let time = tt.time_proj.forward(&ids)?.reshape((batch, ()))?;
                let input = Tensor::cat(&[&added.text_embeds.to_dtype(xs.dtype())?, &time], 1)?;
                emb = (emb + tt.embedding.forward(&input)?)?;
            }
            (Some(_), None) => anyhow::bail!("this UNet needs the pooled text embedding and the size numbers (SDXL)"),
            (None, _) => {}
        }
        // Every resnet takes the embedding through a SiLU first: once for all of them.
        let temb = candle_nn::ops::silu(&emb)?;
        let context = context.contiguous()?;
        let xs = self.conv_in.forward(&xs, None)?;
        let mut states = vec![xs.clone()];
        let mut xs = xs;
        for block in &self.down {
            xs = block.forward(&xs, &temb, &context, &mut states)?;
        }
        let (first, rest) = &self.mid;
        let mut xs = first.forward(&xs, &temb)?;
        for (attention, resnet) in rest {
            xs = resnet.forward(&attention.forward(&xs, &context)?, &temb)?;
        }
        for (i, block) in self.up.iter().enumerate() {
            let skips = states.split_off(states.len() - block.resnets.len());
            let size = match i < n - 1 && odd_size {
                true => {
                    let (_, _, h, w) = states.last().expect("a skip connection per block").dims4()?;
                    Some((h, w))
                }
                false => None,
            };
            xs = block.forward(&xs, &skips, &temb, &context, size)?;
        }
        let xs = self.norm_out.forward(&xs, true)?;
        self.conv_out.forward(&xs, None)
    }
}
