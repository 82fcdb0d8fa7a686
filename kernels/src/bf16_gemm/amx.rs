//! The BF16 products on Intel's AMX tiles (Sapphire Rapids and later), where the CPU has them.
//!
//! One `tdpbf16ps` multiplies a 16 x 32 BF16 tile by a 32 x 16 one into 16 x 16 F32 sums: on a
//! 2-core Xeon with AMX it ran at ~3.3 TFLOP/s per core in a loop of products alone, against
//! ~0.2 for the AVX-512 kernel. The packed right-hand matrix ([`PackedB`]) is already in the
//! tile's layout (a row per pair of `k`, each column's pair side by side), so its tiles load
//! straight from it; left-hand rows are copied into a zero-padded scratch of 32 rows.
//!
//! Each output value is summed over `k` in the same order whatever rows come with it, as the
//! AVX-512 kernel's are (not in the same order as that kernel's, so the two differ in their last
//! bits; a process uses one of them for every product).

use std::arch::asm;
use std::cell::RefCell;

use super::{PackedB, NR};

/// Rows of a tile, and pairs of `k` per tile row (64 bytes).
const TILE: usize = 16;
/// Rows per block: two tiles of rows, each product of a `B` tile used twice.
const BLOCK_ROWS: usize = 2 * TILE;

/// Whether this CPU runs AMX BF16 products and the kernel lets this process use the tiles
/// (asked once, for the whole process, on the first call).
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        if std::env::var_os("TERN_NO_AMX").is_some() {
            return false;
        }
        // Leaf 7, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE (the standard library cannot detect
        // AMX on stable Rust yet).
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0 && tiles_granted()
    })
}

/// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM` for `XFEATURE_XTILEDATA`): without
/// it, the first tile instruction kills the process.
#[cfg(target_os = "linux")]
fn tiles_granted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes which state the kernel saves.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn tiles_granted() -> bool {
    false
}

/// Palette 1, every tile 16 rows of 64 bytes: tiles 0-3 the sums (rows 0-15 and 16-31 by
/// columns 0-15 and 16-31), 4-5 the left-hand rows, 6-7 the right-hand columns.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut bytes = [0u8; 64];
    bytes[0] = 1;
    let mut t = 0;
    while t < 8 {
        bytes[16 + 2 * t] = 64;
        bytes[48 + t] = TILE as u8;
        t += 1;
    }
    TileConfig(bytes)
};

thread_local! {
    /// Per thread: the padded left-hand rows of a block and its sums.
    static SCRATCH: RefCell<(Vec<u32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// [`super::products`] on the tiles.
///
/// # Safety
/// [`available`]; the rest as [`super::products`].
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn products(a: &[u32], rows: usize, b: &PackedB, c0: usize, c1: usize, bias: Option<&[f32]>, out: *mut f32, ldc: usize) {
    let (pairs, padded) = (b.pairs(), b.padded_pairs());
    debug_assert!(padded % TILE == 0 && a.len() >= rows * pairs);
    SCRATCH.with_borrow_mut(|(left, sums)| {
        left.resize(BLOCK_ROWS * padded, 0);
        sums.resize(BLOCK_ROWS * NR, 0.0);
        asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
        for r0 in (0..rows).step_by(BLOCK_ROWS) {
            let n = (rows - r0).min(BLOCK_ROWS);
            // Rows past `n` and pairs past `pairs` stay zero from here on, so the padding adds
            // nothing to the sums.
            for (r, dst) in left.chunks_exact_mut(padded).enumerate() {
                if r < n {
                    dst[..pairs].copy_from_slice(&a[(r0 + r) * pairs..(r0 + r + 1) * pairs]);
                    dst[pairs..].fill(0);
                } else {
                    dst.fill(0);
                }
            }
            for c in (c0..c1).step_by(NR) {
                block(left, n > TILE, padded, b.block(c / NR), sums);
                let cols = (c1 - c).min(NR);
                for (r, row_sums) in sums.chunks_exact(NR).take(n).enumerate() {
                    let dst = std::slice::from_raw_parts_mut(out.add((r0 + r) * ldc + c), cols);
                    match bias {
                        Some(bias) => {
                            for ((d, &s), &b) in dst.iter_mut().zip(row_sums).zip(&bias[c..c + cols]) {
                                *d = s + b;
                            }
                        }
                        None => dst.copy_from_slice(&row_sums[..cols]),
                    }
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    });
}

/// Sums of one block: `left` 32 rows (the second 16 only `with_lower`) of `padded` pairs,
/// times the [`NR`] columns of `block`, into `sums` (32 rows of [`NR`]).
///
/// # Safety
/// The tiles are configured as [`CONFIG`]; `left` holds 32 rows and `block` `padded` rows of
/// [`NR`] pairs.
unsafe fn block(left: &[u32], with_lower: bool, padded: usize, block: &[u32], sums: &mut [f32]) {
    debug_assert!(left.len() >= BLOCK_ROWS * padded && block.len() >= padded * NR && sums.len() >= BLOCK_ROWS * NR);
    let (a_stride, b_stride, c_stride) = (padded * 4, NR * 4, NR * 4);
    let (a, b, c) = (left.as_ptr(), block.as_ptr(), sums.as_mut_ptr());
    asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    for k in (0..padded).step_by(TILE) {
        let (a0, b0) = (a.add(k), b.add(k * NR));
        if with_lower {
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0, a1 = in(reg) a0.add(TILE * padded), b0 = in(reg) b0, b1 = in(reg) b0.add(TILE),
                sa = in(reg) a_stride, sb = in(reg) b_stride, options(nostack, readonly),
            );
        } else {
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                a0 = in(reg) a0, b0 = in(reg) b0, b1 = in(reg) b0.add(TILE),
                sa = in(reg) a_stride, sb = in(reg) b_stride, options(nostack, readonly),
            );
        }
    }
    asm!(
        "tilestored [{c0} + {sc}*1], tmm0",
        "tilestored [{c1} + {sc}*1], tmm1",
        c0 = in(reg) c, c1 = in(reg) c.add(TILE), sc = in(reg) c_stride, options(nostack),
    );
    if with_lower {
        asm!(
            "tilestored [{c2} + {sc}*1], tmm2",
            "tilestored [{c3} + {sc}*1], tmm3",
            c2 = in(reg) c.add(TILE * NR), c3 = in(reg) c.add(TILE * NR + TILE), sc = in(reg) c_stride, options(nostack),
        );
    }
}
