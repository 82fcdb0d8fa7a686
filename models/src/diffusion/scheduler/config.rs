//! `scheduler/scheduler_config.json`, with diffusers' defaults for what it leaves out.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Deserializer, Serialize};

use super::SchedulerKind;

/// A diffusers `scheduler_config.json`: the fields the four schedulers tern computes read.
///
/// A missing field takes the default of the class that is built, not of the class the file
/// names (diffusers' `from_config` drops the values a config only holds as defaults), so the
/// fields whose defaults differ between classes are `Option`s here. Other fields are ignored,
/// as the classes that do not take them ignore them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// The diffusers class (`DDIMScheduler`, `EulerDiscreteScheduler`,
    /// `EulerAncestralDiscreteScheduler`, `PNDMScheduler`): the model's default scheduler.
    #[serde(rename = "_class_name")]
    pub class_name: Option<String>,
    /// Steps of the training schedule; 1000.
    pub num_train_timesteps: usize,
    /// First beta of the `linear` and `scaled_linear` schedules; 0.0001.
    pub beta_start: f64,
    /// Last beta of the `linear` and `scaled_linear` schedules; 0.02.
    pub beta_end: f64,
    /// How betas go from `beta_start` to `beta_end`; `linear`.
    pub beta_schedule: BetaSchedule,
    /// Betas given outright (then the schedule and its bounds are not used); none.
    pub trained_betas: Option<Vec<f64>>,
    /// What the UNet predicts; `epsilon`.
    pub prediction_type: PredictionType,
    /// How inference timesteps are spread over the training ones; `leading` for DDIM and PNDM,
    /// `linspace` for Euler and Euler ancestral.
    pub timestep_spacing: Option<TimestepSpacing>,
    /// Added to `leading` timesteps; 0 (SD 1.5, 2.1 and SDXL set 1).
    pub steps_offset: usize,
    /// DDIM and PNDM: whether the alpha product past the last step is 1 (else the first step's);
    /// true for DDIM, false for PNDM.
    pub set_alpha_to_one: Option<bool>,
    /// DDIM: clip the predicted clean sample to `clip_sample_range`; true (SD configs set
    /// false, but SD 1.5-style configs that lack the field clip when DDIM is asked for).
    pub clip_sample: bool,
    /// DDIM: the clipping bound; 1.
    pub clip_sample_range: f64,
    /// DDIM: dynamic thresholding; false (true is not computed: it is meant for pixel-space
    /// models).
    pub thresholding: bool,
    /// PNDM: PLMS steps only; false (SD 1.5's config sets true).
    pub skip_prk_steps: bool,
    /// Euler: how sigmas are read off the training schedule; `linear` (`log_linear` is not
    /// computed).
    pub interpolation_type: InterpolationType,
    /// Euler: Karras sigmas; false (true is not computed). `null` reads as false.
    #[serde(deserialize_with = "null_is_false")]
    pub use_karras_sigmas: bool,
    /// Euler: exponential sigmas; false (true is not computed).
    #[serde(deserialize_with = "null_is_false")]
    pub use_exponential_sigmas: bool,
    /// Euler: beta-distributed sigmas; false (true is not computed).
    #[serde(deserialize_with = "null_is_false")]
    pub use_beta_sigmas: bool,
    /// DDIM, Euler, Euler ancestral: rescale betas to a zero terminal SNR; false.
    pub rescale_betas_zero_snr: bool,
    /// Euler: `continuous` gives v-prediction models `0.25 * ln(sigma)` as timesteps; `discrete`.
    pub timestep_type: TimestepType,
    /// Euler: the sigma after the last step; `zero`.
    pub final_sigmas_type: FinalSigmasType,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            class_name: None,
            num_train_timesteps: 1000,
            beta_start: 0.0001,
            beta_end: 0.02,
            beta_schedule: BetaSchedule::Linear,
            trained_betas: None,
            prediction_type: PredictionType::Epsilon,
            timestep_spacing: None,
            steps_offset: 0,
            set_alpha_to_one: None,
            clip_sample: true,
            clip_sample_range: 1.0,
            thresholding: false,
            skip_prk_steps: false,
            interpolation_type: InterpolationType::Linear,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            rescale_betas_zero_snr: false,
            timestep_type: TimestepType::Discrete,
            final_sigmas_type: FinalSigmasType::Zero,
        }
    }
}

impl SchedulerConfig {
    /// Reads a `scheduler_config.json`.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// The scheduler the file names (`_class_name`); an error naming the class when tern does
    /// not compute it (a request can still name one it does: see [`super::build`]).
    pub fn kind(&self) -> Result<SchedulerKind> {
        Ok(match self.class_name.as_deref() {
            Some("DDIMScheduler") => SchedulerKind::Ddim,
            Some("EulerDiscreteScheduler") => SchedulerKind::Euler,
            Some("EulerAncestralDiscreteScheduler") => SchedulerKind::EulerAncestral,
            Some("PNDMScheduler") => SchedulerKind::Pndm,
            Some(other) => bail!(
                "scheduler {other} is not supported (DDIMScheduler, EulerDiscreteScheduler, \
                 EulerAncestralDiscreteScheduler and PNDMScheduler are); name one of ddim, euler, euler_a, pndm"
            ),
            None => bail!("the scheduler config has no _class_name"),
        })
    }

    /// The spacing `kind` uses: the file's, else `kind`'s default.
    pub fn timestep_spacing_for(&self, kind: SchedulerKind) -> TimestepSpacing {
        self.timestep_spacing.unwrap_or(match kind {
            SchedulerKind::Ddim | SchedulerKind::Pndm => TimestepSpacing::Leading,
            SchedulerKind::Euler | SchedulerKind::EulerAncestral => TimestepSpacing::Linspace,
        })
    }

    /// Whether the alpha product past the last step is 1 for `kind`: the file's, else `kind`'s
    /// default (true for DDIM, false for PNDM).
    pub fn set_alpha_to_one_for(&self, kind: SchedulerKind) -> bool {
        self.set_alpha_to_one.unwrap_or(kind == SchedulerKind::Ddim)
    }
}

fn null_is_false<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// How betas go from `beta_start` to `beta_end` over the training steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BetaSchedule {
    /// Evenly spaced.
    #[serde(rename = "linear")]
    Linear,
    /// Evenly spaced square roots, squared (Stable Diffusion's).
    #[serde(rename = "scaled_linear")]
    ScaledLinear,
    /// The Glide cosine schedule (bounds unused; betas capped at 0.999).
    #[serde(rename = "squaredcos_cap_v2")]
    SquaredcosCapV2,
}

/// What the UNet predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PredictionType {
    /// The noise (SD 1.5, SDXL, the Turbos).
    #[serde(rename = "epsilon")]
    Epsilon,
    /// The velocity `sqrt(alpha) * noise - sqrt(1 - alpha) * sample` (SD 2.1 768).
    #[serde(rename = "v_prediction")]
    VPrediction,
    /// The clean sample.
    #[serde(rename = "sample")]
    Sample,
}

/// How inference timesteps are spread over the training ones (table 2 of "Common Diffusion
/// Noise Schedules and Sample Steps are Flawed").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimestepSpacing {
    /// `train // steps` apart from 0, plus `steps_offset`.
    #[serde(rename = "leading")]
    Leading,
    /// `train / steps` apart down from the last training step (as numpy's float `arange`).
    #[serde(rename = "trailing")]
    Trailing,
    /// Evenly from the last training step to 0, both included.
    #[serde(rename = "linspace")]
    Linspace,
}

/// How Euler reads sigmas off the training schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InterpolationType {
    /// Linear in the timestep.
    #[serde(rename = "linear")]
    Linear,
    /// Log-linear between the extreme sigmas (not computed: diffusers' version returns the
    /// sigmas ascending and one too many).
    #[serde(rename = "log_linear")]
    LogLinear,
}

/// Whether Euler's timesteps are the training steps or derived from sigmas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimestepType {
    #[serde(rename = "discrete")]
    Discrete,
    /// `0.25 * ln(sigma)`, with v-prediction only (with another prediction it means discrete).
    #[serde(rename = "continuous")]
    Continuous,
}

/// The sigma Euler ends at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinalSigmasType {
    #[serde(rename = "zero")]
    Zero,
    /// The training schedule's smallest sigma.
    #[serde(rename = "sigma_min")]
    SigmaMin,
}
