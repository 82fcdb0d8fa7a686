//! Whisper in Hugging Face's format (`config.json`, `generation_config.json`, safetensors), as
//! users bring openai/whisper-*, distil-whisper and fine-tunes: tiny random models of large-v3's
//! shapes (128 mel bins, the 51,866-token vocabulary) and turbo's (a decoder of far fewer layers
//! than the encoder), made by `scripts/peers/whisper_hf_reference.py` with transformers, load
//! and compute what `WhisperForConditionalGeneration` computes: the encoder's output (as tern's
//! audio embedding) and the greedy transcript. The fixtures are committed; the clip comes from
//! `scripts/models.sh` (the test prints SKIPPED without it, and fails under `CI=true`). The
//! reference is given the features as tern computes them (faster-whisper's: the clip's frames,
//! then zeros), not its own extractor's (silence after the clip): that difference is one of
//! features, not of the model. Both pick by faster-whisper's rules (no timestamp token without
//! timestamps).

use std::path::{Path, PathBuf};

use candle_core::Device;
use tern_models::audio::decode_mono_16k;
use tern_models::precision::Precision;
use tern_models::whisper::{TranscribeOptions, Whisper};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/whisper-hf")
}

fn models_dir() -> PathBuf {
    std::env::var_os("TERN_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tern/models"))
}

#[test]
fn large_v3_and_turbo_shapes_compute_what_transformers_computes() {
    let expected: serde_json::Value = serde_json::from_slice(&std::fs::read(fixtures().join("expected.json")).unwrap()).unwrap();
    for name in ["large-v3", "turbo"] {
        let case = &expected[name];
        let clip = models_dir().join(case["clip"].as_str().unwrap());
        let Ok(wav) = std::fs::read(&clip) else {
            let missing = format!("{} is missing: run scripts/models.sh", clip.display());
            assert!(!std::env::var("CI").is_ok_and(|v| v == "true"), "{missing}");
            eprintln!("SKIPPED: {missing}");
            return;
        };
        let pcm = decode_mono_16k(&wav).unwrap();
        let mut whisper = Whisper::load_in(&fixtures().join(name), &Device::Cpu, Precision::F32).unwrap();
        assert!(whisper.is_multilingual(), "{name}: 51,866 tokens are multilingual");

        // The encoder: its output over the clip's positions, averaged and scaled to unit length.
        let embed = TranscribeOptions { embed: true, ..Default::default() };
        let embedding = whisper.transcribe(&pcm, &embed, &mut |_, _| {}).unwrap().embedding.unwrap().vector;
        let reference: Vec<f32> = case["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(embedding.len(), reference.len(), "{name}: d_model");
        let worst = embedding.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "{name}: the encoder's output is {worst} off transformers'");

        // The decoder after the prompt, before any rule: the ten likeliest tokens' logits.
        let prompt: Vec<u32> = case["prompt"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let logits = whisper.prompt_logits(&pcm, &prompt).unwrap();
        assert_eq!(logits.len(), 51866, "{name}: large-v3's vocabulary");
        for (id, want) in case["top_ids"].as_array().unwrap().iter().zip(case["top_logits"].as_array().unwrap()) {
            let (id, want) = (id.as_u64().unwrap() as usize, want.as_f64().unwrap() as f32);
            assert!((logits[id] - want).abs() < 1e-4, "{name}: token {id}'s logit {} against transformers' {want}", logits[id]);
        }

        // The decoder: greedy, English, no timestamps, as generate() ran it.
        let greedy = TranscribeOptions { language: Some("en".into()), beam_size: 1, fallback: false, timestamps: false, ..Default::default() };
        let text = whisper.transcribe(&pcm, &greedy, &mut |_, _| {}).unwrap().text;
        assert_eq!(text.trim(), case["text"].as_str().unwrap().trim(), "{name}: the greedy transcript");
    }
}

#[test]
fn a_folder_of_another_model_type_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("tern-whisper-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"model_type": "bert", "num_mel_bins": 80, "d_model": 4, "encoder_layers": 1, "encoder_attention_heads": 1, "decoder_layers": 1, "decoder_attention_heads": 1, "vocab_size": 8, "max_source_positions": 4, "max_target_positions": 4}"#).unwrap();
    let error = format!("{:#}", Whisper::load_in(&dir, &Device::Cpu, Precision::F32).err().expect("refused"));
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(error.contains("model_type \"bert\", not whisper"), "{error}");
}

