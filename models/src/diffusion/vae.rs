//! The VAE's decoder (diffusers' `AutoencoderKL` decode: `post_quant_conv`, then `Decoder`) and
//! its decode, whole or in tiles: a large image decodes as overlapping tiles of the size the
//! VAE was trained at, blended where they overlap, exactly as diffusers' `tiled_decode`
//! (`vae.enable_tiling()`) blends them, so a 1024x1024 decode fits where a whole one would not.
//!
//! The decoder is tern's own rather than candle's `AutoEncoderKL`: its layers
//! ([`super::layers`]) run tern's CPU kernels (candle's CPU convolutions took 50 s for one
//! 512x512 image), only the decoder's weights are loaded (text-to-image never encodes), and its
//! attention keeps each image of a batch to itself (candle's mixed them).

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;

use super::config::VaeConfig;
use super::layers::{attention, Conv2d, GroupNorm};

/// The epsilon of every group norm in diffusers' VAE decoder.
const NORM_EPS: f64 = 1e-6;

/// diffusers' `ResnetBlock2D` without a time embedding: `x + conv2(silu(norm2(conv1(silu(norm1(x))))))`,
/// `x` through a 1x1 `conv_shortcut` where the channel count changes.
struct Resnet {
    norm1: GroupNorm,
    conv1: Conv2d,
    norm2: GroupNorm,
    conv2: Conv2d,
    shortcut: Option<Conv2d>,
}

impl Resnet {
    fn load(vb: VarBuilder, c_in: usize, c_out: usize, groups: usize) -> Result<Resnet> {
        Ok(Resnet {
            norm1: GroupNorm::load(vb.pp("norm1"), groups, c_in, NORM_EPS)?,
            conv1: Conv2d::load(vb.pp("conv1"), c_in, c_out, 3)?,
            norm2: GroupNorm::load(vb.pp("norm2"), groups, c_out, NORM_EPS)?,
            conv2: Conv2d::load(vb.pp("conv2"), c_out, c_out, 3)?,
            shortcut: if c_in == c_out { None } else { Some(Conv2d::load(vb.pp("conv_shortcut"), c_in, c_out, 1)?) },
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Each intermediate is dropped as soon as the next is made: at full size one is 128 MB.
        let h = self.norm2.forward(&self.conv1.forward(&self.norm1.forward(x, true)?, None)?, true)?;
        let residual = match &self.shortcut {
            Some(shortcut) => shortcut.forward(x, None)?,
            None => x.clone(),
        };
        self.conv2.forward(&h, Some(&residual))
    }
}

/// The mid block's attention (diffusers' `Attention` with one head, a group norm, a residual
/// connection and `rescale_output_factor` 1).
struct Attention {
    norm: GroupNorm,
    q: Conv2d,
    k: Conv2d,
    v: Conv2d,
    out: Conv2d,
}

impl Attention {
    fn load(vb: VarBuilder, channels: usize, groups: usize) -> Result<Attention> {
        // Old checkpoints name the projections `query`, `key`, `value`, `proj_attn` (diffusers
        // renames them on load).
        let names = if vb.contains_tensor("to_q.weight") {
            ["to_q", "to_k", "to_v", "to_out.0"]
        } else {
            ["query", "key", "value", "proj_attn"]
        };
        let [q, k, v, out] = names.map(|name| Conv2d::load(vb.pp(name), channels, channels, 1));
        Ok(Attention { norm: GroupNorm::load(vb.pp("group_norm"), groups, channels, NORM_EPS)?, q: q?, k: k?, v: v?, out: out? })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.norm.forward(x, false)?;
        let mixed = attention(&self.q.forward(&h, None)?, &self.k.forward(&h, None)?, &self.v.forward(&h, None)?)?;
        self.out.forward(&mixed, Some(x))
    }
}

/// diffusers' `UpDecoderBlock2D`: resnets, then (but in the last block) a 2x nearest upsampling
/// and a 3x3 convolution.
struct UpBlock {
    resnets: Vec<Resnet>,
    upsampler: Option<Conv2d>,
}

/// The tensors of an `AutoencoderKL` file the decoder reads.
pub(crate) const DECODER_PREFIXES: &[&str] = &["decoder.", "post_quant_conv."];

/// The VAE's decoder, latents to images in [-1, 1], with the `post_quant_conv` before it.
pub struct Decoder {
    post_quant_conv: Option<Conv2d>,
    conv_in: Conv2d,
    mid: (Resnet, Attention, Resnet),
    up_blocks: Vec<UpBlock>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Decoder {
    /// Loads the decoder's weights (`decoder.*`, and `post_quant_conv` when the config uses it)
    /// from a diffusers `AutoencoderKL`'s; the encoder's are left unread.
    pub fn load(vb: VarBuilder, config: &VaeConfig) -> Result<Decoder> {
        let c = &config.candle;
        let groups = c.norm_num_groups;
        let post_quant_conv = match c.use_post_quant_conv {
            true => Some(Conv2d::load(vb.pp("post_quant_conv"), c.latent_channels, c.latent_channels, 1).context("post_quant_conv")?),
            false => None,
        };
        let vb = vb.pp("decoder");
        let widest = *c.block_out_channels.last().context("no block_out_channels")?;
        let mid = vb.pp("mid_block");
        let mid = (
            Resnet::load(mid.pp("resnets.0"), widest, widest, groups)?,
            Attention::load(mid.pp("attentions.0"), widest, groups)?,
            Resnet::load(mid.pp("resnets.1"), widest, widest, groups)?,
        );
        let mut up_blocks = Vec::new();
        let mut c_in = widest;
        for (i, &c_out) in c.block_out_channels.iter().rev().enumerate() {
            let vb = vb.pp(format!("up_blocks.{i}"));
            let resnets = (0..c.layers_per_block + 1)
                .map(|j| Resnet::load(vb.pp(format!("resnets.{j}")), if j == 0 { c_in } else { c_out }, c_out, groups))
                .collect::<Result<Vec<_>>>()?;
            let last = i + 1 == c.block_out_channels.len();
            let upsampler = if last { None } else { Some(Conv2d::load(vb.pp("upsamplers.0.conv"), c_out, c_out, 3)?) };
            up_blocks.push(UpBlock { resnets, upsampler });
            c_in = c_out;
        }
        Ok(Decoder {
            post_quant_conv,
            conv_in: Conv2d::load(vb.pp("conv_in"), c.latent_channels, widest, 3)?,
            mid,
            up_blocks,
            conv_norm_out: GroupNorm::load(vb.pp("conv_norm_out"), groups, c_in, NORM_EPS)?,
            conv_out: Conv2d::load(vb.pp("conv_out"), c_in, config.out_channels, 3)?,
        })
    }

    /// Latents `(b, latent_channels, h, w)` (already divided by the scaling factor) to images
    /// `(b, out_channels, 8h, 8w)` in [-1, 1] (unclamped).
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        let mut x = match &self.post_quant_conv {
            Some(conv) => conv.forward(latents, None)?,
            None => latents.clone(),
        };
        x = self.conv_in.forward(&x, None)?;
        x = self.mid.0.forward(&x)?;
        x = self.mid.1.forward(&x)?;
        x = self.mid.2.forward(&x)?;
        for block in &self.up_blocks {
            for resnet in &block.resnets {
                x = resnet.forward(&x)?;
            }
            if let Some(upsampler) = &block.upsampler {
                x = upsampler.forward_upsampled(&x)?;
            }
        }
        self.conv_out.forward(&self.conv_norm_out.forward(&x, true)?, None)
    }
}

/// diffusers' `tile_overlap_factor`.
const OVERLAP: f64 = 0.25;

/// Decodes scaled latents (batch, channels, h, w) to images in [-1, 1]; in tiles when `tiled`
/// and the latents are larger than one tile.
pub fn decode(vae: &Decoder, config: &VaeConfig, latents: &Tensor, tiled: bool) -> Result<Tensor> {
    // One image at a time bounds the decode's memory to one image's; a batch would not run
    // faster, as every layer already spreads one image over all the cores.
    let images = (0..latents.dim(0)?).map(|i| decode_one(vae, config, &latents.narrow(0, i, 1)?, tiled)).collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&images, 0)?)
}

fn decode_one(vae: &Decoder, config: &VaeConfig, latents: &Tensor, tiled: bool) -> Result<Tensor> {
    let tile_latent = config.sample_size / config.scale;
    let (_, _, h, w) = latents.dims4()?;
    if !tiled || (h <= tile_latent && w <= tile_latent) {
        return vae.decode(latents);
    }
    let tile_sample = config.sample_size;
    let stride = (tile_latent as f64 * (1.0 - OVERLAP)) as usize;
    let blend = (tile_sample as f64 * OVERLAP) as usize;
    let limit = tile_sample - blend;
    let mut rows: Vec<Vec<Tensor>> = Vec::new();
    for i in (0..h).step_by(stride) {
        let mut row = Vec::new();
        for j in (0..w).step_by(stride) {
            let tile = latents.narrow(2, i, tile_latent.min(h - i))?.narrow(3, j, tile_latent.min(w - j))?;
            row.push(vae.decode(&tile)?);
        }
        rows.push(row);
    }
    // diffusers blends in place: a tile's blended edges are what the next row and column blend
    // with, so the grid is updated in the same order.
    let mut out_rows = Vec::with_capacity(rows.len());
    for i in 0..rows.len() {
        let mut out_row = Vec::with_capacity(rows[i].len());
        for j in 0..rows[i].len() {
            let mut tile = rows[i][j].clone();
            if i > 0 {
                tile = blend_edge(&rows[i - 1][j], &tile, blend, 2)?;
            }
            if j > 0 {
                tile = blend_edge(&rows[i][j - 1], &tile, blend, 3)?;
            }
            rows[i][j] = tile.clone();
            let (th, tw) = (tile.dim(2)?, tile.dim(3)?);
            out_row.push(tile.narrow(2, 0, limit.min(th))?.narrow(3, 0, limit.min(tw))?);
        }
        out_rows.push(Tensor::cat(&out_row, 3)?);
    }
    Ok(Tensor::cat(&out_rows, 2)?)
}

/// `b` with its first `extent` rows (`dim` 2) or columns (`dim` 3) faded in from the end of `a`.
fn blend_edge(a: &Tensor, b: &Tensor, extent: usize, dim: usize) -> Result<Tensor> {
    let extent = extent.min(a.dim(dim)?).min(b.dim(dim)?);
    if extent == 0 {
        return Ok(b.clone());
    }
    let weights: Vec<f32> = (0..extent).map(|y| y as f32 / extent as f32).collect();
    let shape = if dim == 2 { (1, 1, extent, 1) } else { (1, 1, 1, extent) };
    let wb = Tensor::from_vec(weights, shape, &Device::Cpu)?.to_device(b.device())?.to_dtype(b.dtype())?;
    let wa = (1.0 - &wb)?;
    let a_end = a.narrow(dim, a.dim(dim)? - extent, extent)?;
    let b_start = b.narrow(dim, 0, extent)?;
    let blended = (a_end.broadcast_mul(&wa)? + b_start.broadcast_mul(&wb)?)?;
    let rest = b.narrow(dim, extent, b.dim(dim)? - extent)?;
    Ok(Tensor::cat(&[&blended, &rest], dim)?)
}

/// Bytes a whole decode of one `pixels`-pixel image takes at its peak (F32: a resnet's input,
/// its norm's and conv's outputs at the two widest full-size blocks, and the image): what decides
/// between a whole and a tiled decode when memory is short.
pub fn whole_decode_bytes(config: &VaeConfig, pixels: usize) -> u64 {
    let widths = &config.candle.block_out_channels;
    let (first, second) = (widths[0] as u64, widths.get(1).copied().unwrap_or(widths[0]) as u64);
    4 * pixels as u64 * (2 * second + first + 3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// The tiny SD VAE of the parity fixtures, decoded by tern's CPU kernels (F32) and by
    /// candle's ops (F64, the path CUDA takes): the two agree, so the decoder is wired the
    /// same way on both.
    #[test]
    fn the_cpu_kernels_and_candles_ops_decode_alike() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diffusion/sd-tiny/vae");
        let config = VaeConfig::read(&dir.join("config.json")).unwrap();
        let load = |dtype| Decoder::load(super::super::pipeline::weights(&dir, "diffusion_pytorch_model", dtype, &Device::Cpu).unwrap(), &config).unwrap();
        let (fast, reference) = (load(DType::F32), load(DType::F64));
        let latents = Tensor::randn(0f32, 1.0, (2, config.candle.latent_channels, 5, 7), &Device::Cpu).unwrap();
        let got = fast.decode(&latents).unwrap();
        let want = reference.decode(&latents.to_dtype(DType::F64).unwrap()).unwrap().to_dtype(DType::F32).unwrap();
        assert_eq!(got.dims(), &[2, config.out_channels, 40, 56]);
        let diff = (got - want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-4, "{diff}");
    }
}

