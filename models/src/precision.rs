//! The floating-point precision models compute in.

use candle_core::{DType, Device};

/// Precision of Whisper's weights and activations (the embedder computes in F32 but for the
/// BF16 products below, see [`crate::embed::Embedder::load_in`]; the language model keeps its
/// GGUF quantisation). `Auto` (the default) is F16 on a GPU, where half precision doubles the
/// tensor cores' rate and halves the memory per window (faster-whisper's default there too),
/// and F32 on the CPU, what the reference computes there (candle's half-precision kernels are
/// slower than its F32 ones on a CPU anyway).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
    /// F32, with the linear layers' products in BF16 (F32 sums) on CPUs with AVX-512 BF16 or
    /// AMX: about twice the F32 rate there, at a cost in results: a close call between two
    /// tokens can tip (base's punctuation of one LibriVox clip; on AMX tiny.en's "Cloves"
    /// read "Clothes"), and embeddings move within a cosine of 0.999 (docs/benchmarks.md,
    /// "Transcripts equal to faster-whisper's"). F32 elsewhere. Chosen, never the default.
    Bf16Products,
    /// F32, with the language model's GPU steps of more than 8 requests multiplied on TF32
    /// tensor cores (inputs rounded to 10 bits of mantissa, F32 sums): on an H200, 256
    /// SmolLM2 requests decode 40,264 tokens/s against 31,251, at a cost in results: logits move
    /// by up to 0.2% of the largest and 8 of 8,192 greedy picks tipped (docs/benchmarks.md).
    /// Chosen, never the default.
    Tf32Products,
}

impl Precision {
    /// Whether this CPU has AVX-512 BF16, where `Bf16Products` takes BF16 products.
    pub fn cpu_has_bf16_products() -> bool {
        tern_kernels::bf16_gemm::available()
    }

    /// What runs the BF16 products on this CPU: `Some("AMX")` (Intel's tiles, Sapphire Rapids
    /// and later, unless `TERN_NO_AMX` is set), `Some("AVX-512 BF16")`, or `None`.
    pub fn cpu_bf16_kernel() -> Option<&'static str> {
        tern_kernels::bf16_gemm::kernel_name()
    }

    /// The candle dtype this precision resolves to on `device`.
    pub fn dtype(self, device: &Device) -> DType {
        match self {
            Precision::Auto if device.is_cpu() => DType::F32,
            Precision::Auto | Precision::F16 => DType::F16,
            Precision::F32 | Precision::Bf16Products | Precision::Tf32Products => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Precision::Auto),
            "f32" | "fp32" => Ok(Precision::F32),
            "f16" | "fp16" => Ok(Precision::F16),
            "bf16" => Ok(Precision::Bf16),
            "bf16-products" => Ok(Precision::Bf16Products),
            "tf32-products" => Ok(Precision::Tf32Products),
            other => Err(format!("unknown precision {other:?}; use auto, f32, f16, bf16, bf16-products or tf32-products")),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Auto => "auto",
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
            Precision::Bf16Products => "bf16-products",
            Precision::Tf32Products => "tf32-products",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_f32_on_the_cpu_and_names_parse() {
        assert_eq!(Precision::Auto.dtype(&Device::Cpu), DType::F32);
        assert_eq!(Precision::Bf16.dtype(&Device::Cpu), DType::BF16);
        assert_eq!(Precision::Bf16Products.dtype(&Device::Cpu), DType::F32);
        assert_eq!(Precision::Tf32Products.dtype(&Device::Cpu), DType::F32);
        for p in [Precision::Auto, Precision::F32, Precision::F16, Precision::Bf16, Precision::Bf16Products, Precision::Tf32Products] {
            assert_eq!(p.to_string().parse::<Precision>(), Ok(p));
        }
        assert!("f8".parse::<Precision>().is_err());
    }
}
