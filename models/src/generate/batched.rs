//! The forward pass of every architecture of [`super::architecture`] made of candle's ops, so
//! it runs on any device candle does (a GPU's). Requests decode together as on the CPU
//! ([`super::BatchedPass`]): a step takes one token of every running request through each
//! weight matrix in one product, and each request keeps its own key/value cache, over which it
//! alone attends, so its tokens do not depend on what it is batched with.
//!
//! A step's attention is one set of kernels for every request: the requests' keys and values
//! live in caches shared by the batch, a slot (row) each ([`SlotCaches`]), so the number of
//! kernels a step launches does not grow with the requests in it, and the prompts of requests
//! admitted together are read in one pass ([`BatchedLlama::prefill_many`]). A step's logits
//! stay on the device, where every request's token is picked, greedy or sampled
//! ([`super::sampling`]): only the tokens come back to the host.

use std::io::{Read, Seek};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Embedding;
use tern_kernels::cpu_ops::softmax_last_dim;

use super::architecture::{Activation, Architecture, Config, RopeStyle};
use super::WeightLayout;

#[cfg(feature = "cuda")]
mod fused_step;

/// An RMS norm whose weight the fused step reads too.
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn from_qtensor(weight: QTensor, eps: f32) -> candle_core::Result<RmsNorm> {
        Ok(RmsNorm { weight: weight.dequantize(&weight.device())?.to_dtype(DType::F32)?, eps })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::rms_norm(x, &self.weight, self.eps)
    }
}

struct Layer {
    attn_norm: RmsNorm,
    qkv: Projections,
    /// Biases of q, k and v, `(heads, head_dim)` and twice `(kv_heads, head_dim)` (Qwen2).
    qkv_bias: Option<[Tensor; 3]>,
    /// RMS norms of each query and key head (Qwen3, Gemma 3).
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    attn_output: Matrix,
    post_attn_norm: Option<RmsNorm>,
    ffn_norm: RmsNorm,
    /// The gate's and the up projection's matrices, in that order.
    gate_up: Projections,
    down: Matrix,
    post_ffn_norm: Option<RmsNorm>,
    /// Attends over the window only, with the window's rotary tables (Gemma 3, Phi-3).
    windowed: bool,
}

/// Projections of the same input: dense, their matrices stacked into one (one product, one
/// kernel, for all of them); quantized, one product each. On a GPU a decoding step is bound by
/// its kernel launches, and stacking saves three of a layer's ~25.
enum Projections {
    /// `(sum of outs, in)`, F32; the outputs' widths in order.
    Stacked(Tensor, Vec<usize>),
    Apart(Vec<Matrix>),
}

impl Projections {
    fn new(matrices: Vec<Matrix>) -> candle_core::Result<Projections> {
        let dense: Option<Vec<&Tensor>> = matrices
            .iter()
            .map(|m| match m {
                Matrix::Dense(w) => Some(w),
                Matrix::Quantized(_) => None,
            })
            .collect();
        Ok(match dense {
            Some(ws) => Projections::Stacked(Tensor::cat(&ws, 0)?, ws.iter().map(|w| w.dim(0)).collect::<candle_core::Result<_>>()?),
            None => Projections::Apart(matrices),
        })
    }

    /// `x (rows, t, in)` through each matrix, in order, each output `(rows, t, out / unit,
    /// unit)` (`unit` divides every output's width); stacked, views of the one product.
    fn forward(&self, x: &Tensor, unit: usize) -> candle_core::Result<Vec<Tensor>> {
        let (rows, t, _) = x.dims3()?;
        let in_units = |y: Tensor| -> candle_core::Result<Tensor> {
            let width = y.dim(2)?;
            y.reshape((rows, t, width / unit, unit))
        };
        match self {
            Projections::Apart(ms) => ms.iter().map(|m| in_units(m.forward(x)?)).collect(),
            Projections::Stacked(w, widths) => {
                let y = in_units(x.reshape((rows * t, ()))?.matmul(&w.t()?)?.reshape((rows, t, ()))?)?;
                let mut at = 0;
                widths
                    .iter()
                    .map(|&n| {
                        at += n / unit;
                        y.narrow(2, at - n / unit, n / unit)
                    })
                    .collect()
            }
        }
    }
}

/// A weight matrix as [`WeightLayout`] keeps it.
enum Matrix {
    Quantized(QMatMul),
    /// `(out, in)`, F32.
    Dense(Tensor),
}

impl Matrix {
    /// `x (.., in)` times the matrix's transpose: `(.., out)`. A dense matrix multiplies every
    /// row of every request in one 2-D product (one GEMM), not one per leading index.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Matrix::Quantized(q) => q.forward(x),
            Matrix::Dense(w) => {
                let dims = x.dims();
                let (lead, inner) = dims.split_at(dims.len() - 1);
                let rows: usize = lead.iter().product();
                let y = x.reshape((rows, inner[0]))?.matmul(&w.t()?)?;
                let mut out = lead.to_vec();
                out.push(w.dim(0)?);
                y.reshape(out)
            }
        }
    }
}

/// A model on a candle device, any quantization candle multiplies.
pub(crate) struct BatchedLlama {
    cfg: Config,
    embeddings: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    output: Matrix,
    /// `positions x rotated / 2`, on the device: the full-attention layers' tables...
    cos: Tensor,
    sin: Tensor,
    /// ...and the window layers' (their own rotary base), where the model has a window.
    window_tables: Option<(Tensor, Tensor)>,
    /// A llama block as the fused step computes it (no variation of [`Config`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    plain: bool,
    device: Device,
    caches: Arc<Mutex<SlotCaches>>,
    /// Steps run as `fused_step` runs them (on a GPU, dense weights): default true where it
    /// serves the model ([`BatchedLlama::set_fused_step`]).
    fused_step: std::sync::atomic::AtomicBool,
    /// The fused step's cuBLAS products (steps of more than `fused_step::MAX_ROWS` rows) on
    /// TF32 tensor cores: default false ([`BatchedLlama::set_tf32_products`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tf32_products: std::sync::atomic::AtomicBool,
    #[cfg(feature = "cuda")]
    kernels: std::sync::OnceLock<fused_step::Kernels>,
}

/// The keys and values of every running request: per layer one key and one value tensor
/// `(slots, kv_heads, positions, head_dim)`, each request owning a slot (row) for its life, so
/// a decoding step writes every request's new key with one scatter and attends for all of
/// them with one product (no per-request kernels, no caches regrown by concatenation). The
/// last position of each row is scratch: slots with no request in a step write there.
#[derive(Default)]
struct SlotCaches {
    layers: Vec<(Tensor, Tensor)>,
    in_use: Vec<bool>,
}

impl SlotCaches {
    /// `(slots, positions)` the tensors hold; `(0, 0)` before the first request.
    fn dims(&self) -> (usize, usize) {
        self.layers.first().map_or((0, 0), |(k, _)| {
            let d = k.dims();
            (d[0], d[2])
        })
    }

    /// Slots and positions for one more request of `capacity` positions; its slot. Grows the
    /// tensors (doubling the slots, positions rounded up to 64) when they are too small.
    fn claim(&mut self, capacity: usize, cfg: &Config, device: &Device) -> candle_core::Result<usize> {
        let slot = match self.in_use.iter().position(|used| !used) {
            Some(free) => free,
            None => {
                self.in_use.push(false);
                self.in_use.len() - 1
            }
        };
        self.in_use[slot] = true;
        let (slots, positions) = self.dims();
        let need = (capacity + 1).max(positions);
        if slot >= slots || need > positions {
            let slots_now = if slot >= slots { (slots * 2).max(slot + 1) } else { slots };
            let positions_now = need.div_ceil(64) * 64;
            let grow = |t: Option<&Tensor>| -> candle_core::Result<Tensor> {
                match t {
                    None => Tensor::zeros((slots_now, cfg.kv_heads, positions_now, cfg.head_dim), DType::F32, device),
                    Some(t) => t.pad_with_zeros(2, 0, positions_now - positions)?.pad_with_zeros(0, 0, slots_now - slots),
                }
            };
            self.layers = (0..cfg.layers)
                .map(|l| Ok((grow(self.layers.get(l).map(|kv| &kv.0))?, grow(self.layers.get(l).map(|kv| &kv.1))?)))
                .collect::<candle_core::Result<_>>()?;
        }
        Ok(slot)
    }

    fn release(&mut self, slot: usize) {
        self.in_use[slot] = false;
        // With no request left, the memory goes back.
        if !self.in_use.contains(&true) {
            *self = SlotCaches::default();
        }
    }
}

/// One request's place in the shared caches: its slot and how many positions it has filled.
pub(crate) struct RowCache {
    slot: usize,
    len: usize,
    caches: Arc<Mutex<SlotCaches>>,
}

impl Drop for RowCache {
    fn drop(&mut self) {
        self.caches.lock().unwrap_or_else(|e| e.into_inner()).release(self.slot);
    }
}

impl BatchedLlama {
    /// Loads the model of shape `cfg` (the file's, [`Config::from_gguf`]) onto `device` with
    /// rotary tables for `positions` positions, its matrices kept as `layout` says.
    pub(crate) fn from_gguf<R: Read + Seek>(
        cfg: &Config,
        content: &Content,
        reader: &mut R,
        device: &Device,
        positions: usize,
        layout: WeightLayout,
    ) -> Result<BatchedLlama> {
        let mut cfg = cfg.clone();
        cfg.read_rope_factors(content, reader)?;
        let plain = cfg.arch == Architecture::Llama && cfg.rotated == cfg.head_dim && cfg.rope_scale == 1.0 && cfg.rope_factors.is_none();
        let mut tensor = |name: &str| content.tensor(reader, name, device).with_context(|| format!("reading {name}"));
        let matrix = |t: QTensor| -> Result<Matrix> {
            Ok(match layout {
                WeightLayout::Quantized => Matrix::Quantized(QMatMul::from_qtensor(t)?),
                WeightLayout::Dense => Matrix::Dense(t.dequantize(device)?.to_dtype(DType::F32)?),
            })
        };
        // A fused matrix (Phi-3's qkv and gate-up) cut into its parts' rows, exactly as stored.
        let parts = |t: QTensor, widths: &[usize]| -> Result<Vec<Matrix>> {
            if widths.len() == 1 {
                return Ok(vec![matrix(t)?]);
            }
            let (dtype, cols) = (t.dtype(), t.shape().dims()[1]);
            let row_bytes = cols / dtype.block_size() * dtype.type_size();
            let data = t.data()?;
            let mut at = 0;
            widths
                .iter()
                .map(|&rows| {
                    let part = candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &data[at * row_bytes..(at + rows) * row_bytes], vec![rows, cols], device)?;
                    at += rows;
                    matrix(part)
                })
                .collect()
        };
        let eps = cfg.rms_eps;
        let norm = |t| RmsNorm::from_qtensor(t, eps).map_err(anyhow::Error::from);
        let (q_dim, kv_dim) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let name = |part: &str| format!("blk.{l}.{part}.weight");
            let has = |part: &str| content.tensor_infos.contains_key(&name(part));
            let mut qkv = Vec::new();
            let qkv_names = cfg.qkv_names(l);
            let qkv_widths: Vec<Vec<usize>> = if qkv_names.len() == 1 { vec![vec![q_dim, kv_dim, kv_dim]] } else { vec![vec![q_dim], vec![kv_dim], vec![kv_dim]] };
            for (n, w) in qkv_names.iter().zip(&qkv_widths) {
                qkv.extend(parts(tensor(n)?, w)?);
            }
            let mut gate_up = Vec::new();
            let gate_up_names = cfg.gate_up_names(l);
            let gate_up_widths: Vec<Vec<usize>> = if gate_up_names.len() == 1 { vec![vec![cfg.ffn, cfg.ffn]] } else { vec![vec![cfg.ffn], vec![cfg.ffn]] };
            for (n, w) in gate_up_names.iter().zip(&gate_up_widths) {
                gate_up.extend(parts(tensor(n)?, w)?);
            }
            let qkv_bias = match cfg.qkv_bias {
                true => {
                    let mut bias = |part: &str, heads: usize| -> Result<Tensor> {
                        Ok(tensor(&format!("blk.{l}.{part}.bias"))?.dequantize(device)?.to_dtype(DType::F32)?.reshape((heads, cfg.head_dim))?)
                    };
                    Some([bias("attn_q", cfg.heads)?, bias("attn_k", cfg.kv_heads)?, bias("attn_v", cfg.kv_heads)?])
                }
                false => None,
            };
            let qk_norm = match has("attn_q_norm") {
                true => Some((norm(tensor(&name("attn_q_norm"))?)?, norm(tensor(&name("attn_k_norm"))?)?)),
                false => None,
            };
            let post_attn_norm = if has("post_attention_norm") { Some(norm(tensor(&name("post_attention_norm"))?)?) } else { None };
            let post_ffn_norm = if has("post_ffw_norm") { Some(norm(tensor(&name("post_ffw_norm"))?)?) } else { None };
            layers.push(Layer {
                attn_norm: norm(tensor(&name("attn_norm"))?)?,
                qkv: Projections::new(qkv)?,
                qkv_bias,
                qk_norm,
                attn_output: matrix(tensor(&name("attn_output"))?)?,
                post_attn_norm,
                ffn_norm: norm(tensor(&name("ffn_norm"))?)?,
                gate_up: Projections::new(gate_up)?,
                down: matrix(tensor(&name("ffn_down"))?)?,
                post_ffn_norm,
                windowed: cfg.windowed(l),
            });
        }
        let embedding_table = tensor("token_embd.weight")?;
        let embeddings = Embedding::new(embedding_table.dequantize(device)?, cfg.hidden);
        // Tied embeddings when the file has no output matrix; dense, the lookup's table is it.
        let output = match (content.tensor_infos.contains_key("output.weight"), layout) {
            (true, _) => matrix(tensor("output.weight")?)?,
            (false, WeightLayout::Dense) => Matrix::Dense(embeddings.embeddings().to_dtype(DType::F32)?),
            (false, WeightLayout::Quantized) => matrix(embedding_table)?,
        };
        let norm = norm(tensor("output_norm.weight")?)?;
        let half = cfg.rotated / 2;
        let tables = |windowed: bool| -> candle_core::Result<(Tensor, Tensor)> {
            let (cos, sin) = cfg.rotary_tables(positions, windowed);
            Ok((Tensor::from_vec(cos, (positions, half), device)?, Tensor::from_vec(sin, (positions, half), device)?))
        };
        let (cos, sin) = tables(false)?;
        let window_tables = if cfg.window.is_some() { Some(tables(true)?) } else { None };
        let batched = BatchedLlama {
            cos,
            sin,
            window_tables,
            plain,
            cfg,
            embeddings,
            layers,
            norm,
            output,
            device: device.clone(),
            caches: Arc::default(),
            fused_step: false.into(),
            tf32_products: false.into(),
            #[cfg(feature = "cuda")]
            kernels: Default::default(),
        };
        batched.set_fused_step(true);
        Ok(batched)
    }

    /// Whether decoding steps run fused on a GPU (`fused_step`; the default where it serves the
    /// model) or as candle's ops: for benchmarks comparing the two. Has no effect where the
    /// fused step does not serve the model.
    pub(crate) fn set_fused_step(&self, on: bool) {
        #[cfg(feature = "cuda")]
        let on = on && self.plain && fused_step::supports(self);
        #[cfg(not(feature = "cuda"))]
        let on = {
            let _ = on;
            false
        };
        self.fused_step.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the fused step multiplies steps of more than 8 rows on TF32 tensor cores
    /// (`TERN_PRECISION=tf32-products`) or in F32 (the default). TF32 rounds each product's inputs to 10 bits
    /// of mantissa and sums in F32: a 256-request step of SmolLM2 3.0 ms against 4.6 in F32 on
    /// an H200, logits within 0.2% of the largest (docs/benchmarks.md). No effect off a GPU.
    pub(crate) fn set_tf32_products(&self, on: bool) {
        self.tf32_products.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// A place in the shared caches for one request of up to `capacity` positions.
    pub(crate) fn new_cache(&self, capacity: usize) -> Result<RowCache> {
        let slot = self.lock_caches().claim(capacity, &self.cfg, &self.device)?;
        Ok(RowCache { slot, len: 0, caches: self.caches.clone() })
    }

    fn lock_caches(&self) -> std::sync::MutexGuard<'_, SlotCaches> {
        self.caches.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one request's `tokens` at the positions after those in its cache (adding theirs to
    /// it) and returns the logits of the last one.
    pub(crate) fn prefill(&self, tokens: &[u32], cache: &mut RowCache) -> Result<Vec<f32>> {
        let (t, start) = (tokens.len(), cache.len);
        let ids = Tensor::new(tokens, &self.device)?.unsqueeze(0)?;
        let tables = self.tables_at(|cos| cos.narrow(0, start, t))?;
        let groups = self.cfg.heads / self.cfg.kv_heads;
        let masks = [self.causal_mask(start, t, false)?, self.causal_mask(start, t, true)?];
        let caches = self.lock_caches();
        let attend = |l: usize, q: &Tensor, k: &Tensor, v: &Tensor| -> candle_core::Result<Tensor> {
            let (ck, cv) = &caches.layers[l];
            let (ck, cv) = (ck.narrow(0, cache.slot, 1)?, cv.narrow(0, cache.slot, 1)?);
            ck.slice_set(k, 2, start)?;
            cv.slice_set(v, 2, start)?;
            let Config { heads, kv_heads, head_dim, .. } = self.cfg;
            let q = q.reshape((1, kv_heads, groups * t, head_dim))?;
            let scores = (q.matmul(&ck.narrow(2, 0, start + t)?.t()?)? * self.scale())?;
            let scores = match &masks[usize::from(self.layers[l].windowed)] {
                Some(mask) => scores.broadcast_add(mask)?,
                None => scores,
            };
            let y = softmax_last_dim(&scores)?.matmul(&cv.narrow(2, 0, start + t)?)?;
            y.reshape((1, heads, t, head_dim))?.transpose(1, 2)?.reshape((1, t, heads * head_dim))
        };
        let logits = self.forward(&ids, &tables, None, attend)?;
        drop(caches);
        cache.len += t;
        Ok(logits.flatten_all()?.to_vec1()?)
    }

    /// Reads the prompts of several requests whose caches are still empty in one pass, each
    /// right-padded to the longest (its padding comes after its tokens, so causality hides it
    /// from them; its keys land past the request's length, where its first steps overwrite
    /// them before attending there). Returns the logits of each prompt's last token, in order.
    /// A request with tokens already cached, or one alone, is read as by [`Self::prefill`].
    ///
    /// On a GPU this is one pass of a few hundred kernels for the whole group instead of one
    /// per request; the caller bounds the padded tokens per group.
    pub(crate) fn prefill_many(&self, prompts: &mut [(&[u32], &mut RowCache)]) -> Result<Vec<Vec<f32>>> {
        if prompts.len() < 2 || prompts.iter().any(|(tokens, cache)| cache.len > 0 || tokens.is_empty()) {
            return prompts.iter_mut().map(|(tokens, cache)| self.prefill(tokens, cache)).collect();
        }
        let n = prompts.len();
        let t = prompts.iter().map(|(tokens, _)| tokens.len()).max().unwrap_or(1);
        let mut ids = Vec::with_capacity(n * t);
        let mut last = Vec::with_capacity(n);
        for (r, (tokens, _)) in prompts.iter().enumerate() {
            ids.extend_from_slice(tokens);
            // Padding repeats the last token: any id in the vocabulary does.
            ids.extend(std::iter::repeat_n(tokens[tokens.len() - 1], t - tokens.len()));
            last.push((r * t + tokens.len() - 1) as u32);
        }
        let ids = Tensor::from_vec(ids, (n, t), &self.device)?;
        let last = Tensor::new(last.as_slice(), &self.device)?;
        let tables = self.tables_at(|cos| cos.narrow(0, 0, t))?;
        let Config { heads, kv_heads, head_dim, .. } = self.cfg;
        let groups = heads / kv_heads;
        // Causal over the new tokens alone: nothing is cached.
        let masks = [self.causal_mask(0, t, false)?, self.causal_mask(0, t, true)?];
        let slots: Vec<usize> = prompts.iter().map(|(_, cache)| cache.slot).collect();
        let caches = self.lock_caches();
        let attend = |l: usize, q: &Tensor, k: &Tensor, v: &Tensor| -> candle_core::Result<Tensor> {
            let (ck, cv) = &caches.layers[l];
            for (r, &slot) in slots.iter().enumerate() {
                ck.narrow(0, slot, 1)?.slice_set(&k.narrow(0, r, 1)?, 2, 0)?;
                cv.narrow(0, slot, 1)?.slice_set(&v.narrow(0, r, 1)?, 2, 0)?;
            }
            let q = q.reshape((n, kv_heads, groups * t, head_dim))?;
            let scores = (q.matmul(&k.t()?)? * self.scale())?;
            let scores = match &masks[usize::from(self.layers[l].windowed)] {
                Some(mask) => scores.broadcast_add(mask)?,
                None => scores,
            };
            let y = softmax_last_dim(&scores)?.matmul(v)?;
            y.reshape((n, heads, t, head_dim))?.transpose(1, 2)?.reshape((n, t, heads * head_dim))
        };
        let logits = self.forward(&ids, &tables, Some(&last), attend)?;
        drop(caches);
        for (tokens, cache) in prompts.iter_mut() {
            cache.len = tokens.len();
        }
        Ok(logits.to_vec2()?)
    }

    /// One token of each request, at the position after those in its cache; the logits of
    /// each, in order, `(rows, vocabulary)` on the device.
    pub(crate) fn step(&self, rows: &mut [(u32, &mut RowCache)]) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.fused_step.load(std::sync::atomic::Ordering::Relaxed) {
            return self.step_fused(rows);
        }
        let n = rows.len();
        let tokens: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let positions: Vec<u32> = rows.iter().map(|r| r.1.len as u32).collect();
        let ids = Tensor::new(tokens.as_slice(), &self.device)?.unsqueeze(1)?;
        let positions_t = Tensor::new(positions.as_slice(), &self.device)?;
        // (rows, 1, rotated / 2): each row's own position.
        let tables = self.tables_at(|cos| cos.index_select(&positions_t, 0)?.unsqueeze(1))?;
        let caches = self.lock_caches();
        let Config { heads, kv_heads, head_dim, .. } = self.cfg;
        let groups = heads / kv_heads;
        // Attention runs over the slots up to the highest in this step, in slot order: each
        // slot's row (or row 0 for a slot no row of this step holds, writing to the scratch
        // position and seeing position 0 only), over the positions up to the longest row's.
        let slots = rows.iter().map(|r| r.1.slot + 1).max().unwrap_or(0);
        let span = positions.iter().map(|&p| p as usize + 1).max().unwrap_or(1);
        let scratch = caches.dims().1 - 1;
        let mut row_of_slot = vec![None; slots];
        for (r, row) in rows.iter().enumerate() {
            row_of_slot[row.1.slot] = Some(r);
        }
        let source: Vec<u32> = row_of_slot.iter().map(|r| r.unwrap_or(0) as u32).collect();
        let write_at: Vec<u32> = row_of_slot.iter().map(|r| r.map_or(scratch as u32, |r| positions[r])).collect();
        let mask = |window: Option<usize>| -> Vec<f32> {
            row_of_slot
                .iter()
                .flat_map(|r| {
                    let seen = r.map_or(0, |r| positions[r] as usize);
                    (0..span).map(move |j| if j > seen || window.is_some_and(|w| seen - j >= w) { f32::NEG_INFINITY } else { 0.0 })
                })
                .collect()
        };
        let source = Tensor::new(source.as_slice(), &self.device)?;
        let back: Vec<u32> = rows.iter().map(|r| r.1.slot as u32).collect();
        let back = Tensor::new(back.as_slice(), &self.device)?;
        let write_at = Tensor::new(write_at.as_slice(), &self.device)?.reshape((slots, 1, 1, 1))?.broadcast_as((slots, kv_heads, 1, head_dim))?.contiguous()?;
        let masks = [Tensor::from_vec(mask(None), (slots, 1, 1, span), &self.device)?, Tensor::from_vec(mask(self.cfg.window), (slots, 1, 1, span), &self.device)?];
        // Row r in slot r (one request alone, or a batch none has left): the rows are already
        // in slot order, and four gathers per layer are skipped.
        let in_order = rows.iter().enumerate().all(|(r, row)| row.1.slot == r);
        let to_slots = |x: &Tensor| if in_order { Ok(x.clone()) } else { x.index_select(&source, 0) };
        let attend = |l: usize, q: &Tensor, k: &Tensor, v: &Tensor| -> candle_core::Result<Tensor> {
            let (ck, cv) = &caches.layers[l];
            let (ck, cv) = (ck.narrow(0, 0, slots)?, cv.narrow(0, 0, slots)?);
            ck.scatter_set(&write_at, &to_slots(k)?, 2)?;
            cv.scatter_set(&write_at, &to_slots(v)?, 2)?;
            let q = to_slots(q)?.reshape((slots, kv_heads, groups, head_dim))?;
            let scores = (q.matmul(&ck.narrow(2, 0, span)?.t()?)? * self.scale())?.broadcast_add(&masks[usize::from(self.layers[l].windowed)])?;
            let y = softmax_last_dim(&scores)?.matmul(&cv.narrow(2, 0, span)?)?.reshape((slots, heads * head_dim))?;
            let y = if in_order { y } else { y.index_select(&back, 0)? };
            y.reshape((n, 1, heads * head_dim))
        };
        let logits = self.forward(&ids, &tables, None, attend)?;
        drop(caches);
        for row in rows.iter_mut() {
            row.1.len += 1;
        }
        Ok(logits)
    }

    /// The fused step against candle's ops on the same states: `requests` prompts read into two
    /// sets of caches, then `steps` greedy steps of each (both fed the unfused step's tokens).
    /// For `tern-bench-models --only step-check`.
    #[cfg(feature = "bench")]
    pub(crate) fn compare_fused_step(&self, requests: usize, steps: usize) -> Result<super::FusedStepCheck> {
        use std::sync::atomic::Ordering;
        use std::time::Instant;
        let was = self.fused_step.load(Ordering::Relaxed);
        let prompts: Vec<Vec<u32>> = (0..requests).map(|r| (0..5 + 3 * (r % 7)).map(|i| ((r * 7919 + i * 104_729) % 1000 + 10) as u32).collect()).collect();
        let capacity = prompts.iter().map(Vec::len).max().unwrap_or(0) + steps + 1;
        let (mut fused, mut plain): (Vec<RowCache>, Vec<RowCache>) = (Vec::new(), Vec::new());
        let mut next = Vec::new();
        for p in &prompts {
            let (mut a, mut b) = (self.new_cache(capacity)?, self.new_cache(capacity)?);
            self.prefill(p, &mut a)?;
            let logits = self.prefill(p, &mut b)?;
            next.push(logits.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).map_or(0, |(i, _)| i as u32));
            fused.push(a);
            plain.push(b);
        }
        let mut check = super::FusedStepCheck { requests, steps, ..Default::default() };
        for _ in 0..steps {
            let run = |on: bool, caches: &mut Vec<RowCache>| -> Result<(Vec<f32>, Vec<u32>, f64)> {
                self.fused_step.store(on, Ordering::Relaxed);
                let mut rows: Vec<(u32, &mut RowCache)> = next.iter().copied().zip(caches.iter_mut()).collect();
                let start = Instant::now();
                let logits = self.step(&mut rows)?;
                let tokens = logits.argmax(1)?.to_vec1::<u32>()?;
                let secs = start.elapsed().as_secs_f64();
                Ok((logits.flatten_all()?.to_vec1()?, tokens, secs))
            };
            let (a, ta, sa) = run(true, &mut fused)?;
            let (b, tb, sb) = run(false, &mut plain)?;
            check.fused_secs += sa;
            check.plain_secs += sb;
            for (x, y) in a.iter().zip(&b) {
                check.max_diff = check.max_diff.max((x - y).abs());
                check.max_logit = check.max_logit.max(y.abs());
            }
            check.same_tokens += ta.iter().zip(&tb).filter(|(x, y)| x == y).count();
            next = tb;
        }
        self.fused_step.store(was, Ordering::Relaxed);
        Ok(check)
    }

    /// The attention mask of `t` new tokens after `start` cached ones, `(groups x t, start +
    /// t)`: token i sees the cache and the new tokens up to itself (from the window's first, on
    /// a `windowed` layer). A group's heads share keys, so the rows are the group's heads'
    /// tokens in turn. `None` where every token sees all: one token, no window.
    fn causal_mask(&self, start: usize, t: usize, windowed: bool) -> candle_core::Result<Option<Tensor>> {
        let groups = self.cfg.heads / self.cfg.kv_heads;
        let window = self.cfg.window.filter(|_| windowed);
        (t > 1 || window.is_some_and(|w| start + t > w))
            .then(|| {
                let mask: Vec<f32> = (0..groups * t)
                    .flat_map(|row| {
                        let at = start + row % t;
                        (0..start + t).map(move |j| if j > at || window.is_some_and(|w| at - j >= w) { f32::NEG_INFINITY } else { 0.0 })
                    })
                    .collect();
                Tensor::from_vec(mask, (groups * t, start + t), &self.device)
            })
            .transpose()
    }

    fn scale(&self) -> f64 {
        self.cfg.attention_scale as f64
    }

    /// The rotary tables of the full-attention layers and of the window's, each `pick`ed (the
    /// rows of the positions at hand).
    fn tables_at(&self, pick: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> candle_core::Result<[(Tensor, Tensor); 2]> {
        let full = (pick(&self.cos)?, pick(&self.sin)?);
        let window = match &self.window_tables {
            Some((cos, sin)) => (pick(cos)?, pick(sin)?),
            None => full.clone(),
        };
        Ok([full, window])
    }

    /// Rotary embedding of `x` `(rows, heads, t, head_dim)`: its first `rotated` dimensions, as
    /// the architecture pairs them.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        let (rotated, head_dim) = (self.cfg.rotated, self.cfg.head_dim);
        let turn = |x: &Tensor| match self.cfg.rope_style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin),
            RopeStyle::Halves => candle_nn::rotary_emb::rope(x, cos, sin),
        };
        if rotated == head_dim {
            return turn(x);
        }
        let turned = turn(&x.narrow(3, 0, rotated)?.contiguous()?)?;
        Tensor::cat(&[&turned, &x.narrow(3, rotated, head_dim - rotated)?], 3)
    }

    /// `ids` `(rows, t)`: row r's tokens after those already in the caches; `attend(layer, q, k,
    /// v)` stores the new keys and values and returns the attention output `(rows, t, hidden)`.
    /// Returns the logits of each row's last token, `(rows, vocab)`; `last`, where rows are
    /// padded, names each row's last token as an index into the `rows x t` tokens.
    fn forward(
        &self,
        ids: &Tensor,
        tables: &[(Tensor, Tensor); 2],
        last: Option<&Tensor>,
        attend: impl Fn(usize, &Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let (rows, t) = ids.dims2()?;
        let head_dim = self.cfg.head_dim;
        // (rows, t, heads, head_dim) to (rows, heads, t, head_dim): one copy.
        let split = |x: &Tensor| x.transpose(1, 2)?.contiguous();
        let mut x = self.embeddings.forward(ids)?;
        if let Some(scale) = self.cfg.embedding_scale {
            x = (x * scale as f64)?;
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let h = layer.attn_norm.forward(&x)?;
            let mut qkv = layer.qkv.forward(&h, head_dim)?;
            if let Some(bias) = &layer.qkv_bias {
                for (y, b) in qkv.iter_mut().zip(bias) {
                    *y = y.broadcast_add(b)?;
                }
            }
            if let Some((q_norm, k_norm)) = &layer.qk_norm {
                qkv[0] = q_norm.forward(&qkv[0].contiguous()?)?;
                qkv[1] = k_norm.forward(&qkv[1].contiguous()?)?;
            }
            let (cos, sin) = &tables[usize::from(layer.windowed)];
            let q = self.rotate(&split(&qkv[0])?, cos, sin)?;
            let k = self.rotate(&split(&qkv[1])?, cos, sin)?;
            let v = split(&qkv[2])?;
            let y = attend(l, &q, &k, &v)?;
            let mut attended = layer.attn_output.forward(&y)?;
            if let Some(norm) = &layer.post_attn_norm {
                attended = norm.forward(&attended)?;
            }
            x = (x + attended)?;
            let h = layer.ffn_norm.forward(&x)?;
            let gate_up = layer.gate_up.forward(&h, 1)?;
            let gate = gate_up[0].squeeze(3)?;
            let gate = match self.cfg.activation {
                Activation::Silu => candle_nn::ops::silu(&gate)?,
                Activation::GeluTanh => gate.gelu()?,
            };
            let mut fed = layer.down.forward(&(gate * gate_up[1].squeeze(3)?)?)?;
            if let Some(norm) = &layer.post_ffn_norm {
                fed = norm.forward(&fed)?;
            }
            x = (x + fed)?;
        }
        let last = match last {
            Some(last) => x.reshape((rows * t, ()))?.index_select(last, 0)?,
            None => x.narrow(1, t - 1, 1)?.squeeze(1)?,
        };
        self.output.forward(&self.norm.forward(&last)?)?.to_dtype(DType::F32)
    }
}
