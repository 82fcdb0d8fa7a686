//! candle ops that run [`crate::cpu_kernels`] over a tensor on both cores: GELU, in the tanh
//! approximation (Whisper) or exact (BERT). On other devices or dtypes, candle's own ops.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu_kernels;

/// Elements per parallel task: large enough to amortise the hand-off.
const CHUNK: usize = 16 * 1024;

/// A contiguous f32 CPU tensor's elements.
pub(crate) fn contiguous_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("expected a contiguous tensor".into()))?;
    Ok(&storage.as_slice::<f32>()?[start..end])
}

/// Which GELU.
#[derive(Clone, Copy)]
pub(crate) enum Gelu {
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
pub(crate) fn gelu(x: &Tensor, kind: Gelu) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        return x.contiguous()?.apply_op1_no_bwd(&kind);
    }
    match kind {
        Gelu::Tanh => x.gelu(),
        Gelu::Erf => x.gelu_erf(),
    }
}
