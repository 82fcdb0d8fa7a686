//! The training noise schedule as torch computes it, and inference timesteps as numpy spaces
//! them, operation for operation: timesteps match diffusers exactly, betas and alpha products
//! bit for bit (but after zero-SNR rescaling, which goes through torch's square roots).

use anyhow::{ensure, Result};

use super::config::{BetaSchedule, SchedulerConfig, TimestepSpacing};

/// The cumulative products of `1 - beta` over the training steps, in f32 as diffusers holds
/// them; with `rescale_zero_snr`, of the betas rescaled to a zero terminal SNR.
pub(super) fn alphas_cumprod(config: &SchedulerConfig, rescale_zero_snr: bool) -> Result<Vec<f32>> {
    let train = config.num_train_timesteps;
    let mut betas = match &config.trained_betas {
        Some(betas) => {
            ensure!(betas.len() == train, "{} trained_betas for num_train_timesteps {train}", betas.len());
            betas.iter().map(|&b| b as f32).collect()
        }
        None => match config.beta_schedule {
            BetaSchedule::Linear => torch_linspace(config.beta_start, config.beta_end, train),
            BetaSchedule::ScaledLinear => torch_linspace(config.beta_start.sqrt(), config.beta_end.sqrt(), train)
                .into_iter()
                .map(|b| b * b)
                .collect(),
            BetaSchedule::SquaredcosCapV2 => cosine_betas(train),
        },
    };
    ensure!(!betas.is_empty(), "num_train_timesteps is 0");
    if rescale_zero_snr {
        betas = rescale_zero_terminal_snr(&betas);
    }
    Ok(cumprod(betas.iter().map(|&b| 1.0 - b)))
}

/// `torch.linspace(start, end, n, dtype=float32)` on the CPU: f32 bounds and step, the first
/// half counted up from `start` and the second down from `end`, each with one fused
/// multiply-add.
fn torch_linspace(start: f64, end: f64, n: usize) -> Vec<f32> {
    let (start, end) = (start as f32, end as f32);
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| if i < half { step.mul_add(i as f32, start) } else { (-step).mul_add((n - 1 - i) as f32, end) })
        .collect()
}

/// `torch.cumprod` of f32 values on the CPU, which accumulates in f64.
fn cumprod(values: impl Iterator<Item = f32>) -> Vec<f32> {
    let mut product = 1.0f64;
    values
        .map(|v| {
            product *= v as f64;
            product as f32
        })
        .collect()
}

/// diffusers' `betas_for_alpha_bar` (cosine): computed in f64, held in f32.
fn cosine_betas(train: usize) -> Vec<f32> {
    let alpha_bar = |t: f64| ((t + 0.008) / 1.008 * std::f64::consts::PI / 2.0).cos().powi(2);
    (0..train)
        .map(|i| {
            let (t1, t2) = (i as f64 / train as f64, (i + 1) as f64 / train as f64);
            (1.0 - alpha_bar(t2) / alpha_bar(t1)).min(0.999) as f32
        })
        .collect()
}

/// diffusers' `rescale_zero_terminal_snr` (algorithm 1 of "Common Diffusion Noise Schedules and
/// Sample Steps are Flawed"), in its f32 steps.
fn rescale_zero_terminal_snr(betas: &[f32]) -> Vec<f32> {
    let mut root: Vec<f32> = cumprod(betas.iter().map(|&b| 1.0 - b)).into_iter().map(f32::sqrt).collect();
    let (first, last) = (root[0], root[root.len() - 1]);
    let scale = first / (first - last);
    for r in &mut root {
        *r = (*r - last) * scale;
    }
    let bar: Vec<f32> = root.iter().map(|r| r * r).collect();
    let alphas = std::iter::once(bar[0]).chain(bar.windows(2).map(|w| w[1] / w[0]));
    alphas.map(|a| 1.0 - a).collect()
}

/// `sqrt((1 - a) / a)` of each alpha product, in f32: the training schedule's sigmas.
pub(super) fn train_sigmas(alphas_cumprod: &[f32]) -> Vec<f32> {
    alphas_cumprod.iter().map(|&a| ((1.0 - a) / a).sqrt()).collect()
}

/// The inference timesteps, largest first, as numpy computes them in f64 before each class
/// casts them; `round_linspace` rounds `linspace` ones half to even as DDIM and PNDM do.
pub(super) fn spaced_timesteps(
    spacing: TimestepSpacing,
    train: usize,
    steps: usize,
    steps_offset: usize,
    round_linspace: bool,
) -> Vec<f64> {
    match spacing {
        TimestepSpacing::Linspace => {
            let t = numpy_linspace(0.0, (train - 1) as f64, steps);
            t.into_iter().rev().map(|t| if round_linspace { t.round_ties_even() } else { t }).collect()
        }
        TimestepSpacing::Leading => {
            let ratio = train / steps;
            (0..steps).rev().map(|i| (i * ratio + steps_offset) as f64).collect()
        }
        TimestepSpacing::Trailing => {
            let ratio = train as f64 / steps as f64;
            numpy_arange(train as f64, 0.0, -ratio).into_iter().map(|t| t.round_ties_even() - 1.0).collect()
        }
    }
}

/// `np.linspace(start, stop, n)`: `i * step + start`, the last exactly `stop`.
fn numpy_linspace(start: f64, stop: f64, n: usize) -> Vec<f64> {
    if n == 1 {
        return vec![start];
    }
    let step = (stop - start) / (n - 1) as f64;
    let mut values: Vec<f64> = (0..n).map(|i| i as f64 * step + start).collect();
    values[n - 1] = stop;
    values
}

/// `np.arange(start, stop, step)` for floats: `ceil((stop - start) / step)` values
/// `start + i * delta`, `delta` being `(start + step) - start`. The length can be one more than
/// the step count it was meant for (and its last value round to 0).
fn numpy_arange(start: f64, stop: f64, step: f64) -> Vec<f64> {
    let len = ((stop - start) / step).ceil();
    if len.is_nan() || len <= 0.0 {
        return Vec::new();
    }
    let delta = (start + step) - start;
    (0..len as usize).map(|i| if i == 0 { start } else if i == 1 { start + step } else { start + i as f64 * delta }).collect()
}

/// `np.interp(x, arange(len(fp)), fp)`: the training sigmas read at a (possibly fractional)
/// timestep, in f64; clamped to the ends.
pub(super) fn numpy_interp(x: f64, fp: &[f32]) -> f64 {
    let last = fp.len() - 1;
    if x.is_nan() {
        return f64::NAN;
    }
    if x <= 0.0 {
        return fp[0] as f64;
    }
    if x >= last as f64 {
        return fp[last] as f64;
    }
    let j = x.floor() as usize;
    let (y0, y1) = (fp[j] as f64, fp[j + 1] as f64);
    if j as f64 == x {
        return y0;
    }
    let slope = (y1 - y0) / ((j + 1) as f64 - j as f64);
    slope * (x - j as f64) + y0
}

/// `alphas_cumprod[t]` with Python's indexing: a negative `t` counts from the end, which
/// diffusers reaches when a trailing spacing ends at timestep -1.
pub(super) fn alpha_at(alphas_cumprod: &[f32], t: i64) -> Result<f32> {
    let len = alphas_cumprod.len() as i64;
    ensure!((-len..len).contains(&t), "timestep {t} is outside the {len}-step training schedule");
    Ok(alphas_cumprod[t.rem_euclid(len) as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_spacing_keeps_numpys_extra_step() {
        let t = spaced_timesteps(TimestepSpacing::Trailing, 1000, 61, 0, true);
        assert_eq!(t.len(), 62);
        assert_eq!(t[0], 999.0);
        assert_eq!(t[61], -1.0);
    }

    #[test]
    fn linspace_of_one_step_is_timestep_zero() {
        assert_eq!(spaced_timesteps(TimestepSpacing::Linspace, 1000, 1, 0, false), vec![0.0]);
    }

    #[test]
    fn negative_timesteps_index_from_the_end() {
        let a = [0.9, 0.5, 0.1];
        assert_eq!(alpha_at(&a, -1).unwrap(), 0.1);
        assert!(alpha_at(&a, 3).is_err());
    }
}
