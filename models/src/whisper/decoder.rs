//! Whisper text decoder with a self-attention key/value cache and cross-attention keys/values
//! computed once per window.
//!
//! candle-transformers' `TextDecoder` re-runs the whole token prefix at every step and re-scales
//! the cached cross-attention keys each time; this one feeds only the new tokens after the prompt
//! step. The math follows candle's `whisper::model` (itself OpenAI's `model.py`): queries and keys
//! are both scaled by `head_dim^-0.25`, layer norms use eps 1e-5, and logits come from the tied
//! token embedding.

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::{layer_norm, LayerNorm, VarBuilder};
use rayon::prelude::*;
use candle_transformers::models::whisper::Config;

use std::sync::Arc;

use super::attention::{self, KeyLayout, PackedHead};
use super::LAYER_NORM_EPS;
use crate::bf16_gemm::Bf16Linear;
use crate::linear::{linear, linear_no_bias, Linear};

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
}

impl Attention {
    /// The four layers through `f` (packing them for BF16 products, say).
    fn products(self, f: impl Fn(Linear) -> Result<Linear>) -> Result<Self> {
        Ok(Attention { q: f(self.q)?, k: f(self.k)?, v: f(self.v)?, out: f(self.out)? })
    }

    fn load(n_state: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Attention {
            q: linear(n_state, n_state, vb.pp("q_proj"))?,
            k: linear_no_bias(n_state, n_state, vb.pp("k_proj"))?,
            v: linear(n_state, n_state, vb.pp("v_proj"))?,
            out: linear(n_state, n_state, vb.pp("out_proj"))?,
        })
    }
}

struct Layer {
    self_attn: Attention,
    self_ln: LayerNorm,
    cross_attn: Attention,
    cross_ln: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    mlp_ln: LayerNorm,
}

/// Cross-attention keys (scaled, laid out `(batch, head, head_dim, frames)`) and values
/// (`(batch, head, frames, head_dim)`) of every layer for one batch of encoded windows.
/// Rows encoded with fewer frames than the batch holds carry a mask over the padding, so each
/// row attends to exactly what it would alone. Where the decoder takes BF16 products, each
/// (layer, row, head) is packed instead, over the row's own frames.
pub(crate) struct CrossKv {
    layers: Vec<(Tensor, Tensor)>,
    /// `(batch, 1, 1, frames)`: 0 for a row's own frames, -inf for its padding.
    mask: Option<Tensor>,
    /// Each row's own frames, when some row has padding (the mask's lengths).
    frames: Option<Vec<usize>>,
    /// Per layer, per (row, head) (`row * heads + head`): the packed BF16 keys and values;
    /// empty where `layers` holds tensors.
    packed: Vec<Vec<Arc<PackedHead>>>,
    heads: usize,
}

impl CrossKv {
    /// The keys/values of batch row `b` alone.
    pub fn row(&self, b: usize) -> Result<CrossKv> {
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| Ok((k.narrow(0, b, 1)?, v.narrow(0, b, 1)?)))
            .collect::<Result<Vec<_>>>()?;
        let mask = self.mask.as_ref().map(|m| m.narrow(0, b, 1)).transpose()?;
        let frames = self.frames.as_ref().map(|f| vec![f[b]]);
        Ok(CrossKv { layers, mask, frames, packed: self.packed_rows(&[b]), heads: self.heads })
    }

    /// The packed heads of `rows`, in that order.
    fn packed_rows(&self, rows: &[usize]) -> Vec<Vec<Arc<PackedHead>>> {
        let h = self.heads;
        self.packed.iter().map(|layer| rows.iter().flat_map(|&r| layer[r * h..(r + 1) * h].iter().cloned()).collect()).collect()
    }

    /// The keys/values of the given batch rows, in that order.
    pub fn select(&self, rows: &[usize]) -> Result<CrossKv> {
        if rows.len() == 1 {
            return self.row(rows[0]);
        }
        let packed = self.packed_rows(rows);
        let Some((k0, _)) = self.layers.first() else {
            return Ok(CrossKv { layers: Vec::new(), mask: None, frames: None, packed, heads: self.heads });
        };
        let index = Tensor::from_vec(
            rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            rows.len(),
            k0.device(),
        )?;
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| Ok((k.index_select(&index, 0)?, v.index_select(&index, 0)?)))
            .collect::<Result<Vec<_>>>()?;
        let mask = self.mask.as_ref().map(|m| m.index_select(&index, 0)).transpose()?;
        let frames = self.frames.as_ref().map(|f| rows.iter().map(|&r| f[r]).collect());
        Ok(CrossKv { layers, mask, frames, packed, heads: self.heads })
    }
}

/// Self-attention keys (scaled) and values of the tokens fed so far, per layer, each
/// `(batch, head, len, head_dim)`.
pub(crate) struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// The cache of the given batch rows, in that order.
    pub fn select(&self, rows: &[usize]) -> Result<KvCache> {
        let Some((k0, _)) = self.layers.iter().flatten().next() else {
            return Ok(KvCache { layers: self.layers.clone(), len: self.len });
        };
        let index = Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), k0.device())?;
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                layer.as_ref().map(|(k, v)| Ok((k.index_select(&index, 0)?, v.index_select(&index, 0)?))).transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache { layers, len: self.len })
    }

    /// Number of token positions already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }
}

/// The text decoder of a Whisper model.
pub(crate) struct Decoder {
    /// `(vocab, d_model)`, also the output projection. Held in F16 where [`Decoder::load`] was
    /// asked to, while the rest computes in its own dtype.
    embed_tokens: Tensor,
    /// `(max_target_positions, d_model)`.
    embed_positions: Tensor,
    layers: Vec<Layer>,
    ln: LayerNorm,
    n_head: usize,
    head_dim: usize,
    /// `head_dim^-0.25`, applied to both queries and keys.
    scale: f64,
    /// The token embeddings packed as the BF16 output projection, where the decoder takes BF16
    /// products.
    logits_bf16: Option<Bf16Linear>,
}

impl Decoder {
    /// Loads from a `model.decoder` VarBuilder (the HF / candle tensor names). With
    /// `embeddings_in_f16` (for F32 on the CPU, from a checkpoint stored in F16), the token
    /// embeddings stay in F16: a decoding step's logits read the whole matrix (80 MB in F32 for
    /// tiny), and that read was about half of a step at five rows.
    ///
    /// With `bf16_products` (F32 on the CPU), the layers' linear products and the logits run in
    /// BF16 where the CPU has AVX-512 BF16 ([`crate::bf16_gemm`]): a step of 16 rows then costs
    /// about what a step of a few rows did, where F32 and F16 products were compute-bound.
    pub fn load(vb: VarBuilder, cfg: &Config, embeddings_in_f16: bool, bf16_products: bool) -> Result<Self> {
        let n_state = cfg.d_model;
        let n_head = cfg.decoder_attention_heads;
        let embed_tokens = vb.get((cfg.vocab_size, n_state), "embed_tokens.weight")?;
        // `None` where the CPU lacks AVX-512 BF16.
        let logits_bf16 = if bf16_products { Bf16Linear::pack(&embed_tokens, None)? } else { None };
        let embed_tokens = if embeddings_in_f16 { embed_tokens.to_dtype(DType::F16)? } else { embed_tokens };
        let product = |l: Linear| if logits_bf16.is_some() { l.in_bf16() } else { Ok(l) };
        let embed_positions = vb.get(
            (cfg.max_target_positions, n_state),
            "embed_positions.weight",
        )?;
        let layers = (0..cfg.decoder_layers)
            .map(|i| {
                let vb = vb.pp(format!("layers.{i}"));
                Ok(Layer {
                    self_attn: Attention::load(n_state, vb.pp("self_attn"))?.products(product)?,
                    self_ln: layer_norm(n_state, LAYER_NORM_EPS, vb.pp("self_attn_layer_norm"))?,
                    cross_attn: Attention::load(n_state, vb.pp("encoder_attn"))?.products(product)?,
                    cross_ln: layer_norm(n_state, LAYER_NORM_EPS, vb.pp("encoder_attn_layer_norm"))?,
                    fc1: product(linear(n_state, 4 * n_state, vb.pp("fc1"))?)?,
                    fc2: product(linear(4 * n_state, n_state, vb.pp("fc2"))?)?,
                    mlp_ln: layer_norm(n_state, LAYER_NORM_EPS, vb.pp("final_layer_norm"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let ln = layer_norm(n_state, LAYER_NORM_EPS, vb.pp("layer_norm"))?;
        let head_dim = n_state / n_head;
        Ok(Decoder {
            embed_tokens,
            embed_positions,
            layers,
            ln,
            n_head,
            head_dim,
            scale: (head_dim as f64).powf(-0.25),
            logits_bf16,
        })
    }

    /// Bytes the layers' weights take below F32 (those packed in BF16; the logits' packed copy
    /// of the token embeddings is counted by the caller).
    pub fn bytes_saved(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.self_attn.q, &l.self_attn.k, &l.self_attn.v, &l.self_attn.out, &l.cross_attn.q, &l.cross_attn.k, &l.cross_attn.v, &l.cross_attn.out, &l.fc1, &l.fc2])
            .map(Linear::bytes_saved)
            .sum()
    }

    /// Bytes of the BF16 logits' packed token embeddings, if any.
    pub fn logits_bf16_bytes(&self) -> usize {
        self.logits_bf16.as_ref().map_or(0, |p| p.weight_count() * 2)
    }

    /// Device the weights live on.
    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    /// Maximum number of token positions.
    pub fn max_positions(&self) -> usize {
        self.embed_positions.dim(0).unwrap_or(0)
    }

    /// `(batch, len, d_model)` -> `(batch, head, len, head_dim)`, contiguous.
    fn heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        x.reshape((b, t, self.n_head, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// Computes every layer's cross-attention keys and values from encoder output
    /// `(batch, frames, d_model)`; reuse the result for all decoding steps of those windows.
    /// `frames[b]` is how many leading frames of row `b` are real (the rest is padding and is
    /// masked out); `None` when every row uses all of them.
    pub fn cross_kv(&self, audio_features: &Tensor, frames: Option<&[usize]>) -> Result<CrossKv> {
        let (b, total, _) = audio_features.dims3()?;
        if self.logits_bf16.is_some() {
            return self.cross_kv_bf16(audio_features, frames);
        }
        let mask = match frames {
            Some(frames) if frames.iter().any(|&f| f < total) => {
                let m: Vec<f32> = frames
                    .iter()
                    .flat_map(|&f| (0..total).map(move |j| if j < f { 0.0 } else { f32::NEG_INFINITY }))
                    .collect();
                Some(Tensor::from_vec(m, (b, 1, 1, total), audio_features.device())?.to_dtype(audio_features.dtype())?)
            }
            _ => None,
        };
        let frames = mask.as_ref().and(frames).map(<[usize]>::to_vec);
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let k = (self.heads(&l.cross_attn.k.forward(audio_features)?)? * self.scale)?
                    .transpose(2, 3)?
                    .contiguous()?;
                let v = self.heads(&l.cross_attn.v.forward(audio_features)?)?;
                Ok((k, v))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CrossKv { layers, mask, frames, packed: Vec::new(), heads: self.n_head })
    }

    /// [`Decoder::cross_kv`] packed per (layer, row, head) for BF16 products, each row over its
    /// own frames only (so no mask).
    fn cross_kv_bf16(&self, audio_features: &Tensor, frames: Option<&[usize]>) -> Result<CrossKv> {
        let (b, total, _) = audio_features.dims3()?;
        let (h, hd) = (self.n_head, self.head_dim);
        let packed = self
            .layers
            .iter()
            .map(|l| {
                let k = (self.heads(&l.cross_attn.k.forward(audio_features)?)? * self.scale)?.flatten_all()?.to_vec1::<f32>()?;
                let v = self.heads(&l.cross_attn.v.forward(audio_features)?)?.flatten_all()?.to_vec1::<f32>()?;
                // Both `(batch, head, frames, head_dim)`.
                Ok((0..b * h)
                    .into_par_iter()
                    .map(|pair| {
                        let n = frames.map_or(total, |f| f[pair / h].min(total));
                        let base = pair * total * hd;
                        Arc::new(PackedHead::new(n, hd, |p, i| k[base + p * hd + i], |p, i| v[base + p * hd + i]))
                    })
                    .collect())
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CrossKv { layers: Vec::new(), mask: None, frames: None, packed, heads: h })
    }

    /// An empty self-attention cache.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: vec![None; self.layers.len()],
            len: 0,
        }
    }

    /// Runs `tokens` (`(batch, len)` u32, positions following those already in `cache`) through
    /// the decoder, appending their keys/values to `cache`. Returns the final-layer-normed hidden
    /// states `(batch, len, d_model)`.
    pub fn forward(&self, tokens: &Tensor, cross: &CrossKv, cache: &mut KvCache) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let offset = cache.len;
        let device = tokens.device();
        let emb = self
            .embed_tokens
            .index_select(&tokens.flatten_all()?, 0)?
            .to_dtype(self.embed_positions.dtype())?
            .reshape((b, t, ()))?;
        let pos = self.embed_positions.narrow(0, offset, t)?;
        let mut x = emb.broadcast_add(&pos)?;
        // Causal mask, needed only when several tokens are fed at once.
        let mask = if t > 1 {
            let total = offset + t;
            let m: Vec<f32> = (0..t)
                .flat_map(|i| {
                    (0..total).map(move |j| {
                        if j > offset + i {
                            f32::NEG_INFINITY
                        } else {
                            0.0
                        }
                    })
                })
                .collect();
            Some(Tensor::from_vec(m, (t, total), device)?.to_dtype(x.dtype())?)
        } else {
            None
        };
        for (i, (layer, kv)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            // Self-attention over cache + new tokens.
            let h = layer.self_ln.forward(&x)?;
            let a = &layer.self_attn;
            let q = (self.heads(&a.q.forward(&h)?)? * self.scale)?;
            let k_new = (self.heads(&a.k.forward(&h)?)? * self.scale)?;
            let v_new = self.heads(&a.v.forward(&h)?)?;
            let (k, v) = match kv.take() {
                Some((k, v)) => (
                    Tensor::cat(&[&k, &k_new], 2)?,
                    Tensor::cat(&[&v, &v_new], 2)?,
                ),
                None => (k_new, v_new),
            };
            let o = match attention::attend_one(&q, &k, KeyLayout::Rows, &v, None)? {
                Some(o) => o,
                None => {
                    let mut qk = q.matmul(&k.t()?)?;
                    if let Some(mask) = &mask {
                        qk = qk.broadcast_add(mask)?;
                    }
                    candle_nn::ops::softmax_last_dim(&qk)?.matmul(&v)?
                }
            };
            let o = self.merge(&o)?;
            *kv = Some((k, v));
            x = (x + a.out.forward(&o)?)?;

            // Cross-attention over the window's encoder output.
            let h = layer.cross_ln.forward(&x)?;
            let a = &layer.cross_attn;
            let q = (self.heads(&a.q.forward(&h)?)? * self.scale)?;
            let o = match (cross.packed.get(i), cross.layers.get(i)) {
                (Some(packed), _) => attention::attend_bf16(&q, packed)?,
                (None, Some((ck, cv))) => match attention::attend_one(&q, ck, KeyLayout::Transposed, cv, cross.frames.as_deref())? {
                    Some(o) => o,
                    None => {
                        let mut scores = q.matmul(ck)?;
                        if let Some(mask) = &cross.mask {
                            scores = scores.broadcast_add(mask)?;
                        }
                        candle_nn::ops::softmax_last_dim(&scores)?.matmul(cv)?
                    }
                },
                (None, None) => candle_core::bail!("no cross-attention keys for layer {i}"),
            };
            let o = self.merge(&o)?;
            x = (x + a.out.forward(&o)?)?;

            // MLP.
            let h = layer.mlp_ln.forward(&x)?;
            let h = layer.fc2.forward(&layer.fc1.forward(&h)?.gelu()?)?;
            x = (x + h)?;
        }
        cache.len += t;
        self.ln.forward(&x)
    }

    /// `(batch, head, len, head_dim)` -> `(batch, len, d_model)`, contiguous.
    fn merge(&self, x: &Tensor) -> Result<Tensor> {
        x.transpose(1, 2)?.flatten_from(2)?.contiguous()
    }

    /// Logits `(batch, vocab)` for position `pos` of hidden states `(batch, len, d_model)`.
    pub fn logits_at(&self, hidden: &Tensor, pos: usize) -> Result<Tensor> {
        let h = hidden.i((.., pos, ..))?.contiguous()?;
        // `(vocab, d) x (d, batch)`: the 80 MB (tiny) embedding matrix is the GEMM's left side,
        // read once in its own layout for all rows. As the right side, `h x embᵀ`, gemm packs
        // all of it again on every step, and a batch step costs as much as one step per row.
        self.embed_tokens.matmul(&h.t()?)?.t()
    }

    /// Logits rows as CPU vectors.
    pub fn logits_vecs(&self, hidden: &Tensor, pos: usize) -> Result<Vec<Vec<f32>>> {
        if let Some(logits) = &self.logits_bf16 {
            return logits.forward(&hidden.i((.., pos, ..))?, false)?.to_vec2();
        }
        if self.embed_tokens.dtype() == DType::F16 && hidden.dtype() == DType::F32 && hidden.device().is_cpu() {
            let (_, _, d) = hidden.dims3()?;
            let h = hidden.i((.., pos, ..))?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
            let (storage, layout) = self.embed_tokens.storage_and_layout();
            let (candle_core::Storage::Cpu(candle_core::CpuStorage::F16(w)), Some((from, to))) =
                (&*storage, layout.contiguous_offsets())
            else {
                candle_core::bail!("F16 token embeddings are expected contiguous on the CPU");
            };
            return Ok(crate::linear::few_rows_times_f16(&w[from..to], d, &h));
        }
        self.logits_at(hidden, pos)?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec2()
    }
}
