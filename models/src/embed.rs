//! Sentence embeddings with BERT-family encoders (all-MiniLM-L6-v2 and its kin) on candle:
//! mean pooling over the attention mask, then L2 normalisation, as sentence-transformers does.
//!
//! Texts are tokenised one by one (the shipped tokenizer.json pads everything to 128; its padding
//! is switched off), sorted by length and run in sub-batches padded to their longest text, so a
//! batch of short texts costs short sequences.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use tokenizers::{Tokenizer, TruncationParams};

use crate::precision::Precision;

/// Tokens kept per text (sentence-transformers' setting for all-MiniLM-L6-v2); longer texts are
/// truncated, never refused.
pub const MAX_TOKENS_PER_TEXT: usize = 256;
/// Padded tokens run through the encoder in one forward pass; bounds working memory (attention
/// scores grow with the square of the longest text).
const TOKENS_PER_FORWARD: usize = 8192;

/// The encoder that runs: tern's on the CPU ([`crate::bert`]), candle's elsewhere.
enum Encoder {
    Tern(crate::bert::Bert),
    Candle(BertModel),
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
    /// `model.safetensors` (F32, F16 or BF16; computed in F32). Weights are memory-mapped then
    /// copied onto `device`.
    ///
    /// F32 on GPUs too: candle's BERT masks padding with `f32::MIN`, which overflows to -inf in
    /// F16 and BF16, and `0 x -inf` is NaN for every padded batch. The model is small enough
    /// that half precision gains little: on an H100, 17,130 texts/s in F32 against 18,090 in
    /// BF16 (batch 128, docs/benchmarks.md).
    pub fn load(dir: &Path, device: &Device) -> Result<Embedder> {
        Self::load_in(dir, device, Precision::Auto)
    }

    /// [`Self::load`], with `precision` choosing the products on the CPU: `Auto` takes BF16
    /// products (F32 sums) where the CPU has AVX-512 BF16, anything else keeps F32 ones.
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
        // SAFETY: the file is only read; tern's models directory is not rewritten while in use.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&weights], DType::F32, device)? };
        let model = match crate::bert::Bert::load(vb.clone(), &config, precision == Precision::Auto).context("building the BERT model")? {
            Some(bert) => Encoder::Tern(bert),
            None => Encoder::Candle(BertModel::load(vb, &config).context("building the BERT model")?),
        };
        let weights_bytes = match &model {
            Encoder::Tern(bert) => weights_bytes.saturating_sub(bert.bytes_saved() as u64),
            Encoder::Candle(_) => weights_bytes,
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
            while end < order.len() && encodings[order[end]].len() * (end + 1 - start) <= TOKENS_PER_FORWARD {
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
            Encoder::Candle(bert) => bert.forward(ids, &ids.zeros_like()?, Some(mask))?,
        };
        let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
        let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
        let counts = mask.sum(1)?.clamp(1e-9, f64::INFINITY)?;
        let mean = summed.broadcast_div(&counts)?;
        let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::INFINITY)?;
        Ok(mean.broadcast_div(&norm)?.to_vec2::<f32>()?)
    }
}
