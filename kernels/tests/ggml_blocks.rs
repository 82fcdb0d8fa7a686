//! Blocks of every GGML type tern multiplies, decoded as llama.cpp's own `gguf` package decodes
//! them (`tests/fixtures/ggml_blocks.txt`, written by `scripts/peers/ggml_blocks_reference.py`
//! from random bytes): the same values to the bit, and products with them within the
//! activations' 8-bit rounding of exact.

use tern_kernels::quantized::{QMatrix, QType, QuantizedRows};

fn qtype(name: &str) -> QType {
    match name {
        "Q4_0" => QType::Q4_0,
        "Q4_1" => QType::Q4_1,
        "Q5_0" => QType::Q5_0,
        "Q5_1" => QType::Q5_1,
        "Q8_0" => QType::Q8_0,
        "Q4_K" => QType::Q4_K,
        "Q5_K" => QType::Q5_K,
        "Q6_K" => QType::Q6_K,
        other => panic!("unknown type {other}"),
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn every_types_blocks_hold_the_values_llama_cpps_reader_gives() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/ggml_blocks.txt")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 16, "eight types");
    for pair in lines.chunks(2) {
        let head: Vec<&str> = pair[0].split(' ').collect();
        let (qtype, rows, cols) = (qtype(head[0]), head[1].parse::<usize>().unwrap(), head[2].parse::<usize>().unwrap());
        let want: Vec<f32> = pair[1].split(' ').map(|v| v.parse().unwrap()).collect();
        let matrix = QMatrix::new(qtype, rows, cols, &hex(head[3])).unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            matrix.dequantize_row(r, &mut row);
            let expected = &want[r * cols..(r + 1) * cols];
            let first = row.iter().zip(expected).position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(first.is_none(), "{qtype:?} row {r}, value {}: {} vs gguf's {}", first.unwrap(), row[first.unwrap()], expected[first.unwrap()]);
        }

        // Products: exact but for the activations' rounding to 8 bits per 32 values.
        let x: Vec<f32> = (0..cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0).collect();
        let mut xq = QuantizedRows::default();
        xq.quantize(&x, cols);
        let mut out = vec![0f32; rows];
        matrix.matmul(&xq, &mut out);
        for r in 0..rows {
            let w = &want[r * cols..(r + 1) * cols];
            let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let bound: f64 = x
                .chunks(32)
                .zip(w.chunks(32))
                .map(|(xb, wb)| {
                    let step = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                    wb.iter().map(|v| v.abs() as f64).sum::<f64>() * step * 0.51
                })
                .sum();
            assert!((out[r] as f64 - exact).abs() <= bound + 1e-4, "{qtype:?} row {r}: {} vs exact {exact} (bound {bound})", out[r]);
        }
    }
}
