//! tern's forward pass on the CPU, straight over the quantized blocks of a GGUF file, for every
//! architecture of [`super::architecture`].
//!
//! candle's `quantized_llama` runs every step as some 20 tensor ops per layer, each with its
//! own allocation and thread dispatch, and multiplies Q4_1 weights with scalar code. Here a
//! layer is four products over the file's own blocks ([`tern_kernels::quantized`]: q, k and v
//! stacked into one matrix, gate and up into another, each part of its own type), with the small
//! steps between them (norms, rotary embeddings, attention over the KV cache) as plain loops.
//! The weights keep the file's values: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K are
//! multiplied as stored; only rarer types are re-quantized to Q8_0 at load
//! ([`convertible_to_q8_0`]).

use std::io::{Read, Seek, SeekFrom};

use anyhow::{ensure, Context, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use rayon::prelude::*;

use super::architecture::{rotate_head, Activation, Config};
use tern_kernels::cpu_kernels;
use tern_kernels::quantized::{QMatrix, QType, QuantizedRows, BLOCK};

struct Layer {
    attn_norm: Vec<f32>,
    /// q, k and v projections stacked: `heads + 2 kv_heads` heads of output.
    qkv: QMatrix,
    /// Their biases, stacked the same way (Qwen2).
    qkv_bias: Option<Vec<f32>>,
    /// RMS norm weights of each query and key head (Qwen3, Gemma 3).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    attn_output: QMatrix,
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    /// Gate and up projections stacked: `2 ffn` outputs.
    gate_up: QMatrix,
    down: QMatrix,
    post_ffn_norm: Option<Vec<f32>>,
    /// Which rotary tables: 0 full attention, 1 the window's.
    rotary: usize,
}

/// A model whose matrices are all Q4_0, Q4_1 or Q8_0, on the CPU.
pub(crate) struct CpuPass {
    cfg: Config,
    /// Token embeddings, also the output matrix when the file has no `output.weight`.
    embeddings: QMatrix,
    output: Option<QMatrix>,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    /// Rotary angles' cosines and sines, `positions x rotated / 2`: the full-attention layers'
    /// and the window layers'.
    rotary: Vec<(Vec<f32>, Vec<f32>)>,
}

/// Keys and values of the positions seen so far, per layer: `positions x kv_heads x head_dim`.
pub(crate) struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

/// One sequence's new tokens and its cache, for [`CpuPass::forward_batch`].
pub(crate) struct Segment<'a> {
    pub(crate) tokens: &'a [u32],
    pub(crate) cache: &'a mut KvCache,
}

#[cfg(test)]
impl KvCache {
    /// Positions held.
    fn len(&self) -> usize {
        self.len
    }
}

/// The matrices of `content` this pass multiplies only once re-quantized to Q8_0: those of a
/// type [`tern_kernels::quantized`] has no products for (Q2_K, Q3_K, the IQ types, F16 and
/// F32 matrices). Empty when the file is ready as it is, as files of the usual types
/// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, mixed as the K_M/K_S files mix them) are.
pub(crate) fn convertible_to_q8_0(content: &Content) -> Vec<String> {
    content
        .tensor_infos
        .iter()
        .filter(|(_, i)| i.shape.rank() == 2 && qtype(i.ggml_dtype).is_none())
        .map(|(n, _)| n.clone())
        .collect()
}

impl CpuPass {
    /// Loads the model of shape `cfg` (the file's, [`Config::from_gguf`]), with rotary tables
    /// for `positions` positions. `Ok(None)` when the file holds a matrix this pass does not
    /// multiply (see [`convertible_to_q8_0`]) or rows that are not whole 32-wide blocks.
    pub(crate) fn from_gguf<R: Read + Seek>(cfg: &Config, content: &Content, reader: &mut R, positions: usize) -> Result<Option<CpuPass>> {
        // Matrix types are convertible_to_q8_0's to check.
        let whole_blocks = content.tensor_infos.values().all(|info| match info.shape.rank() {
            2 => info.shape.dims()[1] % BLOCK == 0,
            _ => info.ggml_dtype == GgmlDType::F32,
        });
        if !whole_blocks || !convertible_to_q8_0(content).is_empty() {
            return Ok(None);
        }
        let mut cfg = cfg.clone();
        cfg.read_rope_factors(content, reader)?;
        let (hidden, heads, kv_heads, head_dim) = (cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim);
        let mut tensors = Tensors { content, reader };
        let mut layer_list = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let name = |part: &str| format!("blk.{l}.{part}.weight");
            let optional = |tensors: &mut Tensors<'_, R>, part: &str, len: usize| -> Result<Option<Vec<f32>>> {
                let n = name(part);
                match content.tensor_infos.contains_key(&n) {
                    true => tensors.vector(&n, len).map(Some),
                    false => Ok(None),
                }
            };
            let qkv_parts = cfg.qkv_names(l).iter().map(|n| tensors.matrix(n, hidden)).collect::<Result<Vec<_>>>()?;
            let gate_up_parts = cfg.gate_up_names(l).iter().map(|n| tensors.matrix(n, hidden)).collect::<Result<Vec<_>>>()?;
            let qkv_bias = match cfg.qkv_bias {
                true => {
                    let mut b = tensors.vector(&format!("blk.{l}.attn_q.bias"), heads * head_dim)?;
                    b.extend(tensors.vector(&format!("blk.{l}.attn_k.bias"), kv_heads * head_dim)?);
                    b.extend(tensors.vector(&format!("blk.{l}.attn_v.bias"), kv_heads * head_dim)?);
                    Some(b)
                }
                false => None,
            };
            layer_list.push(Layer {
                attn_norm: tensors.vector(&name("attn_norm"), hidden)?,
                qkv: QMatrix::stack(qkv_parts)?,
                qkv_bias,
                q_norm: optional(&mut tensors, "attn_q_norm", head_dim)?,
                k_norm: optional(&mut tensors, "attn_k_norm", head_dim)?,
                attn_output: tensors.matrix(&name("attn_output"), heads * head_dim)?,
                post_attn_norm: optional(&mut tensors, "post_attention_norm", hidden)?,
                ffn_norm: tensors.vector(&name("ffn_norm"), hidden)?,
                gate_up: QMatrix::stack(gate_up_parts)?,
                down: tensors.matrix(&name("ffn_down"), cfg.ffn)?,
                post_ffn_norm: optional(&mut tensors, "post_ffw_norm", hidden)?,
                rotary: usize::from(cfg.windowed(l)),
            });
            let layer = &layer_list[l];
            ensure!(
                layer.qkv.rows() == (heads + 2 * kv_heads) * head_dim && layer.attn_output.rows() == hidden && layer.gate_up.rows() == 2 * cfg.ffn && layer.down.rows() == hidden,
                "layer {l} does not have the shapes its metadata states"
            );
        }
        let embeddings = tensors.matrix("token_embd.weight", hidden)?;
        let output = match content.tensor_infos.contains_key("output.weight") {
            true => Some(tensors.matrix("output.weight", hidden)?),
            false => None,
        };
        let output_norm = tensors.vector("output_norm.weight", hidden)?;
        let rotary = vec![cfg.rotary_tables(positions, false), cfg.rotary_tables(positions, true)];
        Ok(Some(CpuPass { cfg, embeddings, output, output_norm, layers: layer_list, rotary }))
    }

    /// Bytes of weights held (the blocks as loaded, plus the f32 vectors and rotary tables).
    pub(crate) fn bytes(&self) -> u64 {
        let opt = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, Vec::len);
        let floats = self.output_norm.len()
            + self.rotary.iter().map(|(c, s)| c.len() + s.len()).sum::<usize>()
            + self.layers.iter().map(|l| l.attn_norm.len() + l.ffn_norm.len() + opt(&l.qkv_bias) + opt(&l.q_norm) + opt(&l.k_norm) + opt(&l.post_attn_norm) + opt(&l.post_ffn_norm)).sum::<usize>();
        let blocks = self.embeddings.bytes()
            + self.output.as_ref().map_or(0, QMatrix::bytes)
            + self.layers.iter().map(|l| l.qkv.bytes() + l.attn_output.bytes() + l.gate_up.bytes() + l.down.bytes()).sum::<usize>();
        (blocks + 4 * floats) as u64
    }

    /// Positions the rotary tables cover.
    pub(crate) fn positions(&self) -> usize {
        self.rotary[0].0.len() / (self.cfg.rotated / 2)
    }

    /// An empty cache with room for `capacity` positions.
    pub(crate) fn new_cache(&self, capacity: usize) -> KvCache {
        let floats = capacity * self.cfg.kv_heads * self.cfg.head_dim;
        let empty = || (0..self.layers.len()).map(|_| Vec::with_capacity(floats)).collect();
        KvCache { keys: empty(), values: empty(), len: 0 }
    }

    /// Runs `tokens` at the positions after those in `cache` (adding theirs to it) and returns
    /// the logits of the last one.
    pub(crate) fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let mut logits = self.forward_batch(&mut [Segment { tokens, cache }])?;
        Ok(logits.pop().expect("one segment"))
    }

    /// Runs several sequences at once, each segment's tokens at the positions after those in
    /// its own cache, and returns the logits of each segment's last token. All rows go through
    /// the weight matrices together, so the weights are read once per step for all of them:
    /// decoding `n` sequences costs far less than `n` times one.
    pub(crate) fn forward_batch(&self, segments: &mut [Segment<'_>]) -> Result<Vec<Vec<f32>>> {
        // On one of rayon's threads, so that the ~150 parallel steps of a pass split work
        // between the pool's threads directly; from outside the pool each step would wake this
        // thread through a futex when it ends.
        rayon::scope(|_| self.forward_on_pool(segments))
    }

    fn forward_on_pool(&self, segments: &mut [Segment<'_>]) -> Result<Vec<Vec<f32>>> {
        let c = &self.cfg;
        let h = c.hidden;
        let hd = c.head_dim;
        let (q_dim, kv_dim) = (c.heads * hd, c.kv_heads * hd);
        let vocab = self.embeddings.rows();
        // Each row's segment and position.
        let mut rows: Vec<(usize, usize)> = Vec::new();
        for (s, seg) in segments.iter().enumerate() {
            ensure!(!seg.tokens.is_empty(), "no tokens to run");
            let end = seg.cache.len + seg.tokens.len();
            ensure!(end <= self.positions(), "position {} is past the model's {} positions", end - 1, self.positions());
            rows.extend((seg.cache.len..end).map(|p| (s, p)));
        }
        let m = rows.len();
        ensure!(m > 0, "no sequences to run");

        let mut x = vec![0f32; m * h];
        for (row, &t) in x.chunks_exact_mut(h).zip(segments.iter().flat_map(|s| s.tokens)) {
            ensure!((t as usize) < vocab, "token id {t} is outside the vocabulary of {vocab}");
            self.embeddings.dequantize_row(t as usize, row);
            if let Some(scale) = c.embedding_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        let mut acts = QuantizedRows::default();
        let mut normed = vec![0f32; m * h];
        let mut qkv = vec![0f32; m * (q_dim + 2 * kv_dim)];
        let mut attended = vec![0f32; m * q_dim];
        let mut projected = vec![0f32; m * h];
        let mut gate_up = vec![0f32; m * 2 * c.ffn];
        let mut gated = vec![0f32; m * c.ffn];
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut normed);
            acts.quantize(&normed, h);
            layer.qkv.matmul(&acts, &mut qkv);
            let (cos, sin) = &self.rotary[layer.rotary];
            let half = c.rotated / 2;
            for (row, &(s, pos)) in qkv.chunks_exact_mut(q_dim + 2 * kv_dim).zip(&rows) {
                if let Some(bias) = &layer.qkv_bias {
                    add(row, bias);
                }
                let (queries, rest) = row.split_at_mut(q_dim);
                let keys = &mut rest[..kv_dim];
                if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                    rms_norm_in_place(queries, qn, c.rms_eps);
                    rms_norm_in_place(keys, kn, c.rms_eps);
                }
                let (cos, sin) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
                for head in queries.chunks_exact_mut(hd).chain(keys.chunks_exact_mut(hd)) {
                    rotate_head(head, cos, sin, c.rope_style);
                }
                let cache = &mut *segments[s].cache;
                cache.keys[l].extend_from_slice(&row[q_dim..q_dim + kv_dim]);
                cache.values[l].extend_from_slice(&row[q_dim + kv_dim..]);
            }
            let kv: Vec<(&[f32], &[f32])> = segments.iter().map(|s| (&s.cache.keys[l][..], &s.cache.values[l][..])).collect();
            self.attend(l, &qkv, &kv, &rows, &mut attended);
            acts.quantize(&attended, q_dim);
            layer.attn_output.matmul(&acts, &mut projected);
            if let Some(w) = &layer.post_attn_norm {
                rms_norm_in_place(&mut projected, w, c.rms_eps);
            }
            add(&mut x, &projected);

            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut normed);
            acts.quantize(&normed, h);
            layer.gate_up.matmul(&acts, &mut gate_up);
            for (g, gu) in gated.chunks_exact_mut(c.ffn).zip(gate_up.chunks_exact(2 * c.ffn)) {
                match c.activation {
                    Activation::Silu => cpu_kernels::silu_mul(g, &gu[..c.ffn], &gu[c.ffn..]),
                    Activation::GeluTanh => {
                        for ((o, &a), &b) in g.iter_mut().zip(&gu[..c.ffn]).zip(&gu[c.ffn..]) {
                            *o = cpu_kernels::gelu(a) * b;
                        }
                    }
                }
            }
            acts.quantize(&gated, c.ffn);
            layer.down.matmul(&acts, &mut projected);
            if let Some(w) = &layer.post_ffn_norm {
                rms_norm_in_place(&mut projected, w, c.rms_eps);
            }
            add(&mut x, &projected);
        }

        // The last row of each segment.
        let mut last = Vec::with_capacity(segments.len() * h);
        let mut end = 0;
        for seg in segments.iter_mut() {
            end += seg.tokens.len();
            last.extend_from_slice(&x[(end - 1) * h..end * h]);
            seg.cache.len += seg.tokens.len();
        }
        let mut normed_last = vec![0f32; last.len()];
        rms_norm(&last, &self.output_norm, c.rms_eps, &mut normed_last);
        acts.quantize(&normed_last, h);
        let output = self.output.as_ref().unwrap_or(&self.embeddings);
        let mut logits = vec![0f32; segments.len() * output.rows()];
        output.matmul(&acts, &mut logits);
        Ok(logits.chunks_exact(output.rows()).map(<[f32]>::to_vec).collect())
    }

    /// Causal attention of each row's query heads (rows of `qkv`, at the segments and positions
    /// of `rows`) over its segment's cached keys and values up to its own position (from the
    /// window's first, on layer `l` of a windowed model); one task per (row, head).
    fn attend(&self, l: usize, qkv: &[f32], kv: &[(&[f32], &[f32])], rows: &[(usize, usize)], out: &mut [f32]) {
        let c = &self.cfg;
        let (hd, kv_dim) = (c.head_dim, c.kv_heads * c.head_dim);
        let width = (c.heads + 2 * c.kv_heads) * hd;
        let group = c.heads / c.kv_heads;
        // One scores buffer per thread, as the longest row needs.
        let longest = rows.iter().map(|&(_, pos)| pos + 1).max().unwrap_or(0);
        out.par_chunks_mut(hd).enumerate().for_each_init(
            || vec![0f32; longest],
            |scores, (task, o)| {
                let (i, head) = (task / c.heads, task % c.heads);
                let (s, pos) = rows[i];
                let first = c.first_seen(l, pos);
                let (keys, values) = kv[s];
                let q = &qkv[i * width + head * hd..][..hd];
                let at = first * kv_dim + (head / group) * hd;
                cpu_kernels::attend(q, &keys[at..], &values[at..], kv_dim, c.attention_scale, &mut scores[..=pos - first], o);
            },
        );
    }
}

/// `out = x / rms(x) * weight`, row by row (rows as long as `weight`).
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let h = weight.len();
    for (o, row) in out.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
        let inv = 1.0 / (cpu_kernels::dot(row, row) / h as f32 + eps).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// [`rms_norm`] of each `weight.len()`-wide piece of `x`, in place.
fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let h = weight.len();
    for row in x.chunks_exact_mut(h) {
        let inv = 1.0 / (cpu_kernels::dot(row, row) / h as f32 + eps).sqrt();
        for (v, &w) in row.iter_mut().zip(weight) {
            *v *= inv * w;
        }
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn qtype(dtype: GgmlDType) -> Option<QType> {
    match dtype {
        GgmlDType::Q4_0 => Some(QType::Q4_0),
        GgmlDType::Q4_1 => Some(QType::Q4_1),
        GgmlDType::Q5_0 => Some(QType::Q5_0),
        GgmlDType::Q5_1 => Some(QType::Q5_1),
        GgmlDType::Q8_0 => Some(QType::Q8_0),
        GgmlDType::Q4K => Some(QType::Q4_K),
        GgmlDType::Q5K => Some(QType::Q5_K),
        GgmlDType::Q6K => Some(QType::Q6_K),
        _ => None,
    }
}

/// Reads tensors' bytes from the file as they are stored.
struct Tensors<'a, R> {
    content: &'a Content,
    reader: &'a mut R,
}

impl<R: Read + Seek> Tensors<'_, R> {
    fn bytes(&mut self, name: &str) -> Result<(GgmlDType, Vec<usize>, Vec<u8>)> {
        let info = self.content.tensor_infos.get(name).with_context(|| format!("tensor {name} is missing"))?;
        let dtype = info.ggml_dtype;
        let len = info.shape.elem_count() / dtype.block_size() * dtype.type_size();
        self.reader.seek(SeekFrom::Start(self.content.tensor_data_offset + info.offset))?;
        let mut data = vec![0u8; len];
        self.reader.read_exact(&mut data).with_context(|| format!("reading tensor {name}"))?;
        Ok((dtype, info.shape.dims().to_vec(), data))
    }

    /// A matrix of `cols` columns (GGUF dimensions are listed innermost last here, as candle
    /// reads them: `(rows, cols)`).
    fn matrix(&mut self, name: &str, cols: usize) -> Result<QMatrix> {
        let (dtype, dims, data) = self.bytes(name)?;
        ensure!(dims.len() == 2 && dims[1] == cols, "tensor {name} has shape {dims:?}, expected {cols} columns");
        let qtype = qtype(dtype).with_context(|| format!("tensor {name} is {dtype:?}"))?;
        QMatrix::new(qtype, dims[0], cols, &data).with_context(|| format!("tensor {name}"))
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        let (dtype, dims, data) = self.bytes(name)?;
        ensure!(dtype == GgmlDType::F32 && dims == [len], "tensor {name} is {dtype:?} {dims:?}, expected F32 [{len}]");
        Ok(data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};
    use candle_transformers::models::quantized_llama::ModelWeights;
    use std::fs::File;
    use std::io::BufReader;
    use std::path::PathBuf;

    /// SmolLM2's file under `TERN_MODELS_DIR` (default `~/.cache/tern/models`); `None` (the test
    /// is skipped) when missing, except under `CI=true`.
    fn smollm2() -> Option<PathBuf> {
        let dir = std::env::var_os("TERN_MODELS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tern/models"));
        let path = dir.join("smollm2-135m-instruct/model.gguf");
        if path.is_file() {
            return Some(path);
        }
        assert!(std::env::var("CI").map_or(true, |v| v != "true"), "{} missing", path.display());
        eprintln!("SKIPPED: {} missing (set TERN_MODELS_DIR)", path.display());
        None
    }

    fn log_softmax(xs: &[f32]) -> Vec<f64> {
        let max = xs.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
        let log_sum = xs.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        xs.iter().map(|&x| x as f64 - max - log_sum).collect()
    }

    /// KL(p || q) of two log-distributions.
    fn kl(p: &[f64], q: &[f64]) -> f64 {
        p.iter().zip(q).map(|(x, y)| x.exp() * (x - y)).sum()
    }

    fn argmax_f64(xs: &[f64]) -> usize {
        xs.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap()
    }

    fn argmax(xs: &[f32]) -> usize {
        xs.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap()
    }

    /// Next-token distributions as close to the exact ones as candle's: the exact ones come
    /// from candle's `quantized_llama` on the weights dequantized to f32 (so with unrounded
    /// activations), and candle's own on the file's Q4_1 blocks rounds activations to 8 bits as
    /// tern does. Checked for a prompt and two decoding steps after it.
    #[test]
    fn distributions_are_as_close_to_exact_as_candles() {
        let Some(path) = smollm2() else { return };
        let mut reader = BufReader::new(File::open(&path).unwrap());
        let content = Content::read(&mut reader).unwrap();
        let vocabulary = super::super::vocabulary::Vocabulary::from_gguf(&content).unwrap();
        let cfg = Config::from_gguf(&content).unwrap();
        let ours = CpuPass::from_gguf(&cfg, &content, &mut reader, 256).unwrap().expect("SmolLM2's types are supported");
        let matrices: Vec<&str> = content.tensor_infos.iter().filter(|(_, i)| i.shape.rank() == 2).map(|(n, _)| n.as_str()).collect();
        let exact_gguf = super::super::requantize(&content, &mut reader, &matrices, GgmlDType::F32).unwrap();
        let mut cursor = std::io::Cursor::new(exact_gguf);
        let exact_content = Content::read(&mut cursor).unwrap();
        let mut exact = ModelWeights::from_gguf(exact_content, &mut cursor, &Device::Cpu).unwrap();
        let mut candle = ModelWeights::from_gguf(content, &mut reader, &Device::Cpu).unwrap();

        let prompt = vocabulary.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n").unwrap();
        let mut tokens: Vec<u32> = prompt.clone();
        let mut cache = ours.new_cache(64);
        let mut pos = 0;
        for step in 0..3 {
            let input = &tokens[pos..];
            let run = |model: &mut ModelWeights| -> Vec<f32> {
                let x = Tensor::new(input, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                model.forward(&x, pos).unwrap().squeeze(0).unwrap().to_vec1::<f32>().unwrap()
            };
            let (reference, theirs) = (log_softmax(&run(&mut exact)), log_softmax(&run(&mut candle)));
            let logits = ours.forward(input, &mut cache).unwrap();
            let mine = log_softmax(&logits);
            let (kl_mine, kl_theirs) = (kl(&reference, &mine), kl(&reference, &theirs));
            eprintln!("step {step}: KL from exact: tern {kl_mine:.5}, candle {kl_theirs:.5}");
            assert_eq!(argmax(&logits), argmax_f64(&reference), "step {step}: next token");
            assert!(kl_mine <= (2.0 * kl_theirs).max(1e-3), "step {step}: KL {kl_mine} against candle's {kl_theirs}");
            pos = tokens.len();
            tokens.push(argmax(&logits) as u32);
            assert_eq!(cache.len(), pos);
        }
        let answer = vocabulary.decode(&tokens[prompt.len()..]).unwrap();
        eprintln!("answer starts {answer:?}");
    }

    /// Files llama.cpp quantized to Q4_K_M and Q5_K_M (`tests/fixtures/llm`, mixing K types with
    /// Q5_0, Q5_1 and Q8_0) load with every matrix as stored: nothing is re-quantized.
    #[test]
    fn k_quant_mixes_load_as_stored() {
        for name in ["llama-q4_k_m", "llama-q5_k_m"] {
            let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/llm/{name}.gguf"));
            let mut reader = BufReader::new(File::open(&path).unwrap());
            let content = Content::read(&mut reader).unwrap();
            assert_eq!(convertible_to_q8_0(&content), Vec::<String>::new(), "{name}");
            let cfg = Config::from_gguf(&content).unwrap();
            assert!(CpuPass::from_gguf(&cfg, &content, &mut reader, 64).unwrap().is_some(), "{name}");
        }
    }

    /// Two prompts decoded together give exactly the logits each gives alone.
    #[test]
    fn batched_equals_alone() {
        let Some(path) = smollm2() else { return };
        let mut reader = BufReader::new(File::open(&path).unwrap());
        let content = Content::read(&mut reader).unwrap();
        let pass = CpuPass::from_gguf(&Config::from_gguf(&content).unwrap(), &content, &mut reader, 128).unwrap().unwrap();
        let prompts: [&[u32]; 2] = [&[1, 2, 3, 4, 5, 6, 7], &[100, 200, 300]];
        let alone: Vec<Vec<Vec<f32>>> = prompts
            .iter()
            .map(|p| {
                let mut cache = pass.new_cache(16);
                let mut out = vec![pass.forward(p, &mut cache).unwrap()];
                for t in [42u32, 43] {
                    out.push(pass.forward(&[t], &mut cache).unwrap());
                }
                out
            })
            .collect();
        let (mut c0, mut c1) = (pass.new_cache(16), pass.new_cache(16));
        let mut together = vec![pass.forward_batch(&mut [Segment { tokens: prompts[0], cache: &mut c0 }, Segment { tokens: prompts[1], cache: &mut c1 }]).unwrap()];
        for t in [42u32, 43] {
            together.push(pass.forward_batch(&mut [Segment { tokens: &[t], cache: &mut c0 }, Segment { tokens: &[t], cache: &mut c1 }]).unwrap());
        }
        for step in 0..3 {
            for s in 0..2 {
                assert_eq!(together[step][s], alone[s][step], "sequence {s}, step {step}");
            }
        }
    }
}
