//! CLIP's text side as Stable Diffusion pipelines use it: the tokenizer diffusers folders ship
//! (`vocab.json` + `merges.txt`), and `CLIPTextModel` / `CLIPTextModelWithProjection` with the
//! hidden states of any layer.

use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{Device, IndexOp, Module, Tensor};
use candle_nn::{embedding, Embedding, VarBuilder};
use rayon::prelude::*;
use serde_json::{json, Value};
use tern_kernels::cpu_kernels;

use super::config::{read_json, ClipConfig};
use super::layers::on_cpu_f32;
use super::transformer::{attention, LayerNorm, Linear};

/// CLIP's BPE tokenizer, built from a folder's `vocab.json` and `merges.txt` as transformers'
/// `CLIPTokenizerFast` builds it (lowercase, whitespace collapsed, CLIP's word split, bytes as
/// characters, `</w>` ending each word); ids are padded to `max_length` as the pipelines pad.
pub struct ClipTokenizer {
    tokenizer: tokenizers::Tokenizer,
    bos: u32,
    eos: u32,
    pad: u32,
    /// 77 for every Stable Diffusion model.
    pub max_length: usize,
}

impl ClipTokenizer {
    pub fn load(dir: &Path) -> Result<ClipTokenizer> {
        let vocab: serde_json::Map<String, Value> = read_json(&dir.join("vocab.json"))?;
        let merges_path = dir.join("merges.txt");
        let merges_text = std::fs::read_to_string(&merges_path).with_context(|| format!("reading {}", merges_path.display()))?;
        // The slow tokenizer keeps merges[1 : 49152 - 256 - 2 + 1]: the header line goes, and
        // at most 48,894 merges count.
        let merges: Vec<&str> = merges_text.lines().skip(1).filter(|l| !l.is_empty()).take(49152 - 256 - 2).collect();
        let id = |token: &str| -> Result<u32> {
            vocab.get(token).and_then(Value::as_u64).map(|v| v as u32).with_context(|| format!("{}: no token {token:?} in vocab.json", dir.display()))
        };
        let config: Value = read_json(&dir.join("tokenizer_config.json")).unwrap_or(Value::Null);
        let special = |key: &str, default: &str| -> String {
            match config.get(key) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or(default).to_string(),
                _ => default.to_string(),
            }
        };
        let (bos_t, eos_t) = (special("bos_token", "<|startoftext|>"), special("eos_token", "<|endoftext|>"));
        let pad_t = special("pad_token", &eos_t);
        let max_length = config.get("model_max_length").and_then(Value::as_u64).filter(|&n| n <= 1024).unwrap_or(77) as usize;
        let (bos, eos, pad) = (id(&bos_t)?, id(&eos_t)?, id(&pad_t)?);
        let added = |id: u32, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": true, "special": true});
        let spec = json!({
            "version": "1.0",
            // transformers makes the pad token special too: SDXL's second tokenizer pads with
            // "!", so a "!" in a prompt is that token, not the word-final "!</w>".
            "added_tokens": if pad == eos { vec![added(bos, &bos_t), added(eos, &eos_t)] } else { vec![added(bos, &bos_t), added(eos, &eos_t), added(pad, &pad_t)] },
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "NFC"},
                {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "},
                {"type": "Lowercase"},
            ]},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "<\\|startoftext\\|>|<\\|endoftext\\|>|'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+"}, "behavior": "Removed", "invert": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            ]},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": eos_t, "continuing_subword_prefix": "", "end_of_word_suffix": "</w>",
                      "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": merges},
        });
        let tokenizer = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&spec)?).map_err(anyhow::Error::msg).with_context(|| format!("building the tokenizer of {}", dir.display()))?;
        Ok(ClipTokenizer { tokenizer, bos, eos, pad, max_length })
    }

    /// `text` as `max_length` ids: start, the text's tokens (truncated), end, padding.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.tokenizer.encode(text, false).map_err(anyhow::Error::msg)?;
        let mut ids = Vec::with_capacity(self.max_length);
        ids.push(self.bos);
        ids.extend(encoding.get_ids().iter().take(self.max_length - 2));
        ids.push(self.eos);
        ids.resize(self.max_length, self.pad);
        Ok(ids)
    }

    /// The end-of-text id (where the pooled output is read).
    pub fn eos(&self) -> u32 {
        self.eos
    }
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    heads: usize,
}

impl Attention {
    fn forward(&self, xs: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, t, c) = xs.dims3()?;
        let d = c / self.heads;
        let split = |x: Tensor| x.reshape((b, t, self.heads, d))?.transpose(1, 2)?.contiguous();
        let q = split((self.q.forward(xs)? * (d as f64).powf(-0.5))?)?;
        let k = split(self.k.forward(xs)?)?;
        let v = split(self.v.forward(xs)?)?;
        let scores = q.matmul(&k.t()?)?.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        self.out.forward(&out)
    }
}

struct Layer {
    norm1: LayerNorm,
    attention: Attention,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    quick_gelu: bool,
    width: usize,
}

impl Layer {
    fn forward(&self, xs: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let xs = (xs + self.attention.forward(&self.norm1.forward(xs)?, mask)?)?;
        let h = self.fc1.forward(&self.norm2.forward(&xs)?)?;
        let h = if self.quick_gelu { (&h * candle_nn::ops::sigmoid(&(&h * 1.702)?)?)? } else { h.gelu_erf()? };
        Ok((xs + self.fc2.forward(&h)?)?)
    }

    /// [`Layer::forward`] on tern's CPU kernels: `x` is `b` sequences' rows, attending causally.
    fn rows(&self, x: &[f32], b: usize) -> Result<Vec<f32>> {
        let a = &self.attention;
        let h = self.norm1.rows(x)?;
        let (q, k, v) = (a.q.rows(&h, None)?, a.k.rows(&h, None)?, a.v.rows(&h, None)?);
        let mixed = attention(&q, &k, &v, b, self.width, a.heads, true);
        drop((h, q, k, v));
        let x = a.out.rows(&mixed, Some(x))?;
        let mut h = self.fc1.rows(&self.norm2.rows(&x)?, None)?;
        h.par_chunks_mut(16 * 1024).for_each(|chunk| {
            if self.quick_gelu {
                // x * sigmoid(1.702 x), as transformers' quick_gelu (libm's exp: 77 rows cost
                // little, and the reference's sigmoid is exact).
                chunk.iter_mut().for_each(|v| *v /= 1.0 + (-1.702 * *v).exp());
            } else {
                cpu_kernels::gelu_erf_in_place(chunk);
            }
        });
        self.fc2.rows(&h, Some(&x))
    }
}

/// What a text encoder gives the pipeline.
pub struct TextOutput {
    /// (batch, 77, hidden): the final layer-normed states, or the states after the layer the
    /// pipeline reads (`hidden_layer`).
    pub hidden: Tensor,
    /// (batch, projection): the projected end-of-text state (`CLIPTextModelWithProjection`'s
    /// `text_embeds`), where the model has a projection.
    pub pooled: Option<Tensor>,
}

/// `CLIPTextModel`, or `CLIPTextModelWithProjection` when the folder has `text_projection`.
pub struct ClipTextModel {
    token_embedding: Embedding,
    position_embedding: Embedding,
    layers: Vec<Layer>,
    final_norm: LayerNorm,
    projection: Option<Linear>,
    /// transformers reads the pooled state at the largest id when `eos_token_id` is 2 (configs
    /// from before it knew the id), else at the first end-of-text id.
    argmax_pooling: bool,
}

impl ClipTextModel {
    pub fn load(vb: VarBuilder, config: &ClipConfig) -> Result<ClipTextModel> {
        let projection = if vb.contains_tensor("text_projection.weight") {
            let dim = config.projection_dim.unwrap_or(config.hidden_size);
            Some(Linear::load(vb.pp("text_projection"), config.hidden_size, dim, false)?)
        } else {
            None
        };
        // transformers 4 saves the encoder under `text_model.` (every published folder);
        // transformers 5 without it.
        let vb = if vb.contains_tensor("text_model.embeddings.token_embedding.weight") { vb.pp("text_model") } else { vb };
        let (h, eps) = (config.hidden_size, config.layer_norm_eps);
        let token_embedding = embedding(config.vocab_size, h, vb.pp("embeddings.token_embedding"))?;
        let position_embedding = embedding(config.max_position_embeddings, h, vb.pp("embeddings.position_embedding"))?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let l = vb.pp(format!("encoder.layers.{i}"));
            let a = l.pp("self_attn");
            layers.push(Layer {
                norm1: LayerNorm::load(l.pp("layer_norm1"), h, eps)?,
                attention: Attention {
                    q: Linear::load(a.pp("q_proj"), h, h, true)?,
                    k: Linear::load(a.pp("k_proj"), h, h, true)?,
                    v: Linear::load(a.pp("v_proj"), h, h, true)?,
                    out: Linear::load(a.pp("out_proj"), h, h, true)?,
                    heads: config.num_attention_heads,
                },
                norm2: LayerNorm::load(l.pp("layer_norm2"), h, eps)?,
                fc1: Linear::load(l.pp("mlp.fc1"), h, config.intermediate_size, true)?,
                fc2: Linear::load(l.pp("mlp.fc2"), config.intermediate_size, h, true)?,
                quick_gelu: config.hidden_act == "quick_gelu",
                width: h,
            });
        }
        let final_norm = LayerNorm::load(vb.pp("final_layer_norm"), h, eps)?;
        Ok(ClipTextModel { token_embedding, position_embedding, layers, final_norm, projection, argmax_pooling: config.eos_token_id == 2 })
    }

    /// Encodes rows of token ids (each `max_length` long). `hidden_layer`: `None` gives the last
    /// layer's states after the final layer norm (`last_hidden_state`); `Some(k)` the states
    /// after `k` layers, without the norm (`hidden_states[k]`: SDXL reads `hidden_states[-2]`).
    pub fn forward(&self, ids: &[Vec<u32>], eos: u32, hidden_layer: Option<usize>, device: &Device) -> Result<TextOutput> {
        let (b, t) = (ids.len(), ids[0].len());
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        let input = Tensor::from_vec(flat, (b, t), device)?;
        let positions = Tensor::arange(0u32, t as u32, device)?;
        let mut xs = self.token_embedding.forward(&input)?.broadcast_add(&self.position_embedding.forward(&positions)?)?;
        // Without a projection, the layers past the one read change nothing the pipeline uses
        // (SDXL's first encoder reads the states before its last layer).
        let needed = match (hidden_layer, &self.projection) {
            (Some(k), None) => k.min(self.layers.len()),
            _ => self.layers.len(),
        };
        let mut chosen = (hidden_layer == Some(0)).then(|| xs.clone());
        if on_cpu_f32(&xs) {
            let shape = xs.shape().clone();
            let mut rows = xs.flatten_all()?.to_vec1::<f32>()?;
            for (i, layer) in self.layers[..needed].iter().enumerate() {
                rows = layer.rows(&rows, b)?;
                if hidden_layer == Some(i + 1) {
                    chosen = Some(Tensor::from_slice(&rows, &shape, device)?);
                }
            }
            xs = Tensor::from_vec(rows, shape, device)?;
        } else {
            let mask: Vec<f32> = (0..t).flat_map(|i| (0..t).map(move |j| if j > i { f32::MIN } else { 0.0 })).collect();
            let mask = Tensor::from_vec(mask, (t, t), device)?.to_dtype(xs.dtype())?;
            for (i, layer) in self.layers[..needed].iter().enumerate() {
                xs = layer.forward(&xs, &mask)?;
                if hidden_layer == Some(i + 1) {
                    chosen = Some(xs.clone());
                }
            }
        }
        let last = match (hidden_layer, &self.projection) {
            (Some(_), None) => None,
            _ => Some(self.final_norm.forward(&xs)?),
        };
        let hidden = match hidden_layer {
            None => last.clone().expect("normed when no layer is chosen"),
            Some(k) if k >= self.layers.len() => xs.clone(),
            Some(_) => chosen.expect("set in the loop"),
        };
        let pooled = match &self.projection {
            None => None,
            Some(projection) => {
                let rows = ids
                    .iter()
                    .enumerate()
                    .map(|(r, row)| {
                        let at = if self.argmax_pooling {
                            // torch's argmax: the first of equal maxima.
                            let max = row.iter().copied().max().unwrap_or(0);
                            row.iter().position(|&x| x == max).unwrap_or(0)
                        } else {
                            row.iter().position(|&x| x == eos).unwrap_or(row.len() - 1)
                        };
                        last.as_ref().expect("normed for the projection").i((r, at))
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Some(projection.forward(&Tensor::stack(&rows, 0)?)?)
            }
        };
        Ok(TextOutput { hidden, pooled })
    }

    /// Transformer layers.
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }
}
