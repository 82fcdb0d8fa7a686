//! Stable Diffusion as a [`Family`]: diffusers folders, costed in UNet rows: an image is one row
//! (two under classifier-free guidance) times its pixels' share of the model's native size,
//! rounded up.

use std::any::Any;
use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Result};
use candle_core::DType;

use super::pipeline::{component_bytes, BatchShape, Noise, Sample, StableDiffusion};
use super::{Canceled, GeneratedImage, ImageOutput, ImageRequest, MemoryPolicy, MemoryState, SchedulerKind};
use crate::precision::Precision;
use crate::family::{downcast_all, is_out_of_memory, BatchRun, BudgetRule, Family, FamilyModel, LoadSettings, Setting, Work, WorkError};

/// An image request, with its progress callback and its reply.
pub struct ImageWork {
    pub request: ImageRequest,
    /// After each denoising step of the batch: (steps done, steps in all); false stops the
    /// request (its reply is then an error with code `canceled`).
    pub on_step: Box<dyn FnMut(usize, usize) -> bool + Send>,
    /// The images or why not, and the model that served them.
    pub reply: Box<dyn FnOnce(Result<ImageOutput, WorkError>, &str) + Send>,
}

/// diffusers' pipeline defaults.
pub const DEFAULT_STEPS: usize = 50;
pub const DEFAULT_GUIDANCE: f64 = 7.5;
/// Most images one request may ask for.
pub const MAX_IMAGES: usize = 8;

pub struct DiffusionFamily;
pub static FAMILY: DiffusionFamily = DiffusionFamily;

/// The files of a diffusers repository a hub model downloads (fp32 weights; fp16 variants are
/// read as well when a folder has only those).
const HUB_FILES: &[&str] = &[
    "model_index.json",
    "scheduler/scheduler_config.json",
    "tokenizer/vocab.json",
    "tokenizer/merges.txt",
    "tokenizer/tokenizer_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
];

/// SDXL's second tokenizer and encoder.
const HUB_FILES_XL: &[&str] =
    &["tokenizer_2/vocab.json", "tokenizer_2/merges.txt", "tokenizer_2/tokenizer_config.json", "text_encoder_2/config.json", "text_encoder_2/model.safetensors"];

impl Family for DiffusionFamily {
    fn name(&self) -> &'static str {
        "diffusion"
    }

    fn kinds(&self) -> &'static [&'static str] {
        &["image"]
    }

    fn unit(&self) -> &'static str {
        "rows"
    }

    fn model_setting(&self) -> Setting {
        Setting {
            flag: "image-model",
            env: "TERN_IMAGE_MODEL",
            default: Some("sd-turbo"),
            help: "Stable Diffusion pipeline for `image` jobs: a diffusers folder (`model_index.json`, `unet/`, `vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`) under the models directory, or a hub id (`hf:stabilityai/sd-turbo`)",
        }
    }

    fn budget_setting(&self) -> Setting {
        Setting {
            flag: "image-batch-rows",
            env: "TERN_IMAGE_BATCH_ROWS",
            default: None,
            help: "Most UNet rows in one batch of image jobs (an image is one row, two under guidance, times its pixels' share of the model's native size). Default: calibrated from the memory free and the memory per row measured at warmup, at most 4 on the CPU and 64 on a GPU",
        }
    }

    fn load_settings(&self) -> &'static [Setting] {
        &[
            Setting {
                flag: "image-memory",
                env: "TERN_IMAGE_MEMORY",
                default: Some("auto"),
                help: "Where the image model's text encoders and VAE decoder wait between their steps: `auto` keeps them on the device beside the UNet while the memory free holds a batch, else in host memory, moved to the device for their step; `resident` or `offloaded` fix it",
            },
            Setting {
                flag: "vae-tiling",
                env: "TERN_VAE_TILING",
                default: Some("auto"),
                help: "`auto` decodes an image whole where its working memory fits and in diffusers' overlapping tiles where it does not; `always` tiles every decode (less memory; tiles blend at their seams, so pixels differ slightly from a whole decode)",
            },
        ]
    }

    /// A diffusers repository (`hf:stabilityai/sd-turbo`); a repository whose name says `xl`
    /// also gets the second text encoder.
    fn hub_files(&self, repo: &str, _file: Option<&str>) -> Result<Vec<(String, &'static str)>> {
        let mut files: Vec<&'static str> = HUB_FILES.to_vec();
        if repo.to_ascii_lowercase().contains("xl") {
            files.extend(HUB_FILES_XL);
        }
        Ok(files.into_iter().map(|f| (f.to_string(), f)).collect())
    }

    fn estimate_bytes(&self, dir: &Path, settings: &LoadSettings) -> Result<u64> {
        let dtype = dtype(settings);
        let mut bytes = 0;
        for (folder, stem, prefixes) in [
            ("unet", "diffusion_pytorch_model", &[][..]),
            ("vae", "diffusion_pytorch_model", super::vae::DECODER_PREFIXES),
            ("text_encoder", "model", &[]),
            ("text_encoder_2", "model", &[]),
        ] {
            if !dir.join(folder).is_dir() {
                continue;
            }
            bytes += component_bytes(&dir.join(folder), stem, prefixes, dtype)?;
        }
        Ok(bytes)
    }

    fn load(&self, dir: &Path, settings: &LoadSettings) -> Result<Box<dyn FamilyModel>> {
        let policy = MemoryPolicy::from_env()?;
        let mut model = StableDiffusion::load(dir, &settings.device, dtype(settings))?;
        model.tile_vae = match std::env::var("TERN_VAE_TILING").as_deref() {
            Err(_) | Ok("" | "auto") => false,
            Ok("always") => true,
            Ok(other) => anyhow::bail!("TERN_VAE_TILING must be auto or always, not {other:?}"),
        };
        model.memory_policy = policy;
        if let MemoryPolicy::Fixed(state) = policy {
            model.set_memory_state(state)?;
        }
        Ok(Box::new(model))
    }

    /// Calibrated: the warmup measures a guided native-size image (two rows); the budget is
    /// what the memory free holds, up to 4 rows on the CPU (measured: SD-Turbo at 512x512 takes
    /// 11.3 s an image at 4 rows and 18.8 s at 8 on 2 cores, diffusers 12.1 and 14.0) and 64 on
    /// a GPU.
    fn budget(&self) -> BudgetRule {
        BudgetRule { initial: 2, calibrated: true, cpu_ceiling: 4, device_ceiling: 64 }
    }

    fn refuse(&self, work: Work, error: WorkError, model: &str) {
        if let Ok(w) = work.downcast::<ImageWork>() {
            (w.reply)(Err(error), model);
        }
    }
}

/// F32 by default on every device, as diffusers computes unless given a `torch_dtype`;
/// `TERN_PRECISION=f16` (or `bf16`) chooses half precision, an option whose accuracy cost is not
/// measured yet.
fn dtype(settings: &LoadSettings) -> DType {
    match settings.precision {
        Precision::Auto => DType::F32,
        p => p.dtype(&settings.device),
    }
}

/// A request resolved against the model: what its batch must share, and its cost in rows.
struct Resolved {
    shape: BatchShape,
    n: usize,
    seed: u64,
    guidance: f64,
    cost: usize,
}

impl StableDiffusion {
    fn resolve(&self, r: &ImageRequest) -> Result<Resolved, WorkError> {
        let reject = |message: String| WorkError::Rejected { code: "invalid_input", message };
        let native = self.native_size();
        let (width, height) = (r.width.unwrap_or(native), r.height.unwrap_or(native));
        let scale = self.vae_config.scale;
        if width % scale != 0 || height % scale != 0 || width == 0 || height == 0 {
            return Err(reject(format!("width and height must be positive multiples of {scale}, not {width}x{height}")));
        }
        let steps = r.steps.unwrap_or(DEFAULT_STEPS);
        if steps == 0 {
            return Err(reject("steps must be at least 1".into()));
        }
        let n = r.n.unwrap_or(1);
        if n == 0 || n > MAX_IMAGES {
            return Err(reject(format!("n must be 1 to {MAX_IMAGES}, not {n}")));
        }
        let scheduler = match r.scheduler {
            Some(s) => s,
            None => self.default_scheduler().map_err(|e| WorkError::inference(format!("{e:#}")))?,
        };
        let guidance = r.guidance.unwrap_or(DEFAULT_GUIDANCE);
        let guided = guidance > 1.0;
        let native_pixels = native * native;
        let share = (width * height).div_ceil(native_pixels).max(1);
        let seed = r.seed.unwrap_or_else(|| rand::random::<u32>() as u64);
        Ok(Resolved { shape: BatchShape { width, height, steps, scheduler, guided }, n, seed, guidance, cost: n * share * if guided { 2 } else { 1 } })
    }
}

impl FamilyModel for StableDiffusion {
    fn resident_bytes(&self) -> u64 {
        StableDiffusion::resident_bytes(self)
    }

    /// One guided image at the native size, one step: two UNet rows, whose working memory the
    /// worker measures (the decode's is smaller per image at that size).
    fn warm_up(&mut self, _settings: &LoadSettings) -> Result<u64> {
        let size = self.native_size();
        let shape = BatchShape { width: size, height: size, steps: 1, scheduler: SchedulerKind::Euler, guided: true };
        let sample = Sample { prompt: "tern warmup".into(), negative_prompt: None, guidance: DEFAULT_GUIDANCE, noise: Noise::Seed(0) };
        self.generate(shape, &[sample], &mut |_, _| true)?;
        Ok(2)
    }

    /// A known prompt and seed must make an image, and two runs of it the same image.
    fn check_health(&mut self) -> Result<()> {
        let shape = BatchShape { width: 64, height: 64, steps: 2, scheduler: SchedulerKind::Euler, guided: true };
        let sample = Sample { prompt: "a lighthouse at dusk".into(), negative_prompt: None, guidance: DEFAULT_GUIDANCE, noise: Noise::Seed(7) };
        let (a, _) = self.generate(shape, std::slice::from_ref(&sample), &mut |_, _| true)?;
        let (b, _) = self.generate(shape, &[sample], &mut |_, _| true)?;
        ensure!(a == b, "the same prompt and seed made two different images");
        let spread = a[0].iter().max().copied().unwrap_or(0) - a[0].iter().min().copied().unwrap_or(0);
        ensure!(spread > 0, "the image is one flat colour");
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    /// Requests of the first request's shape (size, steps, scheduler, guided or not) run
    /// together while their rows fit the budget (the first always runs); the rest return to run
    /// next. A batch that runs out of memory runs again in halves: no request fails for it.
    fn run(&mut self, work: Vec<Work>, batch: &mut dyn BatchRun) -> Vec<Work> {
        let name = batch.model_name().to_string();
        let started = Instant::now();
        let mut leftovers = Vec::new();
        let mut taken: Vec<(ImageWork, Resolved)> = Vec::new();
        let mut rows = 0;
        let budget = batch.units().max(1);
        for w in downcast_all::<ImageWork>(work) {
            let resolved = match self.resolve(&w.request) {
                Ok(r) => r,
                Err(e) => {
                    (w.reply)(Err(e), &name);
                    continue;
                }
            };
            let same_shape = taken.first().is_none_or(|(_, first)| first.shape == resolved.shape);
            if !taken.is_empty() && (!same_shape || rows + resolved.cost > budget) {
                leftovers.push(Box::new(w) as Work);
                continue;
            }
            rows += resolved.cost;
            taken.push((w, resolved));
        }
        if taken.is_empty() {
            return leftovers;
        }
        let shape = taken[0].1.shape;
        let rows_per_image = rows / taken.iter().map(|(_, r)| r.n).sum::<usize>().max(1);
        // Every image of every request, in order.
        let samples: Vec<(usize, Sample)> = taken
            .iter()
            .enumerate()
            .flat_map(|(owner, (w, r))| {
                (0..r.n).map(move |i| {
                    (owner, Sample { prompt: w.request.prompt.clone(), negative_prompt: Some(w.request.negative_prompt.clone()).filter(|n| !n.is_empty()), guidance: r.guidance, noise: Noise::Seed(r.seed + i as u64) })
                })
            })
            .collect();
        // The encoders and the VAE wait in host memory while the memory free cannot hold the
        // batch's working memory (their bytes then make room), as the policy decides.
        let before = self.memory_state();
        let state = self.memory_policy.choose(before, batch.free_bytes(), rows as u64 * batch.unit_bytes(), self.offloadable_bytes());
        let mut failure: Option<WorkError> = None;
        if state != before {
            tracing::info!(from = ?before, to = ?state, offloadable_bytes = self.offloadable_bytes(), "text encoders and VAE change memory state");
            if let Err(e) = self.set_memory_state(state) {
                failure = Some(WorkError::inference(format!("moving the text encoders and VAE: {e:#}")));
            }
        }
        let memory_state = self.memory_state();
        let freed = if before == MemoryState::Resident && memory_state == MemoryState::Offloaded { self.offloadable_bytes() } else { 0 };
        // Tiles where a whole decode would not fit the memory free (diffusers' tiling, as a
        // user of diffusers turns it on for large images); whole decodes otherwise.
        let forced_tiles = self.tile_vae;
        let whole_bytes = super::vae::whole_decode_bytes(&self.vae_config, shape.width * shape.height);
        self.tile_vae = forced_tiles || batch.free_bytes().is_some_and(|free| free.saturating_add(freed) < whole_bytes);
        let tiled_decode = self.tile_vae;
        if tiled_decode && !forced_tiles {
            tracing::info!(whole_bytes, "decoding in tiles: a whole decode would not fit the memory free");
        }
        let mut canceled = vec![false; taken.len()];
        let mut images: Vec<Option<Vec<u8>>> = vec![None; samples.len()];
        let mut timings = super::pipeline::Timings::default();
        // Images per chunk: all of them until a chunk runs out of memory.
        let mut chunk = samples.len();
        let mut start = 0;
        while failure.is_none() && start < samples.len() {
            let end = (start + chunk).min(samples.len());
            let part: Vec<Sample> = samples[start..end].iter().map(|(_, s)| s.clone()).collect();
            // Each request once, however many of its images the chunk holds.
            let mut owners: Vec<usize> = samples[start..end].iter().map(|(o, _)| *o).collect();
            owners.dedup();
            let fits = batch.reserve_freed(part.len() * rows_per_image, freed);
            let (chunks_left, offset) = (samples.len().div_ceil(chunk), start / chunk.max(1));
            let result = fits.and_then(|()| {
                self.generate(shape, &part, &mut |done, total| {
                    for &o in &owners {
                        if !canceled[o] && !(taken[o].0.on_step)(offset * total + done, chunks_left * total) {
                            canceled[o] = true;
                        }
                    }
                    owners.iter().any(|&o| !canceled[o])
                })
            });
            match result {
                Ok((made, t)) => {
                    for (i, image) in made.into_iter().enumerate() {
                        images[start + i] = Some(image);
                    }
                    timings.encode_ms += t.encode_ms;
                    timings.denoise_ms += t.denoise_ms;
                    timings.decode_ms += t.decode_ms;
                    start = end;
                }
                Err(e) if e.downcast_ref::<Canceled>().is_some() => start = end,
                Err(e) if is_out_of_memory(&e) && part.len() > 1 => {
                    chunk = part.len() / 2;
                    batch.split((chunk * rows_per_image).max(1), &format!("{e:#}"));
                }
                Err(e) => {
                    failure = Some(if is_out_of_memory(&e) {
                        WorkError::Failed { code: "out_of_memory", message: format!("one image does not fit: {e:#}") }
                    } else {
                        WorkError::inference(format!("{e:#}"))
                    });
                    break;
                }
            }
        }
        self.tile_vae = forced_tiles;
        batch.busy(started);
        let mut next = 0;
        for (owner, (w, r)) in taken.into_iter().enumerate() {
            let mine: Vec<Option<Vec<u8>>> = images[next..next + r.n].to_vec();
            next += r.n;
            let result = if let Some(f) = &failure {
                Err(f.clone())
            } else if canceled[owner] || mine.iter().any(Option::is_none) {
                Err(WorkError::Rejected { code: "canceled", message: "stopped before its images were made".into() })
            } else {
                Ok(ImageOutput {
                    images: mine
                        .into_iter()
                        .enumerate()
                        .map(|(i, rgb)| GeneratedImage { width: r.shape.width, height: r.shape.height, seed: r.seed + i as u64, rgb: rgb.expect("checked") })
                        .collect(),
                    scheduler: r.shape.scheduler,
                    steps: r.shape.steps,
                    guidance: r.guidance,
                    tiled_decode,
                    memory_state,
                    encode_ms: timings.encode_ms,
                    denoise_ms: timings.denoise_ms,
                    decode_ms: timings.decode_ms,
                })
            };
            (w.reply)(result, &name);
        }
        tracing::info!(rows, model_ms = started.elapsed().as_millis() as u64, "image batch done");
        leftovers
    }
}
