//! diffusers' `EulerDiscreteScheduler` with its pipelines' defaults (`s_churn` 0: no noise
//! added), and the sigma schedule it shares with Euler ancestral.

use anyhow::{ensure, Result};
use candle_core::Tensor;

use super::config::{FinalSigmasType, InterpolationType, PredictionType, SchedulerConfig, TimestepSpacing, TimestepType};
use super::schedule::{alphas_cumprod, numpy_interp, spaced_timesteps, train_sigmas};
use super::{check_step, div, mul, Scheduler, SchedulerKind};

/// Timesteps and sigmas as an Euler scheduler's `set_timesteps` makes them.
#[derive(Debug)]
pub(super) struct Sigmas {
    pub(super) timesteps: Vec<f64>,
    /// One per step and the final sigma, in f32 as diffusers holds them.
    pub(super) sigmas: Vec<f32>,
    /// The same as f64, for [`Scheduler::sigmas`].
    pub(super) sigmas_f64: Vec<f64>,
    pub(super) init_noise_sigma: f64,
}

impl Sigmas {
    /// `kind`'s schedule for `steps`, read linearly off the training sigmas at its timesteps,
    /// ending at `final_sigma`.
    pub(super) fn new(config: &SchedulerConfig, kind: SchedulerKind, steps: usize, final_sigma: FinalSigmasType) -> Result<Self> {
        let mut alphas_cumprod = alphas_cumprod(config, config.rescale_betas_zero_snr)?;
        if config.rescale_betas_zero_snr {
            // As diffusers: near 0 but not 0, so that the first sigma is finite.
            let last = alphas_cumprod.len() - 1;
            alphas_cumprod[last] = 2f32.powi(-24);
        }
        let train = train_sigmas(&alphas_cumprod);
        let spacing = config.timestep_spacing_for(kind);
        let timesteps: Vec<f32> = spaced_timesteps(spacing, config.num_train_timesteps, steps, config.steps_offset, false)
            .into_iter()
            .map(|t| t as f32)
            .collect();
        let last = match final_sigma {
            FinalSigmasType::Zero => 0.0,
            FinalSigmasType::SigmaMin => train[0],
        };
        let sigmas: Vec<f32> =
            timesteps.iter().map(|&t| numpy_interp(t as f64, &train) as f32).chain(std::iter::once(last)).collect();
        let max = sigmas.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let init_noise_sigma = match spacing {
            TimestepSpacing::Linspace | TimestepSpacing::Trailing => max,
            TimestepSpacing::Leading => (max * max + 1.0).sqrt(),
        };
        Ok(Self {
            timesteps: timesteps.into_iter().map(f64::from).collect(),
            sigmas_f64: sigmas.iter().map(|&s| s as f64).collect(),
            sigmas,
            init_noise_sigma: init_noise_sigma as f64,
        })
    }

    /// `sample / sqrt(sigma^2 + 1)` at step `step`.
    pub(super) fn scale_model_input(&self, sample: &Tensor, step: usize) -> Result<Tensor> {
        check_step(step, self.timesteps.len())?;
        let sigma = self.sigmas[step];
        div(sample, (sigma * sigma + 1.0).sqrt())
    }

    /// The clean sample `model_output` implies at `sigma`: for v-prediction k-diffusion's
    /// `c_out` and `c_skip`.
    pub(super) fn original(prediction: PredictionType, model_output: &Tensor, sample: &Tensor, sigma: f32) -> Result<Tensor> {
        Ok(match prediction {
            PredictionType::Epsilon => (sample - mul(model_output, sigma)?)?,
            PredictionType::VPrediction => {
                let c_out = -sigma / (sigma * sigma + 1.0).sqrt();
                (mul(model_output, c_out)? + div(sample, sigma * sigma + 1.0)?)?
            }
            PredictionType::Sample => model_output.clone(),
        })
    }
}

#[derive(Debug)]
pub(super) struct Euler {
    sigmas: Sigmas,
    prediction: PredictionType,
}

impl Euler {
    pub(super) fn new(config: &SchedulerConfig, steps: usize) -> Result<Self> {
        ensure!(
            !config.use_karras_sigmas && !config.use_exponential_sigmas && !config.use_beta_sigmas,
            "EulerDiscreteScheduler with Karras, exponential or beta sigmas is not supported"
        );
        ensure!(
            config.interpolation_type == InterpolationType::Linear,
            "EulerDiscreteScheduler's log_linear interpolation is not supported"
        );
        let mut sigmas = Sigmas::new(config, SchedulerKind::Euler, steps, config.final_sigmas_type)?;
        if config.timestep_type == TimestepType::Continuous && config.prediction_type == PredictionType::VPrediction {
            let n = sigmas.timesteps.len();
            sigmas.timesteps = sigmas.sigmas[..n].iter().map(|s| (0.25 * s.ln()) as f64).collect();
        }
        Ok(Self { sigmas, prediction: config.prediction_type })
    }
}

impl Scheduler for Euler {
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

    fn step(&mut self, model_output: &Tensor, step: usize, sample: &Tensor, _noise: Option<&Tensor>) -> Result<Tensor> {
        check_step(step, self.sigmas.timesteps.len())?;
        // s_churn 0: sigma_hat is sigma and no noise is added.
        let sigma = self.sigmas.sigmas[step];
        let original = Sigmas::original(self.prediction, model_output, sample, sigma)?;
        // Computed as diffusers does (not simplified to the model output), to round alike.
        let derivative = div(&(sample - original)?, sigma)?;
        let dt = self.sigmas.sigmas[step + 1] - sigma;
        Ok((sample + mul(&derivative, dt)?)?)
    }
}
