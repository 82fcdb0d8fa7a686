//! The denoising UNet (`UNet2DConditionModel`): candle's blocks under tern's own top level,
//! which adds SDXL's `text_time` conditioning (the pooled text embedding and the size numbers
//! added to the time embedding) that candle's top level leaves out.

use anyhow::Result;
use candle_core::{Module, Tensor};
use candle_nn as nn;
use candle_transformers::models::stable_diffusion::embeddings::{TimestepEmbedding, Timesteps};
use candle_transformers::models::stable_diffusion::unet_2d::BlockConfig;
use candle_transformers::models::stable_diffusion::unet_2d_blocks::{
    CrossAttnDownBlock2D, CrossAttnDownBlock2DConfig, CrossAttnUpBlock2D, CrossAttnUpBlock2DConfig, DownBlock2D, DownBlock2DConfig,
    UNetMidBlock2DCrossAttn, UNetMidBlock2DCrossAttnConfig, UpBlock2D, UpBlock2DConfig,
};

use super::config::UNetConfig;

enum Down {
    Basic(DownBlock2D),
    CrossAttn(CrossAttnDownBlock2D),
}

enum Up {
    Basic(UpBlock2D),
    CrossAttn(CrossAttnUpBlock2D),
}

/// SDXL's added conditioning: `add_time_proj` and `add_embedding`.
struct TextTime {
    time_proj: Timesteps,
    embedding: TimestepEmbedding,
}

pub struct UNet {
    conv_in: nn::Conv2d,
    time_proj: Timesteps,
    time_embedding: TimestepEmbedding,
    text_time: Option<TextTime>,
    down: Vec<Down>,
    mid: UNetMidBlock2DCrossAttn,
    up: Vec<Up>,
    norm_out: nn::GroupNorm,
    conv_out: nn::Conv2d,
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
        let conv = nn::Conv2dConfig { padding: 1, ..Default::default() };
        let conv_in = nn::conv2d(config.in_channels, first, 3, conv, vs.pp("conv_in"))?;
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
            let in_channels = if i > 0 { c.blocks[i - 1].out_channels } else { first };
            let block = DownBlock2DConfig {
                num_layers: c.layers_per_block,
                resnet_eps: c.norm_eps,
                resnet_groups: c.norm_num_groups,
                add_downsample: i < n - 1,
                downsample_padding: c.downsample_padding,
                ..Default::default()
            };
            let vs = vs.pp(format!("down_blocks.{i}"));
            down.push(match use_cross_attn {
                Some(layers) => {
                    let config = CrossAttnDownBlock2DConfig {
                        downblock: block,
                        attn_num_head_channels: attention_head_dim,
                        cross_attention_dim: c.cross_attention_dim,
                        sliced_attention_size: None,
                        use_linear_projection: c.use_linear_projection,
                        transformer_layers_per_block: layers,
                    };
                    Down::CrossAttn(CrossAttnDownBlock2D::new(vs, in_channels, out_channels, Some(time_dim), false, config)?)
                }
                None => Down::Basic(DownBlock2D::new(vs, in_channels, out_channels, Some(time_dim), block)?),
            });
        }
        let mid = UNetMidBlock2DCrossAttnConfig {
            resnet_eps: c.norm_eps,
            output_scale_factor: c.mid_block_scale_factor,
            cross_attn_dim: c.cross_attention_dim,
            attn_num_head_channels: last.attention_head_dim,
            resnet_groups: Some(c.norm_num_groups),
            use_linear_projection: c.use_linear_projection,
            transformer_layers_per_block: last.use_cross_attn.unwrap_or(1),
            ..Default::default()
        };
        let mid = UNetMidBlock2DCrossAttn::new(vs.pp("mid_block"), last.out_channels, Some(time_dim), false, mid)?;
        let mut up = Vec::with_capacity(n);
        for i in 0..n {
            let BlockConfig { out_channels, use_cross_attn, attention_head_dim } = c.blocks[n - 1 - i];
            let prev_out = if i > 0 { c.blocks[n - i].out_channels } else { last.out_channels };
            let in_channels = c.blocks[if i == n - 1 { 0 } else { n - i - 2 }].out_channels;
            let block = UpBlock2DConfig {
                num_layers: c.layers_per_block + 1,
                resnet_eps: c.norm_eps,
                resnet_groups: c.norm_num_groups,
                add_upsample: i < n - 1,
                ..Default::default()
            };
            let vs = vs.pp(format!("up_blocks.{i}"));
            up.push(match use_cross_attn {
                Some(layers) => {
                    let config = CrossAttnUpBlock2DConfig {
                        upblock: block,
                        attn_num_head_channels: attention_head_dim,
                        cross_attention_dim: c.cross_attention_dim,
                        sliced_attention_size: None,
                        use_linear_projection: c.use_linear_projection,
                        transformer_layers_per_block: layers,
                    };
                    Up::CrossAttn(CrossAttnUpBlock2D::new(vs, in_channels, prev_out, out_channels, Some(time_dim), false, config)?)
                }
                None => Up::Basic(UpBlock2D::new(vs, in_channels, prev_out, out_channels, Some(time_dim), block)?),
            });
        }
        let norm_out = nn::group_norm(c.norm_num_groups, first, c.norm_eps, vs.pp("conv_norm_out"))?;
        let conv_out = nn::conv2d(first, config.out_channels, 3, conv, vs.pp("conv_out"))?;
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
        let xs = self.conv_in.forward(&xs)?;
        let mut residuals = vec![xs.clone()];
        let mut xs = xs;
        for block in &self.down {
            let (out, res) = match block {
                Down::Basic(b) => b.forward(&xs, Some(&emb))?,
                Down::CrossAttn(b) => b.forward(&xs, Some(&emb), Some(context))?,
            };
            residuals.extend(res);
            xs = out;
        }
        let mut xs = self.mid.forward(&xs, Some(&emb), Some(context))?;
        let mut upsample_size = None;
        for (i, block) in self.up.iter().enumerate() {
            let res = residuals.split_off(residuals.len() - (c.layers_per_block + 1));
            if i < n - 1 && odd_size {
                let (_, _, h, w) = residuals.last().expect("a residual per block").dims4()?;
                upsample_size = Some((h, w));
            }
            xs = match block {
                Up::Basic(b) => b.forward(&xs, &res, Some(&emb), upsample_size)?,
                Up::CrossAttn(b) => b.forward(&xs, &res, Some(&emb), upsample_size, Some(context))?,
            };
        }
        let xs = candle_nn::ops::silu(&self.norm_out.forward(&xs)?)?;
        Ok(self.conv_out.forward(&xs)?)
    }
}
