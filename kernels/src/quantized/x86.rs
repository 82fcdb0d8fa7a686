//! The products' kernel with AVX2 and FMA.

use super::{ActRow, WeightRow, BLOCK, BYTES, BYTES16, NIBBLES5};
use std::arch::x86_64::*;

pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

#[inline(always)]
unsafe fn sum_lanes(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// Byte `j` all ones where bit `j` of `bits` is set, else zero (llama.cpp's `bytes_from_bits_32`).
#[inline(always)]
unsafe fn bytes_from_bits(bits: u32) -> __m256i {
    let spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread);
    // Every bit but byte j's own (j mod 8): all ones exactly where that bit is set.
    let others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1))
}

/// `out[r][t] = Σ_b (ws[r].scales[b] xs[t].d[b] P_b + ws[r].offsets[b] xs[t].s[b])`, where
/// `P_b` is block `b`'s integer product of weight row `r` and activation row `t`: each weight
/// block is unpacked once for the `T` activation rows, each activation block read from cache
/// for the `R` weight rows. `F` is the weights' [`super::Form`]: unsigned 4- or 5-bit values
/// with offsets, or signed bytes (through `maddubs` on |w| and x with w's sign) with a scale
/// per 32 or per 16 values.
///
/// A block's offset term joins its product term in the running sums (an eighth in each lane,
/// exact), as the scalar reference adds them: the unsigned values' product terms share a large
/// bias the offsets cancel, and summing each kind alone over the row before subtracting lost
/// digits where activations are large (SmolLM2's first position: errors of 4e-4 against 2e-5,
/// and a next-token distribution five times further from exact).
///
/// # Safety
/// The CPU has AVX2 and FMA ([`available`]); the rows hold whole blocks of the same count.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile<const R: usize, const T: usize, const F: u8>(ws: [WeightRow<'_>; R], xs: [ActRow<'_>; T]) -> [[f32; T]; R] {
    let signed = F == BYTES || F == BYTES16;
    let blocks = xs[0].d.len();
    let low = _mm256_set1_epi8(0x0f);
    let fifth = _mm256_set1_epi8(0x10);
    let ones = _mm256_set1_epi16(1);
    let mut even = [[_mm256_setzero_ps(); T]; R];
    let mut odd = [[_mm256_setzero_ps(); T]; R];
    // Block `b` into `acc`: even blocks into one set of registers, odd ones into the other
    // (constant indices keep them in registers), two dependency chains. A macro, not a
    // closure: closures do not inherit the caller's target features.
    macro_rules! block {
        ($b:expr, $acc:expr) => {{
            let b = $b;
            let acc = &mut $acc;
            for r in 0..R {
                let w = &ws[r];
                let q = if signed {
                    _mm256_loadu_si256(w.packed.as_ptr().add(b * BLOCK) as *const __m256i)
                } else {
                    let packed = _mm_loadu_si128(w.packed.as_ptr().add(b * 16) as *const __m128i);
                    // Values 0..16 are the low nibbles, 16..32 the high ones.
                    let q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed), low);
                    if F == NIBBLES5 {
                        _mm256_or_si256(q, _mm256_and_si256(bytes_from_bits(*w.high.get_unchecked(b)), fifth))
                    } else {
                        q
                    }
                };
                let magnitude = if signed { _mm256_sign_epi8(q, q) } else { q };
                // Lanes 0-3 sum values 0..16, lanes 4-7 values 16..32.
                let wd = if F == BYTES16 {
                    _mm256_set_m128(_mm_set1_ps(*w.scales.get_unchecked(2 * b + 1)), _mm_set1_ps(*w.scales.get_unchecked(2 * b)))
                } else {
                    _mm256_broadcast_ss(w.scales.get_unchecked(b))
                };
                let offset = if signed { wd } else { _mm256_broadcast_ss(w.offsets.get_unchecked(b)) };
                for t in 0..T {
                    let mut v = _mm256_loadu_si256(xs[t].qs.get_unchecked(b).as_ptr() as *const __m256i);
                    if signed {
                        v = _mm256_sign_epi8(v, q);
                    }
                    let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, v), ones);
                    let scale = _mm256_mul_ps(wd, _mm256_broadcast_ss(xs[t].d.get_unchecked(b)));
                    if !signed {
                        acc[r][t] = _mm256_fmadd_ps(offset, _mm256_broadcast_ss(xs[t].s_eighth.get_unchecked(b)), acc[r][t]);
                    }
                    acc[r][t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[r][t]);
                }
            }
        }};
    }
    let mut b = 0;
    while b + 1 < blocks {
        block!(b, even);
        block!(b + 1, odd);
        b += 2;
    }
    if b < blocks {
        block!(b, even);
    }
    // Loops, not `array::from_fn`: its closure would not inherit the target features, and
    // every intrinsic in it would become a function call.
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = sum_lanes(_mm256_add_ps(even[r][t], odd[r][t]));
        }
    }
    out
}
