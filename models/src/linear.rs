//! The linear layer of tern's own model code (Whisper's decoder, BERT on the CPU).

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

/// A linear layer `x Wᵀ + b` (weights `(d_out, d_in)` as PyTorch stores them) that stays fast
/// for the few rows of a decoding step or of one short text.
///
/// candle's `Linear` computes `x Wᵀ`, where gemm re-packs the whole transposed weight matrix
/// on every call; for a handful of rows that packing costs more than the products. Computed as
/// `(W xᵀ)ᵀ`, the weights are read once in their own layout.
pub(crate) struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// `weight` `(d_out, d_in)`, `bias` `(d_out)`.
    pub(crate) fn new(weight: Tensor, bias: Option<Tensor>) -> Linear {
        Linear { weight, bias }
    }

    /// Rows up to which `(W xᵀ)ᵀ` is used; more rows use `x Wᵀ` as candle does.
    const FEW_ROWS: usize = 64;

    /// The bias `(d_out)`, if any.
    pub(crate) fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `x Wᵀ` without the bias, for an op that adds it in its own pass; `(..., d_out)`.
    pub(crate) fn forward_no_bias(&self, x: &Tensor) -> Result<Tensor> {
        Linear { weight: self.weight.clone(), bias: None }.forward(x)
    }

    /// `x`: `(..., d_in)`; returns `(..., d_out)`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let d_in = *dims.last().expect("at least one dimension");
        let rows = x.elem_count() / d_in.max(1);
        let x2 = x.reshape((rows, d_in))?;
        let y = if rows <= Self::FEW_ROWS {
            self.weight.matmul(&x2.t()?)?.t()?
        } else {
            x2.matmul(&self.weight.t()?)?
        };
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y.contiguous()?,
        };
        let mut out_dims = dims;
        *out_dims.last_mut().expect("at least one dimension") = self.weight.dim(0)?;
        y.reshape(out_dims)
    }
}

/// `weight` `(d_out, d_in)` and `bias` from `vb`.
pub(crate) fn linear(d_in: usize, d_out: usize, vb: VarBuilder) -> Result<Linear> {
    Ok(Linear { weight: vb.get((d_out, d_in), "weight")?, bias: Some(vb.get(d_out, "bias")?) })
}

/// `weight` `(d_out, d_in)` from `vb`, no bias.
pub(crate) fn linear_no_bias(d_in: usize, d_out: usize, vb: VarBuilder) -> Result<Linear> {
    Ok(Linear { weight: vb.get((d_out, d_in), "weight")?, bias: None })
}
