//! The linear layer of tern's own model code (Whisper's decoder, BERT on the CPU).

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;

use tern_kernels::bf16_gemm::Bf16Linear;
use tern_kernels::cpu_kernels;
use tern_kernels::f32_linear::{self, Residual};

/// A linear layer `x Wᵀ + b` (weights `(d_out, d_in)` as PyTorch stores them) that stays fast
/// for the few rows of a decoding step or of one short text.
///
/// candle's `Linear` computes `x Wᵀ`, where gemm re-packs the whole transposed weight matrix
/// on every call; for a handful of rows that packing costs more than the products. Computed as
/// `(W xᵀ)ᵀ`, the weights are read once in their own layout. After [`Linear::in_bf16`], the
/// products are BF16 ones ([`Bf16Linear`]) for any number of rows.
pub(crate) struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
}

enum Weight {
    F32(Tensor),
    Bf16(Bf16Linear),
    /// F32 on the CPU with the weights kept transposed for many-row products
    /// ([`tern_kernels::f32_linear`]).
    Transposed(TransposedF32),
}

/// A layer's F32 weights as `Wᵀ` (`d_in x d_out`, row-major) and its bias, on the CPU.
pub(crate) struct TransposedF32 {
    pub w_t: Vec<f32>,
    pub d_in: usize,
    pub d_out: usize,
    pub bias: Option<Vec<f32>>,
}

impl TransposedF32 {
    /// `weight` `(d_out, d_in)` and `bias` kept transposed, where they are F32 on the CPU;
    /// `None` elsewhere.
    pub(crate) fn new(weight: &Tensor, bias: Option<&Tensor>) -> Result<Option<TransposedF32>> {
        if !weight.device().is_cpu() || weight.dtype() != candle_core::DType::F32 {
            return Ok(None);
        }
        let (d_out, d_in) = weight.dims2()?;
        let w_t = f32_linear::transposed(&weight.flatten_all()?.to_vec1::<f32>()?, d_out, d_in);
        let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
        Ok(Some(TransposedF32 { w_t, d_in, d_out, bias }))
    }

    /// `x` (rows of `d_in`) times `W`, plus the bias and `residual`, into `out` (rows of
    /// `d_out`); `with_bias` false leaves the bias out.
    pub(crate) fn rows_into(&self, x: &[f32], with_bias: bool, residual: Residual, out: &mut [f32]) {
        let bias = self.bias.as_deref().filter(|_| with_bias);
        f32_linear::rows_times_transposed(x, self.d_in, &self.w_t, self.d_out, bias, residual, out);
    }

    fn forward(&self, x: &Tensor, with_bias: bool) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let x = x.contiguous()?;
        let (storage, layout) = x.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("transposed F32 weights run on the CPU");
        };
        let values = tern_kernels::cpu_ops::contiguous_f32(cpu, layout)?;
        let mut out = vec![0f32; values.len() / self.d_in * self.d_out];
        self.rows_into(values, with_bias, Residual::None, &mut out);
        let mut out_dims = dims;
        *out_dims.last_mut().expect("at least one dimension") = self.d_out;
        Tensor::from_vec(out, out_dims, x.device())
    }
}

impl Linear {
    /// `weight` `(d_out, d_in)`, `bias` `(d_out)`.
    pub(crate) fn new(weight: Tensor, bias: Option<Tensor>) -> Linear {
        Linear { weight: Weight::F32(weight), bias }
    }

    /// Rows up to which `(W xᵀ)ᵀ` is used; more rows use `x Wᵀ` as candle does.
    const FEW_ROWS: usize = 64;

    /// This layer with its weights packed for BF16 products where the CPU runs them
    /// ([`tern_kernels::bf16_gemm::available`]), else unchanged.
    pub(crate) fn in_bf16(self) -> Result<Linear> {
        self.repacked(|weight, bias| Ok(Bf16Linear::pack(weight, bias)?.map(Weight::Bf16)))
    }

    /// This layer with its weights kept transposed for F32 products on the CPU
    /// ([`Linear::transposed`], [`tern_kernels::f32_linear`]), where they are F32 on the CPU;
    /// else unchanged. gemm runs many rows (an encoder's frames) and a decoding step's few rows
    /// alike on its wide kernel over them.
    pub(crate) fn in_f32_transposed(self) -> Result<Linear> {
        self.repacked(|weight, bias| Ok(TransposedF32::new(weight, bias)?.map(Weight::Transposed)))
    }

    /// This layer with its F32 weights (and bias) repacked by `pack`; unchanged where they are
    /// packed already or `pack` declines (`None`).
    fn repacked(self, pack: impl FnOnce(&Tensor, Option<&Tensor>) -> Result<Option<Weight>>) -> Result<Linear> {
        let Weight::F32(weight) = &self.weight else {
            return Ok(self);
        };
        match pack(weight, self.bias.as_ref())? {
            Some(weight) => Ok(Linear { weight, bias: self.bias }),
            None => Ok(self),
        }
    }

    /// This layer with transposed weights back in their own layout, for tests' references
    /// through candle's ops.
    #[cfg(test)]
    pub(crate) fn untransposed(self) -> Result<Linear> {
        let Weight::Transposed(t) = &self.weight else {
            return Ok(self);
        };
        let weight = Tensor::from_vec(f32_linear::transposed(&t.w_t, t.d_in, t.d_out), (t.d_out, t.d_in), &candle_core::Device::Cpu)?;
        Ok(Linear::new(weight, self.bias))
    }

    /// Bytes the weights take below F32 (half of them once in BF16).
    pub(crate) fn bytes_saved(&self) -> usize {
        match &self.weight {
            Weight::F32(_) | Weight::Transposed(_) => 0,
            Weight::Bf16(packed) => packed.weight_count() * 2,
        }
    }

    /// The BF16-packed weights, after [`Linear::in_bf16`] found the CPU's features.
    pub(crate) fn packed(&self) -> Option<&Bf16Linear> {
        match &self.weight {
            Weight::Bf16(packed) => Some(packed),
            _ => None,
        }
    }

    /// The transposed F32 weights, after [`Linear::in_f32_transposed`].
    pub(crate) fn transposed(&self) -> Option<&TransposedF32> {
        match &self.weight {
            Weight::Transposed(t) => Some(t),
            _ => None,
        }
    }

    /// The bias `(d_out)`, if any.
    pub(crate) fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `x Wᵀ` without the bias, for an op that adds it in its own pass; `(..., d_out)`.
    pub(crate) fn forward_no_bias(&self, x: &Tensor) -> Result<Tensor> {
        match &self.weight {
            Weight::F32(weight) => Linear::new(weight.clone(), None).forward(x),
            Weight::Bf16(packed) => packed.forward(x, false),
            Weight::Transposed(t) => t.forward(x, false),
        }
    }

    /// `x`: `(..., d_in)`; returns `(..., d_out)`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let weight = match &self.weight {
            Weight::F32(weight) => weight,
            Weight::Bf16(packed) => return packed.forward(x, true),
            Weight::Transposed(t) => return t.forward(x, true),
        };
        let dims = x.dims().to_vec();
        let d_in = *dims.last().expect("at least one dimension");
        let rows = x.elem_count() / d_in.max(1);
        let x2 = x.reshape((rows, d_in))?;
        let y = if rows <= Self::FEW_ROWS {
            weight.matmul(&x2.t()?)?.t()?
        } else {
            x2.matmul(&weight.t()?)?
        };
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y.contiguous()?,
        };
        let mut out_dims = dims;
        *out_dims.last_mut().expect("at least one dimension") = weight.dim(0)?;
        y.reshape(out_dims)
    }
}

/// `weight` `(d_out, d_in)` and `bias` from `vb`.
pub(crate) fn linear(d_in: usize, d_out: usize, vb: VarBuilder) -> Result<Linear> {
    Ok(Linear::new(vb.get((d_out, d_in), "weight")?, Some(vb.get(d_out, "bias")?)))
}

/// `weight` `(d_out, d_in)` from `vb`, no bias.
pub(crate) fn linear_no_bias(d_in: usize, d_out: usize, vb: VarBuilder) -> Result<Linear> {
    Ok(Linear::new(vb.get((d_out, d_in), "weight")?, None))
}

/// Activation rows taken together against each weight row by [`few_rows_times_f16`].
const F16_TILE: usize = 4;
/// Weight rows per rayon task in [`few_rows_times_f16`]: enough work to be worth a task, and
/// many tasks for a 50k-row vocabulary.
const F16_ROWS_PER_TASK: usize = 512;

/// `out[i][r] = x_i · w_r` for each row `x_i` of `x` (rows of `cols` values) and each row `w_r`
/// of the f16 matrix `w` (`w.len() / cols` rows), on the CPU, split over rayon's threads by
/// weight rows. For a few rows against a large matrix, such as a decoding step's logits, where
/// the time goes to reading the weights: f16 reads half the bytes of f32. Each output value is
/// the same whichever other rows come with it.
pub(crate) fn few_rows_times_f16(w: &[half::f16], cols: usize, x: &[f32]) -> Vec<Vec<f32>> {
    let m = x.len() / cols.max(1);
    let rows = w.len() / cols.max(1);
    let xs: Vec<&[f32]> = x.chunks_exact(cols).collect();
    let mut by_weight_row = vec![0f32; rows * m];
    by_weight_row.par_chunks_mut(F16_ROWS_PER_TASK * m.max(1)).enumerate().for_each(|(c, chunk)| {
        for (j, ys) in chunk.chunks_exact_mut(m.max(1)).enumerate() {
            let r = c * F16_ROWS_PER_TASK + j;
            let wr = &w[r * cols..(r + 1) * cols];
            let mut tiles = ys.chunks_exact_mut(F16_TILE);
            for (k, tile) in tiles.by_ref().enumerate() {
                let i = k * F16_TILE;
                tile.copy_from_slice(&cpu_kernels::dots_f16(wr, [xs[i], xs[i + 1], xs[i + 2], xs[i + 3]]));
            }
            let done = m / F16_TILE * F16_TILE;
            for (i, y) in tiles.into_remainder().iter_mut().enumerate() {
                [*y] = cpu_kernels::dots_f16(wr, [xs[done + i]]);
            }
        }
    });
    let mut out = vec![vec![0f32; rows]; m];
    for (r, ys) in by_weight_row.chunks_exact(m.max(1)).enumerate() {
        for (o, &y) in out.iter_mut().zip(ys) {
            o[r] = y;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::few_rows_times_f16;

    #[test]
    fn f16_products_land_row_by_row_and_a_row_gives_the_same_alone() {
        let (rows, cols) = (1_100usize, 48usize);
        let w: Vec<half::f16> = (0..rows * cols).map(|i| half::f16::from_f32(((i * 31 % 97) as f32 - 48.0) / 50.0)).collect();
        let x: Vec<f32> = (0..5 * cols).map(|i| ((i * 7 % 23) as f32 - 11.0) / 9.0).collect();
        let all = few_rows_times_f16(&w, cols, &x);
        assert_eq!((all.len(), all[0].len()), (5, rows));
        for (i, row) in all.iter().enumerate() {
            let alone = few_rows_times_f16(&w, cols, &x[i * cols..(i + 1) * cols]).remove(0);
            assert_eq!(&alone, row, "row {i} alone and among five");
            for r in [0, 511, 512, rows - 1] {
                let want: f32 = (0..cols).map(|c| w[r * cols + c].to_f32() * x[i * cols + c]).sum();
                assert!((row[r] - want).abs() < 1e-4 * (1.0 + want.abs()), "x{i} . w{r}: {} vs {want}", row[r]);
            }
        }
    }
}
