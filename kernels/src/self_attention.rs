//! Multi-head self-attention on the CPU in one fused pass per (sequence, head), for encoders
//! (Whisper's audio encoder, BERT): see [`self_attention`].

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::bf16_gemm::{self, PackedB};
use crate::cpu_ops::{contiguous_f32, OutPtr};

/// Softmax attention of `q`, `k`, `v` (f32 on the CPU), each `(batch, len, heads * head_dim)`,
/// queries already scaled; sequence `b` attends over its first `lens[b]` positions (all
/// without `lens`) and its other rows come out zero. With `bf16` (where
/// [`bf16_gemm::available`]), both products take BF16 operands with F32 sums. See
/// [`SelfAttention`].
pub fn self_attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, lens: Option<&[usize]>, bf16: bool) -> Result<Tensor> {
    let (b, len, _) = q.dims3()?;
    self_attention_spans(q, k, v, heads, &padded(b, len, lens)?, bf16)
}

/// The spans (first row, rows) of `b` sequences padded to `len` rows each, sequence `i` taking
/// its first `lens[i]` (all `len` without `lens`). An error where `lens` has another count or a
/// length of 0 or over `len`.
pub fn padded(b: usize, len: usize, lens: Option<&[usize]>) -> Result<Vec<(usize, usize)>> {
    if let Some(lens) = lens {
        if lens.len() != b || lens.iter().any(|&n| n == 0 || n > len) {
            candle_core::bail!("self-attention: lengths {lens:?} for {b} windows of {len}");
        }
    }
    Ok((0..b).map(|i| (i * len, lens.map_or(len, |l| l[i]))).collect())
}

/// The spans (first row, rows) of sequences of `lens` rows laid end to end.
pub fn end_to_end(lens: &[usize]) -> Vec<(usize, usize)> {
    let mut first = 0;
    lens.iter()
        .map(|&n| {
            first += n;
            (first - n, n)
        })
        .collect()
}

/// [`self_attention`] over sequences laid end to end: `q`, `k`, `v` are `(rows, heads *
/// head_dim)` (or any shape whose last dimension is that), and sequence `i` is the `spans[i].1`
/// rows from row `spans[i].0`. Rows outside every span come out zero.
pub fn self_attention_spans(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, spans: &[(usize, usize)], bf16: bool) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let bf16 = bf16 && bf16_gemm::available();
    q.apply_op3_no_bwd(&k, &v, &SelfAttention { heads, spans: spans.to_vec(), bf16 })
}

/// Multi-head softmax attention of `q`, `k`, `v`, rows of `d_model` with the heads side by side,
/// queries already scaled, over sequences of rows (`spans`: first row, rows). A window padded
/// to the longest of its batch is a span of its own rows only, so it comes out as it would
/// alone, and the padding's rows come out zero.
///
/// candle's ops materialise every head's `len x len` scores twice over (products, then
/// softmax: ~50 MB per layer for 16 short windows) and copy `q`, `k` and `v` into per-head
/// layouts; the fresh pages and the memory traffic cost about a fifth of Whisper's encoder at
/// batch 16.
/// Here each (sequence, head, block of queries) runs on one core with its scores in a buffer
/// that stays in cache ([`crate::f32_linear::attend_spans_f32`]), and gemm reads the heads in
/// place through strides.
struct SelfAttention {
    heads: usize,
    spans: Vec<(usize, usize)>,
    /// Products in BF16 ([`bf16_head`]).
    bf16: bool,
}

/// A task's buffers for [`bf16_head`], kept from one head to the next.
#[derive(Default)]
struct Bf16Scratch {
    queries: Vec<u32>,
    keys: PackedB,
    values: PackedB,
    scores: Vec<f32>,
    weights: Vec<u32>,
}

/// One head of one window with BF16 products ([`bf16_gemm::attention`]): `n` positions, rows
/// `d` apart from `base` in `q`, `k`, `v` and `out`, `hd` values each.
///
/// # Safety
/// [`bf16_gemm::available`]; `out` holds this head's `n` rows (`d` apart, from `base`) and no
/// other task writes them.
#[allow(clippy::too_many_arguments)]
unsafe fn bf16_head(scratch: &mut Bf16Scratch, q: &[f32], k: &[f32], v: &[f32], base: usize, n: usize, hd: usize, d: usize, out: *mut f32) {
    let Bf16Scratch { queries, keys, values, scores, weights } = scratch;
    let hd_pairs = hd.div_ceil(2);
    queries.resize(n * hd_pairs, 0);
    for (r, dst) in queries.chunks_exact_mut(hd_pairs).enumerate() {
        bf16_gemm::row_to_bf16(&q[base + r * d..base + r * d + hd], dst);
    }
    keys.refill_columns_of(&k[base..], d, hd, n);
    values.refill_rows_of(&v[base..], d, n, hd);
    bf16_gemm::attention(queries, n, keys, values, scores, weights, out.add(base), d);
}

/// The BF16 attention of [`self_attention_spans`] over plain slices: `q`, `k`, `v` and `out`
/// are rows of `d` values; the rows of `out` in `spans` are written, the others left as they
/// are. Panics where [`bf16_gemm::available`] is false or a span leaves the rows.
pub fn attend_spans_bf16(q: &[f32], k: &[f32], v: &[f32], d: usize, heads: usize, spans: &[(usize, usize)], out: &mut [f32]) {
    let rows = q.len() / d;
    assert!(bf16_gemm::available() && d % heads == 0 && k.len() == q.len() && v.len() == q.len() && out.len() == q.len());
    assert!(spans.iter().all(|&(from, n)| from + n <= rows), "sequences {spans:?} over {rows} rows");
    let hd = d / heads;
    let dst = OutPtr(out.as_mut_ptr());
    (0..spans.len() * heads).into_par_iter().for_each_init(Bf16Scratch::default, |scratch, pair| {
        let (from, n) = spans[pair / heads];
        let base = from * d + (pair % heads) * hd;
        // SAFETY: checked above; this task alone writes this head's rows of `out`.
        unsafe { bf16_head(scratch, q, k, v, base, n, hd, d, dst.at(0)) };
    });
}

impl CustomOp3 for SelfAttention {
    fn name(&self) -> &'static str {
        "fused-self-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = (contiguous_f32(qs, ql)?, contiguous_f32(ks, kl)?, contiguous_f32(vs, vl)?);
        let d = ql.shape().dims().last().copied().unwrap_or(0);
        if kl.shape() != ql.shape() || vl.shape() != ql.shape() || d == 0 || d % self.heads != 0 {
            candle_core::bail!("self-attention: q {:?}, k {:?}, v {:?}, {} heads", ql.shape(), kl.shape(), vl.shape(), self.heads);
        }
        let rows = q.len() / d;
        if self.spans.iter().any(|&(from, n)| n == 0 || from + n > rows) {
            candle_core::bail!("self-attention: sequences {:?} over {rows} rows", self.spans);
        }
        let h = self.heads;
        let mut out = vec![0f32; q.len()];
        if self.bf16 {
            attend_spans_bf16(q, k, v, d, h, &self.spans, &mut out);
            return Ok((CpuStorage::F32(out), ql.shape().clone()));
        }
        crate::f32_linear::attend_spans_f32(q, k, v, d, h, &self.spans, &mut out);
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16_gemm::test_values as values;
    use candle_core::Device;

    /// Windows of different lengths, two heads: the BF16 products give the F32 result within
    /// their rounding, and the padding's rows stay zero.
    #[test]
    fn bf16_heads_match_f32_ones() {
        if bf16_gemm::skip_without_bf16() {
            return;
        }
        let (b, len, heads, hd) = (2usize, 41usize, 2usize, 8usize);
        let lens = [41usize, 17];
        let t = |seed| Tensor::from_vec(values(b * len * heads * hd, seed), (b, len, heads * hd), &Device::Cpu).unwrap();
        let (q, k, v) = (t(1), t(2), t(3));
        let want = self_attention(&q, &k, &v, heads, Some(&lens), false).unwrap().to_vec3::<f32>().unwrap();
        let got = self_attention(&q, &k, &v, heads, Some(&lens), true).unwrap().to_vec3::<f32>().unwrap();
        for w in 0..b {
            for p in 0..len {
                for (i, (g, x)) in got[w][p].iter().zip(&want[w][p]).enumerate() {
                    if p >= lens[w] {
                        assert_eq!(*g, 0.0, "window {w}, padding position {p}");
                    }
                    assert!((g - x).abs() < 0.02, "window {w}, position {p}, value {i}: {g} vs {x}");
                }
            }
        }
    }
}
