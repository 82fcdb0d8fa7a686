//! Embeddings with the real all-MiniLM-L6-v2 weights.
//!
//! Models dir: `TERN_MODELS_DIR`, default `$HOME/.cache/tern/models`, holding
//! `all-MiniLM-L6-v2/` (scripts/models.sh --all). Tests print SKIPPED and return when it is
//! missing, except under `CI=true`, where a missing model fails them.

use std::path::PathBuf;

use candle_core::Device;
use tern_models::precision::Precision;
use tern_models::embed::Embedder;

fn model_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("TERN_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tern/models"))
        .join("all-MiniLM-L6-v2");
    if dir.join("model.safetensors").is_file() {
        return Some(dir);
    }
    let msg = format!("{} missing (run scripts/models.sh --all)", dir.display());
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{msg}");
    }
    eprintln!("SKIPPED: {msg}");
    None
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn cosine_matches_the_reference_value() {
    let Some(dir) = model_dir() else { return };
    // `Bf16Products` takes BF16 products on a CPU with AVX-512 BF16; `Auto` and `F32` never do.
    for precision in [Precision::Auto, Precision::Bf16Products, Precision::F32] {
        let model = Embedder::load_in(&dir, &Device::Cpu, precision).unwrap();
        let v = model.embed(&["A man is eating food.", "A man is eating a piece of bread."]).unwrap();
        assert_eq!(v[0].len(), 384);
        let norm = dot(&v[0], &v[0]).sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{precision}: vectors are unit length, got {norm}");
        let cosine = dot(&v[0], &v[1]);
        assert!((cosine - 0.755).abs() <= 0.005, "{precision}: cosine {cosine}, reference 0.755");
    }
}

#[test]
fn batched_equals_single() {
    let Some(dir) = model_dir() else { return };
    let model = Embedder::load(&dir, &Device::Cpu).unwrap();
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let texts = ["short", "A somewhat longer sentence about the weather in spring.", long.as_str(), "", "数字 12345"];
    let batched = model.embed(&texts).unwrap();
    for (text, b) in texts.iter().zip(&batched) {
        let single = model.embed(&[text]).unwrap().remove(0);
        let diff = single.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(diff <= 1e-4, "{text:?}: batched differs from single by {diff}");
    }
    let tokens = model.count_tokens(&texts).unwrap();
    assert_eq!(tokens[2], tern_models::embed::MAX_TOKENS_PER_TEXT, "long text truncated");
    assert_eq!(tokens[3], 2, "empty text is [CLS] [SEP]");
}

/// Half precision through candle's layers with tern's finite padding mask: every text of a
/// padded batch keeps its F32 vector, with no NaN (candle's own mask made every half-precision
/// batch NaN). F16, the GPU's default, to a cosine of 0.999; BF16, with 8 bits of mantissa, to
/// 0.99 (0.9967 on the 256-token text). On the CPU here; on a GPU it is the default.
#[test]
fn half_precision_matches_f32_on_padded_batches() {
    let Some(dir) = model_dir() else { return };
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let texts = [
        "A man is eating food.",
        "short",
        "A somewhat longer sentence about the weather in spring, and what the farmers made of it.",
        long.as_str(),
        "",
        "数字 12345",
    ];
    let reference = Embedder::load_in(&dir, &Device::Cpu, Precision::F32).unwrap().embed(&texts).unwrap();
    for (precision, floor) in [(Precision::F16, 0.999), (Precision::Bf16, 0.99)] {
        let model = Embedder::load_in(&dir, &Device::Cpu, precision).unwrap();
        let half = model.embed(&texts).unwrap();
        for (i, (r, h)) in reference.iter().zip(&half).enumerate() {
            assert!(h.iter().all(|x| x.is_finite()), "{precision}: text {i} has a non-finite value");
            let cosine = dot(r, h);
            assert!(cosine >= floor, "{precision}: text {i} ({} chars): cosine to F32 {cosine}", texts[i].len());
        }
    }
}
