//! The products' kernel with 512-bit registers and VNNI's `vpdpbusd` (AVX-512 VNNI: Intel Ice
//! Lake and later, AMD Zen 4 and later): two 32-value blocks per register, and one instruction
//! for the byte products and their sums where AVX2 takes two. On a 2-core Xeon with AMX,
//! decoding SmolLM2 spent ~70% of its time in the AVX2 kernel; this one took it from 117 to
//! 135-137 tokens/s (docs/benchmarks.md, eighth round).

use super::{ActRow, WeightRow, BLOCK, BYTES, BYTES16, NIBBLES5};
use std::arch::x86_64::*;

pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512vnni"))
}

/// Lanes 0-7 `v[0]`, lanes 8-15 `v[1]`: the two blocks' scales beside their sums.
#[inline(always)]
unsafe fn pair_scales(v: __m128) -> __m512 {
    _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps128_ps512(v))
}

/// Lanes 4k..4k+4 `v[k]`: Q6_K's scales per 16 values beside their sums.
#[inline(always)]
unsafe fn quarter_scales(v: __m128) -> __m512 {
    _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_castps128_ps512(v))
}

/// As [`super::x86::tile`], blocks `b` and `b + 1` in one register (lanes 0-7 and 8-15; past
/// the last block, zeros), so each (weight row, activation row) pair runs the same instructions
/// in any tile shape and a row's products do not depend on its neighbours. Offsets join the
/// lane sums block by block, as there (summed apart over the row and subtracted at the end,
/// they lose digits where activations are large).
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and VNNI ([`available`]); the rows hold whole blocks of the
/// same count.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn tile<const R: usize, const T: usize, const F: u8>(ws: [WeightRow<'_>; R], xs: [ActRow<'_>; T]) -> [[f32; T]; R] {
    let signed = F == BYTES || F == BYTES16;
    let blocks = xs[0].d.len();
    let low = _mm512_set1_epi8(0x0f);
    let fifth = _mm512_set1_epi8(0x10);
    // Low nibbles of block b, its high nibbles, then block b + 1's (64-bit lanes).
    let nibble_order = _mm512_set_epi64(7, 6, 3, 2, 5, 4, 1, 0);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut b = 0;
    while b < blocks {
        let two = blocks - b >= 2;
        let (block_mask, packed_mask, scale_mask): (u64, u32, u8) = if two { (u64::MAX, u32::MAX, 0b11) } else { (u32::MAX as u64, 0xffff, 0b01) };
        let mut x = [_mm512_setzero_si512(); T];
        let mut xd = [_mm512_setzero_ps(); T];
        let mut xs8 = [_mm512_setzero_ps(); T];
        for t in 0..T {
            x[t] = _mm512_maskz_loadu_epi8(block_mask, xs[t].qs.as_ptr().add(b) as *const i8);
            xd[t] = pair_scales(_mm_maskz_loadu_ps(scale_mask, xs[t].d.as_ptr().add(b)));
            if !signed {
                xs8[t] = pair_scales(_mm_maskz_loadu_ps(scale_mask, xs[t].s_eighth.as_ptr().add(b)));
            }
        }
        for r in 0..R {
            let w = &ws[r];
            let q = if signed {
                _mm512_maskz_loadu_epi8(block_mask, w.packed.as_ptr().add(b * BLOCK) as *const i8)
            } else {
                let packed = _mm256_maskz_loadu_epi8(packed_mask, w.packed.as_ptr().add(b * 16) as *const i8);
                let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(packed), _mm256_srli_epi16::<4>(packed));
                let q = _mm512_and_si512(_mm512_permutexvar_epi64(nibble_order, both), low);
                if F == NIBBLES5 {
                    // Bit j of the two blocks' fifth bits is lane j's.
                    let high = *w.high.get_unchecked(b) as u64 | if two { (*w.high.get_unchecked(b + 1) as u64) << 32 } else { 0 };
                    _mm512_mask_add_epi8(q, high, q, fifth)
                } else {
                    q
                }
            };
            let offset = if signed { _mm512_setzero_ps() } else { pair_scales(_mm_maskz_loadu_ps(scale_mask, w.offsets.as_ptr().add(b))) };
            let wd = if F == BYTES16 {
                quarter_scales(_mm_maskz_loadu_ps(if two { 0b1111 } else { 0b0011 }, w.scales.as_ptr().add(2 * b)))
            } else {
                pair_scales(_mm_maskz_loadu_ps(scale_mask, w.scales.as_ptr().add(b)))
            };
            for t in 0..T {
                let dot = if signed {
                    // Unsigned |w| times x with w's sign (activations lie within ±127).
                    let negative = _mm512_movepi8_mask(q);
                    let v = _mm512_mask_sub_epi8(x[t], negative, _mm512_setzero_si512(), x[t]);
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q), v)
                } else {
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x[t])
                };
                if !signed {
                    acc[r][t] = _mm512_fmadd_ps(offset, xs8[t], acc[r][t]);
                }
                acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(wd, xd[t]), _mm512_cvtepi32_ps(dot), acc[r][t]);
            }
        }
        b += 2;
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    out
}
