use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// What a job does. Each kind has its own Redis queue and its own input/output JSON Schemas
/// (`schemas/{kind}.input.json`, `schemas/{kind}.output.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    /// Diagnostic kind: returns its input after an optional `sleep_ms`; exercises the whole path
    /// (API, queue, worker, S3) without a model.
    Echo,
    /// Speech to text with Whisper: JSON, SRT and VTT outputs. Costs one unit per 30 s window.
    Transcribe,
    /// Sentence embeddings (BERT family): up to 2,048 texts. Costs its padded tokens.
    Embed,
    /// Text generation with a small LLM from a prompt or chat messages. Costs prompt tokens plus
    /// `max_tokens`.
    Generate,
    /// A recording as a vector, from Whisper's encoder (the model `transcribe` runs). Costs one
    /// unit per 30 s window, batched with transcriptions' windows.
    #[serde(rename = "audio_embed")]
    AudioEmbed,
    /// Images from a text prompt with a Stable Diffusion pipeline: 1 to 8 PNGs of up to
    /// 2048 x 2048. Costs UNet rows, the unit its batches are sized in: one per image, two under
    /// guidance, times the image's pixels' share of the model's native size (estimated at
    /// submit).
    Image,
}

impl JobKind {
    /// Every kind, in a stable order.
    pub const ALL: &'static [JobKind] = &[JobKind::Echo, JobKind::Transcribe, JobKind::Embed, JobKind::Generate, JobKind::AudioEmbed, JobKind::Image];

    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Echo => "echo",
            JobKind::Transcribe => "transcribe",
            JobKind::Embed => "embed",
            JobKind::Generate => "generate",
            JobKind::AudioEmbed => "audio_embed",
            JobKind::Image => "image",
        }
    }

    /// The kind whose model (and model versions) this kind runs: itself, but `audio_embed`,
    /// which runs `transcribe`'s Whisper.
    pub fn model_kind(self) -> JobKind {
        match self {
            JobKind::AudioEmbed => JobKind::Transcribe,
            other => other,
        }
    }

    /// Whether its cost is 30 s windows of audio, probed from the file.
    pub fn costs_audio(self) -> bool {
        matches!(self, JobKind::Transcribe | JobKind::AudioEmbed)
    }

    /// Input fields that carry a file (a [`crate::file_ref::FileRef`]).
    pub fn file_fields(self) -> &'static [&'static str] {
        match self {
            JobKind::Echo => &["file"],
            JobKind::Transcribe | JobKind::AudioEmbed => &["audio"],
            JobKind::Embed | JobKind::Generate | JobKind::Image => &[],
        }
    }
}

impl fmt::Display for JobKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobKind {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        JobKind::ALL.iter().copied().find(|k| k.as_str() == s).ok_or(())
    }
}
