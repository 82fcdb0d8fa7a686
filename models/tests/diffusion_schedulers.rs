//! tern's diffusion schedulers against diffusers': `fixtures/diffusion/schedulers.{json,safetensors}`,
//! written by `scripts/peers/diffusers_schedulers.py` (see there for the cases: SD 1.5, 2.1, SDXL
//! and SD-Turbo configs, each model's own scheduler and the others a request may name).
//!
//! Timesteps must match exactly, sigmas and `init_noise_sigma` to 1e-6 (relative; two looser
//! cases say why), and each denoising loop (fed diffusers' model outputs and noise, but its own
//! samples) to 1e-4 of the largest value at every step.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use serde::Deserialize;
use tern_models::diffusion::scheduler::{self, SchedulerConfig, SchedulerKind};

#[derive(Deserialize)]
struct Fixture {
    diffusers: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    config: serde_json::Value,
    kind: SchedulerKind,
    schedules: Vec<Schedule>,
    loops: Vec<Loop>,
}

#[derive(Deserialize)]
struct Schedule {
    steps: usize,
    timesteps: Vec<f64>,
    sigmas: Option<Vec<f64>>,
    init_noise_sigma: f64,
}

#[derive(Deserialize)]
struct Loop {
    steps: usize,
    /// Steps the loop ran (`len(scheduler.timesteps)`).
    len: usize,
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diffusion")
}

fn fixture() -> Fixture {
    let text = std::fs::read_to_string(fixtures().join("schedulers.json")).expect("schedulers.json");
    serde_json::from_str(&text).expect("parsing schedulers.json")
}

fn config(case: &Case) -> SchedulerConfig {
    serde_json::from_value(case.config.clone()).unwrap_or_else(|e| panic!("{}: config: {e}", case.name))
}

/// How far a value may be from diffusers'.
#[derive(Clone, Copy)]
enum Tolerance {
    Exact,
    Relative(f64),
    Absolute(f64),
}

/// Fixture floats are the shortest decimals of f32 values: compare as those f32s.
fn close(got: f64, want: f64, tolerance: Tolerance) -> bool {
    let (got, want) = (got as f32 as f64, want as f32 as f64);
    got == want
        || match tolerance {
            Tolerance::Exact => false,
            Tolerance::Relative(r) => (got - want).abs() <= r * want.abs(),
            Tolerance::Absolute(a) => (got - want).abs() <= a,
        }
}

/// Where `got` and `want` first differ, if they do.
fn differ(got: &[f64], want: &[f64], tolerance: Tolerance) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} values, diffusers {}", got.len(), want.len()));
    }
    let bad: Vec<usize> = (0..got.len()).filter(|&i| !close(got[i], want[i], tolerance)).collect();
    let &first = bad.first()?;
    Some(format!("{} differ, first [{first}]: {}, diffusers {}", bad.len(), got[first], want[first]))
}

#[test]
fn timesteps_sigmas_and_init_noise_sigma_match_diffusers() {
    let fixture = fixture();
    let mut failures = Vec::new();
    let mut checked = 0;
    for case in &fixture.cases {
        let config = config(case);
        for s in &case.schedules {
            let what = format!("{} ({:?}), {} steps", case.name, case.kind, s.steps);
            let sched = match scheduler::build(&config, case.kind, s.steps) {
                Ok(sched) => sched,
                Err(e) => {
                    failures.push(format!("{what}: {e:#}"));
                    continue;
                }
            };
            // Continuous timesteps are f32 logarithms of sigmas near 1 too, where torch's CPU
            // log is off by a few 1e-8 (absolute).
            let timesteps = if case.config["timestep_type"] == "continuous" { Tolerance::Absolute(1e-6) } else { Tolerance::Exact };
            // Torch's f32 square roots are not all correctly rounded (1 ulp off for a fifth of
            // values on an AVX-512 build), and rescaling to zero terminal SNR turns that ulp
            // into 1e-5 of a sigma through 1 - alpha (its own rounding noise, not a formula
            // difference); elsewhere sigmas agree to an ulp or two.
            let sigmas = Tolerance::Relative(if case.config["rescale_betas_zero_snr"] == true { 1e-5 } else { 1e-6 });
            if let Some(diff) = differ(sched.timesteps(), &s.timesteps, timesteps) {
                failures.push(format!("{what}: timesteps {diff}"));
            }
            match (sched.sigmas(), &s.sigmas) {
                (None, None) => {}
                (Some(got), Some(want)) => {
                    if let Some(diff) = differ(got, want, sigmas) {
                        failures.push(format!("{what}: sigmas {diff}"));
                    }
                }
                (got, want) => failures.push(format!("{what}: sigmas {got:?}, diffusers {want:?}")),
            }
            if !close(sched.init_noise_sigma(), s.init_noise_sigma, sigmas) {
                failures.push(format!("{what}: init_noise_sigma {}, diffusers {}", sched.init_noise_sigma(), s.init_noise_sigma));
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{} of {checked} schedules differ from diffusers {}:\n{}", failures.len(), fixture.diffusers, failures.join("\n"));
    assert!(checked > 200, "only {checked} schedules checked");
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

/// Max |got - want| over `max(1, max |want|)`.
fn relative_error(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.dims(), want.dims());
    max_abs(&(got - want).unwrap()) / max_abs(want).max(1.0)
}

#[test]
fn denoising_loops_match_diffusers() {
    let fixture = fixture();
    let device = Device::Cpu;
    let tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(fixtures().join("schedulers.safetensors"), &device).expect("schedulers.safetensors");
    let get = |key: &str| tensors.get(key).unwrap_or_else(|| panic!("{key} is not in the fixture")).clone();
    let mut failures = Vec::new();
    let mut steps_checked = 0;
    let mut worst = (0f32, String::new());
    for case in &fixture.cases {
        let config = config(case);
        for l in &case.loops {
            let prefix = format!("{}/{}", case.name, l.steps);
            let mut sched = scheduler::build(&config, case.kind, l.steps).unwrap_or_else(|e| panic!("{prefix}: {e:#}"));
            assert_eq!(sched.timesteps().len(), l.len, "{prefix}: steps to run");
            let mut latents = get(&format!("{prefix}/latents"));
            for i in 0..l.len {
                let scaled = sched.scale_model_input(&latents, i).unwrap();
                let err = relative_error(&scaled, &get(&format!("{prefix}/scaled/{i}")));
                if err > 1e-4 {
                    failures.push(format!("{prefix}: step {i}: scaled input off by {err:e}"));
                }
                let noise = sched.needs_noise().then(|| get(&format!("{prefix}/noise/{i}")));
                let model_output = get(&format!("{prefix}/model_output/{i}"));
                latents = sched.step(&model_output, i, &latents, noise.as_ref()).unwrap_or_else(|e| panic!("{prefix}: step {i}: {e:#}"));
                let err = relative_error(&latents, &get(&format!("{prefix}/prev/{i}")));
                if err > worst.0 {
                    worst = (err, format!("{prefix} step {i}"));
                }
                if err > 1e-4 {
                    failures.push(format!("{prefix}: step {i}: prev_sample off by {err:e}"));
                }
                steps_checked += 1;
            }
        }
    }
    eprintln!("{steps_checked} steps; the farthest from diffusers: {} ({:e})", worst.1, worst.0);
    assert!(failures.is_empty(), "{} of {steps_checked} steps differ from diffusers {}:\n{}", failures.len(), fixture.diffusers, failures.join("\n"));
    assert!(steps_checked > 300, "only {steps_checked} steps checked");
}

fn sd15() -> SchedulerConfig {
    serde_json::from_str(
        r#"{"_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "beta_start": 0.00085, "num_train_timesteps": 1000, "set_alpha_to_one": false,
            "skip_prk_steps": true, "steps_offset": 1, "trained_betas": null, "clip_sample": false}"#,
    )
    .unwrap()
}

#[test]
fn an_unknown_class_is_named_but_others_can_still_be_built() {
    let mut config = sd15();
    config.class_name = Some("LMSDiscreteScheduler".into());
    let error = format!("{:#}", config.kind().unwrap_err());
    assert!(error.contains("LMSDiscreteScheduler"), "{error}");
    assert_eq!(scheduler::build(&config, SchedulerKind::Ddim, 20).unwrap().timesteps().len(), 20);
    assert_eq!(sd15().kind().unwrap(), SchedulerKind::Pndm);
}

#[test]
fn missing_fields_take_the_built_class_defaults() {
    let config = sd15();
    // No timestep_spacing: DDIM and PNDM space leading, Euler linspace (from 999).
    assert_eq!(scheduler::build(&config, SchedulerKind::Ddim, 4).unwrap().timesteps(), [751.0, 501.0, 251.0, 1.0]);
    assert_eq!(scheduler::build(&config, SchedulerKind::Pndm, 4).unwrap().timesteps(), [751.0, 501.0, 501.0, 251.0, 1.0]);
    assert_eq!(scheduler::build(&config, SchedulerKind::Euler, 4).unwrap().timesteps(), [999.0, 666.0, 333.0, 0.0]);
    assert!(!config.set_alpha_to_one_for(SchedulerKind::Ddim));
    let bare: SchedulerConfig = serde_json::from_str(r#"{"_class_name": "PNDMScheduler"}"#).unwrap();
    assert!(bare.set_alpha_to_one_for(SchedulerKind::Ddim));
    assert!(!bare.set_alpha_to_one_for(SchedulerKind::Pndm));
}

#[test]
fn settings_tern_does_not_compute_are_refused() {
    let refuse = |json: &str, kind: SchedulerKind, steps: usize| {
        let config: SchedulerConfig = serde_json::from_str(json).unwrap();
        assert!(scheduler::build(&config, kind, steps).is_err(), "{json} with {kind:?}, {steps} steps was built");
    };
    refuse(r#"{"_class_name": "EulerDiscreteScheduler", "use_karras_sigmas": true}"#, SchedulerKind::Euler, 20);
    refuse(r#"{"_class_name": "EulerDiscreteScheduler", "interpolation_type": "log_linear"}"#, SchedulerKind::Euler, 20);
    refuse(r#"{"_class_name": "DDIMScheduler", "thresholding": true}"#, SchedulerKind::Ddim, 20);
    refuse(r#"{"_class_name": "PNDMScheduler"}"#, SchedulerKind::Pndm, 3);
    refuse(r#"{"_class_name": "PNDMScheduler", "prediction_type": "sample"}"#, SchedulerKind::Pndm, 20);
    refuse(r#"{"prediction_type": "sample"}"#, SchedulerKind::EulerAncestral, 20);
    refuse(r#"{"steps_offset": 1}"#, SchedulerKind::Ddim, 1000);
    refuse(r#"{}"#, SchedulerKind::Euler, 0);
    refuse(r#"{}"#, SchedulerKind::Euler, 1001);
    // Euler's sigma settings mean nothing to the classes that do not take them.
    let karras: SchedulerConfig = serde_json::from_str(r#"{"use_karras_sigmas": null, "interpolation_type": "log_linear"}"#).unwrap();
    assert!(scheduler::build(&karras, SchedulerKind::EulerAncestral, 20).is_ok());
}

#[test]
fn euler_ancestral_needs_noise_and_pndm_steps_in_order() {
    let device = Device::Cpu;
    let x = Tensor::ones((1, 4, 2, 2), candle_core::DType::F32, &device).unwrap();
    let mut euler_a = scheduler::build(&sd15(), SchedulerKind::EulerAncestral, 4).unwrap();
    assert!(euler_a.needs_noise());
    assert!(euler_a.step(&x, 0, &x, None).is_err());
    assert!(euler_a.step(&x, 0, &x, Some(&x)).is_ok());
    let mut pndm = scheduler::build(&sd15(), SchedulerKind::Pndm, 4).unwrap();
    assert!(!pndm.needs_noise());
    assert!(pndm.step(&x, 1, &x, None).is_err());
    assert!(pndm.step(&x, 0, &x, None).is_ok());
}
