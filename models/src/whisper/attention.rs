//! Attention of one new token per row on the CPU, for the decoder's steps after the prompt.
//!
//! With candle's ops, a step's attention is a batched matmul of `batch x heads` tiny products,
//! each a separate gemm call with its own thread-pool dispatch: a step of 16 rows cost five times
//! one row although the work is mostly reading each row's keys and values once. Here each
//! (row, head) is a plain dot-product / weighted-sum loop over contiguous memory (compiled for
//! the CPU's widest vectors, [`tern_kernels::cpu_kernels`]), and the pairs are split across threads.

use std::sync::Arc;

use candle_core::{Device, Result, Storage, Tensor};
use rayon::prelude::*;

use tern_kernels::bf16_gemm::{self, PackedB};
use tern_kernels::cpu_kernels;

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

/// One head's cross-attention keys and values for one window, packed for BF16 products over
/// the window's own frames: keys as `(head_dim x frames)`, values as `(frames x head_dim)`.
pub(crate) struct PackedHead {
    keys: PackedB,
    values: PackedB,
}

impl PackedHead {
    /// Packs `frames` rows of `head_dim` keys (already scaled) and values: frame `p`'s are
    /// `keys[p * stride..][..head_dim]` and `values[p * stride..][..head_dim]`.
    pub(crate) fn new(frames: usize, head_dim: usize, keys: &[f32], values: &[f32], stride: usize) -> PackedHead {
        let mut packed = PackedHead { keys: PackedB::default(), values: PackedB::default() };
        packed.keys.refill_columns_of(keys, stride, head_dim, frames);
        packed.values.refill_rows_of(values, stride, frames, head_dim);
        packed
    }
}

/// One head's cross-attention keys and values for one window in F32, over the window's own
/// frames: keys transposed, `(head_dim x frames)`, values `(frames x head_dim)`.
pub(crate) struct F32Head {
    frames: usize,
    keys_t: Vec<f32>,
    values: Vec<f32>,
}

impl F32Head {
    /// As [`PackedHead::new`]: frame `p`'s keys (already scaled) and values are
    /// `keys[p * stride..][..head_dim]` and `values[p * stride..][..head_dim]`.
    pub(crate) fn new(frames: usize, head_dim: usize, keys: &[f32], values: &[f32], stride: usize) -> F32Head {
        let mut keys_t = vec![0f32; head_dim * frames];
        let mut rows = Vec::with_capacity(frames * head_dim);
        for p in 0..frames {
            let (k, v) = (&keys[p * stride..p * stride + head_dim], &values[p * stride..p * stride + head_dim]);
            for (i, &x) in k.iter().enumerate() {
                keys_t[i * frames + p] = x;
            }
            rows.extend_from_slice(v);
        }
        F32Head { frames, keys_t, values: rows }
    }
}

/// A window's cross-attention keys and values for one head, computed once per window and
/// shared (not copied) by the rows that decode it: its beams, and the batches it joins.
pub(crate) enum CrossHead {
    /// Packed for BF16 products.
    Bf16(PackedHead),
    F32(F32Head),
}

/// Softmax attention of `q` `(batch, heads, tokens, head_dim)` (already scaled, F32 on the
/// CPU) over `heads[b * heads + h]`. Returns `(batch, heads, tokens, head_dim)`.
pub(crate) fn attend_heads(q: &Tensor, heads: &[Arc<CrossHead>]) -> Result<Tensor> {
    let (batch, h, _, _) = q.dims4()?;
    if heads.len() != batch * h {
        candle_core::bail!("cross-attention: {} heads for {batch} rows of {h}", heads.len());
    }
    match heads.first().map(|head| &**head) {
        Some(CrossHead::F32(_)) => attend_f32(q, heads),
        _ => attend_bf16(q, heads),
    }
}

/// [`attend_heads`] over F32 heads. The rows that share a head (a window's beams) are taken
/// together, so its keys and values are read from memory once per step for all of them, not
/// once per beam: at beam 5 that read was most of a step. Each query's arithmetic is the
/// same, in the same order, as alone ([`attend_one`]'s): a row computes the same whichever rows
/// share its head.
fn attend_f32(q: &Tensor, heads: &[Arc<CrossHead>]) -> Result<Tensor> {
    let (batch, h, t, hd) = q.dims4()?;
    let head = |pair: usize| match &*heads[pair] {
        CrossHead::F32(head) => Ok(head),
        CrossHead::Bf16(_) => Err(candle_core::Error::Msg("cross-attention heads of two kinds".into())),
    };
    for pair in 0..batch * h {
        head(pair)?;
    }
    // Runs of consecutive rows whose heads are the same ones: (first row, rows).
    let mut groups: Vec<(usize, usize)> = Vec::new();
    for b in 0..batch {
        match groups.last_mut() {
            Some((first, n)) if Arc::ptr_eq(&heads[*first * h], &heads[b * h]) => *n += 1,
            _ => groups.push((b, 1)),
        }
    }
    let qd = q.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; batch * h * t * hd];
    let dst = tern_kernels::cpu_ops::OutPtr(out.as_mut_ptr());
    let tasks: Vec<(usize, usize, usize)> = groups.iter().flat_map(|&(first, m)| (0..h).map(move |hi| (first, m, hi))).collect();
    tasks.into_par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, (first, m, hi)| {
        let F32Head { frames: n, keys_t, values } = head(first * h + hi).expect("checked above");
        let n = *n;
        // The group's queries: row `first + r`, token `j` is query `r * t + j`.
        let queries = m * t;
        let query = |i: usize| {
            let pair = (first + i / t) * h + hi;
            let at = (pair * t + i % t) * hd;
            at..at + hd
        };
        scores.clear();
        scores.resize(queries * n, 0.0);
        for d in 0..hd {
            let keys = &keys_t[d * n..(d + 1) * n];
            for (i, s) in scores.chunks_exact_mut(n).enumerate() {
                cpu_kernels::axpy(s, qd[query(i)][d], keys);
            }
        }
        for s in scores.chunks_exact_mut(n) {
            cpu_kernels::softmax_in_place(s);
        }
        for i in 0..queries {
            // SAFETY: this task alone writes its group's rows of this head; `out` holds
            // batch x h x t x hd values.
            let o = unsafe { dst.slice(query(i).start, hd) };
            o.fill(0.0);
        }
        for (p, v) in values.chunks_exact(hd).enumerate() {
            for (i, s) in scores.chunks_exact(n).enumerate() {
                // SAFETY: as above.
                let o = unsafe { dst.slice(query(i).start, hd) };
                cpu_kernels::axpy(o, s[p], v);
            }
        }
    });
    Tensor::from_vec(out, (batch, h, t, hd), q.device())
}

/// [`attend_heads`] over BF16-packed heads, each (row, head) by [`bf16_gemm::attention`]. Only
/// where [`bf16_gemm::available`] (the packed heads exist only there).
fn attend_bf16(q: &Tensor, heads: &[Arc<CrossHead>]) -> Result<Tensor> {
    let (batch, h, t, hd) = q.dims4()?;
    let heads = heads
        .iter()
        .map(|head| match &**head {
            CrossHead::Bf16(packed) => Ok(packed),
            CrossHead::F32(_) => Err(candle_core::Error::Msg("cross-attention heads of two kinds".into())),
        })
        .collect::<Result<Vec<&PackedHead>>>()?;
    let qd = q.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; batch * h * t * hd];
    let hd_pairs = hd.div_ceil(2);
    out.par_chunks_mut(t * hd).enumerate().for_each_init(
        || (Vec::new(), Vec::new(), Vec::new()),
        |(queries, scores, weights), (pair, o)| {
            let head = &heads[pair];
            queries.resize(t * hd_pairs, 0);
            for (x, dst) in qd[pair * t * hd..(pair + 1) * t * hd].chunks_exact(hd).zip(queries.chunks_exact_mut(hd_pairs)) {
                bf16_gemm::row_to_bf16(x, dst);
            }
            // SAFETY: packed heads exist only where the CPU has the features; `o` holds `t`
            // rows of `hd` values.
            unsafe { bf16_gemm::attention(queries, t, &head.keys, &head.values, scores, weights, o.as_mut_ptr(), hd) };
        },
    );
    Tensor::from_vec(out, (batch, h, t, hd), q.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_kernels::bf16_gemm::test_values as values;
    /// F32 heads shared by beams: three windows (two, one and three beams, of different
    /// lengths) give each row, to the bit, what the per-row kernel over the transposed keys
    /// gives it alone, for one query token and two.
    #[test]
    fn shared_f32_heads_give_each_beam_what_it_gets_alone() {
        let (h, hd, frames) = (2usize, 8usize, 37usize);
        let windows = [(2usize, 37usize), (1, 20), (3, 5)];
        let k = values(windows.len() * h * frames * hd, 1);
        let v = values(windows.len() * h * frames * hd, 2);
        // Window w's head hi: frames x hd at (w * h + hi) * frames * hd.
        let shared: Vec<Vec<Arc<CrossHead>>> = windows
            .iter()
            .enumerate()
            .map(|(w, &(_, n))| (0..h).map(|hi| {
                let base = (w * h + hi) * frames * hd;
                Arc::new(CrossHead::F32(F32Head::new(n, hd, &k[base..], &v[base..], hd)))
            }).collect())
            .collect();
        let rows: Vec<usize> = windows.iter().enumerate().flat_map(|(w, &(beams, _))| std::iter::repeat_n(w, beams)).collect();
        let heads: Vec<Arc<CrossHead>> = rows.iter().flat_map(|&w| shared[w].iter().cloned()).collect();
        let dev = Device::Cpu;
        for t in [1usize, 2] {
            let q = Tensor::from_vec(values(rows.len() * h * t * hd, 3 + t), (rows.len(), h, t, hd), &dev).unwrap();
            let got = attend_heads(&q, &heads).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (r, &w) in rows.iter().enumerate() {
                let n = windows[w].1;
                let mut k_t = vec![0f32; h * hd * n];
                for hi in 0..h {
                    for p in 0..n {
                        for i in 0..hd {
                            k_t[hi * hd * n + i * n + p] = k[(w * h + hi) * frames * hd + p * hd + i];
                        }
                    }
                }
                let k_t = Tensor::from_vec(k_t, (1, h, hd, n), &dev).unwrap();
                let v_w: Vec<f32> = (0..h).flat_map(|hi| v[(w * h + hi) * frames * hd..][..n * hd].to_vec()).collect();
                let v_w = Tensor::from_vec(v_w, (1, h, n, hd), &dev).unwrap();
                for tok in 0..t {
                    let q_tok = q.narrow(0, r, 1).unwrap().narrow(2, tok, 1).unwrap().contiguous().unwrap();
                    let want = attend_one(&q_tok, &k_t, KeyLayout::Transposed, &v_w, None).unwrap().expect("F32 on the CPU");
                    let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    for hi in 0..h {
                        let at = ((r * h + hi) * t + tok) * hd;
                        assert_eq!(&got[at..at + hd], &want[hi * hd..(hi + 1) * hd], "row {r} (window {w}), head {hi}, token {tok} of {t}");
                    }
                }
            }
        }
        assert!(attend_heads(&Tensor::zeros((1, h, 1, hd), candle_core::DType::F32, &dev).unwrap(), &heads[..1]).is_err(), "a head count that is not rows x heads");
    }

    /// Against the F32 kernel over the transposed keys: two rows of different lengths (the
    /// shorter masked there, packed short here), two heads, one and two query tokens.
    #[test]
    fn bf16_cross_attention_matches_f32_within_bf16_rounding() {
        if bf16_gemm::skip_without_bf16() {
            return;
        }
        let (batch, h, hd, frames) = (2usize, 2usize, 8usize, 37usize);
        let lens = [37usize, 20];
        let k = values(batch * h * frames * hd, 1);
        let v = values(batch * h * frames * hd, 2);
        let packed: Vec<Arc<CrossHead>> = (0..batch * h)
            .map(|pair| {
                let base = pair * frames * hd;
                Arc::new(CrossHead::Bf16(PackedHead::new(lens[pair / h], hd, &k[base..], &v[base..], hd)))
            })
            .collect();
        // `(batch, head, head_dim, frames)` for the F32 kernel.
        let mut k_t = vec![0f32; k.len()];
        for pair in 0..batch * h {
            for p in 0..frames {
                for i in 0..hd {
                    k_t[pair * frames * hd + i * frames + p] = k[pair * frames * hd + p * hd + i];
                }
            }
        }
        let dev = Device::Cpu;
        let k_t = Tensor::from_vec(k_t, (batch, h, hd, frames), &dev).unwrap();
        let v_t = Tensor::from_vec(v.clone(), (batch, h, frames, hd), &dev).unwrap();
        for t in [1usize, 2] {
            let q = Tensor::from_vec(values(batch * h * t * hd, 3 + t), (batch, h, t, hd), &dev).unwrap();
            let got = attend_heads(&q, &packed).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for tok in 0..t {
                let q_tok = q.narrow(2, tok, 1).unwrap().contiguous().unwrap();
                let want = attend_one(&q_tok, &k_t, KeyLayout::Transposed, &v_t, Some(&lens)).unwrap().expect("F32 on the CPU");
                let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for pair in 0..batch * h {
                    for i in 0..hd {
                        let (g, w) = (got[(pair * t + tok) * hd + i], want[pair * hd + i]);
                        assert!((g - w).abs() < 0.02, "token {tok} of {t}, pair {pair}, value {i}: {g} vs {w}");
                    }
                }
            }
        }
    }
}
