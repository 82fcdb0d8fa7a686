//! The shape of a decoder-only language model, read from a GGUF's metadata and tensor names:
//! the llama family and the variants of it tern serves (Qwen2/2.5, Qwen3, Phi-3, Gemma 3), as
//! llama.cpp's graphs for those architectures compute them.
//!
//! | | rotary pairs | extras |
//! |---|---|---|
//! | `llama` (Llama 2/3, SmolLM) | interleaved | Llama 3.1's `rope_freqs` |
//! | `qwen2` | halves | biases on q, k and v |
//! | `qwen3` | halves | RMS norm of each query and key head |
//! | `phi3` | halves | q, k, v in one matrix; gate and up in one; sliding window |
//! | `gemma3` | halves | embeddings times sqrt(hidden), GELU, norms after attention and feed-forward too, q/k norms, 5 of 6 layers on a 512-token window with their own rotary base |

use std::io::{Read, Seek};

use anyhow::{bail, ensure, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::Device;

use super::{metadata_int, metadata_str};

/// The architectures tern's forward passes implement (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma3,
}

impl Architecture {
    pub(crate) fn from_gguf(content: &Content) -> Result<Architecture> {
        Ok(match metadata_str(content, "general.architecture").unwrap_or("") {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            "phi3" => Architecture::Phi3,
            "gemma3" => Architecture::Gemma3,
            other => bail!("architecture {other:?} is not supported: llama, qwen2, qwen3, phi3 and gemma3 are"),
        })
    }

    /// The prefix of its metadata keys.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Phi3 => "phi3",
            Architecture::Gemma3 => "gemma3",
        }
    }
}

/// How rotary embeddings pair a head's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RopeStyle {
    /// `(2i, 2i + 1)`: GGML's normal mode, llama's (whose converter permutes q and k for it).
    Interleaved,
    /// `(i, i + rotated / 2)`: GPT-NeoX's, everyone else's.
    Halves,
}

/// The feed-forward block's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    /// `silu(gate) * up`.
    Silu,
    /// `gelu(gate) * up`, GELU's tanh approximation (Gemma).
    GeluTanh,
}

/// The network's shape and the variations of the llama block it uses.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) arch: Architecture,
    pub(crate) hidden: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) ffn: usize,
    pub(crate) layers: usize,
    pub(crate) rms_eps: f32,
    pub(crate) rope_style: RopeStyle,
    /// Leading dimensions of each head that rotate (all of them but for partial rotary models).
    pub(crate) rotated: usize,
    pub(crate) rope_base: f32,
    /// Positions are multiplied by this on the full-attention layers (linear scaling: 1 /
    /// `rope.scaling.factor`).
    pub(crate) rope_scale: f32,
    /// Llama 3.1's per-frequency divisors (`rope_freqs.weight`), `rotated / 2` of them.
    pub(crate) rope_factors: Option<Vec<f32>>,
    /// Layers on a window see the latest `window` positions only, with rotary base
    /// `local_rope_base` and no scaling.
    pub(crate) window: Option<usize>,
    pub(crate) local_rope_base: f32,
    /// Multiplies attention scores: 1 / sqrt(head_dim) but for Gemma 3 27B.
    pub(crate) attention_scale: f32,
    /// Multiplies token embeddings (Gemma: sqrt(hidden)).
    pub(crate) embedding_scale: Option<f32>,
    pub(crate) activation: Activation,
    /// q, k and v have biases (Qwen2).
    pub(crate) qkv_bias: bool,
    /// q, k and v are one matrix in the file (`attn_qkv`, Phi-3).
    pub(crate) fused_qkv: bool,
    /// Gate and up are one matrix in the file (`ffn_up` of twice the width, Phi-3).
    pub(crate) fused_gate_up: bool,
}

impl Config {
    /// The metadata and tensor names of `content`; an error for a variant tern does not
    /// implement (YaRN or LongRoPE scaling, mixtures of experts).
    pub(crate) fn from_gguf(content: &Content) -> Result<Config> {
        let arch = Architecture::from_gguf(content)?;
        let prefix = arch.key();
        let int = |key: &str| metadata_int(content, &format!("{prefix}.{key}")).and_then(|v| usize::try_from(v).ok());
        let need = |key: &str| int(key).with_context(|| format!("{prefix}.{key} is missing from the GGUF metadata"));
        let float = |key: &str| match content.metadata.get(&format!("{prefix}.{key}")) {
            Some(Value::F32(x)) => Some(*x),
            Some(Value::F64(x)) => Some(*x as f32),
            _ => None,
        };
        let has = |name: &str| content.tensor_infos.contains_key(name);
        let (hidden, heads, layers) = (need("embedding_length")?, need("attention.head_count")?, need("block_count")?);
        let kv_heads = int("attention.head_count_kv").unwrap_or(heads);
        ensure!(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "{heads} heads are not a multiple of {kv_heads} key/value heads");
        let head_dim = match int("attention.key_length") {
            Some(d) => d,
            None => {
                ensure!(hidden % heads == 0, "{heads} heads do not divide {hidden}");
                hidden / heads
            }
        };
        ensure!(int("attention.value_length").unwrap_or(head_dim) == head_dim, "keys and values of different widths are not supported");
        let rotated = int("rope.dimension_count").unwrap_or(head_dim);
        ensure!(rotated <= head_dim && rotated % 2 == 0 && rotated > 0, "{rotated} rotary dimensions for heads of {head_dim}");
        ensure!(int("expert_count").unwrap_or(0) == 0, "mixtures of experts are not supported");
        let scaling = metadata_str(content, &format!("{prefix}.rope.scaling.type"));
        let rope_scale = match scaling {
            None | Some("none") => 1.0,
            Some("linear") => 1.0 / float("rope.scaling.factor").filter(|f| *f > 0.0).unwrap_or(1.0),
            Some(other) => bail!("rotary scaling {other:?} is not supported (none and linear are)"),
        };
        ensure!(!has("rope_factors_long.weight"), "LongRoPE scaling is not supported");
        let gemma = arch == Architecture::Gemma3;
        let window = match arch {
            Architecture::Gemma3 | Architecture::Phi3 => int("attention.sliding_window").filter(|&w| w > 0),
            _ => None,
        };
        Ok(Config {
            arch,
            hidden,
            heads,
            kv_heads,
            head_dim,
            ffn: need("feed_forward_length")?,
            layers,
            rms_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_style: if arch == Architecture::Llama { RopeStyle::Interleaved } else { RopeStyle::Halves },
            rotated,
            rope_base: float("rope.freq_base").unwrap_or(10_000.0),
            rope_scale,
            rope_factors: None,
            window,
            // llama.cpp's fixed base for Gemma 3's window layers.
            local_rope_base: if gemma { 10_000.0 } else { float("rope.freq_base").unwrap_or(10_000.0) },
            // Gemma 3 27B (62 layers) scales by its hidden size per head instead (llama.cpp).
            attention_scale: if gemma && layers == 62 { 1.0 / ((hidden / heads) as f32).sqrt() } else { 1.0 / (head_dim as f32).sqrt() },
            embedding_scale: gemma.then(|| (hidden as f32).sqrt()),
            activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
            qkv_bias: has("blk.0.attn_q.bias"),
            fused_qkv: has("blk.0.attn_qkv.weight"),
            fused_gate_up: !has("blk.0.ffn_gate.weight"),
        })
    }

    /// Reads Llama 3.1's rotary divisors (`rope_freqs.weight`, `rotated / 2` of them) into
    /// [`Config::rope_factors`], where the file has them.
    pub(crate) fn read_rope_factors<R: Read + Seek>(&mut self, content: &Content, reader: &mut R) -> Result<()> {
        const NAME: &str = "rope_freqs.weight";
        if !content.tensor_infos.contains_key(NAME) {
            return Ok(());
        }
        let factors: Vec<f32> = content.tensor(reader, NAME, &Device::Cpu)?.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?;
        ensure!(factors.len() == self.rotated / 2, "{NAME} holds {} values for {} rotary dimensions", factors.len(), self.rotated);
        self.rope_factors = Some(factors);
        Ok(())
    }

    /// Whether layer `l` attends over the window only: Gemma 3's five of every six, Phi-3's all.
    pub(crate) fn windowed(&self, l: usize) -> bool {
        match (self.window, self.arch) {
            (None, _) => false,
            (Some(_), Architecture::Gemma3) => l % 6 < 5,
            (Some(_), _) => true,
        }
    }

    /// The positions layer `l` sees from position `pos`: `first..=pos`.
    pub(crate) fn first_seen(&self, l: usize, pos: usize) -> usize {
        match self.window {
            Some(w) if self.windowed(l) => (pos + 1).saturating_sub(w),
            _ => 0,
        }
    }

    /// Rotary angles' cosines and sines for layer kind `windowed`, `positions x rotated / 2`,
    /// in f32 as llama.cpp computes them: `pos * scale * base^(-2i / rotated) / factor_i`.
    pub(crate) fn rotary_tables(&self, positions: usize, windowed: bool) -> (Vec<f32>, Vec<f32>) {
        let half = self.rotated / 2;
        let (base, scale) = if windowed { (self.local_rope_base, 1.0) } else { (self.rope_base, self.rope_scale) };
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for i in 0..half {
                let mut theta = 1f32 / base.powf((2 * i) as f32 / self.rotated as f32);
                if let Some(f) = &self.rope_factors {
                    theta /= f[i];
                }
                let angle = p as f32 * scale * theta;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        (cos, sin)
    }

    /// The tensors of layer `l`'s q, k and v projections (one name where they are fused).
    pub(crate) fn qkv_names(&self, l: usize) -> Vec<String> {
        match self.fused_qkv {
            true => vec![format!("blk.{l}.attn_qkv.weight")],
            false => ["attn_q", "attn_k", "attn_v"].iter().map(|p| format!("blk.{l}.{p}.weight")).collect(),
        }
    }

    /// The tensors of layer `l`'s gate and up projections (one name where they are fused).
    pub(crate) fn gate_up_names(&self, l: usize) -> Vec<String> {
        match self.fused_gate_up {
            true => vec![format!("blk.{l}.ffn_up.weight")],
            false => vec![format!("blk.{l}.ffn_gate.weight"), format!("blk.{l}.ffn_up.weight")],
        }
    }
}

/// Turns `x` (one head, `head_dim` wide) by a position's angles (`rotated / 2` cosines and sines).
#[inline]
pub(crate) fn rotate_head(x: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    let half = cos.len();
    match style {
        RopeStyle::Interleaved => {
            for (pair, (&c, &s)) in x[..2 * half].chunks_exact_mut(2).zip(cos.iter().zip(sin)) {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * c - b * s;
                pair[1] = a * s + b * c;
            }
        }
        RopeStyle::Halves => {
            let (lo, hi) = x[..2 * half].split_at_mut(half);
            for ((a, b), (&c, &s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cos.iter().zip(sin)) {
                let (x0, x1) = (*a, *b);
                *a = x0 * c - x1 * s;
                *b = x0 * s + x1 * c;
            }
        }
    }
}
