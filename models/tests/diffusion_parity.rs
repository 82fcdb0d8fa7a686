//! Stable Diffusion equal to diffusers: tiny SD 1.5-style and SDXL-style pipelines with random
//! weights (the SDXL one stored as fp16), made and run by diffusers in
//! `scripts/peers/diffusers_reference.py`; tern loads the same folders and, from the same
//! initial latents, must make the same images within 2/255 per pixel.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use tern_models::diffusion::{BatchShape, Noise, Sample, SchedulerKind, StableDiffusion};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diffusion")
}

struct Expected {
    cases: Vec<Value>,
    tensors: HashMap<String, Tensor>,
}

fn expected() -> Expected {
    let json: Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap()).unwrap();
    let tensors = candle_core::safetensors::load(fixtures().join("expected.safetensors"), &Device::Cpu).unwrap();
    Expected { cases: json["cases"].as_array().unwrap().clone(), tensors }
}

fn load(model: &str) -> StableDiffusion {
    StableDiffusion::load(&fixtures().join(model), &Device::Cpu, DType::F32).map_err(|e| format!("{e:#}")).unwrap()
}

fn scheduler(name: &str) -> SchedulerKind {
    serde_json::from_value(Value::String(name.into())).unwrap()
}

/// The largest difference between two RGB8 buffers, and how many values differ at all.
fn max_diff(a: &[u8], b: &[u8]) -> (u8, usize) {
    assert_eq!(a.len(), b.len());
    let diffs = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y));
    let differing = a.iter().zip(b).filter(|(x, y)| x != y).count();
    (diffs.max().unwrap_or(0), differing)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

#[test]
fn images_equal_diffusers_from_the_same_latents() {
    let expected = expected();
    let mut models: HashMap<String, StableDiffusion> = HashMap::new();
    let mut worst = Vec::new();
    for case in expected.cases.iter().filter(|c| c.get("key").is_some()) {
        let name = case["model"].as_str().unwrap();
        let key = case["key"].as_str().unwrap();
        let model = models.entry(name.to_string()).or_insert_with(|| load(name));
        let prompts = strings(&case["prompts"]);
        let negatives = strings(&case["negative_prompts"]);
        let guidance = case["guidance"].as_f64().unwrap();
        let latents = &expected.tensors[&format!("{key}/latents")];
        let samples: Vec<Sample> = prompts
            .iter()
            .zip(&negatives)
            .enumerate()
            .map(|(i, (p, n))| Sample {
                prompt: p.clone(),
                // The reference was given a list of negatives where any was set, else None.
                negative_prompt: negatives.iter().any(|n| !n.is_empty()).then(|| n.clone()),
                guidance,
                noise: Noise::Latents(latents.narrow(0, i, 1).unwrap()),
            })
            .collect();
        let shape = BatchShape {
            width: case["width"].as_u64().unwrap() as usize,
            height: case["height"].as_u64().unwrap() as usize,
            steps: case["steps"].as_u64().unwrap() as usize,
            scheduler: scheduler(case["scheduler"].as_str().unwrap()),
            guided: guidance > 1.0,
        };
        let (images, _) = model.generate(shape, &samples, &mut |_, _| true).unwrap();
        let want = expected.tensors[&format!("{key}/image")].flatten_all().unwrap().to_vec1::<u8>().unwrap();
        for (i, image) in images.iter().enumerate() {
            let n = image.len();
            eprintln!("  image {i}: max difference {}/255", max_diff(image, &want[i * n..(i + 1) * n]).0);
        }
        let got: Vec<u8> = images.concat();
        let (max, differing) = max_diff(&got, &want);
        eprintln!("{key} ({} {} steps, guidance {guidance}): max difference {max}/255, {differing} of {} values differ", case["scheduler"], shape.steps, want.len());
        worst.push((key.to_string(), max));
    }
    for (key, max) in worst {
        assert!(max <= 2, "{key}: a pixel differs from diffusers' by {max}/255");
    }
}

#[test]
fn tokenizers_give_the_reference_ids() {
    let expected = expected();
    for case in expected.cases.iter().filter(|c| c.get("tokens").is_some()) {
        let model = load(case["model"].as_str().unwrap());
        let prompts = strings(&case["tokens"]["prompts"]);
        let ids: Vec<Vec<Vec<u32>>> = serde_json::from_value(case["tokens"]["ids"].clone()).unwrap();
        for (p, prompt) in prompts.iter().enumerate() {
            let got = model.token_ids(prompt).unwrap();
            for (t, tokenizer_ids) in ids.iter().enumerate() {
                assert_eq!(got[t], tokenizer_ids[p], "{} tokenizer {t}, {prompt:?}", case["model"]);
            }
        }
    }
}

#[test]
fn tiled_decode_equals_diffusers_tiled_decode() {
    let expected = expected();
    for name in ["sd-tiny", "sdxl-tiny"] {
        let mut model = load(name);
        let latents = &expected.tensors[&format!("{name}/decode/latents")];
        for (tiled, key) in [(false, "whole"), (true, "tiled")] {
            model.tile_vae = tiled;
            let got = model.decode(latents).unwrap().concat();
            let want = expected.tensors[&format!("{name}/decode/{key}")].flatten_all().unwrap().to_vec1::<u8>().unwrap();
            let (max, differing) = max_diff(&got, &want);
            eprintln!("{name} {key} decode: max difference {max}/255, {differing} values differ");
            assert!(max <= 2, "{name} {key}: a pixel differs from diffusers' by {max}/255");
        }
    }
}

#[test]
fn a_batch_of_four_equals_each_image_alone() {
    for (name, kind, guidance) in [("sd-tiny", SchedulerKind::EulerAncestral, 7.5), ("sdxl-tiny", SchedulerKind::Ddim, 5.0)] {
        let model = load(name);
        let prompts = ["a lighthouse at dusk", "red cat", "the sea at night", "photo of a horse"];
        let samples: Vec<Sample> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| Sample { prompt: p.to_string(), negative_prompt: (i == 1).then(|| "blue".into()), guidance: guidance + i as f64, noise: Noise::Seed(40 + i as u64) })
            .collect();
        let shape = BatchShape { width: 64, height: 64, steps: 3, scheduler: kind, guided: true };
        let (batch, _) = model.generate(shape, &samples, &mut |_, _| true).unwrap();
        for (i, sample) in samples.iter().enumerate() {
            let (alone, _) = model.generate(shape, std::slice::from_ref(sample), &mut |_, _| true).unwrap();
            let (max, _) = max_diff(&batch[i], &alone[0]);
            assert!(max <= 1, "{name}: image {i} of the batch differs from it alone by {max}/255");
        }
    }
}

#[test]
fn a_step_callback_stops_the_batch() {
    let model = load("sd-tiny");
    let sample = Sample { prompt: "a cat".into(), negative_prompt: None, guidance: 7.5, noise: Noise::Seed(1) };
    let shape = BatchShape { width: 64, height: 64, steps: 10, scheduler: SchedulerKind::Ddim, guided: true };
    let mut seen = 0;
    let error = model.generate(shape, &[sample], &mut |done, total| {
        assert_eq!(total, 10);
        seen = done;
        done < 3
    });
    assert!(error.unwrap_err().downcast_ref::<tern_models::diffusion::Canceled>().is_some());
    assert_eq!(seen, 3);
}
