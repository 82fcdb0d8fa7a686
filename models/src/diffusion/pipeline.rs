//! A Stable Diffusion pipeline as diffusers' `StableDiffusionPipeline` and
//! `StableDiffusionXLPipeline` compute it: prompts encoded by CLIP, latents denoised by the UNet
//! under classifier-free guidance as the scheduler steps, decoded by the VAE.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use rand::{Rng, SeedableRng};

use super::clip::{ClipTextModel, ClipTokenizer};
use super::config::{ClipConfig, PipelineConfig, PipelineKind, UNetConfig, VaeConfig};
use super::offload::{tensor_bytes, MemoryPolicy, MemoryState, Placed};
use super::scheduler::{self, SchedulerConfig, SchedulerKind};
use super::unet::{AddedCondition, UNet};
use super::vae;
use crate::weights::safetensors_files;

/// The safetensors of a component: `STEM.safetensors`, else `STEM.fp16.safetensors`, else the
/// shards an `STEM.safetensors.index.json` names; loaded as `dtype`.
pub(crate) fn weights(dir: &Path, stem: &str, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    let files = safetensors_files(dir, stem)?;
    // Safety: the files are memory-mapped read-only; tern never writes model folders while a
    // worker runs them.
    Ok(unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? })
}

/// One image of a batch: its prompt, its guidance and where its initial noise comes from.
#[derive(Debug, Clone)]
pub struct Sample {
    pub prompt: String,
    /// What guidance steers away from. `None` is diffusers' `negative_prompt=None`: the encoded
    /// "" (SD), or zeros (SDXL, whose `force_zeros_for_empty_prompt` is set).
    pub negative_prompt: Option<String>,
    /// Classifier-free guidance scale (only read when the batch guides).
    pub guidance: f64,
    pub noise: Noise,
}

/// Where an image's Gaussian noise comes from.
#[derive(Debug, Clone)]
pub enum Noise {
    /// tern's generator seeded with this (initial latents, then each step's noise for ancestral
    /// schedulers): an image's noise does not depend on the batch it runs in.
    Seed(u64),
    /// Given initial latents (1, channels, h/8, w/8), unscaled, as diffusers' `latents=`
    /// argument takes them; ancestral steps then draw from seed 0.
    Latents(Tensor),
}

/// What every image of a batch shares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchShape {
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    pub scheduler: SchedulerKind,
    /// Whether the batch runs the unconditional pass (diffusers: guidance above 1).
    pub guided: bool,
}

/// Times of one batch's phases.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timings {
    pub encode_ms: u64,
    pub denoise_ms: u64,
    pub decode_ms: u64,
}

/// A loaded pipeline.
pub struct StableDiffusion {
    pub(crate) kind: PipelineKind,
    force_zeros_for_empty_prompt: bool,
    tokenizers: Vec<ClipTokenizer>,
    encoders: Vec<Placed<ClipTextModel>>,
    unet: UNet,
    pub(crate) unet_config: UNetConfig,
    vae: Placed<vae::Decoder>,
    pub(crate) vae_config: VaeConfig,
    pub(crate) scheduler_config: SchedulerConfig,
    pub(crate) device: Device,
    dtype: DType,
    /// Decode in tiles whatever the size (else only where a whole decode would not fit).
    pub tile_vae: bool,
    /// How batches choose where the text encoders and the VAE wait (`TERN_IMAGE_MEMORY` in a
    /// worker); [`MemoryPolicy::Auto`] by default.
    pub memory_policy: MemoryPolicy,
    unet_bytes: u64,
}

impl StableDiffusion {
    /// Loads a diffusers folder onto `device`, computing in `dtype`, every component resident.
    pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<StableDiffusion> {
        let pipeline = PipelineConfig::read(dir)?;
        let unet_config = UNetConfig::read(&dir.join("unet/config.json"))?;
        let vae_config = VaeConfig::read(&dir.join("vae/config.json"))?;
        let scheduler_config = SchedulerConfig::read(&dir.join("scheduler/scheduler_config.json"))?;
        let sides: &[&str] = match pipeline.kind {
            PipelineKind::Sd => &[""],
            PipelineKind::Sdxl => &["", "_2"],
        };
        let mut tokenizers = Vec::new();
        let mut encoders = Vec::new();
        for side in sides {
            tokenizers.push(ClipTokenizer::load(&dir.join(format!("tokenizer{side}")))?);
            let folder = dir.join(format!("text_encoder{side}"));
            let config = ClipConfig::read(&folder.join("config.json"))?;
            let build = Box::new(move |vb: VarBuilder| ClipTextModel::load(vb, &config));
            let encoder = Placed::load(safetensors_files(&folder, "model")?, &[], build, dtype, device).with_context(|| format!("loading {}", folder.display()))?;
            encoders.push(encoder);
        }
        let unet_dir = dir.join("unet");
        let unet_bytes = component_bytes(&unet_dir, "diffusion_pytorch_model", &[], dtype)?;
        let unet = UNet::load(weights(&unet_dir, "diffusion_pytorch_model", dtype, device)?, &unet_config)
            .with_context(|| format!("loading {}", unet_dir.display()))?;
        let vae_dir = dir.join("vae");
        let decoder_config = vae_config.clone();
        let build = Box::new(move |vb: VarBuilder| vae::Decoder::load(vb, &decoder_config));
        let vae = Placed::load(safetensors_files(&vae_dir, "diffusion_pytorch_model")?, vae::DECODER_PREFIXES, build, dtype, device)
            .with_context(|| format!("loading {}", vae_dir.display()))?;
        Ok(StableDiffusion {
            kind: pipeline.kind,
            force_zeros_for_empty_prompt: pipeline.force_zeros_for_empty_prompt,
            tokenizers,
            encoders,
            unet,
            unet_config,
            vae,
            vae_config,
            scheduler_config,
            device: device.clone(),
            dtype,
            tile_vae: false,
            memory_policy: MemoryPolicy::Auto,
            unet_bytes,
        })
    }

    /// Where the text encoders and the VAE decoder wait between their steps.
    pub fn memory_state(&self) -> MemoryState {
        self.vae.state()
    }

    /// Moves the text encoders and the VAE decoder to host memory, or back to the device.
    pub fn set_memory_state(&mut self, state: MemoryState) -> Result<()> {
        for encoder in &mut self.encoders {
            encoder.place(state, &self.device)?;
        }
        self.vae.place(state, &self.device)
    }

    /// Bytes of the components that can wait in host memory (the text encoders, the VAE
    /// decoder).
    pub fn offloadable_bytes(&self) -> u64 {
        self.encoders.iter().map(|e| e.bytes).sum::<u64>() + self.vae.bytes
    }

    /// Bytes of every component's weights (the VAE's decoder only), on the device or in host
    /// memory.
    pub fn resident_bytes(&self) -> u64 {
        self.unet_bytes + self.offloadable_bytes()
    }

    /// The default image size (pixels): the UNet's sample size x 8.
    pub fn native_size(&self) -> usize {
        self.unet_config.sample_size * self.vae_config.scale
    }

    /// `text` as each tokenizer's ids (the first encoder's first).
    pub fn token_ids(&self, text: &str) -> Result<Vec<Vec<u32>>> {
        self.tokenizers.iter().map(|t| t.encode(text)).collect()
    }

    /// The scheduler the model's `scheduler_config.json` names.
    pub fn default_scheduler(&self) -> Result<SchedulerKind> {
        self.scheduler_config.kind()
    }

    /// Runs one batch; `on_step(done, total)` after each denoising step, false stops it (the
    /// error then says so). Returns each sample's image, (height, width, 3) RGB8.
    pub fn generate(&self, shape: BatchShape, samples: &[Sample], on_step: &mut dyn FnMut(usize, usize) -> bool) -> Result<(Vec<Vec<u8>>, Timings)> {
        let latents = self.denoise(shape, samples, on_step)?;
        let started = Instant::now();
        let images = self.decode(&latents.0)?;
        let mut timings = latents.1;
        timings.decode_ms = started.elapsed().as_millis() as u64;
        Ok((images, timings))
    }

    /// The denoised latents (batch, channels, h/8, w/8) of `samples`.
    pub fn denoise(&self, shape: BatchShape, samples: &[Sample], on_step: &mut dyn FnMut(usize, usize) -> bool) -> Result<(Tensor, Timings)> {
        let scale = self.vae_config.scale;
        ensure!(shape.width % scale == 0 && shape.height % scale == 0, "width and height must be multiples of {scale}");
        ensure!(!samples.is_empty(), "no samples");
        let started = Instant::now();
        let (context, added) = self.encode_prompts(samples, shape)?;
        let encode_ms = started.elapsed().as_millis() as u64;
        let started = Instant::now();
        let mut scheduler = scheduler::build(&self.scheduler_config, shape.scheduler, shape.steps)?;
        let (h, w) = (shape.height / scale, shape.width / scale);
        let channels = self.unet_config.in_channels;
        let mut generators: Vec<rand::rngs::StdRng> = Vec::with_capacity(samples.len());
        let mut initial = Vec::with_capacity(samples.len());
        for s in samples {
            match &s.noise {
                Noise::Seed(seed) => {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(*seed);
                    initial.push(gaussian(&mut rng, (1, channels, h, w), &self.device)?);
                    generators.push(rng);
                }
                Noise::Latents(t) => {
                    ensure!(t.dims() == [1, channels, h, w], "given latents are {:?}, not {:?}", t.dims(), [1, channels, h, w]);
                    initial.push(t.to_device(&self.device)?.to_dtype(DType::F32)?);
                    generators.push(rand::rngs::StdRng::seed_from_u64(0));
                }
            }
        }
        let mut latents = (Tensor::cat(&initial, 0)? * scheduler.init_noise_sigma())?;
        let guidance = Tensor::from_vec(samples.iter().map(|s| s.guidance as f32).collect::<Vec<_>>(), (samples.len(), 1, 1, 1), &self.device)?;
        let timesteps = scheduler.timesteps().to_vec();
        for (i, &t) in timesteps.iter().enumerate() {
            let input = if shape.guided { Tensor::cat(&[&latents, &latents], 0)? } else { latents.clone() };
            let input = scheduler.scale_model_input(&input, i)?.to_dtype(self.dtype)?;
            let added = added.as_ref().map(|(text_embeds, time_ids)| AddedCondition { text_embeds, time_ids });
            let prediction = self.unet.forward(&input, t, &context, added)?.to_dtype(DType::F32)?;
            let prediction = if shape.guided {
                let b = samples.len();
                let (uncond, cond) = (prediction.narrow(0, 0, b)?, prediction.narrow(0, b, b)?);
                (&uncond + (cond - &uncond)?.broadcast_mul(&guidance)?)?
            } else {
                prediction
            };
            let noise = if scheduler.needs_noise() {
                let rows = generators.iter_mut().map(|g| gaussian(g, (1, channels, h, w), &self.device)).collect::<Result<Vec<_>>>()?;
                Some(Tensor::cat(&rows, 0)?)
            } else {
                None
            };
            latents = scheduler.step(&prediction, i, &latents, noise.as_ref())?;
            if !on_step(i + 1, timesteps.len()) {
                bail!(super::Canceled);
            }
        }
        Ok((latents, Timings { encode_ms, denoise_ms: started.elapsed().as_millis() as u64, decode_ms: 0 }))
    }

    /// The prompts as the UNet's context ([negatives; prompts] when guided) and, for SDXL, the
    /// pooled embeddings and size numbers in the same row order.
    fn encode_prompts(&self, samples: &[Sample], shape: BatchShape) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let prompts: Vec<&str> = samples.iter().map(|s| s.prompt.as_str()).collect();
        let (cond, cond_pooled) = self.encode_texts(&prompts)?;
        let (context, pooled) = if shape.guided {
            let negatives: Vec<&str> = samples.iter().map(|s| s.negative_prompt.as_deref().unwrap_or("")).collect();
            let (mut uncond, mut uncond_pooled) = self.encode_texts(&negatives)?;
            if self.kind == PipelineKind::Sdxl && self.force_zeros_for_empty_prompt {
                // diffusers zeroes the negative side when no negative prompt is given (row by
                // row here: each request has its own).
                let keep: Vec<f32> = samples.iter().map(|s| if s.negative_prompt.is_none() { 0.0 } else { 1.0 }).collect();
                let keep = Tensor::from_vec(keep, samples.len(), &self.device)?;
                uncond = uncond.broadcast_mul(&keep.reshape((samples.len(), 1, 1))?.to_dtype(uncond.dtype())?)?;
                uncond_pooled = match uncond_pooled {
                    Some(p) => Some(p.broadcast_mul(&keep.reshape((samples.len(), 1))?.to_dtype(p.dtype())?)?),
                    None => None,
                };
            }
            let pooled = match (uncond_pooled, cond_pooled) {
                (Some(u), Some(c)) => Some(Tensor::cat(&[u, c], 0)?),
                _ => None,
            };
            (Tensor::cat(&[uncond, cond], 0)?, pooled)
        } else {
            (cond, cond_pooled)
        };
        let added = match (self.kind, pooled) {
            (PipelineKind::Sdxl, Some(pooled)) => {
                let (h, w) = (shape.height as f32, shape.width as f32);
                let rows = context.dim(0)?;
                // original size, crop top-left, target size.
                let ids: Vec<f32> = (0..rows).flat_map(|_| [h, w, 0.0, 0.0, h, w]).collect();
                Some((pooled, Tensor::from_vec(ids, (rows, 6), &self.device)?))
            }
            (PipelineKind::Sdxl, None) => bail!("the second text encoder has no projection (text_projection)"),
            _ => None,
        };
        Ok((context.to_dtype(self.dtype)?, added))
    }

    /// Every encoder's states of `texts` (SD: the last layer's; SDXL: each encoder's
    /// penultimate layer, side by side) and the last encoder's pooled projection.
    fn encode_texts(&self, texts: &[&str]) -> Result<(Tensor, Option<Tensor>)> {
        let mut states = Vec::new();
        let mut pooled = None;
        for (tokenizer, encoder) in self.tokenizers.iter().zip(&self.encoders) {
            let ids = texts.iter().map(|t| tokenizer.encode(t)).collect::<Result<Vec<_>>>()?;
            // SDXL reads each encoder's penultimate layer.
            let penultimate = self.kind == PipelineKind::Sdxl;
            let out = encoder.with(&self.device, |e| e.forward(&ids, tokenizer.eos(), penultimate.then(|| e.layer_count() - 1), &self.device))?;
            states.push(out.hidden);
            pooled = out.pooled;
        }
        Ok((Tensor::cat(&states, 2)?, pooled))
    }

    /// Latents to RGB8 images, as diffusers' image processor rounds them.
    pub fn decode(&self, latents: &Tensor) -> Result<Vec<Vec<u8>>> {
        let scaled = (latents / self.vae_config.scaling_factor)?.to_dtype(self.dtype)?;
        let images = self.vae.with(&self.device, |v| vae::decode(v, &self.vae_config, &scaled, self.tile_vae))?.to_dtype(DType::F32)?;
        let images = ((images / 2.0)? + 0.5)?.clamp(0f32, 1f32)?;
        let images = (images * 255.0)?.round()?.to_dtype(DType::U8)?.permute((0, 2, 3, 1))?;
        let b = images.dim(0)?;
        (0..b).map(|i| Ok(images.get(i)?.flatten_all()?.to_vec1::<u8>()?)).collect()
    }
}

/// Bytes a component's weights under `prefixes` (all where none) take in `dtype`.
pub(crate) fn component_bytes(dir: &Path, stem: &str, prefixes: &[&str], dtype: DType) -> Result<u64> {
    tensor_bytes(&safetensors_files(dir, stem)?, prefixes, dtype)
}

/// Standard normal noise from `rng` (Box-Muller), F32.
fn gaussian(rng: &mut rand::rngs::StdRng, shape: (usize, usize, usize, usize), device: &Device) -> Result<Tensor> {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let mut values = Vec::with_capacity(n + 1);
    while values.len() < n {
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        values.push((r * theta.cos()) as f32);
        values.push((r * theta.sin()) as f32);
    }
    values.truncate(n);
    Ok(Tensor::from_vec(values, shape, device)?)
}

