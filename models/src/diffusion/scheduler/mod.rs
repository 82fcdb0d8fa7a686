//! Diffusion schedulers, computing what diffusers computes from `scheduler_config.json`.
//!
//! [`SchedulerConfig`] reads the file; [`build`] makes the scheduler a request names (the
//! model's own, or another: diffusers' `XScheduler.from_config(pipe.scheduler.config)`) for a
//! step count. The loop is diffusers' pipeline loop:
//!
//! ```ignore
//! let mut s = scheduler::build(&config, kind, steps)?;
//! let mut latents = (noise * s.init_noise_sigma())?;
//! for (i, &t) in s.timesteps().to_vec().iter().enumerate() {
//!     let prediction = unet(&s.scale_model_input(&latents, i)?, t)?;
//!     let noise = s.needs_noise().then(|| fresh_gaussian_like(&latents));
//!     latents = s.step(&prediction, i, &latents, noise.as_ref())?;
//! }
//! ```
//!
//! The noise schedule is computed as torch computes it (f32 betas from a fused linspace, a
//! cumulative product accumulated in f64) and the timestep spacings as numpy computes them, so
//! timesteps match diffusers exactly and sigmas to an f32 ulp or two (torch's own f32 square
//! roots are not all correctly rounded); each step does diffusers' f32 operations in its order.
//! `models/tests/diffusion_schedulers.rs` checks all of it against
//! `scripts/peers/diffusers_schedulers.py`.

mod config;
mod ddim;
mod euler;
mod euler_ancestral;
mod pndm;
mod schedule;

use anyhow::{ensure, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

pub use config::{BetaSchedule, FinalSigmasType, InterpolationType, PredictionType, SchedulerConfig, TimestepSpacing, TimestepType};

/// A scheduler a request may name (`ddim`, `euler`, `euler_a`, `pndm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerKind {
    /// `DDIMScheduler` (eta 0: deterministic).
    Ddim,
    /// `EulerDiscreteScheduler`.
    Euler,
    /// `EulerAncestralDiscreteScheduler` (adds noise each step).
    #[serde(rename = "euler_a")]
    EulerAncestral,
    /// `PNDMScheduler`: PLMS steps when `skip_prk_steps` (SD 1.5's config), else 12 Runge-Kutta
    /// steps first.
    Pndm,
}

impl SchedulerKind {
    /// The diffusers class this kind computes.
    pub fn class_name(self) -> &'static str {
        match self {
            Self::Ddim => "DDIMScheduler",
            Self::Euler => "EulerDiscreteScheduler",
            Self::EulerAncestral => "EulerAncestralDiscreteScheduler",
            Self::Pndm => "PNDMScheduler",
        }
    }
}

/// A scheduler set up for one step count, as diffusers' after `set_timesteps(steps)`.
///
/// Tensors are F32 with the batch first, on any device; each step's coefficients are the same
/// for every row. Call `scale_model_input` and `step` once per entry of `timesteps()`, in order.
pub trait Scheduler: Send + std::fmt::Debug {
    /// The UNet's timestep input at each step: diffusers' `scheduler.timesteps` (whole numbers
    /// for DDIM and PNDM; f32 values for Euler). Its length is the number of steps to run, which
    /// is not always the step count asked for: PNDM's PLMS runs one more from 2 steps (diffusers
    /// repeats a timestep), its Runge-Kutta start nine more, and a trailing spacing adds one at some counts
    /// (61 of 1000, for example) because numpy's `arange` does.
    fn timesteps(&self) -> &[f64];

    /// Diffusers' `scheduler.sigmas` (one more than the timesteps, ending at the final sigma),
    /// for the schedulers that have them (Euler, Euler ancestral).
    fn sigmas(&self) -> Option<&[f64]> {
        None
    }

    /// What the initial Gaussian noise is multiplied by: 1 for DDIM and PNDM; for Euler the
    /// largest sigma (`linspace` and `trailing` spacings) or `sqrt(sigma_max^2 + 1)`
    /// (`leading`).
    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    /// The UNet's input at step `step` (Euler divides by `sqrt(sigma^2 + 1)`; the others return
    /// the sample).
    fn scale_model_input(&self, sample: &Tensor, _step: usize) -> Result<Tensor> {
        Ok(sample.clone())
    }

    /// Whether `step` needs fresh standard Gaussian noise (Euler ancestral: at every step, the
    /// last included, as diffusers draws it).
    fn needs_noise(&self) -> bool {
        false
    }

    /// The sample one step less noisy (diffusers' `step(...).prev_sample`), from the UNet's
    /// output at step `step` (after guidance) and the sample it was given. `noise` (the shape of
    /// `sample`) is required when `needs_noise`, and ignored otherwise.
    fn step(&mut self, model_output: &Tensor, step: usize, sample: &Tensor, noise: Option<&Tensor>) -> Result<Tensor>;
}

/// The scheduler `kind` as diffusers builds it from `config` (fields the file sets are used,
/// the others take `kind`'s defaults), set up for `steps` denoising steps.
///
/// Errors when `steps` is 0 or above `num_train_timesteps`, and for settings tern does not
/// compute (Karras, exponential or beta sigmas, `log_linear` interpolation, dynamic
/// thresholding), as for those diffusers itself refuses (Euler ancestral predicting `sample`,
/// PNDM predicting `sample`, PNDM's Runge-Kutta start with fewer than 4 steps, timesteps past the
/// schedule).
pub fn build(config: &SchedulerConfig, kind: SchedulerKind, steps: usize) -> Result<Box<dyn Scheduler>> {
    let train = config.num_train_timesteps;
    ensure!(
        (1..=train).contains(&steps),
        "{steps} denoising steps: {} takes 1 to num_train_timesteps ({train})",
        kind.class_name()
    );
    Ok(match kind {
        SchedulerKind::Ddim => Box::new(ddim::Ddim::new(config, steps)?),
        SchedulerKind::Euler => Box::new(euler::Euler::new(config, steps)?),
        SchedulerKind::EulerAncestral => Box::new(euler_ancestral::EulerAncestral::new(config, steps)?),
        SchedulerKind::Pndm => Box::new(pndm::Pndm::new(config, steps)?),
    })
}

/// `t * m`, as torch multiplies an f32 tensor by an f32 scalar.
fn mul(t: &Tensor, m: f32) -> Result<Tensor> {
    Ok(t.affine(m as f64, 0.0)?)
}

/// `t / d` divided element by element, as torch does: multiplying by `1 / d` rounds
/// differently, which Euler's cancellations at large sigmas magnify past 1e-4.
fn div(t: &Tensor, d: f32) -> Result<Tensor> {
    Ok(t.broadcast_div(&Tensor::new(d, t.device())?.to_dtype(t.dtype())?)?)
}

/// `step` of a scheduler that has `len` steps, checked.
fn check_step(step: usize, len: usize) -> Result<()> {
    ensure!(step < len, "step {step} of a schedule of {len} steps");
    Ok(())
}
