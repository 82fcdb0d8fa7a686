//! Attention of one new token per row on the CPU, for the decoder's steps after the prompt.
//!
//! With candle's ops, a step's attention is a batched matmul of `batch x heads` tiny products,
//! each a separate gemm call with its own thread-pool dispatch: a step of 16 rows cost five times
//! one row although the work is mostly reading each row's keys and values once. Here each
//! (row, head) is a plain dot-product / weighted-sum loop over contiguous memory (compiled for
//! the CPU's widest vectors, [`crate::cpu_kernels`]), and the pairs are split across threads.

use candle_core::{Device, Result, Storage, Tensor};
use rayon::prelude::*;

use crate::cpu_kernels;

/// How the keys are laid out per (row, head).
#[derive(Clone, Copy)]
pub(crate) enum KeyLayout {
    /// `(head_dim, len)`: the cross-attention keys, transposed once per window.
    Transposed,
    /// `(len, head_dim)`: the self-attention cache, appended to at every step.
    Rows,
}

/// A contiguous f32 CPU tensor's elements, or `None` for any other tensor.
fn cpu_f32<'a>(storage: &'a Storage, t: &Tensor) -> Option<&'a [f32]> {
    let layout = t.layout();
    let (start, end) = layout.contiguous_offsets()?;
    match storage {
        Storage::Cpu(cpu) => cpu.as_slice::<f32>().ok().map(|s| &s[start..end]),
        _ => None,
    }
}

/// Softmax attention of `q` `(batch, heads, 1, head_dim)` (already scaled, as the keys are)
/// over `k` (see [`KeyLayout`]) and `v` `(batch, heads, len, head_dim)`. Row `b` attends to
/// its first `lens[b]` positions (all when `lens` is `None`). Returns `(batch, heads, 1,
/// head_dim)`, or `None` when the tensors are not contiguous f32 on the CPU (callers then use
/// candle's ops).
pub(crate) fn attend_one(
    q: &Tensor,
    k: &Tensor,
    layout: KeyLayout,
    v: &Tensor,
    lens: Option<&[usize]>,
) -> Result<Option<Tensor>> {
    if !matches!(q.device(), Device::Cpu) {
        return Ok(None);
    }
    let (batch, heads, one, hd) = q.dims4()?;
    let len = v.dims4()?.2;
    if one != 1 {
        return Ok(None);
    }
    let (qs, ks, vs) = (q.storage_and_layout().0, k.storage_and_layout().0, v.storage_and_layout().0);
    let (Some(qd), Some(kd), Some(vd)) = (cpu_f32(&qs, q), cpu_f32(&ks, k), cpu_f32(&vs, v)) else {
        return Ok(None);
    };
    let mut out = vec![0f32; batch * heads * hd];
    out.par_chunks_mut(hd).enumerate().for_each_init(
        || vec![0f32; len],
        |scores, (pair, o)| {
            let b = pair / heads;
            let n = lens.map_or(len, |l| l[b].min(len));
            let q = &qd[pair * hd..(pair + 1) * hd];
            let k = &kd[pair * hd * len..(pair + 1) * hd * len];
            let v = &vd[pair * len * hd..(pair + 1) * len * hd];
            let s = &mut scores[..n];
            match layout {
                KeyLayout::Transposed => {
                    s.fill(0.0);
                    for (d, &qd) in q.iter().enumerate() {
                        cpu_kernels::axpy(s, qd, &k[d * len..d * len + n]);
                    }
                    cpu_kernels::softmax_in_place(s);
                    o.fill(0.0);
                    for (p, &w) in s.iter().enumerate() {
                        cpu_kernels::axpy(o, w, &v[p * hd..(p + 1) * hd]);
                    }
                }
                // Queries come scaled already.
                KeyLayout::Rows => cpu_kernels::attend(q, k, v, hd, 1.0, s, o),
            }
        },
    );
    Ok(Some(Tensor::from_vec(out, (batch, heads, 1, hd), q.device())?))
}
