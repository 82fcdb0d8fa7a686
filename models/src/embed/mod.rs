//! Sentence embeddings with BERT-family encoders (all-MiniLM-L6-v2 and its kin) on candle:
//! mean pooling over the attention mask, then L2 normalisation, as sentence-transformers does.
//!
//! Texts are tokenised one by one (the shipped tokenizer.json pads everything to 128; its padding
//! is switched off), sorted by length and run in sub-batches padded to their longest text, so a
//! batch of short texts costs short sequences.

pub mod family;

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{embedding, layer_norm, Embedding, LayerNorm, VarBuilder};
use candle_transformers::models::bert::{BertEncoder, Config};
use tokenizers::{Tokenizer, TruncationParams};

use crate::precision::Precision;

/// Tokens kept per text (sentence-transformers' setting for all-MiniLM-L6-v2); longer texts are
/// truncated, never refused.
pub const MAX_TOKENS_PER_TEXT: usize = 256;
/// Padded tokens run through the encoder in one forward pass by [`Embedder::embed`]; bounds
/// working memory (attention scores grow with the square of the longest text).
pub const TOKENS_PER_FORWARD: usize = 8192;

/// What padding adds to attention scores: finite in every compute type (`f32::MIN`, which
/// candle's `BertModel` uses, overflows to -inf in F16 and BF16, and its mask is built as
/// `0 x -inf`, NaN), and low enough that exp() of it is 0 in each.
const MASK_VALUE: f64 = -1e4;

/// The encoder that runs: tern's on the CPU in F32 ([`crate::bert`]), candle's layers
/// elsewhere and in half precision.
enum Encoder {
    Tern(crate::bert::Bert),
    Candle(CandleBert),
}

/// candle-transformers' BERT layers under embeddings and a padding mask built here, in the
/// weights' dtype, so that half precision stays finite.
struct CandleBert {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
    layers: BertEncoder,
    dtype: DType,
}

impl CandleBert {
    fn load(vb: VarBuilder, config: &Config) -> candle_core::Result<CandleBert> {
        let vb = if vb.contains_tensor("embeddings.word_embeddings.weight") { vb } else { vb.pp("bert") };
        let (e, d) = (vb.pp("embeddings"), config.hidden_size);
        Ok(CandleBert {
            word: embedding(config.vocab_size, d, e.pp("word_embeddings"))?,
            position: embedding(config.max_position_embeddings, d, e.pp("position_embeddings"))?,
            token_type: embedding(config.type_vocab_size, d, e.pp("token_type_embeddings"))?,
            norm: layer_norm(d, config.layer_norm_eps, e.pp("LayerNorm"))?,
            layers: BertEncoder::load(vb.pp("encoder"), config)?,
            dtype: vb.dtype(),
        })
    }

    /// Hidden states `(batch, len, d)` of token ids `(batch, len)`; `mask` is 1 over tokens and
    /// 0 over padding.
    fn forward(&self, ids: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let len = ids.dim(1)?;
        let positions = Tensor::arange(0u32, len as u32, ids.device())?.unsqueeze(0)?;
        let x = self.word.forward(ids)?.broadcast_add(&self.position.forward(&positions)?)?;
        // Sentence embeddings use one segment.
        let x = x.broadcast_add(&self.token_type.forward(&Tensor::zeros((1, 1), DType::U32, ids.device())?)?)?;
        let x = self.norm.forward(&x)?;
        // (batch, 1, 1, len): 0 over tokens, MASK_VALUE over padding.
        let additive = ((mask.to_dtype(DType::F32)? - 1.0)? * -MASK_VALUE)?.to_dtype(self.dtype)?;
        self.layers.forward(&x, &additive.unsqueeze(1)?.unsqueeze(1)?)
    }
}

/// A loaded sentence-embedding model and its tokenizer on one candle [`Device`].
pub struct Embedder {
    model: Encoder,
    tokenizer: Tokenizer,
    device: Device,
    dimensions: usize,
    weights_bytes: u64,
}

const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Embedder>();
};

impl Embedder {
    /// Loads a Hugging Face folder: `config.json` (BERT config), `tokenizer.json` and
    /// `model.safetensors` (F32, F16 or BF16). Weights are memory-mapped then copied onto
    /// `device`, in F16 on a GPU and F32 on the CPU (see [`Self::load_in`]).
    pub fn load(dir: &Path, device: &Device) -> Result<Embedder> {
        Self::load_in(dir, device, Precision::Auto)
    }

    /// [`Self::load`] computing in `precision`'s dtype ([`Precision::dtype`]: `Auto` is F16 on
    /// a GPU, F32 on the CPU). On the CPU, `Bf16Products` takes BF16 products (F32 sums) where the
    /// CPU has AVX-512 BF16, and `Auto` and `F32` keep F32 ones; `F16` and `Bf16` compute in half precision
    /// there too (slowly: candle's CPU kernels are made for F32), which is how the half
    /// precision path is tested without a GPU. Padding is masked with a finite value, so half
    /// precision gives the F32 vectors to a cosine of 0.999 and better.
    pub fn load_in(dir: &Path, device: &Device, precision: Precision) -> Result<Embedder> {
        let cfg_path = dir.join("config.json");
        let config: Config = serde_json::from_slice(
            &std::fs::read(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?,
        )
        .with_context(|| format!("parsing {}", cfg_path.display()))?;
        let tok_path = dir.join("tokenizer.json");
        let mut tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow!("loading {}: {e}", tok_path.display()))?;
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: MAX_TOKENS_PER_TEXT.min(config.max_position_embeddings),
                ..Default::default()
            }))
            .map_err(|e| anyhow!("configuring truncation: {e}"))?;
        let weights = dir.join("model.safetensors");
        let weights_bytes = std::fs::metadata(&weights)
            .with_context(|| format!("reading {}", weights.display()))?
            .len();
        let dtype = precision.dtype(device);
        // SAFETY: the file is only read; tern's models directory is not rewritten while in use.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&weights], dtype, device)? };
        // tern's encoder takes F32 on the CPU; it declines the rest.
        let model = match crate::bert::Bert::load(vb.clone(), &config, precision == Precision::Bf16Products).context("building the BERT model")? {
            Some(bert) => Encoder::Tern(bert),
            None => Encoder::Candle(CandleBert::load(vb, &config).context("building the BERT model")?),
        };
        // The file holds F32 weights.
        let weights_bytes = match &model {
            Encoder::Tern(bert) => weights_bytes.saturating_sub(bert.bytes_saved() as u64),
            Encoder::Candle(_) => weights_bytes * dtype.size_in_bytes() as u64 / 4,
        };
        Ok(Embedder { model, tokenizer, device: device.clone(), dimensions: config.hidden_size, weights_bytes })
    }

    /// Length of each embedding vector (384 for all-MiniLM-L6-v2).
    pub fn dimensions(&self) -> usize {
        self.dimensions
    }

    /// Bytes of weights held (the safetensors file size, F32, less half of the layers packed in
    /// BF16).
    pub fn weights_bytes(&self) -> u64 {
        self.weights_bytes
    }

    /// Tokens each text costs, `[CLS]` and `[SEP]` included, after truncation to
    /// [`MAX_TOKENS_PER_TEXT`].
    pub fn count_tokens(&self, texts: &[&str]) -> Result<Vec<usize>> {
        texts
            .iter()
            .map(|t| Ok(self.tokenizer.encode(*t, true).map_err(|e| anyhow!("tokenizing: {e}"))?.len()))
            .collect()
    }

    /// Embeds every text: unit-length vectors of [`Self::dimensions`] floats, in input order.
    /// A text's vector does not depend on what it is batched with (within float rounding, ~1e-6).
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        self.embed_in(texts, TOKENS_PER_FORWARD)
    }

    /// [`Self::embed`], running at most `tokens_per_forward` padded tokens through the encoder
    /// at once (a text longer than that runs alone). More suits a GPU, whose working memory
    /// the worker measures; the vectors are the same.
    pub fn embed_in(&self, texts: &[&str], tokens_per_forward: usize) -> Result<Vec<Vec<f32>>> {
        let encodings = texts
            .iter()
            .map(|t| self.tokenizer.encode(*t, true).map_err(|e| anyhow!("tokenizing: {e}")))
            .collect::<Result<Vec<_>>>()?;
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| encodings[i].len());
        let mut out = vec![Vec::new(); texts.len()];
        let mut start = 0;
        while start < order.len() {
            // Sorted ascending: the last text of a sub-batch is its longest.
            let mut end = start + 1;
            while end < order.len() && encodings[order[end]].len() * (end + 1 - start) <= tokens_per_forward {
                end += 1;
            }
            let rows = &order[start..end];
            let width = encodings[rows[rows.len() - 1]].len().max(1);
            let lens: Vec<usize> = rows.iter().map(|&i| encodings[i].len().max(1)).collect();
            let mut ids = Vec::with_capacity(rows.len() * width);
            let mut mask = Vec::with_capacity(rows.len() * width);
            for &i in rows {
                let e = &encodings[i];
                ids.extend_from_slice(e.get_ids());
                mask.extend(std::iter::repeat_n(1u32, e.len()));
                ids.extend(std::iter::repeat_n(0u32, width - e.len()));
                mask.extend(std::iter::repeat_n(0u32, width - e.len()));
            }
            let ids = Tensor::from_vec(ids, (rows.len(), width), &self.device)?;
            let mask = Tensor::from_vec(mask, (rows.len(), width), &self.device)?;
            let vectors = self.forward(&ids, &mask, &lens)?;
            for (&i, v) in rows.iter().zip(vectors) {
                out[i] = v;
            }
            start = end;
        }
        Ok(out)
    }

    fn forward(&self, ids: &Tensor, mask: &Tensor, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        let hidden = match &self.model {
            Encoder::Tern(bert) => bert.forward(ids, lens)?,
            Encoder::Candle(bert) => bert.forward(ids, mask)?.to_dtype(DType::F32)?,
        };
        let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
        let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
        let counts = mask.sum(1)?.clamp(1e-9, f64::INFINITY)?;
        let mean = summed.broadcast_div(&counts)?;
        let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::INFINITY)?;
        Ok(mean.broadcast_div(&norm)?.to_vec2::<f32>()?)
    }
}
