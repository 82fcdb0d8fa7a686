//! GGUF's blocks decoded into the forms the products read ([`Form`]), exactly: every value a
//! file's block holds is the same f32 after conversion (`kernels/tests/ggml_blocks.rs` checks
//! them against llama.cpp's `gguf` package). The K types' 256-value blocks become eight 32-value
//! blocks, their 6-bit sub-block scales and minimums multiplied out into f32 (exact: an f16
//! times a 6-bit integer).

use super::{Form, Part, QType};
use half::f16;

/// The little-endian f16 at `at` in `bytes`.
pub(super) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Scale and minimum of sub-block `j` (0..8) of a Q4_K or Q5_K block, 6 bits each, packed in
/// 12 bytes as llama.cpp's `get_scale_min_k4` reads them.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    };
    (sc as f32, m as f32)
}

impl Part {
    /// Appends one of the file's blocks (`qtype.block_bytes()` bytes) as its 32-value blocks.
    pub(super) fn push_file_block(&mut self, block: &[u8]) {
        debug_assert_eq!(block.len(), self.qtype.block_bytes());
        match self.qtype {
            QType::Q4_0 => {
                let d = f16_at(block, 0);
                self.push_nibbles(d, -8.0 * d, &block[2..18], None);
            }
            QType::Q4_1 => self.push_nibbles(f16_at(block, 0), f16_at(block, 2), &block[4..20], None),
            QType::Q5_0 => {
                let d = f16_at(block, 0);
                self.push_nibbles(d, -16.0 * d, &block[6..22], Some(u32_at(block, 2)));
            }
            QType::Q5_1 => self.push_nibbles(f16_at(block, 0), f16_at(block, 2), &block[8..24], Some(u32_at(block, 4))),
            QType::Q8_0 => {
                self.scales.push(f16_at(block, 0));
                self.packed.extend_from_slice(&block[2..34]);
            }
            QType::Q4_K | QType::Q5_K => {
                let (d, dmin, scales) = (f16_at(block, 0), f16_at(block, 2), &block[4..16]);
                let (qh, qs) = match self.qtype {
                    QType::Q5_K => (Some(&block[16..48]), &block[48..176]),
                    _ => (None, &block[16..144]),
                };
                // Each 64 values: the low nibbles of 32 bytes are sub-block 2c, the high ones
                // sub-block 2c + 1; Q5_K's fifth bits are bit j of byte l for sub-block j.
                for c in 0..4 {
                    let q = &qs[32 * c..32 * (c + 1)];
                    for (j, shift) in [(2 * c, 0), (2 * c + 1, 4)] {
                        let (sc, m) = scale_min_k4(j, scales);
                        let v: [u8; 32] = std::array::from_fn(|l| (q[l] >> shift) & 0x0f);
                        let nibbles: [u8; 16] = std::array::from_fn(|l| v[l] | (v[l + 16] << 4));
                        let high = qh.map(|qh| (0..32).fold(0u32, |h, l| h | ((((qh[l] >> j) & 1) as u32) << l)));
                        self.push_nibbles(d * sc, -(dmin * m), &nibbles, high);
                    }
                }
            }
            QType::Q6_K => {
                let (ql, qh, sc, d) = (&block[0..128], &block[128..192], &block[192..208], f16_at(block, 208));
                // Each 128 values: four runs of 32, from the low and high nibbles of two 32-byte
                // runs of `ql` and two bits of `qh` each; a scale per 16 values.
                for half in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
                    for k in 0..4 {
                        let (low, shift) = (&ql[32 * (k % 2)..], 4 * (k / 2));
                        for l in 0..32 {
                            let q = ((low[l] >> shift) & 0x0f) | (((qh[l] >> (2 * k)) & 3) << 4);
                            self.packed.push((q as i8 - 32) as u8);
                        }
                        self.scales.push(d * sc[2 * k] as i8 as f32);
                        self.scales.push(d * sc[2 * k + 1] as i8 as f32);
                    }
                }
            }
        }
    }

    fn push_nibbles(&mut self, scale: f32, offset: f32, nibbles: &[u8], high: Option<u32>) {
        debug_assert!(matches!(self.qtype.form(), Form::Nibbles | Form::Nibbles5));
        self.scales.push(scale);
        self.offsets.push(offset);
        self.packed.extend_from_slice(nibbles);
        if let Some(h) = high {
            self.high.push(h);
        }
    }
}
