//! Reading and rewriting GGUF files: metadata values, tensors re-quantized in memory, the
//! memory loaded weights take.

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use super::WeightLayout;

/// Quantisations whose matrix products candle runs without SIMD kernels on the CPU (Q4_1 is
/// SmolLM2's: ~17 tokens/s scalar, against several times that for Q8_0 with AVX2).
pub(super) const WITHOUT_CPU_KERNEL: [GgmlDType; 4] = [GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1, GgmlDType::Q8_1];

/// A GGUF image of `content` with the `slow` tensors re-quantized to `dtype` (Q8_0 represents
/// their values almost exactly: 8 bits per weight against their 4-5). Tensors whose rows are not
/// a whole number of 32-wide blocks are kept as they are.
pub(super) fn requantize<R: std::io::Read + std::io::Seek>(content: &Content, reader: &mut R, slow: &[&str], dtype: GgmlDType) -> Result<Vec<u8>> {
    let cpu = Device::Cpu;
    let mut tensors = Vec::with_capacity(content.tensor_infos.len());
    for name in content.tensor_infos.keys() {
        let t = content.tensor(reader, name, &cpu)?;
        let fits = t.shape().dims().last().is_some_and(|d| d % 32 == 0);
        let t = if slow.contains(&name.as_str()) && fits {
            QTensor::quantize(&t.dequantize(&cpu)?, dtype)?
        } else {
            t
        };
        tensors.push((name.as_str(), t));
    }
    let metadata: Vec<(&str, &Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    candle_core::quantized::gguf_file::write(&mut out, &metadata, &refs)?;
    Ok(out.into_inner())
}

/// Memory the loaded weights take (see [`Llm::weights_bytes`]), their matrices kept as
/// `layout` says.
pub(super) fn resident_bytes(content: &Content, layout: WeightLayout) -> u64 {
    let stored = |name: &str| {
        content.tensor_infos.get(name).map_or(0, |info| {
            let dtype = info.ggml_dtype;
            match layout {
                WeightLayout::Quantized => (info.shape.elem_count() / dtype.block_size() * dtype.type_size()) as u64,
                WeightLayout::Dense => info.shape.elem_count() as u64 * 4,
            }
        })
    };
    let mut total: u64 = content.tensor_infos.keys().map(|name| stored(name)).sum();
    if layout == WeightLayout::Dense {
        // The lookup's F32 table is also the output matrix of tied-embedding models.
        return total;
    }
    if let Some(info) = content.tensor_infos.get("token_embd.weight") {
        // from_gguf dequantizes the embeddings to f32 for the lookup...
        total += info.shape.elem_count() as u64 * 4;
        // ...and keeps the quantized copy only as the output matrix of tied-embedding models.
        if content.tensor_infos.contains_key("output.weight") {
            total -= stored("token_embd.weight");
        }
    }
    total
}

pub(super) fn metadata_str<'a>(content: &'a Content, key: &str) -> Option<&'a str> {
    content
        .metadata
        .get(key)
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
}

pub(super) fn metadata_array<'a>(content: &'a Content, key: &str) -> Result<&'a Vec<Value>> {
    content
        .metadata
        .get(key)
        .with_context(|| format!("{key} is missing from the GGUF metadata"))?
        .to_vec()
        .with_context(|| format!("{key} is not an array"))
}

pub(super) fn metadata_int(content: &Content, key: &str) -> Option<i64> {
    content.metadata.get(key).and_then(value_int)
}

/// Any GGUF integer type: writers differ in the width they pick for ids and counts.
pub(super) fn value_int(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::I8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::I16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::I32(x) => Some(x.into()),
        Value::U64(x) => i64::try_from(x).ok(),
        Value::I64(x) => Some(x),
        _ => None,
    }
}
