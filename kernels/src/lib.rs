//! tern's compute kernels, apart from the model definitions that call them (`tern-models`), as
//! candle keeps its kernels in a crate of their own. Each kernel is compiled for AVX-512,
//! AVX2 and a portable baseline where that pays, and picked at run time from what the CPU has.
//!
//! - [`cpu_kernels`]: element-wise and row kernels on slices: `exp`, GELU, softmax,
//!   log-sum-exp, layer norm, dot products with F16 weights, one-token attention.
//! - [`cpu_ops`]: the same as candle custom ops on tensors (bias + residual + layer norm in one
//!   pass, bias + GELU in one pass), run on both cores.
//! - [`bf16_gemm`]: BF16 products with F32 sums on CPUs with AVX-512 BF16 (a 12x32 kernel) or
//!   Intel's AMX tiles, over weights packed once, and the attention built on them.
//! - [`f32_linear`]: F32 products with weights kept transposed (bias and residual in the
//!   product's pass) and attention over plain slices, per block of queries.
//! - [`self_attention`]: fused multi-head self-attention over each sequence's own rows (no
//!   padding is computed), in F32 or BF16 products.
//! - [`quantized`]: products of GGML Q4_0 / Q4_1 / Q8_0 weight blocks with activations as
//!   integer dot products (AVX-512 VNNI or AVX2), each row's result independent of its
//!   neighbours.
//!
//! Everything here runs on the CPU; GPU work goes through candle's own CUDA kernels.

pub mod bf16_gemm;
pub mod cpu_kernels;
pub mod cpu_ops;
pub mod f32_linear;
pub mod quantized;
pub mod self_attention;
