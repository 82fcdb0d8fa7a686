//! diffusers' `DDIMScheduler` with eta 0 (its pipelines' default): deterministic.

use anyhow::{ensure, Result};
use candle_core::Tensor;

use super::config::{PredictionType, SchedulerConfig};
use super::schedule::{alpha_at, alphas_cumprod, spaced_timesteps};
use super::{check_step, div, mul, Scheduler, SchedulerKind};

#[derive(Debug)]
pub(super) struct Ddim {
    timesteps: Vec<f64>,
    alphas_cumprod: Vec<f32>,
    /// The alpha product past the last step (`set_alpha_to_one`).
    final_alpha_cumprod: f32,
    /// diffusers steps back `train // steps` whatever the spacing (so a trailing schedule's
    /// steps do not always land on the next timestep).
    step_back: i64,
    prediction: PredictionType,
    clip: Option<f32>,
}

impl Ddim {
    pub(super) fn new(config: &SchedulerConfig, steps: usize) -> Result<Self> {
        ensure!(!config.thresholding, "DDIMScheduler's dynamic thresholding is not supported");
        let alphas_cumprod = alphas_cumprod(config, config.rescale_betas_zero_snr)?;
        let train = config.num_train_timesteps;
        let spacing = config.timestep_spacing_for(SchedulerKind::Ddim);
        let timesteps = spaced_timesteps(spacing, train, steps, config.steps_offset, true);
        for &t in &timesteps {
            alpha_at(&alphas_cumprod, t as i64)?;
        }
        let final_alpha_cumprod = if config.set_alpha_to_one_for(SchedulerKind::Ddim) { 1.0 } else { alphas_cumprod[0] };
        Ok(Self {
            timesteps,
            alphas_cumprod,
            final_alpha_cumprod,
            step_back: (train / steps) as i64,
            prediction: config.prediction_type,
            clip: config.clip_sample.then_some(config.clip_sample_range as f32),
        })
    }
}

impl Scheduler for Ddim {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn step(&mut self, model_output: &Tensor, step: usize, sample: &Tensor, _noise: Option<&Tensor>) -> Result<Tensor> {
        check_step(step, self.timesteps.len())?;
        let t = self.timesteps[step] as i64;
        let prev_t = t - self.step_back;
        let alpha = alpha_at(&self.alphas_cumprod, t)?;
        let alpha_prev = if prev_t >= 0 { alpha_at(&self.alphas_cumprod, prev_t)? } else { self.final_alpha_cumprod };
        let beta = 1.0 - alpha;
        let (sqrt_alpha, sqrt_beta) = (alpha.sqrt(), beta.sqrt());
        let (original, epsilon) = match self.prediction {
            PredictionType::Epsilon => (div(&(sample - mul(model_output, sqrt_beta)?)?, sqrt_alpha)?, model_output.clone()),
            PredictionType::Sample => {
                let original = model_output.clone();
                let epsilon = div(&(sample - mul(&original, sqrt_alpha)?)?, sqrt_beta)?;
                (original, epsilon)
            }
            PredictionType::VPrediction => (
                (mul(sample, sqrt_alpha)? - mul(model_output, sqrt_beta)?)?,
                (mul(model_output, sqrt_alpha)? + mul(sample, sqrt_beta)?)?,
            ),
        };
        let original = match self.clip {
            Some(range) => original.clamp(-range, range)?,
            None => original,
        };
        // With eta 0 the noise term and its share of the direction vanish.
        let direction = mul(&epsilon, (1.0 - alpha_prev).sqrt())?;
        Ok((mul(&original, alpha_prev.sqrt())? + direction)?)
    }
}
