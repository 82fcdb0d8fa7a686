//! The llama forward pass made of candle's ops, so it runs on any device candle does (a GPU's;
//! the CPU for quantizations tern's own pass lacks). Requests decode together as on the CPU
//! ([`super::BatchedPass`]): a step takes one token of every running request through each
//! weight matrix in one product, and each request keeps its own key/value cache, over which it
//! alone attends, so its tokens do not depend on what it is batched with.
//!
//! Still to make a GPU's step cheap (issue 19): attention runs per request (a few small
//! kernels each per layer), the caches grow by concatenation, and the logits come back to the
//! host for sampling.

use std::io::{Read, Seek};

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Embedding;
use candle_transformers::quantized_nn::RmsNorm;

use super::llama::Config;

struct Layer {
    attn_norm: RmsNorm,
    q: QMatMul,
    k: QMatMul,
    v: QMatMul,
    attn_output: QMatMul,
    ffn_norm: RmsNorm,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
}

/// A llama-architecture model on a candle device, any quantization candle multiplies.
pub(crate) struct BatchedLlama {
    cfg: Config,
    embeddings: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    output: QMatMul,
    /// `positions x head_dim / 2`, on the device.
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

/// One request's keys and values, per layer `(1, kv_heads, len, head_dim)`.
pub(crate) struct RowCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl RowCache {
    /// Adds layer `l`'s new keys and values and returns all of them.
    fn append(&mut self, l: usize, k: Tensor, v: Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let kv = match self.layers[l].take() {
            None => (k, v),
            Some((ks, vs)) => (Tensor::cat(&[&ks, &k], 2)?, Tensor::cat(&[&vs, &v], 2)?),
        };
        self.layers[l] = Some(kv.clone());
        Ok(kv)
    }
}

impl BatchedLlama {
    /// Loads the model onto `device` with rotary tables for `positions` positions; `Ok(None)`
    /// for a variant it does not implement ([`Config::from_gguf`]).
    pub(crate) fn from_gguf<R: Read + Seek>(content: &Content, reader: &mut R, device: &Device, positions: usize) -> Result<Option<BatchedLlama>> {
        let Some(cfg) = Config::from_gguf(content)? else { return Ok(None) };
        let mut tensor = |name: &str| content.tensor(reader, name, device).with_context(|| format!("reading {name}"));
        let matrix = |t| QMatMul::from_qtensor(t).map_err(anyhow::Error::from);
        let norm = |t| RmsNorm::from_qtensor(t, f64::from(cfg.rms_eps)).map_err(anyhow::Error::from);
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let name = |part: &str| format!("blk.{l}.{part}.weight");
            layers.push(Layer {
                attn_norm: norm(tensor(&name("attn_norm"))?)?,
                q: matrix(tensor(&name("attn_q"))?)?,
                k: matrix(tensor(&name("attn_k"))?)?,
                v: matrix(tensor(&name("attn_v"))?)?,
                attn_output: matrix(tensor(&name("attn_output"))?)?,
                ffn_norm: norm(tensor(&name("ffn_norm"))?)?,
                gate: matrix(tensor(&name("ffn_gate"))?)?,
                up: matrix(tensor(&name("ffn_up"))?)?,
                down: matrix(tensor(&name("ffn_down"))?)?,
            });
        }
        let embedding_table = tensor("token_embd.weight")?;
        let embeddings = Embedding::new(embedding_table.dequantize(device)?, cfg.hidden);
        // Tied embeddings when the file has no output matrix.
        let output = match content.tensor_infos.contains_key("output.weight") {
            true => matrix(tensor("output.weight")?)?,
            false => matrix(embedding_table)?,
        };
        let norm = norm(tensor("output_norm.weight")?)?;
        let (cos, sin) = cfg.rotary_tables(positions);
        let half = cfg.head_dim / 2;
        Ok(Some(BatchedLlama {
            cos: Tensor::from_vec(cos, (positions, half), device)?,
            sin: Tensor::from_vec(sin, (positions, half), device)?,
            cfg,
            embeddings,
            layers,
            norm,
            output,
            device: device.clone(),
        }))
    }

    /// An empty cache for one request.
    pub(crate) fn new_cache(&self) -> RowCache {
        RowCache { layers: vec![None; self.layers.len()], len: 0 }
    }

    /// Runs one request's `tokens` at the positions after those in its cache (adding theirs to
    /// it) and returns the logits of the last one.
    pub(crate) fn prefill(&self, tokens: &[u32], cache: &mut RowCache) -> Result<Vec<f32>> {
        let (t, start) = (tokens.len(), cache.len);
        let ids = Tensor::new(tokens, &self.device)?.unsqueeze(0)?;
        let cos = self.cos.narrow(0, start, t)?;
        let sin = self.sin.narrow(0, start, t)?;
        // Token i sees the cache and the new tokens up to itself.
        let mask = (t > 1)
            .then(|| {
                let mask: Vec<f32> = (0..t).flat_map(|i| (0..start + t).map(move |j| if j > start + i { f32::NEG_INFINITY } else { 0.0 })).collect();
                Tensor::from_vec(mask, (t, start + t), &self.device)
            })
            .transpose()?;
        let logits = self.forward(&ids, &cos, &sin, &mut [cache], mask.as_ref())?;
        Ok(logits.flatten_all()?.to_vec1()?)
    }

    /// One token of each request, at the position after those in its cache; the logits of
    /// each, in order.
    pub(crate) fn step(&self, rows: &mut [(u32, &mut RowCache)]) -> Result<Vec<Vec<f32>>> {
        let tokens: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let positions: Vec<u32> = rows.iter().map(|r| r.1.len as u32).collect();
        let ids = Tensor::new(tokens.as_slice(), &self.device)?.unsqueeze(1)?;
        let positions = Tensor::new(positions.as_slice(), &self.device)?;
        // (rows, 1, head_dim / 2): each row's own position.
        let cos = self.cos.index_select(&positions, 0)?.unsqueeze(1)?;
        let sin = self.sin.index_select(&positions, 0)?.unsqueeze(1)?;
        let mut caches: Vec<&mut RowCache> = rows.iter_mut().map(|r| &mut *r.1).collect();
        Ok(self.forward(&ids, &cos, &sin, &mut caches, None)?.to_vec2()?)
    }

    /// `ids` `(rows, t)`: row r's tokens after those in `caches[r]`. Returns the logits of each
    /// row's last token, `(rows, vocab)`.
    fn forward(&self, ids: &Tensor, cos: &Tensor, sin: &Tensor, caches: &mut [&mut RowCache], mask: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let (rows, t) = ids.dims2()?;
        let Config { heads, kv_heads, head_dim, .. } = self.cfg;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let split = |x: Tensor, n: usize| x.reshape((rows, t, n, head_dim))?.transpose(1, 2)?.contiguous();
        let mut x = self.embeddings.forward(ids)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = layer.attn_norm.forward(&x)?;
            let q = candle_nn::rotary_emb::rope_i(&split(layer.q.forward(&h)?, heads)?, cos, sin)?;
            let k = candle_nn::rotary_emb::rope_i(&split(layer.k.forward(&h)?, kv_heads)?, cos, sin)?;
            let v = split(layer.v.forward(&h)?, kv_heads)?;
            let mut attended = Vec::with_capacity(rows);
            for (r, cache) in caches.iter_mut().enumerate() {
                let (ks, vs) = cache.append(l, k.narrow(0, r, 1)?, v.narrow(0, r, 1)?)?;
                let ks = candle_transformers::utils::repeat_kv(ks, heads / kv_heads)?;
                let vs = candle_transformers::utils::repeat_kv(vs, heads / kv_heads)?;
                let scores = (q.narrow(0, r, 1)?.matmul(&ks.t()?)? * scale)?;
                let scores = match mask {
                    Some(mask) => scores.broadcast_add(mask)?,
                    None => scores,
                };
                attended.push(candle_nn::ops::softmax_last_dim(&scores)?.matmul(&vs.contiguous()?)?);
            }
            let y = Tensor::cat(&attended, 0)?.transpose(1, 2)?.reshape((rows, t, heads * head_dim))?;
            x = (x + layer.attn_output.forward(&y)?)?;
            let h = layer.ffn_norm.forward(&x)?;
            let gated = (candle_nn::ops::silu(&layer.gate.forward(&h)?)? * layer.up.forward(&h)?)?;
            x = (x + layer.down.forward(&gated)?)?;
        }
        for cache in caches.iter_mut() {
            cache.len += t;
        }
        let last = x.narrow(1, t - 1, 1)?.squeeze(1)?;
        self.output.forward(&self.norm.forward(&last)?)?.to_dtype(DType::F32)
    }
}
