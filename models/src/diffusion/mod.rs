//! Image generation with Stable Diffusion (SD 1.5 and 2.1, SDXL, SD-Turbo and SDXL-Turbo) from
//! diffusers-layout folders (`model_index.json`, `unet/`, `vae/`, `text_encoder/`,
//! `tokenizer/`, `scheduler/`, and for SDXL `text_encoder_2/`, `tokenizer_2/`), fp16 or fp32
//! safetensors, computed in F32 as diffusers does on the CPU.

mod clip;
mod config;
pub mod family;
mod layers;
pub mod offload;
pub mod pipeline;
pub mod scheduler;
mod transformer;
mod unet;
mod vae;

use serde::{Deserialize, Serialize};

pub use offload::{MemoryPolicy, MemoryState};
pub use pipeline::{BatchShape, Noise, Sample, StableDiffusion};
pub use scheduler::SchedulerKind;

/// A request's `on_step` asked to stop.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("canceled")]
pub struct Canceled;

/// One image request: `n` images of one prompt. Unset fields take the defaults diffusers'
/// pipelines take (50 steps, guidance 7.5, the model's native size).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ImageRequest {
    pub prompt: String,
    /// What to steer away from (the unconditional side of classifier-free guidance); empty by
    /// default.
    #[serde(default)]
    pub negative_prompt: String,
    /// Pixels, a multiple of 8; the model's native size (UNet sample size x 8) when unset.
    pub width: Option<usize>,
    pub height: Option<usize>,
    /// Denoising steps; 50 when unset.
    pub steps: Option<usize>,
    /// Classifier-free guidance scale; 7.5 when unset. At 1 or below no unconditional pass runs
    /// (as diffusers decides), so Turbo models take 0.
    pub guidance: Option<f64>,
    /// Seed of image `i` is `seed + i`; random when unset (the output says which).
    pub seed: Option<u64>,
    /// Images of this prompt, 1 by default.
    pub n: Option<usize>,
    /// The scheduler; the one the model's `scheduler/scheduler_config.json` names when unset.
    pub scheduler: Option<SchedulerKind>,
}

/// One generated image.
#[derive(Debug, Clone)]
pub struct GeneratedImage {
    pub width: usize,
    pub height: usize,
    /// The seed its initial noise came from.
    pub seed: u64,
    /// Interleaved 8-bit RGB, row after row.
    pub rgb: Vec<u8>,
}

/// What an image request produced.
#[derive(Debug, Clone)]
pub struct ImageOutput {
    pub images: Vec<GeneratedImage>,
    /// The scheduler and step count that ran.
    pub scheduler: SchedulerKind,
    pub steps: usize,
    pub guidance: f64,
    /// Whether the images were decoded in tiles (`TERN_VAE_TILING=always`, or a whole decode
    /// would not have fit the memory free).
    pub tiled_decode: bool,
    /// Where the text encoders and the VAE decoder waited ([`MemoryState`]).
    pub memory_state: MemoryState,
    /// Milliseconds spent encoding the prompts, denoising and decoding (the whole batch's, shared
    /// by the requests in it).
    pub encode_ms: u64,
    pub denoise_ms: u64,
    pub decode_ms: u64,
}
