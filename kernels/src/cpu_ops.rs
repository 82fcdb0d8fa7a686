//! candle ops that run [`crate::cpu_kernels`] over a tensor on both cores: GELU, in the tanh
//! approximation (Whisper) or exact (BERT), and BERT's fused bias + GELU and residual + layer
//! norm; and a softmax that sums in f32 on the CPU whatever the dtype. On other devices or
//! dtypes, candle's own ops.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu_kernels;

/// Elements per parallel task: large enough to amortise the hand-off.
const CHUNK: usize = 16 * 1024;

/// A contiguous f32 CPU tensor's elements.
pub fn contiguous_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("expected a contiguous tensor".into()))?;
    Ok(&storage.as_slice::<f32>()?[start..end])
}

/// An output buffer's base pointer, shared by parallel tasks that each write their own
/// disjoint part of it.
pub struct OutPtr<T = f32>(pub *mut T);
// SAFETY: each task writes only its own part of the buffer, which outlives the tasks.
unsafe impl<T> Send for OutPtr<T> {}
unsafe impl<T> Sync for OutPtr<T> {}

impl<T> OutPtr<T> {
    /// The element `offset` places past the base.
    pub fn at(&self, offset: usize) -> *mut T {
        // SAFETY: callers pass offsets inside the buffer.
        unsafe { self.0.add(offset) }
    }

    /// The `len` elements from `offset`, for the one task that writes them.
    ///
    /// # Safety
    /// They lie inside the buffer, and no other task reads or writes them meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(offset), len)
    }
}

/// Which GELU.
#[derive(Clone, Copy)]
pub enum Gelu {
    /// The tanh approximation (candle's `gelu`).
    Tanh,
    /// `x/2 (1 + erf(x / sqrt 2))` (candle's `gelu_erf`).
    Erf,
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        match self {
            Gelu::Tanh => "parallel-gelu",
            Gelu::Erf => "parallel-gelu-erf",
        }
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let src = contiguous_f32(storage, layout)?;
        let mut dst = vec![0f32; src.len()];
        let kernel = match self {
            Gelu::Tanh => cpu_kernels::gelu_slice,
            Gelu::Erf => cpu_kernels::gelu_erf_slice,
        };
        dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| kernel(d, s));
        Ok((CpuStorage::F32(dst), layout.shape().clone()))
    }
}

/// `kind` GELU of `x`, on both cores for f32 on the CPU.
pub fn gelu(x: &Tensor, kind: Gelu) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        return x.contiguous()?.apply_op1_no_bwd(&kind);
    }
    match kind {
        Gelu::Tanh => x.gelu(),
        Gelu::Erf => x.gelu_erf(),
    }
}

/// Softmax over the last dimension, its sums in f32 everywhere.
///
/// candle's CPU softmax sums a row in the row's own dtype, one element after another. In BF16
/// (8 bits of mantissa) a sum stops growing once it is 256 times the terms it adds: over 1,500
/// frames of attention the weights then sum to several times 1, and Whisper in BF16 on the CPU
/// repeated one word to the end of every window. F16 and BF16 rows on the CPU are therefore
/// widened to f32 for the softmax and narrowed back; GPU kernels already sum in f32.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && matches!(x.dtype(), DType::F16 | DType::BF16) {
        return candle_nn::ops::softmax_last_dim(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype());
    }
    candle_nn::ops::softmax_last_dim(x)
}

/// Rows per parallel task for row-wise ops over rows of `n` values.
pub fn rows_per_task(n: usize) -> usize {
    (CHUNK / n.max(1)).max(1)
}

/// `gelu_erf(y + bias)`, `bias` broadcast over the rows of `y`.
struct BiasGeluErf;

impl CustomOp2 for BiasGeluErf {
    fn name(&self) -> &'static str {
        "bias-gelu-erf"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (y, bias) = (contiguous_f32(s1, l1)?, contiguous_f32(s2, l2)?);
        let n = bias.len();
        let mut dst = vec![0f32; y.len()];
        let task = rows_per_task(n) * n;
        dst.par_chunks_mut(task).zip(y.par_chunks(task)).for_each(|(d, s)| {
            for (d, s) in d.chunks_mut(n).zip(s.chunks(n)) {
                cpu_kernels::bias_gelu_erf(d, s, bias);
            }
        });
        Ok((CpuStorage::F32(dst), l1.shape().clone()))
    }
}

/// The exact GELU of `y + bias` (`y` `(..., n)`, `bias` `(n)`), in one pass over `y` on the CPU
/// in f32; elsewhere candle's add and GELU.
pub fn bias_gelu_erf(y: &Tensor, bias: &Tensor) -> Result<Tensor> {
    if y.device().is_cpu() && y.dtype() == DType::F32 && bias.dims1()? == y.dim(candle_core::D::Minus1)? {
        return y.contiguous()?.apply_op2_no_bwd(&bias.contiguous()?, &BiasGeluErf);
    }
    y.broadcast_add(bias)?.gelu_erf()
}

/// `layer_norm(y + residual + bias) * gamma + beta` per row; the third operand is `(3, n)`:
/// bias, gamma, beta.
struct AddLayerNorm {
    eps: f32,
}

impl CustomOp3 for AddLayerNorm {
    fn name(&self) -> &'static str {
        "add-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, residual, params) = (contiguous_f32(s1, l1)?, contiguous_f32(s2, l2)?, contiguous_f32(s3, l3)?);
        let n = params.len() / 3;
        let mut dst = vec![0f32; y.len()];
        let task = rows_per_task(n) * n;
        dst.par_chunks_mut(task).zip(y.par_chunks(task).zip(residual.par_chunks(task))).for_each(|(d, (y, r))| {
            for ((d, y), r) in d.chunks_mut(n).zip(y.chunks(n)).zip(r.chunks(n)) {
                cpu_kernels::add_layer_norm(d, y, r, params, self.eps);
            }
        });
        Ok((CpuStorage::F32(dst), l1.shape().clone()))
    }
}

/// A post-norm residual step, `layer_norm(y + residual + bias)` scaled by `gamma` and shifted by
/// `beta`, in one pass on the CPU in f32. `params` is `(3, n)`: bias, gamma, beta; `y` and
/// `residual` are `(..., n)` of the same shape.
pub fn add_layer_norm(y: &Tensor, residual: &Tensor, params: &Tensor, eps: f64) -> Result<Tensor> {
    let n = params.dim(1)?;
    if y.device().is_cpu() && y.dtype() == DType::F32 && y.dims() == residual.dims() && y.dim(candle_core::D::Minus1)? == n {
        return y.contiguous()?.apply_op3_no_bwd(&residual.contiguous()?, &params.contiguous()?, &AddLayerNorm { eps: eps as f32 });
    }
    let x = y.add(residual)?.broadcast_add(&params.get(0)?)?;
    let mean = x.mean_keepdim(candle_core::D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
    centred.broadcast_div(&(var + eps)?.sqrt()?)?.broadcast_mul(&params.get(1)?)?.broadcast_add(&params.get(2)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Deterministic values in about [-3, 3].
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 6001) as f32 / 1000.0 - 3.0).collect()
    }

    fn max_difference(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn fused_bias_gelu_and_add_layer_norm_match_candles_separate_ops() {
        let (rows, n) = (37, 384);
        let dev = Device::Cpu;
        let y = Tensor::from_vec(values(rows * n, 1), (rows, n), &dev).unwrap();
        let residual = Tensor::from_vec(values(rows * n, 7), (rows, n), &dev).unwrap();
        let bias = Tensor::from_vec(values(n, 3), n, &dev).unwrap();
        let gamma = Tensor::from_vec(values(n, 5), n, &dev).unwrap();
        let beta = Tensor::from_vec(values(n, 9), n, &dev).unwrap();

        let fused = bias_gelu_erf(&y, &bias).unwrap();
        let separate = y.broadcast_add(&bias).unwrap().gelu_erf().unwrap();
        assert!(max_difference(&fused, &separate) < 1e-5);

        let params = Tensor::stack(&[&bias, &gamma, &beta], 0).unwrap();
        let fused = add_layer_norm(&y, &residual, &params, 1e-12).unwrap();
        let sum = y.add(&residual).unwrap().broadcast_add(&bias).unwrap();
        let separate = candle_nn::ops::layer_norm(&sum, &gamma, &beta, 1e-12).unwrap();
        let d = max_difference(&fused, &separate);
        assert!(d < 1e-4, "{d}");
        // A transposed (non-contiguous) input gives the same rows.
        let yt = y.t().unwrap().contiguous().unwrap().t().unwrap();
        assert!(max_difference(&add_layer_norm(&yt, &residual, &params, 1e-12).unwrap(), &fused) == 0.0);
    }

    /// Rows as long as Whisper's 1,500 frames, in half precision, weigh as the f32 softmax
    /// weighs them: each weight within its dtype's rounding, each row summing to 1.
    #[test]
    fn half_precision_softmax_sums_to_one_over_long_rows() {
        let (rows, n) = (4, 1500);
        let x = Tensor::from_vec(values(rows * n, 7), (rows, n), &Device::Cpu).unwrap();
        let want = candle_nn::ops::softmax_last_dim(&x).unwrap();
        for (dtype, tolerance) in [(DType::BF16, 1.0 / 128.0), (DType::F16, 1.0 / 1024.0)] {
            let got = softmax_last_dim(&x.to_dtype(dtype).unwrap()).unwrap();
            assert_eq!(got.dtype(), dtype);
            let got = got.to_dtype(DType::F32).unwrap();
            for (g, w) in got.to_vec2::<f32>().unwrap().iter().zip(want.to_vec2::<f32>().unwrap()) {
                let sum: f32 = g.iter().sum();
                assert!((sum - 1.0).abs() < 0.01, "{dtype:?} row sums to {sum}");
                for (g, w) in g.iter().zip(&w) {
                    // The input's own rounding to the dtype moves a weight by up to its ulp too;
                    // F16's smallest weights are subnormal, with steps of 6e-8.
                    assert!((g - w).abs() <= 3.0 * tolerance * w + 1e-7, "{dtype:?}: {g} for {w}");
                }
            }
        }
    }
}
