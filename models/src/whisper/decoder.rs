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

use super::attention::{self, CrossHead, F32Head, KeyLayout, PackedHead};
use super::LAYER_NORM_EPS;
use tern_kernels::bf16_gemm::Bf16Linear;
use tern_kernels::cpu_kernels;
use tern_kernels::cpu_ops::softmax_last_dim;
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
/// row attends to exactly what it would alone. On the CPU in F32, each (layer, row, head) is
/// kept on its own instead (packed where the decoder takes BF16 products), over the row's own
/// frames, and shared by the rows that decode the window.
#[derive(Clone)]
pub(crate) struct CrossKv {
    layers: Vec<(Tensor, Tensor)>,
    /// `(batch, 1, 1, frames)`: 0 for a row's own frames, -inf for its padding.
    mask: Option<Tensor>,
    /// Each row's own frames, when some row has padding (the mask's lengths).
    frames: Option<Vec<usize>>,
    /// Per layer, per (row, head) (`row * heads + head`): the keys and values; empty where
    /// `layers` holds tensors.
    packed: Vec<Vec<Arc<CrossHead>>>,
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
    fn packed_rows(&self, rows: &[usize]) -> Vec<Vec<Arc<CrossHead>>> {
        let h = self.heads;
        self.packed.iter().map(|layer| rows.iter().flat_map(|&r| layer[r * h..(r + 1) * h].iter().cloned()).collect()).collect()
    }

    /// Whether rows are kept one by one ([`Decoder::cross_kv`] on the CPU in F32), so that
    /// joining and selecting rows copies no keys or values.
    pub fn is_packed(&self) -> bool {
        !self.packed.is_empty()
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        match (self.packed.first(), self.layers.first()) {
            (Some(layer), _) => layer.len() / self.heads.max(1),
            (None, Some((k, _))) => k.dim(0).unwrap_or(0),
            (None, None) => 0,
        }
    }

    /// The rows of `parts`, in order, as one batch. Packed rows are shared, not copied; tensor
    /// rows are cut to their own frames and zero-padded to the longest, under a mask.
    pub fn join(parts: &[&CrossKv]) -> Result<CrossKv> {
        let Some(first) = parts.first() else { candle_core::bail!("joining no cross-attention rows") };
        let heads = first.heads;
        if first.is_packed() {
            let packed = (0..first.packed.len())
                .map(|layer| parts.iter().flat_map(|p| p.packed[layer].iter().cloned()).collect())
                .collect();
            return Ok(CrossKv { layers: Vec::new(), mask: None, frames: None, packed, heads });
        }
        if parts.len() == 1 {
            return first.select(&(0..first.rows()).collect::<Vec<_>>());
        }
        // Each row's own frames.
        let frames: Vec<usize> = parts
            .iter()
            .flat_map(|p| {
                let total = p.layers.first().map_or(0, |(_, v)| v.dim(2).unwrap_or(0));
                (0..p.rows()).map(move |r| p.frames.as_ref().map_or(total, |f| f[r]))
            })
            .collect();
        let longest = frames.iter().copied().max().unwrap_or(0);
        let layers = (0..first.layers.len())
            .map(|layer| {
                let (mut ks, mut vs) = (Vec::new(), Vec::new());
                let mut row = 0;
                for p in parts {
                    let (k, v) = &p.layers[layer];
                    for r in 0..p.rows() {
                        let n = frames[row];
                        row += 1;
                        ks.push(k.narrow(0, r, 1)?.narrow(3, 0, n)?.pad_with_zeros(3, 0, longest - n)?);
                        vs.push(v.narrow(0, r, 1)?.narrow(2, 0, n)?.pad_with_zeros(2, 0, longest - n)?);
                    }
                }
                Ok((Tensor::cat(&ks, 0)?, Tensor::cat(&vs, 0)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let (k0, _) = &layers[0];
        let mask = padding_mask(&frames, longest, k0.device(), k0.dtype())?;
        let frames = mask.as_ref().map(|_| frames);
        Ok(CrossKv { layers, mask, frames, packed: Vec::new(), heads })
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

/// `(rows, 1, 1, total)`: 0 over each row's first `frames[row]` positions, -inf after them;
/// `None` when every row has all `total`.
fn padding_mask(frames: &[usize], total: usize, device: &Device, dtype: DType) -> Result<Option<Tensor>> {
    if frames.iter().all(|&f| f >= total) {
        return Ok(None);
    }
    let m: Vec<f32> = frames.iter().flat_map(|&f| (0..total).map(move |j| if j < f { 0.0 } else { f32::NEG_INFINITY })).collect();
    Ok(Some(Tensor::from_vec(m, (frames.len(), 1, 1, total), device)?.to_dtype(dtype)?))
}

/// One window's self-attention keys (scaled) and values on the CPU, per layer, `(len,
/// d_model)` with the heads side by side: each row of a running batch keeps its own, so
/// windows join and leave the batch at any step without copying the others'.
#[derive(Clone)]
pub(crate) struct RowKv {
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    len: usize,
}

/// The self-attention caches of a batch of windows decoding one token per step.
pub(crate) enum SelfKv {
    /// One per row, each at its own position (F32 on the CPU): rows join at any step.
    Rows(Vec<RowKv>),
    /// One tensor cache for all rows, at one position: rows join only an empty batch.
    Batch(KvCache),
}

impl SelfKv {
    /// Whether each row has its own cache ([`SelfKv::Rows`]): the condition on this side for
    /// rows to join while others decode.
    pub fn per_row(&self) -> bool {
        matches!(self, SelfKv::Rows(_))
    }

    /// Keeps the caches of `rows`, in that order; a row named more than once is copied (the
    /// beams of a search that extend one beam).
    pub fn select(&mut self, rows: &[usize]) -> Result<()> {
        match self {
            SelfKv::Rows(all) => {
                let mut uses = vec![0usize; all.len()];
                rows.iter().for_each(|&r| uses[r] += 1);
                let mut taken: Vec<Option<RowKv>> = std::mem::take(all).into_iter().map(Some).collect();
                *all = rows
                    .iter()
                    .map(|&r| {
                        uses[r] -= 1;
                        // The last use takes the cache; earlier ones copy it.
                        if uses[r] == 0 { taken[r].take() } else { taken[r].clone() }.expect("a row is taken at its last use")
                    })
                    .collect();
            }
            SelfKv::Batch(cache) => *cache = cache.select(rows)?,
        }
        Ok(())
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
    /// BF16 where the CPU has AVX-512 BF16 ([`tern_kernels::bf16_gemm`]): a step of 16 rows then costs
    /// about what a step of a few rows did, where F32 and F16 products were compute-bound.
    pub fn load(vb: VarBuilder, cfg: &Config, embeddings_in_f16: bool, bf16_products: bool) -> Result<Self> {
        let n_state = cfg.d_model;
        let n_head = cfg.decoder_attention_heads;
        let embed_tokens = vb.get((cfg.vocab_size, n_state), "embed_tokens.weight")?;
        // `None` where the CPU lacks AVX-512 BF16.
        let logits_bf16 = if bf16_products { Bf16Linear::pack(&embed_tokens, None)? } else { None };
        let embed_tokens = if embeddings_in_f16 { embed_tokens.to_dtype(DType::F16)? } else { embed_tokens };
        // In F32 on the CPU the weights are kept transposed: gemm then runs a step's few rows
        // against them with its wide kernel (candle's product of the weights and the rows'
        // transpose ran its narrowest, a sixteenth of a vector per five rows).
        let product = |l: Linear| if logits_bf16.is_some() { l.in_bf16() } else { l.in_f32_transposed() };
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

    /// Whether [`Decoder::cross_kv`] keeps each row's keys and values on its own (on the CPU in
    /// F32; packed for BF16 products), so rows join and leave a batch, and beams share their
    /// window's, without copies.
    pub fn packs_cross(&self) -> bool {
        self.logits_bf16.is_some() || (self.device().is_cpu() && self.embed_positions.dtype() == DType::F32)
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
        let total = audio_features.dim(1)?;
        if self.packs_cross() {
            return self.cross_kv_rows(audio_features, frames);
        }
        let mask = match frames {
            Some(frames) => padding_mask(frames, total, audio_features.device(), audio_features.dtype())?,
            None => None,
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

    /// [`Decoder::cross_kv`] kept per (layer, row, head), each row over its own frames only (so
    /// no mask).
    fn cross_kv_rows(&self, audio_features: &Tensor, frames: Option<&[usize]>) -> Result<CrossKv> {
        let (b, total, d) = audio_features.dims3()?;
        let spans: Vec<(usize, usize)> = (0..b).map(|i| (i * total, frames.map_or(total, |f| f[i].min(total)))).collect();
        self.cross_kv_spans(&audio_features.reshape((b * total, d))?, &spans)
    }

    /// [`Decoder::cross_kv`] of windows encoded end to end (`Encoder::forward_ragged`):
    /// `audio_features` `(Σ lens, d_model)`, window `i` taking `lens[i]` rows. Only where
    /// [`Decoder::packs_cross`].
    pub fn cross_kv_ragged(&self, audio_features: &Tensor, lens: &[usize]) -> Result<CrossKv> {
        if !self.packs_cross() {
            candle_core::bail!("this decoder's cross-attention takes windows padded to one length");
        }
        self.cross_kv_spans(audio_features, &tern_kernels::self_attention::end_to_end(lens))
    }

    /// Per-head keys and values (packed where the products are BF16) of windows whose frames are the rows `spans[i].0..+spans[i].1` of
    /// `features` `(rows, d_model)`.
    fn cross_kv_spans(&self, features: &Tensor, spans: &[(usize, usize)]) -> Result<CrossKv> {
        let (h, hd) = (self.n_head, self.head_dim);
        let d = h * hd;
        let bf16 = self.logits_bf16.is_some();
        let packed = self
            .layers
            .iter()
            .map(|l| {
                let k = (l.cross_attn.k.forward(features)? * self.scale)?.flatten_all()?.to_vec1::<f32>()?;
                let v = l.cross_attn.v.forward(features)?.flatten_all()?.to_vec1::<f32>()?;
                Ok((0..spans.len() * h)
                    .into_par_iter()
                    .map(|pair| {
                        let (first, n) = spans[pair / h];
                        let base = first * d + (pair % h) * hd;
                        Arc::new(match bf16 {
                            true => CrossHead::Bf16(PackedHead::new(n, hd, &k[base..], &v[base..], d)),
                            false => CrossHead::F32(F32Head::new(n, hd, &k[base..], &v[base..], d)),
                        })
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
        self.forward_keeping(tokens, cross, cache, None)
    }

    /// Runs one window's `tokens` (from its SOT) through the decoder over `cross`, keeping the
    /// cross-attention query-key products (scaled, before the softmax) of `heads`, `(layer,
    /// head)` pairs, against `features`, the window's encoder output `(frames, d_model)`:
    /// `[pair][token][frame]`, for word timestamps. Also returns the hidden states `(1, len,
    /// d_model)`. The products are F32 from the features, whatever precision `cross` holds.
    pub fn cross_weights(&self, tokens: &[u32], cross: &CrossKv, features: &Tensor, heads: &[(usize, usize)]) -> Result<(Vec<Vec<Vec<f32>>>, Tensor)> {
        let input = Tensor::from_vec(tokens.to_vec(), (1, tokens.len()), self.device())?;
        let mut kept = vec![Vec::new(); heads.len()];
        let hidden = self.forward_keeping(&input, cross, &mut self.new_cache(), Some((features, heads, &mut kept)))?;
        Ok((kept, hidden))
    }

    /// [`Decoder::forward`], keeping cross-attention products as [`Decoder::cross_weights`] asks.
    #[allow(clippy::type_complexity)]
    fn forward_keeping(
        &self,
        tokens: &Tensor,
        cross: &CrossKv,
        cache: &mut KvCache,
        mut keep: Option<(&Tensor, &[(usize, usize)], &mut Vec<Vec<Vec<f32>>>)>,
    ) -> Result<Tensor> {
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
                    softmax_last_dim(&qk)?.matmul(&v)?
                }
            };
            let o = self.merge(&o)?;
            *kv = Some((k, v));
            x = (x + a.out.forward(&o)?)?;
            if let Some((features, heads, kept)) = keep.as_mut() {
                if heads.iter().any(|&(l, _)| l == i) {
                    let c = &layer.cross_attn;
                    let q = (self.heads(&c.q.forward(&layer.cross_ln.forward(&x)?)?)? * self.scale)?.to_dtype(DType::F32)?;
                    let k = (self.heads(&c.k.forward(&features.unsqueeze(0)?)?)? * self.scale)?.to_dtype(DType::F32)?;
                    for (pair, &(l, head)) in heads.iter().enumerate().filter(|(_, &(l, _))| l == i) {
                        debug_assert_eq!(l, i);
                        let qk = q.i((0, head))?.matmul(&k.i((0, head))?.t()?)?;
                        kept[pair] = qk.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
                    }
                }
            }
            x = self.cross_and_mlp(i, layer, x, cross)?;
        }
        cache.len += t;
        self.ln.forward(&x)
    }

    /// An empty self-attention cache for decoding one token per step: one per row on the CPU
    /// in F32 ([`SelfKv::Rows`]), else one tensor for the batch.
    pub fn new_self_kv(&self) -> SelfKv {
        if self.device().is_cpu() && self.embed_positions.dtype() == DType::F32 {
            SelfKv::Rows(Vec::new())
        } else {
            SelfKv::Batch(self.new_cache())
        }
    }

    /// An empty row cache with room for `tokens` tokens.
    fn empty_row(&self, tokens: usize) -> RowKv {
        let room = tokens * self.n_head * self.head_dim;
        RowKv { layers: (0..self.layers.len()).map(|_| (Vec::with_capacity(room), Vec::with_capacity(room))).collect(), len: 0 }
    }

    /// Adds an empty row to a [`SelfKv::Rows`] cache, room reserved for `tokens` tokens.
    pub fn push_row(&self, kv: &mut SelfKv, tokens: usize) {
        if let SelfKv::Rows(all) = kv {
            all.push(self.empty_row(tokens));
        }
    }

    /// Feeds `tokens` `(rows, len)` at once through the decoder for rows that start decoding,
    /// with their cross-attention keys/values `cross`, and appends each row's cache to a
    /// [`SelfKv::Rows`] cache (room for `room` tokens each). Returns the hidden states `(rows,
    /// len, d_model)`. For prompts of several tokens: one pass instead of a step per token.
    pub fn prefill_rows(&self, tokens: &Tensor, cross: &CrossKv, kv: &mut SelfKv, room: usize) -> Result<Tensor> {
        let SelfKv::Rows(all) = kv else { candle_core::bail!("prefill_rows needs one cache per row") };
        let mut cache = self.new_cache();
        let hidden = self.forward(tokens, cross, &mut cache)?;
        let (rows, len) = tokens.dims2()?;
        let d = self.n_head * self.head_dim;
        let mut new: Vec<RowKv> = (0..rows).map(|_| self.empty_row(room.max(len))).collect();
        for (i, layer) in cache.layers.into_iter().enumerate() {
            let Some((k, v)) = layer else { candle_core::bail!("prefill left a layer uncached") };
            // `(rows, head, len, head_dim)` -> per row `(len, d_model)`.
            let k = k.transpose(1, 2)?.flatten_all()?.to_vec1::<f32>()?;
            let v = v.transpose(1, 2)?.flatten_all()?.to_vec1::<f32>()?;
            for (r, row) in new.iter_mut().enumerate() {
                let span = r * len * d..(r + 1) * len * d;
                let (keys, values) = &mut row.layers[i];
                keys.extend_from_slice(&k[span.clone()]);
                values.extend_from_slice(&v[span]);
                row.len = len;
            }
        }
        all.extend(new);
        Ok(hidden)
    }

    /// Feeds one token per row (`tokens[row]`, at the row's own next position) through the
    /// decoder, appending its keys/values to the row's cache. Returns the final-layer-normed
    /// hidden states `(rows, 1, d_model)`. With [`SelfKv::Rows`], each row's self-attention
    /// is its own loop over its own cache, so a row computes the same whatever rows come with
    /// it and whenever it joined.
    pub fn step(&self, tokens: &[u32], cross: &CrossKv, kv: &mut SelfKv) -> Result<Tensor> {
        let device = self.device().clone();
        let rows = match kv {
            SelfKv::Batch(cache) => {
                let input = Tensor::from_vec(tokens.to_vec(), (tokens.len(), 1), &device)?;
                return self.forward(&input, cross, cache);
            }
            SelfKv::Rows(rows) => rows,
        };
        let b = tokens.len();
        if rows.len() != b {
            candle_core::bail!("decoder step: {b} tokens for {} cached rows", rows.len());
        }
        let d = self.n_head * self.head_dim;
        let positions: Vec<u32> = rows.iter().map(|r| r.len as u32).collect();
        let emb = self.embed_tokens.index_select(&Tensor::new(tokens, &device)?, 0)?.to_dtype(DType::F32)?;
        let pos = self.embed_positions.index_select(&Tensor::new(positions.as_slice(), &device)?, 0)?;
        let mut x = (emb + pos)?.reshape((b, 1, d))?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.self_ln.forward(&x)?;
            let a = &layer.self_attn;
            let q = (a.q.forward(&h)? * self.scale)?.flatten_all()?.to_vec1::<f32>()?;
            let k = (a.k.forward(&h)? * self.scale)?.flatten_all()?.to_vec1::<f32>()?;
            let v = a.v.forward(&h)?.flatten_all()?.to_vec1::<f32>()?;
            for (r, row) in rows.iter_mut().enumerate() {
                let (keys, values) = &mut row.layers[i];
                keys.extend_from_slice(&k[r * d..(r + 1) * d]);
                values.extend_from_slice(&v[r * d..(r + 1) * d]);
            }
            let (heads, hd) = (self.n_head, self.head_dim);
            let rows_ref: &[RowKv] = rows;
            let mut o = vec![0f32; b * d];
            o.par_chunks_mut(hd).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (pair, out)| {
                let (r, head) = (pair / heads, pair % heads);
                let row = &rows_ref[r];
                let (keys, values) = &row.layers[i];
                scores.resize(row.len + 1, 0.0);
                let q = &q[r * d + head * hd..r * d + (head + 1) * hd];
                // Queries come scaled already.
                cpu_kernels::attend(q, &keys[head * hd..], &values[head * hd..], d, 1.0, scores, out);
            });
            let o = Tensor::from_vec(o, (b, 1, d), &device)?;
            x = (x + a.out.forward(&o)?)?;
            x = self.cross_and_mlp(i, layer, x, cross)?;
        }
        for row in rows.iter_mut() {
            row.len += 1;
        }
        self.ln.forward(&x)
    }

    /// Layer `i`'s cross-attention over the windows' encoder output and its MLP, each with its
    /// residual, on hidden states `x` `(batch, tokens, d_model)`.
    fn cross_and_mlp(&self, i: usize, layer: &Layer, mut x: Tensor, cross: &CrossKv) -> Result<Tensor> {
        // Cross-attention over the window's encoder output.
        let h = layer.cross_ln.forward(&x)?;
        let a = &layer.cross_attn;
        let q = (self.heads(&a.q.forward(&h)?)? * self.scale)?;
        let o = match (cross.packed.get(i), cross.layers.get(i)) {
            (Some(packed), _) => attention::attend_heads(&q, packed)?,
            (None, Some((ck, cv))) => match attention::attend_one(&q, ck, KeyLayout::Transposed, cv, cross.frames.as_deref())? {
                Some(o) => o,
                None => {
                    let mut scores = q.matmul(ck)?;
                    if let Some(mask) = &cross.mask {
                        scores = scores.broadcast_add(mask)?;
                    }
                    softmax_last_dim(&scores)?.matmul(cv)?
                }
            },
            (None, None) => candle_core::bail!("no cross-attention keys for layer {i}"),
        };
        let o = self.merge(&o)?;
        x = (x + a.out.forward(&o)?)?;

        // MLP.
        let h = layer.mlp_ln.forward(&x)?;
        let h = layer.fc2.forward(&tern_kernels::cpu_ops::gelu(&layer.fc1.forward(&h)?, tern_kernels::cpu_ops::Gelu::Erf)?)?;
        x = (x + h)?;
        Ok(x)
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

    /// Logits `(batch, vocab)` for position `pos`, left on the device: [`Decoder::logits_at`],
    /// but on the CPU by the product [`Decoder::logits_vecs`] takes (F16 embeddings under F32
    /// states, BF16 products), so both give the same numbers there.
    pub fn logits_on_device(&self, hidden: &Tensor, pos: usize) -> Result<Tensor> {
        if !hidden.device().is_cpu() {
            return self.logits_at(hidden, pos);
        }
        let rows = self.logits_vecs(hidden, pos)?;
        let vocab = rows.first().map_or(0, Vec::len);
        Tensor::from_vec(rows.concat(), (rows.len(), vocab), hidden.device())
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
