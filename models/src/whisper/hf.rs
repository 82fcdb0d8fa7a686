//! Reader for Hugging Face Whisper folders, as `WhisperForConditionalGeneration.save_pretrained`
//! writes them and the hub keeps them (openai/whisper-* of every size, distil-whisper,
//! fine-tunes): `config.json` (the architecture), `generation_config.json` (suppressed tokens,
//! languages, alignment heads), `tokenizer.json`, and safetensors whose names are already the
//! ones tern's encoder and decoder read (`model.encoder.conv1.weight`, ...).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_transformers::models::whisper::Config;
use serde::Deserialize;

use super::DecodingRules;

/// A Hugging Face Whisper: its weights under candle's names (F32, on the CPU), its architecture
/// and its decoding rules.
pub(crate) struct HfWhisper {
    pub tensors: HashMap<String, Tensor>,
    pub config: Config,
    pub rules: DecodingRules,
    /// Whether the file stores the token embeddings in F16.
    pub embeddings_f16: bool,
}

/// `config.json`'s architecture.
#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    model_type: String,
    num_mel_bins: usize,
    d_model: usize,
    encoder_layers: usize,
    encoder_attention_heads: usize,
    decoder_layers: usize,
    decoder_attention_heads: usize,
    vocab_size: usize,
    max_source_positions: usize,
    max_target_positions: usize,
    #[serde(default = "default_activation")]
    activation_function: String,
    #[serde(default)]
    scale_embedding: bool,
    encoder_ffn_dim: Option<usize>,
    decoder_ffn_dim: Option<usize>,
    /// Older folders keep these here rather than in `generation_config.json`.
    #[serde(default)]
    suppress_tokens: Option<Vec<u32>>,
    #[serde(default)]
    begin_suppress_tokens: Option<Vec<u32>>,
}

fn default_activation() -> String {
    "gelu".into()
}

/// `generation_config.json`'s rules for decoding.
#[derive(Deserialize, Default)]
struct GenerationConfig {
    #[serde(default)]
    suppress_tokens: Option<Vec<u32>>,
    #[serde(default)]
    begin_suppress_tokens: Option<Vec<u32>>,
    /// `{"<|en|>": 50259, ...}`.
    #[serde(default)]
    lang_to_id: HashMap<String, u32>,
    /// `[[layer, head], ...]`.
    #[serde(default)]
    alignment_heads: Vec<(usize, usize)>,
}

fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    crate::weights::safetensors_files(dir, "model")
}

/// Elements of the weights in `dir`, from the files' headers.
pub(crate) fn elements(dir: &Path) -> Result<u64> {
    // Safety: read-only maps of files tern does not write while a worker runs.
    let mapped = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&weight_files(dir)?)? };
    Ok(mapped.tensors().iter().filter(|(name, _)| name != "proj_out.weight").map(|(_, v)| v.shape().iter().product::<usize>() as u64).sum())
}

/// Reads the folder `dir`.
pub(crate) fn read(dir: &Path) -> Result<HfWhisper> {
    let config_path = dir.join("config.json");
    let hf: HfConfig = serde_json::from_slice(&std::fs::read(&config_path).with_context(|| format!("reading {}", config_path.display()))?)
        .with_context(|| format!("parsing {}", config_path.display()))?;
    if hf.model_type != "whisper" {
        bail!("{}: model_type {:?}, not whisper (a CTranslate2 folder holds model.bin)", config_path.display(), hf.model_type);
    }
    // tern's layers compute Whisper's: GELU, unscaled embeddings (every published Whisper).
    if hf.activation_function != "gelu" {
        bail!("{}: activation_function {:?}: tern computes Whisper's gelu only", config_path.display(), hf.activation_function);
    }
    for (side, dim) in [("encoder_ffn_dim", hf.encoder_ffn_dim), ("decoder_ffn_dim", hf.decoder_ffn_dim)] {
        if dim.is_some_and(|d| d != 4 * hf.d_model) {
            bail!("{}: {side} {dim:?}: tern computes Whisper's feed-forward of 4 x d_model ({})", config_path.display(), 4 * hf.d_model);
        }
    }
    if hf.scale_embedding {
        bail!("{}: scale_embedding is set: tern computes Whisper's unscaled embeddings only", config_path.display());
    }
    let generation_path = dir.join("generation_config.json");
    let generation: GenerationConfig = match std::fs::read(&generation_path) {
        Ok(bytes) => serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", generation_path.display()))?,
        Err(_) => GenerationConfig::default(),
    };

    let mut tensors = HashMap::new();
    let mut embeddings_f16 = false;
    for file in weight_files(dir)? {
        for (name, tensor) in candle_core::safetensors::load(&file, &Device::Cpu).with_context(|| format!("reading {}", file.display()))? {
            // `WhisperModel` saves without the `model.` of `WhisperForConditionalGeneration`;
            // `proj_out` is the token embeddings again (tied), which the decoder reads.
            let name = if name.starts_with("encoder.") || name.starts_with("decoder.") { format!("model.{name}") } else { name };
            if name == "proj_out.weight" {
                continue;
            }
            if name == "model.decoder.embed_tokens.weight" {
                embeddings_f16 = tensor.dtype() == DType::F16;
            }
            tensors.insert(name, tensor.to_dtype(DType::F32)?);
        }
    }
    for name in ["model.encoder.conv1.weight", "model.decoder.embed_tokens.weight"] {
        if !tensors.contains_key(name) {
            bail!("{}: the weights lack {name}", dir.display());
        }
    }
    let config = Config {
        num_mel_bins: hf.num_mel_bins,
        max_source_positions: hf.max_source_positions,
        d_model: hf.d_model,
        encoder_attention_heads: hf.encoder_attention_heads,
        encoder_layers: hf.encoder_layers,
        vocab_size: hf.vocab_size,
        max_target_positions: hf.max_target_positions,
        decoder_attention_heads: hf.decoder_attention_heads,
        decoder_layers: hf.decoder_layers,
        suppress_tokens: Vec::new(),
    };
    let mut lang_ids: Vec<u32> = generation.lang_to_id.values().copied().collect();
    lang_ids.sort_unstable();
    let rules = DecodingRules {
        suppress_ids: generation.suppress_tokens.or(hf.suppress_tokens).unwrap_or_default(),
        suppress_ids_begin: generation.begin_suppress_tokens.or(hf.begin_suppress_tokens).unwrap_or_default(),
        lang_ids,
        alignment_heads: generation.alignment_heads,
    };
    Ok(HfWhisper { tensors, config, rules, embeddings_f16 })
}
