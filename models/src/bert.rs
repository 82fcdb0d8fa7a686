//! BERT encoder on the CPU: the maths of candle-transformers' `BertModel` (post-norm layers,
//! exact GELU, absolute positions), run the way tern runs Whisper's encoder.
//!
//! On candle's model, one 17-token text spent a third of its time in gemm re-packing each
//! transposed weight matrix ([`crate::linear::Linear`] reads them in place for few rows), and
//! its attention materialised padded scores per head; here attention is
//! [`tern_kernels::self_attention::self_attention`], over each text's own tokens, with the scale
//! folded into the query weights, the three projections are one product, and GELU runs on
//! both cores ([`tern_kernels::cpu_ops`]). Other devices and other BERT variants use candle's
//! model (see `embed.rs`).

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{layer_norm, LayerNorm, VarBuilder};
use candle_transformers::models::bert::{Config, HiddenAct, PositionEmbeddingType};
use tern_kernels::cpu_ops::{add_layer_norm, bias_gelu_erf, gelu, Gelu};
use crate::linear::{linear, linear_no_bias, Linear};
use tern_kernels::self_attention::self_attention;

struct Layer {
    /// Query, key and value stacked `(3 d, d)`; the query rows scaled by `head_dim^-0.5`.
    qkv: Linear,
    /// The attention output's weights; its bias is the first row of `attn_norm`.
    out: Linear,
    /// `(3, d)`: the attention output's bias, then its layer norm's gamma and beta.
    attn_norm: Tensor,
    fc1: Linear,
    /// The feed-forward output's weights; its bias is the first row of `out_norm`.
    fc2: Linear,
    /// `(3, d)`: the feed-forward output's bias, then its layer norm's gamma and beta.
    out_norm: Tensor,
}

/// A BERT encoder in F32 on the CPU.
pub(crate) struct Bert {
    word: Tensor,
    position: Tensor,
    /// Token type 0's embedding `(d)`: sentence embeddings use one segment.
    token_type: Tensor,
    emb_ln: LayerNorm,
    layers: Vec<Layer>,
    heads: usize,
    eps: f64,
    /// Whether the products run in BF16 ([`tern_kernels::bf16_gemm`]).
    bf16: bool,
}

impl Bert {
    /// Loads `embeddings.*` and `encoder.layer.N.*` (or the same under `bert.`) in F32 on the
    /// CPU; `None` for a configuration this code does not cover (an activation other than
    /// exact GELU, relative positions), which candle's model then runs. With `bf16_products`,
    /// the linear layers and attention take BF16 products where the CPU has AVX-512 BF16.
    pub fn load(vb: VarBuilder, cfg: &Config, bf16_products: bool) -> Result<Option<Bert>> {
        if !vb.device().is_cpu()
            || vb.dtype() != DType::F32
            || cfg.hidden_act != HiddenAct::Gelu
            || cfg.position_embedding_type != PositionEmbeddingType::Absolute
            || cfg.num_attention_heads == 0
            || cfg.hidden_size % cfg.num_attention_heads != 0
        {
            return Ok(None);
        }
        let vb = if vb.contains_tensor("embeddings.word_embeddings.weight") { vb } else { vb.pp("bert") };
        let (d, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
        let scale = ((d / cfg.num_attention_heads) as f64).powf(-0.5);
        let e = vb.pp("embeddings");
        let bf16 = bf16_products && tern_kernels::bf16_gemm::available();
        let product = |l: Linear| if bf16 { l.in_bf16() } else { Ok(l) };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = vb.pp(format!("encoder.layer.{i}"));
                let a = l.pp("attention.self");
                let weight = Tensor::cat(
                    &[(a.get((d, d), "query.weight")? * scale)?, a.get((d, d), "key.weight")?, a.get((d, d), "value.weight")?],
                    0,
                )?;
                let bias =
                    Tensor::cat(&[(a.get(d, "query.bias")? * scale)?, a.get(d, "key.bias")?, a.get(d, "value.bias")?], 0)?;
                // A dense layer's bias and the layer norm after it, applied in one pass.
                let norm = |dense: &str, ln: &str| -> Result<Tensor> {
                    Tensor::stack(&[l.pp(dense).get(d, "bias")?, l.pp(ln).get(d, "weight")?, l.pp(ln).get(d, "bias")?], 0)
                };
                Ok(Layer {
                    qkv: product(Linear::new(weight, Some(bias)))?,
                    out: product(linear_no_bias(d, d, l.pp("attention.output.dense"))?)?,
                    attn_norm: norm("attention.output.dense", "attention.output.LayerNorm")?,
                    fc1: product(linear(d, cfg.intermediate_size, l.pp("intermediate.dense"))?)?,
                    fc2: product(linear_no_bias(cfg.intermediate_size, d, l.pp("output.dense"))?)?,
                    out_norm: norm("output.dense", "output.LayerNorm")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Bert {
            word: e.get((cfg.vocab_size, d), "word_embeddings.weight")?,
            position: e.get((cfg.max_position_embeddings, d), "position_embeddings.weight")?,
            token_type: e.get((cfg.type_vocab_size, d), "token_type_embeddings.weight")?.get(0)?,
            emb_ln: layer_norm(d, eps, e.pp("LayerNorm"))?,
            layers,
            heads: cfg.num_attention_heads,
            eps,
            bf16,
        }))
    }

    /// Bytes the weights take below F32 (those packed in BF16).
    pub fn bytes_saved(&self) -> usize {
        self.layers.iter().flat_map(|l| [&l.qkv, &l.out, &l.fc1, &l.fc2]).map(Linear::bytes_saved).sum()
    }

    /// Hidden states `(batch, len, d)` of token ids `(batch, len)` (u32), text `b` being its
    /// first `lens[b]` tokens and the rest padding (whose states are not meaningful).
    pub fn forward(&self, ids: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let (b, len) = ids.dims2()?;
        let d = self.word.dim(1)?;
        let x = self.word.index_select(&ids.flatten_all()?, 0)?.reshape((b, len, d))?;
        let x = x.broadcast_add(&self.position.narrow(0, 0, len)?)?.broadcast_add(&self.token_type)?;
        let mut x = self.emb_ln.forward(&x)?;
        for layer in &self.layers {
            let qkv = layer.qkv.forward(&x)?;
            let (q, k, v) = (qkv.narrow(2, 0, d)?, qkv.narrow(2, d, d)?, qkv.narrow(2, 2 * d, d)?);
            let attended = self_attention(&q, &k, &v, self.heads, Some(lens), self.bf16)?;
            // Bias, residual and layer norm in one pass; bias and GELU in one pass.
            x = add_layer_norm(&layer.out.forward(&attended)?, &x, &layer.attn_norm, self.eps)?;
            let hidden = match layer.fc1.bias() {
                Some(b) => bias_gelu_erf(&layer.fc1.forward_no_bias(&x)?, b)?,
                None => gelu(&layer.fc1.forward(&x)?, Gelu::Erf)?,
            };
            x = add_layer_norm(&layer.fc2.forward(&hidden)?, &x, &layer.out_norm, self.eps)?;
        }
        Ok(x)
    }
}
