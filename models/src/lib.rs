//! The models tern's workers run.
//!
//! - [`audio`]: probe and decode uploads (WAV/FLAC/MP3/OGG-Vorbis) to 16 kHz mono PCM.
//! - [`whisper`]: Whisper on candle, loaded straight from faster-whisper (CTranslate2) folders.
//! - [`embed`]: sentence embeddings with BERT-family encoders (all-MiniLM-L6-v2).
//! - [`generate`]: text generation with SmolLM2-135M-Instruct (GGUF) and its ChatML template,
//!   on tern's own llama forward pass over the file's quantized blocks on the CPU.
//! - [`diffusion`]: image generation with Stable Diffusion from diffusers folders.
//! - [`family`]: a model family as a plug-in (load, warmup, health check, running its batches).
//! - [`wer`]: word error rate, to check transcripts against references.
//! - [`precision`]: Whisper's precision: F32 on the CPU, F16 (or BF16) on GPUs.
//! - [`cpu_threads`] and `allocator` (feature `allocator`): process settings that the binaries
//!   running models make first thing in `main`.
//!
//! Everything runs on the CPU by default (pass another candle `Device` to
//! [`whisper::Whisper::load_ct2`] to change that); no network access is needed at run time.

#[cfg(feature = "allocator")]
pub mod allocator;
/// Audio input, re-exported from `tern-audio`, which the API uses without the models.
pub use tern_audio as audio;
mod bert;
pub mod cpu_threads;
mod linear;
pub mod diffusion;
pub mod embed;
pub mod family;
pub mod generate;
pub mod precision;
pub mod wer;
mod weights;
pub mod whisper;
