//! The VAE's decode, whole or in tiles: a large image decodes as overlapping tiles of the size
//! the VAE was trained at, blended where they overlap, exactly as diffusers' `tiled_decode`
//! (`vae.enable_tiling()`) blends them, so a 1024x1024 decode fits where a whole one would not.

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_transformers::models::stable_diffusion::vae::AutoEncoderKL;

use super::config::VaeConfig;

/// diffusers' `tile_overlap_factor`.
const OVERLAP: f64 = 0.25;

/// Decodes scaled latents (batch, channels, h, w) to images in [-1, 1]; in tiles when `tiled`
/// and the latents are larger than one tile.
pub fn decode(vae: &AutoEncoderKL, config: &VaeConfig, latents: &Tensor, tiled: bool) -> Result<Tensor> {
    // One image at a time: candle's VAE attention mixes the images of a batch (a second image
    // decoded beside a first comes out up to 33/255 off), and one at a time also bounds the
    // decode's memory to one image's.
    let images = (0..latents.dim(0)?).map(|i| decode_one(vae, config, &latents.narrow(0, i, 1)?, tiled)).collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&images, 0)?)
}

fn decode_one(vae: &AutoEncoderKL, config: &VaeConfig, latents: &Tensor, tiled: bool) -> Result<Tensor> {
    let tile_latent = config.sample_size / config.scale;
    let (_, _, h, w) = latents.dims4()?;
    if !tiled || (h <= tile_latent && w <= tile_latent) {
        return Ok(vae.decode(latents)?);
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

/// Bytes a whole decode of `pixels` pixels per image takes at its widest (the last up block's
/// activations, a few alive at once, F32): what decides between a whole and a tiled decode.
pub fn whole_decode_bytes(config: &VaeConfig, batch: usize, pixels: usize) -> u64 {
    let widest_at_full_size = config.candle.block_out_channels[0] as u64;
    // A resnet holds its input, its norm's output and its conv's output at once; the upsampler
    // before it a fourth.
    4 * 4 * widest_at_full_size * pixels as u64 * batch as u64
}
