//! diffusers' `EulerAncestralDiscreteScheduler`: an Euler step down to `sigma_down`, then fresh
//! noise up to the next sigma.

use anyhow::{bail, Context, Result};
use candle_core::Tensor;

use super::config::{FinalSigmasType, PredictionType, SchedulerConfig};
use super::euler::Sigmas;
use super::{check_step, mul, div, Scheduler, SchedulerKind};

#[derive(Debug)]
pub(super) struct EulerAncestral {
    sigmas: Sigmas,
    prediction: PredictionType,
}

impl EulerAncestral {
    pub(super) fn new(config: &SchedulerConfig, steps: usize) -> Result<Self> {
        if config.prediction_type == PredictionType::Sample {
            bail!("EulerAncestralDiscreteScheduler does not take prediction_type sample (diffusers does not implement it)");
        }
        // The class has no interpolation, sigma-kind or final-sigma settings: a config's are
        // ignored, as diffusers ignores them.
        let sigmas = Sigmas::new(config, SchedulerKind::EulerAncestral, steps, FinalSigmasType::Zero)?;
        Ok(Self { sigmas, prediction: config.prediction_type })
    }
}

impl Scheduler for EulerAncestral {
    fn timesteps(&self) -> &[f64] {
        &self.sigmas.timesteps
    }

    fn sigmas(&self) -> Option<&[f64]> {
        Some(&self.sigmas.sigmas_f64)
    }

    fn init_noise_sigma(&self) -> f64 {
        self.sigmas.init_noise_sigma
    }

    fn scale_model_input(&self, sample: &Tensor, step: usize) -> Result<Tensor> {
        self.sigmas.scale_model_input(sample, step)
    }

    fn needs_noise(&self) -> bool {
        true
    }

    fn step(&mut self, model_output: &Tensor, step: usize, sample: &Tensor, noise: Option<&Tensor>) -> Result<Tensor> {
        check_step(step, self.sigmas.timesteps.len())?;
        let noise = noise.context("Euler ancestral needs fresh noise at every step")?;
        let (sigma, sigma_to) = (self.sigmas.sigmas[step], self.sigmas.sigmas[step + 1]);
        // `new` refused prediction_type sample.
        let original = Sigmas::original(self.prediction, model_output, sample, sigma)?;
        let (from2, to2) = (sigma * sigma, sigma_to * sigma_to);
        let sigma_up = (to2 * (from2 - to2) / from2).sqrt();
        let sigma_down = (to2 - sigma_up * sigma_up).sqrt();
        let derivative = div(&(sample - original)?, sigma)?;
        let prev = (sample + mul(&derivative, sigma_down - sigma)?)?;
        Ok((prev + mul(noise, sigma_up)?)?)
    }
}
