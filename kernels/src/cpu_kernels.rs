//! Element-wise CPU kernels of the models' hot loops (exp, GELU, softmax, dot products), each
//! compiled three times, for AVX-512, for AVX2 + FMA and for baseline x86-64, and chosen at run
//! time as gemm chooses its matmul kernels.
//!
//! The release build targets baseline x86-64 (SSE2, 4 lanes), so without this a loop runs at a
//! quarter of an AVX-512 CPU's width. The loops keep their sums and maxima in [`LANES`]
//! independent accumulators: a single running `f32` sum is a serial chain the compiler may not
//! reorder, which kept the whole softmax loop scalar (a quarter of the encoder's time at batch
//! 16 on an AVX-512 CPU).

/// Accumulators per reduction: one AVX-512 register of f32.
const LANES: usize = 16;

/// `e^x` within 1e-5 relative for `x` in [-87, 88] (clamped outside), written so that loops over
/// slices vectorise: `2^n * 2^f` with `f` in [-0.5, 0.5] and a degree-6 polynomial for `2^f`.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to the nearest integer without a libm call, and leaves that
    // integer in the low bits of the sum: `2^n` comes from integer ops on those bits. (A float
    // to `i32` cast instead saturates, which compilers do one lane at a time.)
    const ROUND: f32 = 12_582_912.0;
    let t = x.clamp(-87.0, 88.0) * std::f32::consts::LOG2_E;
    let shifted = t + ROUND;
    let n = shifted - ROUND;
    let f = t - n;
    let p = 1.0
        + f * (0.693_147_2
            + f * (0.240_226_5
                + f * (0.055_504_11 + f * (0.009_618_129 + f * (0.001_333_355 + f * 0.000_154_035_3)))));
    // n is in [-126, 127] here, so the biased exponent n + 127 is a normal float's.
    let biased = shifted.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    p * f32::from_bits(biased << 23)
}

/// candle's `gelu` (the tanh approximation), with `tanh(y) = 1 - 2 / (e^(2y) + 1)`.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let y = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    let tanh = 1.0 - 2.0 / (fast_exp(2.0 * y) + 1.0);
    0.5 * x * (1.0 + tanh)
}

/// The exact GELU, `x/2 (1 + erf(x / sqrt 2))`, with Abramowitz and Stegun's erf (7.1.26,
/// within 1.5e-7) and [`fast_exp`]: within 2e-6 of the library functions.
#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    let z = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = t * (0.254_829_6 + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152 + t * 1.061_405_4))));
    let erf_abs = 1.0 - poly * fast_exp(-z * z);
    let erf = if x < 0.0 { -erf_abs } else { erf_abs };
    0.5 * x * (1.0 + erf)
}

/// Largest element (`-inf` for an empty slice).
#[inline(always)]
fn max_of(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    rest.iter().chain(&acc).fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// Sum of the elements.
#[inline(always)]
fn sum_of(xs: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    rest.iter().chain(&acc).sum()
}

#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    tail + acc.iter().sum::<f32>()
}

#[inline(always)]
fn gelu_generic(dst: &mut [f32], src: &[f32]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = gelu(x);
    }
}

#[inline(always)]
fn gelu_in_place_generic(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x = gelu(*x);
    }
}

#[inline(always)]
fn gelu_erf_generic(dst: &mut [f32], src: &[f32]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = gelu_erf(x);
    }
}

#[inline(always)]
fn gelu_erf_in_place_generic(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x = gelu_erf(*x);
    }
}

#[inline(always)]
fn bias_gelu_erf_generic(dst: &mut [f32], src: &[f32], bias: &[f32]) {
    for ((d, &x), &b) in dst.iter_mut().zip(src).zip(bias) {
        *d = gelu_erf(x + b);
    }
}

/// A layer norm's statistics of `x`: its mean and `1 / sqrt(variance + eps)`.
#[inline(always)]
fn mean_and_inverse_deviation(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = sum_of(x) / n;
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|v| (v - mean) * (v - mean)).sum();
    for c in chunks {
        for i in 0..LANES {
            acc[i] += (c[i] - mean) * (c[i] - mean);
        }
    }
    let var = (tail + acc.iter().sum::<f32>()) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

#[inline(always)]
fn add_layer_norm_generic(dst: &mut [f32], y: &[f32], residual: &[f32], params: &[f32], eps: f32) {
    let n = dst.len();
    let (bias, rest) = params.split_at(n);
    let (gamma, beta) = rest.split_at(n);
    for (((d, &a), &r), &b) in dst.iter_mut().zip(y).zip(residual).zip(bias) {
        *d = a + r + b;
    }
    let (mean, inv) = mean_and_inverse_deviation(dst, eps);
    for ((d, &g), &b) in dst.iter_mut().zip(gamma).zip(beta) {
        *d = (*d - mean) * inv * g + b;
    }
}

#[inline(always)]
fn layer_norm_generic(dst: &mut [f32], x: &[f32], gamma: &[f32], beta: &[f32], eps: f32) {
    let (mean, inv) = mean_and_inverse_deviation(x, eps);
    for (((d, &v), &g), &b) in dst.iter_mut().zip(x).zip(gamma).zip(beta) {
        *d = (v - mean) * inv * g + b;
    }
}

#[inline(always)]
fn softmax_in_place_generic(xs: &mut [f32]) {
    let max = max_of(xs);
    for x in xs.iter_mut() {
        *x = fast_exp(*x - max);
    }
    let inv = 1.0 / sum_of(xs);
    for x in xs.iter_mut() {
        *x *= inv;
    }
}

#[inline(always)]
fn log_sum_exp_generic(xs: &[f32]) -> f32 {
    let max = max_of(xs);
    if max == f32::NEG_INFINITY {
        return max;
    }
    let mut acc = [0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|&x| fast_exp(x - max)).sum();
    for c in chunks {
        for i in 0..LANES {
            acc[i] += fast_exp(c[i] - max);
        }
    }
    max + (tail + acc.iter().sum::<f32>()).ln()
}

#[inline(always)]
fn axpy_generic(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += w * v;
    }
}

#[inline(always)]
fn silu_mul_generic(dst: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((d, &g), &u) in dst.iter_mut().zip(gate).zip(up) {
        *d = g / (1.0 + fast_exp(-g)) * u;
    }
}

#[inline(always)]
fn attend_generic(q: &[f32], keys: &[f32], values: &[f32], stride: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) {
    let d = q.len();
    for (p, s) in scores.iter_mut().enumerate() {
        *s = dot_generic(q, &keys[p * stride..p * stride + d]) * scale;
    }
    softmax_in_place_generic(scores);
    out.fill(0.0);
    for (p, &s) in scores.iter().enumerate() {
        axpy_generic(out, s, &values[p * stride..p * stride + d]);
    }
}

/// The widest instruction set this CPU runs, detected once.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
enum Level {
    Avx512,
    Avx2,
    Baseline,
}

#[cfg(target_arch = "x86_64")]
fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
            Level::Avx512
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            Level::Avx2
        } else {
            Level::Baseline
        }
    })
}

/// `pub fn $name(args) -> ret` that runs `$generic` compiled for the CPU's widest level.
macro_rules! dispatched {
    ($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $generic:ident) => {
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,fma")]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $generic($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $generic($($arg),*)
                }
                match level() {
                    // SAFETY: `level` found the features these versions are compiled for.
                    Level::Avx512 => return unsafe { avx512($($arg),*) },
                    Level::Avx2 => return unsafe { avx2($($arg),*) },
                    Level::Baseline => {}
                }
            }
            $generic($($arg),*)
        }
    };
}

dispatched!(
    /// `dst[i] = gelu(src[i])` over the shorter of the two slices.
    gelu_slice(dst: &mut [f32], src: &[f32]) = gelu_generic
);
dispatched!(
    /// `xs[i] = gelu(xs[i])`.
    gelu_in_place(xs: &mut [f32]) = gelu_in_place_generic
);
dispatched!(
    /// `dst[i] = gelu_erf(src[i])` over the shorter of the two slices.
    gelu_erf_slice(dst: &mut [f32], src: &[f32]) = gelu_erf_generic
);
dispatched!(
    /// `xs[i] = gelu_erf(xs[i])`.
    gelu_erf_in_place(xs: &mut [f32]) = gelu_erf_in_place_generic
);
dispatched!(
    /// `dst[i] = gelu_erf(src[i] + bias[i])` over the shortest slice: a linear layer's bias and
    /// BERT's activation in one pass.
    bias_gelu_erf(dst: &mut [f32], src: &[f32], bias: &[f32]) = bias_gelu_erf_generic
);
dispatched!(
    /// One row of a post-norm residual: `dst = layer_norm(y + residual + bias) * gamma + beta`,
    /// `params` holding `bias`, `gamma` and `beta` one after another (each as long as `dst`).
    add_layer_norm(dst: &mut [f32], y: &[f32], residual: &[f32], params: &[f32], eps: f32) = add_layer_norm_generic
);
dispatched!(
    /// One row of a layer norm: `dst = (x - mean) / sqrt(var + eps) * gamma + beta`, all as
    /// long as `x`.
    layer_norm(dst: &mut [f32], x: &[f32], gamma: &[f32], beta: &[f32], eps: f32) = layer_norm_generic
);
dispatched!(
    /// `xs = softmax(xs)`.
    softmax_in_place(xs: &mut [f32]) = softmax_in_place_generic
);
dispatched!(
    /// `Σ a[i] * b[i]` over the shorter of the two slices.
    dot(a: &[f32], b: &[f32]) -> f32 = dot_generic
);
dispatched!(
    /// `ln Σ e^x` over `xs` (`-inf` when empty or all `-inf`), with [`fast_exp`]: an entry
    /// more than 87 below the largest counts as `e^-87` instead of less, which moves the sum
    /// by under 1e-33 per entry.
    log_sum_exp(xs: &[f32]) -> f32 = log_sum_exp_generic
);
dispatched!(
    /// `dst[i] = silu(gate[i]) * up[i]` (llama's gated feed-forward) over the shortest slice.
    silu_mul(dst: &mut [f32], gate: &[f32], up: &[f32]) = silu_mul_generic
);
dispatched!(
    /// One query's softmax attention over `scores.len()` positions: key and value `p` are the
    /// `q.len()` values at `p * stride` in `keys` and `values`; `out` (as long as `q`) gets the
    /// weighted sum, `scores` the weights. In one compiled loop, as the per-position calls of
    /// [`dot`] and [`axpy`] cost more than their 64-wide arithmetic.
    attend(q: &[f32], keys: &[f32], values: &[f32], stride: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) = attend_generic
);
dispatched!(
    /// `acc[i] += w * x[i]` over the shorter of the two slices.
    axpy(acc: &mut [f32], w: f32, x: &[f32]) = axpy_generic
);

/// Dot products of one row of f16 weights with `T` rows of f32 activations, `ws.len()` values
/// each: `out[t] = Σ w[i] * xs[t][i]`. Each row's sum is taken in the same order whatever `T`
/// is, so a row's products do not depend on the rows beside it.
///
/// Weights held as f16 halve the bytes a product reads; Whisper's checkpoints are stored in
/// f16, so nothing is rounded that the file had not rounded already.
pub fn dots_f16<const T: usize>(ws: &[half::f16], xs: [&[f32]; T]) -> [f32; T] {
    debug_assert!(xs.iter().all(|x| x.len() >= ws.len()));
    #[cfg(target_arch = "x86_64")]
    match f16_level() {
        // SAFETY: `f16_level` found the features these versions are compiled for, and every
        // load stays within `ws` and the first `ws.len()` values of each row.
        F16Level::Avx512 => return unsafe { f16_x86::dots_avx512(ws, xs) },
        F16Level::Avx2 => return unsafe { f16_x86::dots_avx2(ws, xs) },
        F16Level::Baseline => {}
    }
    let mut out = [0f32; T];
    for (o, x) in out.iter_mut().zip(xs) {
        *o = ws.iter().zip(x).map(|(w, x)| w.to_f32() * x).sum();
    }
    out
}

/// The f16 conversions need F16C next to AVX2 (AVX-512F has its own).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum F16Level {
    Avx512,
    Avx2,
    Baseline,
}

#[cfg(target_arch = "x86_64")]
fn f16_level() -> F16Level {
    static LEVEL: std::sync::OnceLock<F16Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| match level() {
        Level::Avx512 => F16Level::Avx512,
        Level::Avx2 if is_x86_feature_detected!("f16c") => F16Level::Avx2,
        _ => F16Level::Baseline,
    })
}

#[cfg(target_arch = "x86_64")]
mod f16_x86 {
    use std::arch::x86_64::*;

    /// Values of the tail past the last full vector, added after the vector sums.
    #[inline(always)]
    fn tail<const T: usize>(ws: &[half::f16], xs: &[&[f32]; T], from: usize, out: &mut [f32; T]) {
        for (o, x) in out.iter_mut().zip(xs) {
            *o += ws[from..].iter().zip(&x[from..]).map(|(w, x)| w.to_f32() * x).sum::<f32>();
        }
    }

    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn dots_avx512<const T: usize>(ws: &[half::f16], xs: [&[f32]; T]) -> [f32; T] {
        let n = ws.len();
        let mut acc = [_mm512_setzero_ps(); T];
        let mut i = 0;
        while i + 16 <= n {
            let w = _mm512_cvtph_ps(_mm256_loadu_si256(ws.as_ptr().add(i).cast()));
            for t in 0..T {
                acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs[t].as_ptr().add(i)), acc[t]);
            }
            i += 16;
        }
        let mut out = [0f32; T];
        for t in 0..T {
            out[t] = _mm512_reduce_add_ps(acc[t]);
        }
        tail(ws, &xs, i, &mut out);
        out
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dots_avx2<const T: usize>(ws: &[half::f16], xs: [&[f32]; T]) -> [f32; T] {
        let n = ws.len();
        let mut acc = [_mm256_setzero_ps(); T];
        let mut i = 0;
        while i + 8 <= n {
            let w = _mm256_cvtph_ps(_mm_loadu_si128(ws.as_ptr().add(i).cast()));
            for t in 0..T {
                acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[t].as_ptr().add(i)), acc[t]);
            }
            i += 8;
        }
        let mut out = [0f32; T];
        for t in 0..T {
            let half = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps::<1>(acc[t]));
            let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
            out[t] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps::<1>(pair, pair)));
        }
        tail(ws, &xs, i, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_and_gelu_match_the_library_functions() {
        for i in -2000..=2000 {
            let x = i as f32 / 40.0;
            let (fast, exact) = (fast_exp(x), x.exp());
            assert!((fast - exact).abs() <= 1e-5 * exact, "exp({x}): {fast} vs {exact}");
            let reference = 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh());
            assert!((gelu(x) - reference).abs() < 1e-5, "gelu({x}): {} vs {reference}", gelu(x));
        }
    }

    #[test]
    fn gelu_erf_matches_candles_exact_gelu() {
        let xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 / 200.0).collect();
        let exact = candle_core::Tensor::new(xs.as_slice(), &candle_core::Device::Cpu)
            .and_then(|t| t.gelu_erf())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("candle's gelu_erf");
        let mut fast = vec![0f32; xs.len()];
        gelu_erf_slice(&mut fast, &xs);
        for ((x, f), e) in xs.iter().zip(&fast).zip(&exact) {
            assert!((f - e).abs() <= 2e-6 * (1.0 + e.abs()), "gelu_erf({x}): {f} vs {e}");
        }
    }

    #[test]
    fn attend_and_silu_mul_match_plain_loops() {
        let (d, stride, n) = (8usize, 24usize, 5usize);
        let q: Vec<f32> = (0..d).map(|i| (i as f32 - 3.0) / 4.0).collect();
        let keys: Vec<f32> = (0..n * stride).map(|i| ((i * 31 % 17) as f32 - 8.0) / 5.0).collect();
        let values: Vec<f32> = (0..n * stride).map(|i| ((i * 7 % 13) as f32 - 6.0) / 3.0).collect();
        let (mut scores, mut out) = (vec![0f32; n], vec![0f32; d]);
        attend(&q, &keys[4..], &values[4..], stride, 0.5, &mut scores, &mut out);
        let raw: Vec<f32> = (0..n).map(|p| (0..d).map(|i| q[i] * keys[4 + p * stride + i]).sum::<f32>() * 0.5).collect();
        let total: f32 = raw.iter().map(|s| s.exp()).sum();
        for i in 0..d {
            let want: f32 = (0..n).map(|p| raw[p].exp() / total * values[4 + p * stride + i]).sum();
            assert!((out[i] - want).abs() < 1e-5 * (1.0 + want.abs()), "attend[{i}]: {} vs {want}", out[i]);
        }
        let (gate, up) = ([-3.0f32, -0.5, 0.0, 2.0], [1.0f32, 2.0, 3.0, -1.5]);
        let mut got = [0f32; 4];
        silu_mul(&mut got, &gate, &up);
        for i in 0..4 {
            let want = gate[i] / (1.0 + (-gate[i]).exp()) * up[i];
            assert!((got[i] - want).abs() < 1e-5, "silu_mul[{i}]: {} vs {want}", got[i]);
        }
    }

    #[test]
    fn f16_dots_match_f64_sums_and_each_row_is_the_same_alone_or_in_a_tile() {
        for n in [7usize, 16, 40, 384] {
            let w: Vec<half::f16> = (0..n).map(|i| half::f16::from_f32(((i * 37 % 101) as f32 - 50.0) / 64.0)).collect();
            let rows: Vec<Vec<f32>> =
                (0..4).map(|r| (0..n).map(|i| ((i * 13 + r * 7) % 29) as f32 / 3.0 - 4.5).collect()).collect();
            let tile = dots_f16(&w, [&rows[0], &rows[1], &rows[2], &rows[3]]);
            for (r, x) in rows.iter().enumerate() {
                let [alone] = dots_f16(&w, [x]);
                assert_eq!(alone.to_bits(), tile[r].to_bits(), "row {r} of {n}: alone {alone}, in a tile {}", tile[r]);
                let exact: f64 = w.iter().zip(x).map(|(w, x)| f64::from(w.to_f32()) * f64::from(*x)).sum();
                let scale: f64 = w.iter().zip(x).map(|(w, x)| f64::from(w.to_f32() * x).abs()).sum();
                assert!((f64::from(alone) - exact).abs() <= 1e-6 * (1.0 + scale), "row {r} of {n}: {alone} vs {exact}");
            }
        }
    }

    /// Lengths around the lane count exercise both the chunks and the remainder.
    #[test]
    fn reductions_match_plain_loops_at_every_length() {
        for n in [0usize, 1, 5, 15, 16, 17, 33, 100, 1500] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 13 % 29) as f32 - 14.0) / 3.0).collect();
            let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - plain).abs() <= 1e-3 * (1.0 + plain.abs()), "dot at {n}");
            if n == 0 {
                continue;
            }
            let max = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let denom: f32 = a.iter().map(|x| (x - max).exp()).sum();
            let mut out = a.clone();
            softmax_in_place(&mut out);
            for i in 0..n {
                let want = (a[i] - max).exp() / denom;
                assert!((out[i] - want).abs() <= 1e-5 * (1.0 + want), "softmax[{i}] at {n}");
            }
            let lse = max + denom.ln();
            assert!((log_sum_exp(&a) - lse).abs() <= 1e-5 * (1.0 + lse.abs()), "log_sum_exp at {n}");
            let mut acc = b.clone();
            axpy(&mut acc, 0.5, &a);
            for i in 0..n {
                assert_eq!(acc[i], b[i] + 0.5 * a[i], "axpy[{i}] at {n}");
            }
        }
    }
}
