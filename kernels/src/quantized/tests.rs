use super::*;
use half::f16;

const ALL: [QType; 8] = [QType::Q4_0, QType::Q4_1, QType::Q5_0, QType::Q5_1, QType::Q8_0, QType::Q4_K, QType::Q5_K, QType::Q6_K];

/// A matrix of made-up blocks: random bytes, with scales in [0.01, 0.05) (the K types' `d` a
/// tenth of that, their 6-bit sub-block scales taking it back), minimums below zero for
/// Q4_1 and Q5_1, and Q8_0's values within ±127 as quantizers write them.
fn matrix(qtype: QType, rows: usize, cols: usize) -> QMatrix {
    let mut seed = 12345u32 ^ qtype as u32;
    let mut next = || {
        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
        (seed >> 8) as u8
    };
    let mut data = Vec::new();
    for _ in 0..rows * cols / qtype.block_values() {
        let mut block: Vec<u8> = (0..qtype.block_bytes()).map(|_| next()).collect();
        let mut set_f16 = |at: usize, v: f32| block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
        let scale = 0.01 + next() as f32 / 6400.0;
        match qtype {
            QType::Q4_0 | QType::Q5_0 => set_f16(0, scale),
            QType::Q4_1 | QType::Q5_1 => {
                set_f16(0, scale);
                set_f16(2, -(next() as f32) / 850.0);
            }
            QType::Q8_0 => {
                set_f16(0, scale);
                for q in &mut block[2..] {
                    *q = ((*q % 255) as i32 - 127) as i8 as u8;
                }
            }
            QType::Q4_K | QType::Q5_K => {
                set_f16(0, scale / 10.0);
                set_f16(2, scale / 40.0);
            }
            QType::Q6_K => set_f16(208, scale / 100.0),
        }
        data.extend(block);
    }
    QMatrix::new(qtype, rows, cols, &data).unwrap()
}

/// Every type, kernel, tile and remainder path against f64 products of the dequantized weights
/// with the dequantized activations (the same numbers, so only rounding differs), and the
/// result against the unquantized activations within the 8-bit quantization's error.
#[test]
fn products_match_the_dequantized_weights() {
    for qtype in ALL {
        let cols = if qtype.block_values() == 256 { 512 } else { 96 };
        let w = matrix(qtype, 37, cols);
        let part = &w.parts[0];
        for m in [1usize, 3, 4, 7, 70] {
            let x: Vec<f32> = (0..m * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0).collect();
            let mut xq = QuantizedRows::default();
            xq.quantize(&x, cols);
            let mut out = vec![0f32; m * w.rows()];
            w.matmul(&xq, &mut out);
            // Each row's products are the same alone as among others, to the bit.
            let last = m - 1;
            let mut alone = QuantizedRows::default();
            alone.quantize(&x[last * cols..], cols);
            let mut out_alone = vec![0f32; w.rows()];
            w.matmul(&alone, &mut out_alone);
            assert_eq!(out_alone, out[last * w.rows()..], "{qtype:?} m={m}: the last row alone");
            let mut row = vec![0f32; cols];
            for r in 0..w.rows() {
                w.dequantize_row(r, &mut row);
                let wr = part.weight_row(r, cols);
                for i in 0..m {
                    let a = xq.row(i, qtype);
                    // Rounding moves each activation by at most half its block's step.
                    let (mut exact, mut from_quantized, mut bound) = (0f64, 0f64, 1e-4);
                    for (k, &wv) in row.iter().enumerate() {
                        let (d, q) = (a.d[k / BLOCK], a.qs[k / BLOCK][k % BLOCK]);
                        from_quantized += wv as f64 * (d * q as f32) as f64;
                        exact += wv as f64 * x[i * cols + k] as f64;
                        bound += (wv.abs() * d) as f64 / 2.0;
                    }
                    let got = out[i * w.rows() + r] as f64;
                    // Q4_1's and Q5_1's minimums meet the block sums as Q8_1 rounds them to f16.
                    let rounded_sums: f64 = match qtype.rounded_sums() {
                        true => wr.offsets.iter().zip(a.s).map(|(m, s)| (m * s).abs() as f64 / 2048.0).sum(),
                        false => 0.0,
                    };
                    assert!((got - from_quantized).abs() < 1e-4 * (1.0 + from_quantized.abs()) + rounded_sums, "{qtype:?} m={m} [{i},{r}]: {got} vs {from_quantized}");
                    assert!((got - exact).abs() <= bound, "{qtype:?} m={m} [{i},{r}]: {got} vs exact {exact}");
                    let scalar = dot_scalar(qtype.form(), wr, a) as f64;
                    assert!((got - scalar).abs() < 1e-4 * (1.0 + scalar.abs()), "{qtype:?} scalar");
                }
            }
        }
    }
}

#[test]
fn stacking_keeps_rows_in_order_and_each_types_values() {
    let (a, b) = (matrix(QType::Q4_1, 2, 256), matrix(QType::Q4_1, 3, 256));
    let (mut ra, mut rs) = (vec![0f32; 256], vec![0f32; 256]);
    b.dequantize_row(1, &mut ra);
    let stacked = QMatrix::stack(vec![a, b]).unwrap();
    assert_eq!((stacked.rows(), stacked.parts.len()), (5, 1));
    stacked.dequantize_row(3, &mut rs);
    assert_eq!(ra, rs);
    assert!(QMatrix::stack(vec![matrix(QType::Q4_1, 1, 64), matrix(QType::Q8_0, 1, 96)]).is_err());
    assert!(QMatrix::new(QType::Q8_0, 1, 48, &[0; 51]).is_err());
    assert!(QMatrix::new(QType::Q4_K, 1, 128, &[0; 72]).is_err());

    // Types mixed as Q4_K_M files mix them: each part's products are its own matrix's.
    let parts = || vec![matrix(QType::Q5_0, 5, 256), matrix(QType::Q4_K, 6, 256), matrix(QType::Q8_0, 3, 256), matrix(QType::Q6_K, 7, 256)];
    let mixed = QMatrix::stack(parts()).unwrap();
    assert_eq!((mixed.rows(), mixed.parts.len()), (21, 4));
    for m in [1usize, 5] {
        let x: Vec<f32> = (0..m * 256).map(|i| ((i * 31 % 97) as f32 - 48.0) / 20.0).collect();
        let mut xq = QuantizedRows::default();
        xq.quantize(&x, 256);
        let mut out = vec![0f32; m * 21];
        mixed.matmul(&xq, &mut out);
        let mut first = 0;
        for p in parts() {
            let mut own = vec![0f32; m * p.rows()];
            p.matmul(&xq, &mut own);
            for i in 0..m {
                assert_eq!(own[i * p.rows()..(i + 1) * p.rows()], out[i * 21 + first..i * 21 + first + p.rows()], "m={m}, row {i}");
            }
            let mut want = vec![0f32; 256];
            p.dequantize_row(p.rows() - 1, &mut want);
            mixed.dequantize_row(first + p.rows() - 1, &mut rs);
            assert_eq!(want, rs);
            first += p.rows();
        }
    }
}

/// Each instruction set's kernel (those this CPU has) gives the scalar reference's products,
/// in every tile shape: a machine with AVX-512 otherwise never runs the AVX2 one.
#[test]
fn every_kernel_computes_the_scalar_products() {
    for qtype in ALL {
        let cols = if qtype.block_values() == 256 { 512 } else { 96 };
        let w = matrix(qtype, 4, cols);
        let part = &w.parts[0];
        let x: Vec<f32> = (0..4 * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0).collect();
        let mut xq = QuantizedRows::default();
        xq.quantize(&x, cols);
        let ws: [WeightRow<'_>; 4] = std::array::from_fn(|r| part.weight_row(r, cols));
        let xs: [ActRow<'_>; 4] = std::array::from_fn(|i| xq.row(i, qtype));
        let form = qtype.form();
        let want: [[f32; 4]; 4] = std::array::from_fn(|r| std::array::from_fn(|t| dot_scalar(form, ws[r], xs[t])));
        let check = |name: &str, got: [[f32; 4]; 4]| {
            for r in 0..4 {
                for t in 0..4 {
                    assert!((got[r][t] - want[r][t]).abs() < 1e-4 * (1.0 + want[r][t].abs()), "{qtype:?} {name} [{r}][{t}]: {} vs {}", got[r][t], want[r][t]);
                }
            }
        };
        #[cfg(target_arch = "x86_64")]
        {
            macro_rules! run {
                ($module:ident) => {{
                    const R: usize = 4;
                    const T: usize = 4;
                    // SAFETY: the module's `available` found its instruction set; the rows hold
                    // whole blocks of the same count.
                    unsafe { tile_of_form!($module, form, ws, xs) }
                }};
            }
            if x86::available() {
                check("AVX2", run!(x86));
            }
            if x86_512::available() {
                check("AVX-512", run!(x86_512));
            }
        }
        let _ = check;
    }
}
