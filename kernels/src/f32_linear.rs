//! F32 products of rows with a layer's weights kept transposed, the bias and residual written
//! in the product's pass, and attention over plain slices: the linear layers and attention of
//! encoders and the UNet on the CPU in F32.
//!
//! Why the weights are kept transposed: a layer computes `x Wᵀ` with `W` stored `(out, in)`;
//! gemm computes a row-major product as its transpose, where `Wᵀ` is the left operand, and
//! packs a column-major left operand by plain copies instead of a transposing gather on every
//! call (the gather took a tenth of SDXL's UNet step, and of Whisper's encoder).

use rayon::prelude::*;

use crate::cpu_kernels;
use crate::cpu_ops::{rows_per_task, OutPtr};

/// Below this many rows a product splits its output columns between the threads itself: gemm's
/// own threading gives each thread too little of a few-row product (a prompt's 77 tokens ran
/// slower on two threads than on one).
pub const FEW_ROWS: usize = 128;

/// What a product adds besides the bias.
#[derive(Clone, Copy)]
pub enum Residual<'a> {
    None,
    /// These rows (as many values as the output).
    Add(&'a [f32]),
    /// What the output holds already: the product is added to it.
    InOut,
}

/// `src` (`rows x cols`, row-major) as `cols x rows`, in blocks that stay in cache, on every
/// core (a strided copy on one thread took a fifth of SDXL's load).
pub fn transposed(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const BLOCK: usize = 64;
    assert_eq!(src.len(), rows * cols, "a {rows} x {cols} matrix");
    let mut out = vec![0f32; rows * cols];
    out.par_chunks_mut(BLOCK * rows).enumerate().for_each(|(bj, dst)| {
        let (c0, c1) = (bj * BLOCK, ((bj + 1) * BLOCK).min(cols));
        for r0 in (0..rows).step_by(BLOCK) {
            for r in r0..(r0 + BLOCK).min(rows) {
                for c in c0..c1 {
                    dst[(c - c0) * rows + r] = src[r * cols + c];
                }
            }
        }
    });
    out
}

/// `out = x · w_t + bias + residual` on every core: `x` rows of `c_in`, `w_t` the layer's
/// weights transposed (`c_in x c_out`, row-major), `bias` `c_out` values, `out` as many rows of
/// `c_out`. Panics where the lengths disagree.
pub fn rows_times_transposed(x: &[f32], c_in: usize, w_t: &[f32], c_out: usize, bias: Option<&[f32]>, residual: Residual, out: &mut [f32]) {
    let n = c_out;
    let rows = x.len() / c_in.max(1);
    assert!(rows * c_in == x.len() && w_t.len() == c_in * n && out.len() == rows * n, "{} inputs of {c_in}, {} weights, {} outputs of {n}", x.len(), w_t.len(), out.len());
    assert!(bias.is_none_or(|b| b.len() == n), "a bias of {n} values");
    if let Residual::Add(r) = residual {
        assert_eq!(r.len(), out.len(), "a residual as long as the output");
    }
    // The bias and residual first, then gemm adds the product to them (`read_dst`).
    let read_dst = bias.is_some() || !matches!(residual, Residual::None);
    if bias.is_some() || matches!(residual, Residual::Add(_)) {
        let task = rows_per_task(n) * n;
        out.par_chunks_mut(task).enumerate().for_each(|(t, dst)| {
            for (r, row) in dst.chunks_exact_mut(n).enumerate() {
                let at = (t * task / n + r) * n;
                match (bias, residual) {
                    (Some(b), Residual::Add(res)) => row.iter_mut().zip(b).zip(&res[at..at + n]).for_each(|((o, b), r)| *o = b + r),
                    (Some(b), Residual::InOut) => row.iter_mut().zip(b).for_each(|(o, b)| *o += b),
                    (Some(b), Residual::None) => row.copy_from_slice(b),
                    (None, Residual::Add(res)) => row.copy_from_slice(&res[at..at + n]),
                    (None, _) => {}
                }
            }
        });
    }
    if rows >= FEW_ROWS {
        // SAFETY: `out` is rows x n, `x` rows x c_in, `w_t` c_in x n (checked above).
        unsafe {
            gemm::gemm(
                rows, n, c_in,
                out.as_mut_ptr(), 1, n as isize, read_dst,
                x.as_ptr(), 1, c_in as isize,
                w_t.as_ptr(), 1, n as isize,
                1.0, 1.0, false, false, false, gemm::Parallelism::Rayon(rayon::current_num_threads()),
            );
        }
        return;
    }
    let block = n.div_ceil(4 * rayon::current_num_threads()).next_multiple_of(16).min(n).max(1);
    let dst = OutPtr(out.as_mut_ptr());
    (0..n.div_ceil(block)).into_par_iter().for_each(|t| {
        let (from, width) = (t * block, block.min(n - t * block));
        // SAFETY: this task alone writes columns from..from + width of every row of `out`
        // (rows x n); `w_t` (c_in x n) is read from column `from` on.
        unsafe {
            gemm::gemm(
                rows, width, c_in,
                dst.at(from), 1, n as isize, read_dst,
                x.as_ptr(), 1, c_in as isize,
                w_t.as_ptr().add(from), 1, n as isize,
                1.0, 1.0, false, false, false, gemm::Parallelism::None,
            );
        }
    });
}

/// Softmax attention over plain slices: `q`, `k`, `v` and `out` are rows of `d` values, the
/// heads side by side (`d / heads` each), queries already scaled; sequence `i` is the
/// `spans[i].1` rows from row `spans[i].0` and attends over its own rows only. The rows of
/// `out` in the spans are written, the others left as they are ([`attend_blocks`], 64 queries a
/// task: 64 x 1,500 keys of scores is 375 KB, which stays in a core's cache). Panics where a
/// span leaves the rows.
pub fn attend_spans_f32(q: &[f32], k: &[f32], v: &[f32], d: usize, heads: usize, spans: &[(usize, usize)], out: &mut [f32]) {
    assert!(k.len() == q.len(), "self-attention: as many keys as queries");
    let sequences: Vec<((usize, usize), (usize, usize))> = spans.iter().map(|&span| (span, span)).collect();
    attend_blocks(q, k, v, d, heads, &sequences, 1.0, false, 64, out);
}

/// Softmax attention over plain slices, one task per (sequence, head, block of
/// `queries_per_task` queries) with its scores in cache, gemm reading the heads in place through
/// strides. `q` and `out` are rows of `d` values, `k` and `v` rows of `d` too (as many as the
/// sequences need: the queries' own rows for self-attention, a context's for cross-attention),
/// the heads side by side (`d / heads` each). Sequence `i` is `sequences[i] = ((first query row,
/// queries), (first key row, keys))`; its scores are `scale` times the products. `causal`: query
/// `j` of a sequence weighs its keys `0..=j` only, the others weight 0 exactly. The query rows
/// of `out` in the sequences are written, the others left as they are. Panics where a sequence
/// leaves the rows.
#[allow(clippy::too_many_arguments)]
pub fn attend_blocks(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: usize,
    heads: usize,
    sequences: &[((usize, usize), (usize, usize))],
    scale: f32,
    causal: bool,
    queries_per_task: usize,
    out: &mut [f32],
) {
    let (q_rows, k_rows) = (q.len() / d.max(1), k.len() / d.max(1));
    assert!(d % heads == 0 && v.len() == k.len() && out.len() == q.len() && queries_per_task > 0, "attention over rows of {d} in {heads} heads");
    assert!(
        sequences.iter().all(|&((qf, n), (kf, m))| qf + n <= q_rows && kf + m <= k_rows),
        "sequences {sequences:?} over {q_rows} query rows and {k_rows} key rows"
    );
    let hd = d / heads;
    let d_s = d as isize;
    let tasks: Vec<(usize, usize, usize)> = sequences
        .iter()
        .enumerate()
        .flat_map(|(s, &((_, n), _))| (0..heads).flat_map(move |head| (0..n).step_by(queries_per_task).map(move |q0| (s, head, q0))))
        .collect();
    let longest = sequences.iter().map(|&(_, (_, m))| m).max().unwrap_or(0);
    let dst = OutPtr(out.as_mut_ptr());
    tasks.into_par_iter().for_each_init(
        || vec![0f32; queries_per_task * longest],
        |scores, (s, head, q0)| {
            let ((qf, n), (kf, m)) = sequences[s];
            let rows = queries_per_task.min(n - q0);
            let scores = &mut scores[..rows * m];
            let (q_at, kv_at) = ((qf + q0) * d + head * hd, kf * d + head * hd);
            // SAFETY: the block's queries are `rows` rows of `hd` values, `d` apart, from q_at
            // (inside q); the head's keys and values `m` such rows from kv_at (inside k and v);
            // `scores` holds rows x m; this task alone writes its queries' rows of this head.
            unsafe {
                // scores (rows x m) = scale * q_block (rows x hd) . k_headᵀ (hd x m)
                gemm::gemm(
                    rows, m, hd, scores.as_mut_ptr(), 1, m as isize, false,
                    q.as_ptr().add(q_at), 1, d_s,
                    k.as_ptr().add(kv_at), d_s, 1,
                    0.0, scale, false, false, false, gemm::Parallelism::None,
                );
            }
            for (i, row) in scores.chunks_exact_mut(m).enumerate() {
                if causal {
                    let (seen, unseen) = row.split_at_mut((q0 + i + 1).min(m));
                    cpu_kernels::softmax_in_place(seen);
                    unseen.fill(0.0);
                } else {
                    cpu_kernels::softmax_in_place(row);
                }
            }
            // SAFETY: as above.
            unsafe {
                // out_block (rows x hd) = scores (rows x m) . v_head (m x hd)
                gemm::gemm(
                    rows, hd, m, dst.at(q_at), 1, d_s, false,
                    scores.as_ptr(), 1, m as isize,
                    v.as_ptr().add(kv_at), 1, d_s,
                    0.0, 1.0, false, false, false, gemm::Parallelism::None,
                );
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16_gemm::test_values as values;

    /// Every residual kind, many rows and few, against the products summed in f64.
    #[test]
    fn products_add_bias_and_residual_as_summed_directly() {
        let (c_in, c_out) = (37usize, 70usize);
        let w = values(c_out * c_in, 1);
        let w_t = transposed(&w, c_out, c_in);
        assert_eq!(w_t[3 * c_out + 5], w[5 * c_in + 3]);
        let bias = values(c_out, 2);
        for rows in [3usize, 200] {
            let x = values(rows * c_in, 3);
            let res = values(rows * c_out, 4);
            let want = |r: usize, c: usize, with_bias: bool, with_res: bool| {
                let dot: f64 = (0..c_in).map(|i| x[r * c_in + i] as f64 * w[c * c_in + i] as f64).sum();
                dot + if with_bias { bias[c] as f64 } else { 0.0 } + if with_res { res[r * c_out + c] as f64 } else { 0.0 }
            };
            for (with_bias, kind) in [(true, 0), (false, 0), (true, 1), (false, 1), (true, 2)] {
                let mut out = if kind == 2 { res.clone() } else { vec![f32::NAN; rows * c_out] };
                let residual = match kind {
                    0 => Residual::None,
                    1 => Residual::Add(&res),
                    _ => Residual::InOut,
                };
                rows_times_transposed(&x, c_in, &w_t, c_out, with_bias.then_some(&bias[..]), residual, &mut out);
                for r in 0..rows {
                    for c in 0..c_out {
                        let want = want(r, c, with_bias, kind != 0);
                        assert!((out[r * c_out + c] as f64 - want).abs() < 1e-4, "{rows} rows, bias {with_bias}, residual {kind}: ({r}, {c})");
                    }
                }
            }
        }
    }

    /// Blocks of queries give each row what the softmax of its whole row of scores gives, per
    /// sequence and head; rows outside the spans are left alone.
    #[test]
    fn attention_in_query_blocks_matches_direct_softmax() {
        let (heads, hd) = (2usize, 8usize);
        let d = heads * hd;
        let spans = [(0usize, 70usize), (75, 9)];
        let rows = 90;
        let (q, k, v) = (values(rows * d, 5), values(rows * d, 6), values(rows * d, 7));
        let mut out = vec![-7f32; rows * d];
        attend_spans_f32(&q, &k, &v, d, heads, &spans, &mut out);
        for &(from, n) in &spans {
            for h in 0..heads {
                for i in from..from + n {
                    let scores: Vec<f64> = (from..from + n).map(|j| (0..hd).map(|c| q[i * d + h * hd + c] as f64 * k[j * d + h * hd + c] as f64).sum()).collect();
                    let top = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                    let total: f64 = e.iter().sum();
                    for c in 0..hd {
                        let want: f64 = (from..from + n).zip(&e).map(|(j, e)| e / total * v[j * d + h * hd + c] as f64).sum();
                        assert!((out[i * d + h * hd + c] as f64 - want).abs() < 1e-4, "row {i}, head {h}, value {c}");
                    }
                }
            }
        }
        assert!(out[70 * d..75 * d].iter().chain(&out[84 * d..]).all(|&x| x == -7.0), "rows outside the spans untouched");
    }
}
