//! diffusers' `PNDMScheduler`: pseudo numerical methods (PNDM, arXiv 2202.09778). With
//! `skip_prk_steps` (SD 1.5's config) only linear multi-step (PLMS) steps, the second repeating
//! the first timestep; without, 12 Runge-Kutta (PRK) steps over the last four timesteps first.

use anyhow::{bail, ensure, Context, Result};
use candle_core::Tensor;

use super::config::{PredictionType, SchedulerConfig};
use super::schedule::{alpha_at, alphas_cumprod, spaced_timesteps};
use super::{div, mul, Scheduler, SchedulerKind};

/// Runge-Kutta steps take four model outputs each, over this many timesteps.
const PNDM_ORDER: usize = 4;

#[derive(Debug)]
pub(super) struct Pndm {
    timesteps: Vec<f64>,
    /// The leading Runge-Kutta steps of `timesteps` (0 with `skip_prk_steps`).
    prk_steps: usize,
    alphas_cumprod: Vec<f32>,
    final_alpha_cumprod: f32,
    /// `train // steps`: how far back a PLMS step goes.
    step_back: i64,
    v_prediction: bool,
    /// Steps taken: the state machine diffusers keeps (`counter`).
    counter: usize,
    /// Past model outputs (at most four are used).
    ets: Vec<Tensor>,
    /// Runge-Kutta: the weighted sum of this step's model outputs so far.
    cur_model_output: Option<Tensor>,
    /// The sample a Runge-Kutta step (or PLMS' first two) starts from.
    cur_sample: Option<Tensor>,
}

impl Pndm {
    pub(super) fn new(config: &SchedulerConfig, steps: usize) -> Result<Self> {
        let v_prediction = match config.prediction_type {
            PredictionType::Epsilon => false,
            PredictionType::VPrediction => true,
            PredictionType::Sample => bail!("PNDMScheduler takes prediction_type epsilon or v_prediction, not sample"),
        };
        // PNDM has no rescale_betas_zero_snr: diffusers drops the field for it.
        let alphas_cumprod = alphas_cumprod(config, false)?;
        let train = config.num_train_timesteps;
        let spacing = config.timestep_spacing_for(SchedulerKind::Pndm);
        let ascending: Vec<i64> = spaced_timesteps(spacing, train, steps, config.steps_offset, true)
            .into_iter()
            .rev()
            .map(|t| t as i64)
            .collect();
        let n = ascending.len();
        let (prk, plms): (Vec<i64>, Vec<i64>) = if config.skip_prk_steps {
            // The last-but-one timestep twice: PLMS' second step redoes the first from a
            // better estimate.
            let mut plms: Vec<i64> = ascending[..n - 1].to_vec();
            if n >= 2 {
                plms.push(ascending[n - 2]);
            }
            plms.push(ascending[n - 1]);
            plms.reverse();
            (Vec::new(), plms)
        } else {
            ensure!(n >= PNDM_ORDER, "PNDMScheduler without skip_prk_steps needs at least {PNDM_ORDER} steps, not {steps}");
            let half = (train / steps / 2) as i64;
            // Each of the last four timesteps and its midpoint; then every one of them twice
            // but the first and last (diffusers' `repeat` and slicing), largest first.
            let points: Vec<i64> = ascending[n - PNDM_ORDER..].iter().flat_map(|&t| [t, t + half]).collect();
            let repeated: Vec<i64> = points[..points.len() - 1].iter().flat_map(|&t| [t, t]).collect();
            let mut prk = repeated[1..repeated.len() - 1].to_vec();
            prk.reverse();
            (prk, ascending[..n - 3].iter().rev().copied().collect())
        };
        for &t in prk.iter().chain(&plms) {
            alpha_at(&alphas_cumprod, t)?;
        }
        let final_alpha_cumprod = if config.set_alpha_to_one_for(SchedulerKind::Pndm) { 1.0 } else { alphas_cumprod[0] };
        Ok(Self {
            prk_steps: prk.len(),
            timesteps: prk.into_iter().chain(plms).map(|t| t as f64).collect(),
            alphas_cumprod,
            final_alpha_cumprod,
            step_back: (train / steps) as i64,
            v_prediction,
            counter: 0,
            ets: Vec::new(),
            cur_model_output: None,
            cur_sample: None,
        })
    }

    fn step_prk(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor> {
        let c = self.counter;
        let half = self.step_back / 2;
        let prev_t = self.timesteps[c] as i64 - if c % 2 == 1 { 0 } else { half };
        // Every step of a Runge-Kutta group starts from its first timestep.
        let t = self.timesteps[c / 4 * 4] as i64;
        let model_output = match c % 4 {
            0 => {
                self.cur_model_output = Some(mul(model_output, 1.0 / 6.0)?);
                self.ets.push(model_output.clone());
                self.cur_sample = Some(sample.clone());
                model_output.clone()
            }
            1 | 2 => {
                let sum = self.cur_model_output.take().context("PNDM's Runge-Kutta sum is missing")?;
                self.cur_model_output = Some((sum + mul(model_output, 1.0 / 3.0)?)?);
                model_output.clone()
            }
            _ => {
                let sum = self.cur_model_output.take().context("PNDM's Runge-Kutta sum is missing")?;
                (sum + mul(model_output, 1.0 / 6.0)?)?
            }
        };
        let start = self.cur_sample.clone().unwrap_or_else(|| sample.clone());
        self.prev_sample(&start, t, prev_t, &model_output)
    }

    fn step_plms(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor> {
        let mut t = self.timesteps[self.counter] as i64;
        let mut prev_t = t - self.step_back;
        if self.counter != 1 {
            let keep = self.ets.len().saturating_sub(3);
            self.ets.drain(..keep);
            self.ets.push(model_output.clone());
        } else {
            // The repeated timestep: redo the first step with the average of both outputs.
            prev_t = t;
            t += self.step_back;
        }
        let e = &self.ets;
        let k = e.len();
        let (model_output, sample) = if k == 1 && self.counter == 0 {
            self.cur_sample = Some(sample.clone());
            (model_output.clone(), sample.clone())
        } else if k == 1 && self.counter == 1 {
            let first = self.cur_sample.take().context("PLMS' first sample is missing")?;
            (div(&(model_output + &e[0])?, 2.0)?, first)
        } else if k == 2 {
            (div(&(mul(&e[1], 3.0)? - &e[0])?, 2.0)?, sample.clone())
        } else if k == 3 {
            let sum = ((mul(&e[2], 23.0)? - mul(&e[1], 16.0)?)? + mul(&e[0], 5.0)?)?;
            (div(&sum, 12.0)?, sample.clone())
        } else {
            let sum = (((mul(&e[3], 55.0)? - mul(&e[2], 59.0)?)? + mul(&e[1], 37.0)?)? - mul(&e[0], 9.0)?)?;
            (mul(&sum, 1.0 / 24.0)?, sample.clone())
        };
        self.prev_sample(&sample, t, prev_t, &model_output)
    }

    /// Formula (9) of the PNDM paper: the sample at `prev_t` from the one at `t`.
    fn prev_sample(&self, sample: &Tensor, t: i64, prev_t: i64, model_output: &Tensor) -> Result<Tensor> {
        let alpha = alpha_at(&self.alphas_cumprod, t)?;
        let alpha_prev = if prev_t >= 0 { alpha_at(&self.alphas_cumprod, prev_t)? } else { self.final_alpha_cumprod };
        let (beta, beta_prev) = (1.0 - alpha, 1.0 - alpha_prev);
        let model_output = if self.v_prediction {
            (mul(model_output, alpha.sqrt())? + mul(sample, beta.sqrt())?)?
        } else {
            model_output.clone()
        };
        let sample_coeff = (alpha_prev / alpha).sqrt();
        let denom = alpha * beta_prev.sqrt() + (alpha * beta * alpha_prev).sqrt();
        Ok((mul(sample, sample_coeff)? - div(&mul(&model_output, alpha_prev - alpha)?, denom)?)?)
    }
}

impl Scheduler for Pndm {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn step(&mut self, model_output: &Tensor, step: usize, sample: &Tensor, _noise: Option<&Tensor>) -> Result<Tensor> {
        ensure!(
            step == self.counter && step < self.timesteps.len(),
            "PNDM steps run in order, once each: step {step} asked after {} of {}",
            self.counter,
            self.timesteps.len()
        );
        let prev = if self.counter < self.prk_steps {
            self.step_prk(model_output, sample)?
        } else {
            self.step_plms(model_output, sample)?
        };
        self.counter += 1;
        Ok(prev)
    }
}
