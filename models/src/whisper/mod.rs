//! Whisper speech-to-text on candle, loading faster-whisper (CTranslate2) model folders directly
//! so no converted copy of the weights is needed on disk.
//!
//! Audio is processed in fixed 30 s windows (Whisper's input size): each window is encoded,
//! decoded by beam search or greedily with temperature fallback, and its segments are offset by
//! the window start. Features and decoding rules follow faster-whisper's (the parity test,
//! `tests/whisper_parity.rs`, holds them to it).

mod attention;
pub mod family;
mod ct2;
mod decode;
mod decoder;
mod encoder;
mod hf;
mod mel;
mod words;

use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::VecDeque;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use candle_transformers::models::whisper::{self as m, Config};

use crate::precision::Precision;
use tokenizers::Tokenizer;

use decode::Specials;
pub use decode::DecodeStats;
pub use mel::FeaturePadding;
pub use words::Word;

// The cost unit the API prices audio in (tern_audio::windows_for) is Whisper's window.
const _: () = assert!(m::CHUNK_LENGTH == tern_audio::WINDOW_SECONDS as usize);
/// Windows encoded and decoded together (bounds memory: ~20 MB of cross-attention keys/values
/// per window for tiny, more for larger models).
const DECODE_BATCH: usize = 8;
/// Epsilon of every Whisper layer norm (OpenAI's `model.py`).
const LAYER_NORM_EPS: f64 = 1e-5;
/// Seconds per timestamp token.
const TIMESTAMP_STEP: f64 = 0.02;

/// What the decoder is asked to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Text in the spoken language.
    Transcribe,
    /// English text whatever the spoken language (multilingual models only; `.en` models ignore it).
    Translate,
}

/// Options for [`Whisper::transcribe`].
#[derive(Debug, Clone)]
pub struct TranscribeOptions {
    /// Spoken language as a Whisper code ("en", "de", ...). `None` (the default) detects it from
    /// the first window on multilingual models; `.en` models always use "en".
    pub language: Option<String>,
    /// Default [`Task::Transcribe`].
    pub task: Task,
    /// Predict timestamp tokens so each window splits into timed segments. Default `true`. When
    /// `false`, each window becomes one segment spanning the window.
    pub timestamps: bool,
    /// How much of a short window's padding the encoder runs over. Default [`Padding::Full`],
    /// what the reference computes; [`Padding::DEFAULT_TRIMMED`] is faster and writes other
    /// words (docs/benchmarks.md, "Padding: what trimming costs").
    pub padding: Padding,
    /// What the features hold past a window's audio. Default [`FeaturePadding::Zeros`], as
    /// faster-whisper computes them; [`FeaturePadding::Silence`] is OpenAI's reference and
    /// transformers' (docs/benchmarks.md, "Features past the audio: zeros or silence").
    pub feature_padding: FeaturePadding,
    /// Text that conditions every window (names, spellings, style), fed before its SOT as
    /// `<|startofprev|>` and the prompt's last 223 tokens, as OpenAI's `initial_prompt`. Windows
    /// decode in parallel, so each gets this prompt rather than the text before it. Default none.
    pub prompt: Option<String>,
    /// The first temperature of each window, 0 to 1: 0 (the default) decodes greedily or by
    /// beam search ([`TranscribeOptions::beam_size`]), above 0 samples.
    pub temperature: f64,
    /// Hypotheses a beam search keeps at temperature 0, 1 to [`MAX_BEAM_SIZE`]: 1 decodes
    /// greedily. Default [`DEFAULT_BEAM_SIZE`] (faster-whisper's); each costs a decoder row.
    pub beam_size: usize,
    /// Whether a window that decodes badly (compression ratio above 2.4, or mean
    /// log-probability below -1 without being silence) runs again 0.2 hotter, up to 1
    /// (OpenAI's and faster-whisper's fallback). Default `true`.
    pub fallback: bool,
    /// Embed the recording instead of transcribing it: the result's [`Transcript::embedding`]
    /// holds one vector from the encoder, and its text and segments are empty. Its windows
    /// go through the encoder with the transcriptions' windows and skip the decoder. Default
    /// `false`.
    pub embed: bool,
    /// Time each word ([`Segment::words`]) from the cross-attention of the model's alignment
    /// heads. Default `false`: it costs one more decoder pass over each window's text, and
    /// each window keeps its encoder output until it is decoded (2.3 MB in F32 for tiny, 7.7 MB
    /// for large models), beyond what the batch budget counts.
    pub word_timestamps: bool,
}

impl Default for TranscribeOptions {
    /// Auto language, transcribe, timestamps on, full padding, beam search of 5 with fallback:
    /// faster-whisper's defaults.
    fn default() -> Self {
        TranscribeOptions {
            language: None,
            task: Task::Transcribe,
            timestamps: true,
            padding: Padding::Full,
            feature_padding: FeaturePadding::Zeros,
            prompt: None,
            temperature: 0.0,
            beam_size: DEFAULT_BEAM_SIZE,
            fallback: true,
            embed: false,
            word_timestamps: false,
        }
    }
}

/// Default [`TranscribeOptions::beam_size`]: faster-whisper's.
pub const DEFAULT_BEAM_SIZE: usize = 5;
/// Largest [`TranscribeOptions::beam_size`].
pub const MAX_BEAM_SIZE: usize = 16;

/// A timed piece of the transcript. Times are seconds from the start of the audio.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Segment {
    /// Start in seconds from the start of the audio (window start + timestamp token).
    pub start: f64,
    /// End in seconds; text after the last timestamp of a window runs to the window end.
    /// Always `start <= end <= duration`.
    pub end: f64,
    /// Trimmed text of the segment.
    pub text: String,
    /// Its words with their times, where [`TranscribeOptions::word_timestamps`] asked for them.
    /// The segment's start and end are then its first word's start and last word's end, save
    /// where a word runs well past the segment's own timestamp (OpenAI's rules).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub words: Option<Vec<Word>>,
}

/// How far a recording got, for [`Whisper::transcribe_many`]'s `progress`.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'t> {
    /// Windows done.
    pub done: usize,
    /// Windows in all (at least [`windows_for`] of the duration: see [`Whisper::transcribe`]).
    pub total: usize,
    /// The transcript of the windows done from the start on, with no window missing: it only
    /// grows at its end, and once every window is done it is the transcript's text.
    pub text: &'t str,
}

/// Result of [`Whisper::transcribe`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct Transcript {
    /// All segment texts joined with single spaces.
    pub text: String,
    /// Language code used for decoding ("en" for `.en` models, else given or detected).
    pub language: String,
    /// Audio duration in seconds (samples / 16000).
    pub duration: f64,
    /// Segments in time order; windows judged silent contribute none.
    pub segments: Vec<Segment>,
    /// The recording's embedding, where [`TranscribeOptions::embed`] asked for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub embedding: Option<AudioEmbedding>,
}

/// A recording as a vector: the mean of the encoder's output over the positions (20 ms each)
/// that hold audio, over all its windows, L2-normalised. Recordings of the same speech lie
/// near each other (cosine near 1) whatever their sample rate or encoding.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AudioEmbedding {
    /// `d_model` values (384 for tiny, 512 for base), unit length.
    pub vector: Vec<f32>,
    /// Each 30 s window's own vector, in time order, also unit length.
    pub windows: Vec<WindowEmbedding>,
}

/// One window's vector of an [`AudioEmbedding`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct WindowEmbedding {
    /// Seconds from the start of the recording.
    pub start: f64,
    pub end: f64,
    pub vector: Vec<f32>,
}

/// `v` scaled to unit length (left as is when it is all zeros).
fn unit(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// A loaded Whisper model, tokenizer and decoding config on one candle [`Device`].
///
/// Not `Sync`-shareable for concurrent use: [`Whisper::transcribe`] takes `&mut self` because the
/// decoder caches cross-attention keys/values per window. Load one per worker thread.
pub struct Whisper {
    config: Config,
    encoder: encoder::Encoder,
    /// Our cached decoder (candle's re-runs the whole prefix each step); `model.decoder` unused.
    decoder: decoder::Decoder,
    tokenizer: Tokenizer,
    specials: Specials,
    /// (token id, language code) for every language token, empty for `.en` models.
    languages: Vec<(u32, String)>,
    /// The decoder's (layer, head) pairs whose cross-attention follows the audio in time, for
    /// word timestamps.
    alignment_heads: Vec<(usize, usize)>,
    filters: Vec<f32>,
    device: Device,
    weights_bytes: u64,
    /// What the last [`Whisper::transcribe_many`] call's decoding did.
    last_decode: DecodeStats,
    /// Picks tokens on the device; see [`Whisper::set_device_picks`].
    picker: Option<decode::DevicePicker>,
}

/// How much of the silence that pads a window shorter than 30 s goes through the encoder.
///
/// Whisper was trained on windows padded to 30 s, so a 6 s clip costs a 30 s encoder pass.
/// Trimming runs the audio plus a margin of the padding, and the decoder attends to just that:
/// a 6 s clip then costs about a quarter of the encoder. With no margin Whisper loses the end
/// of speech and loops; from 1 s on, the LibriVox test clips transcribe as well as with full
/// padding (tiny.en: 5.6% word error rate against 8.5%; base: 2.8% both). A trimmed window
/// whose greedy decode looks degenerate is decoded again over the full 30 s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Padding {
    /// All of it: every window costs a full 30 s encoder pass, as Whisper was trained.
    Full,
    /// The audio plus `margin_seconds` of the padding (capped at 30 s).
    Trimmed {
        /// Seconds of padding kept after the audio.
        margin_seconds: f64,
    },
}

impl Padding {
    /// Trimmed with a 2 s margin: the trimmed padding measured in docs/benchmarks.md.
    pub const DEFAULT_TRIMMED: Padding = Padding::Trimmed { margin_seconds: 2.0 };
}

impl std::str::FromStr for Padding {
    type Err = String;

    /// `full`, or the trimmed margin in seconds (`2`, `1.5`; at least 0.5).
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("full") {
            return Ok(Padding::Full);
        }
        match s.parse::<f64>() {
            Ok(margin) if margin >= 0.5 && margin.is_finite() => Ok(Padding::Trimmed { margin_seconds: margin }),
            _ => Err(format!("expected `full` or a margin of at least 0.5 seconds, got {s:?}")),
        }
    }
}

// Workers move a loaded model into their own thread.
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Whisper>();
};

pub use tern_audio::windows_for;

/// Encoder positions of a full window (20 ms each).
const FULL_POSITIONS: usize = m::N_FRAMES / 2;

/// Encoder positions (20 ms each, at most 1500) run for a window of `samples` samples.
fn encoder_positions(padding: Padding, samples: usize) -> usize {
    match padding {
        Padding::Full => FULL_POSITIONS,
        Padding::Trimmed { margin_seconds } => {
            let speech = samples.div_ceil(2 * m::HOP_LENGTH);
            (speech + (margin_seconds.max(0.0) * 50.0).ceil() as usize).min(FULL_POSITIONS)
        }
    }
}

/// Longest share of a group's encoder work that may go to padding when windows of different
/// lengths are encoded together.
const MAX_ENCODER_PADDING: f64 = 0.2;

/// Rows of a window batch that go through the encoder together, given each row's encoder
/// positions. With `mixed` (an encoder that takes lengths), rows sorted by length form groups
/// whose shortest row is at least `1 - MAX_ENCODER_PADDING` of the longest, so a group wastes
/// at most that share on padding while its matrix products run over many rows at once (the
/// short clips of a batch are all of different lengths). Otherwise rows of equal length group.
fn encoder_groups(positions: &[usize], mixed: bool) -> Vec<Vec<usize>> {
    let mut rows: Vec<usize> = (0..positions.len()).collect();
    rows.sort_by_key(|&r| std::cmp::Reverse(positions[r]));
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for r in rows {
        let joins = groups.last().is_some_and(|g| {
            let longest = positions[g[0]];
            if mixed {
                positions[r] as f64 >= (1.0 - MAX_ENCODER_PADDING) * longest as f64
            } else {
                positions[r] == longest
            }
        });
        match groups.last_mut() {
            Some(g) if joins => g.push(r),
            _ => groups.push(vec![r]),
        }
    }
    groups
}

/// How far before a window's 30 s end the cut may move to land in a pause.
const CUT_LOOKBACK_SAMPLES: usize = 5 * m::SAMPLE_RATE;
/// Loudness is compared over frames of this many samples (20 ms).
const CUT_FRAME: usize = m::SAMPLE_RATE / 50;
/// A cut lands in the middle of the quietest run of this many frames (200 ms), so a short
/// stop consonant inside a word does not pass for a pause.
const CUT_QUIET_FRAMES: usize = 10;

/// Sample ranges of the windows `pcm` is transcribed in: consecutive, covering all of it, each
/// at most 30 s, each cut in the quietest 200 ms within the last 5 s before the window's 30 s
/// end, so a cut falls between words wherever the speaker paused, instead of in the middle of
/// one. That takes a window more than [`windows_for`] counts (the cost) every ten or so: cut to
/// that count, the windows had no room left after the first few pauses, and the rest were cut
/// at 30 s marks inside words (a 30-minute recording read at 4.5% WER, against 1.9% on 120 s).
fn window_cuts(pcm: &[f32]) -> Vec<(usize, usize)> {
    let mut cuts = Vec::with_capacity(windows_for(pcm.len() as f64 / m::SAMPLE_RATE as f64) + 1);
    let mut start = 0;
    while pcm.len() - start > m::N_SAMPLES {
        let latest = start + m::N_SAMPLES;
        let end = quietest_point(pcm, latest - CUT_LOOKBACK_SAMPLES, latest);
        cuts.push((start, end));
        start = end;
    }
    cuts.push((start, pcm.len()));
    cuts
}

/// The middle of the quietest run of [`CUT_QUIET_FRAMES`] frames between `from` and `to`
/// (`to` itself when the span is shorter than one run).
fn quietest_point(pcm: &[f32], from: usize, to: usize) -> usize {
    let energy: Vec<f32> = pcm[from..to].chunks_exact(CUT_FRAME).map(|f| f.iter().map(|x| x * x).sum()).collect();
    if energy.len() < CUT_QUIET_FRAMES {
        return to;
    }
    let mut run: f32 = energy[..CUT_QUIET_FRAMES].iter().sum();
    let (mut best, mut best_at) = (run, 0);
    for i in CUT_QUIET_FRAMES..energy.len() {
        run += energy[i] - energy[i - CUT_QUIET_FRAMES];
        // Ties go to the later run: windows stay as long as they can.
        if run <= best {
            (best, best_at) = (run, i + 1 - CUT_QUIET_FRAMES);
        }
    }
    from + (best_at + CUT_QUIET_FRAMES / 2) * CUT_FRAME
}

/// Shortest untranscribed end of a window that runs again (2 s).
const MIN_TAIL_SAMPLES: usize = 2 * m::SAMPLE_RATE;

/// Whether `tail`, the end of `window` after its last segment, holds speech worth a second
/// pass: at least 2 s, with a 200 ms stretch at least a tenth as loud (mean square) as the
/// window's loudest 200 ms (trailing silence or room noise stays below that).
fn untranscribed_speech(pcm: &[f32], window: (usize, usize), tail: (usize, usize)) -> bool {
    if tail.1.saturating_sub(tail.0) < MIN_TAIL_SAMPLES {
        return false;
    }
    let loudest = |from: usize, to: usize| -> f32 {
        pcm[from..to]
            .chunks(CUT_FRAME * CUT_QUIET_FRAMES)
            .map(|c| c.iter().map(|x| x * x).sum::<f32>() / c.len() as f32)
            .fold(0.0, f32::max)
    };
    let peak = loudest(window.0, window.1);
    peak > 0.0 && loudest(tail.0, tail.1) >= 0.1 * peak
}

/// A recording's transcript while [`Whisper::transcribe_many`] builds it.
struct Pending {
    /// Windows the recording costs.
    total: usize,
    /// `None` until detected from the first window.
    language: Option<(Option<u32>, String)>,
    /// Each window's segments (a window and its tail finish in that order).
    window_segments: Vec<Vec<Segment>>,
    /// Each window's pieces not decoded yet: itself, then its tail if it has one.
    open: Vec<usize>,
    /// Windows done.
    done: usize,
    error: Option<anyhow::Error>,
    /// The tokens of its text prompt.
    prompt: Vec<u32>,
    /// Windows done from the first on, with none missing, and their text ([`Progress::text`]).
    leading: usize,
    text: String,
    /// For an embedding: each window's sum of the encoder output over its audio positions,
    /// the positions, and its range.
    pooled: Vec<Option<(Vec<f32>, usize, (usize, usize))>>,
}

/// A recording for [`Whisper::transcribe_continuous`]: 16 kHz mono PCM and its options, borrowed
/// or owned (the model lets go of them as soon as the recording is answered).
pub struct TranscribeInput<'a> {
    pub pcm: Pcm<'a>,
    pub options: Cow<'a, TranscribeOptions>,
}

/// The samples of a [`TranscribeInput`]: borrowed, or shared with a caller that keeps them to
/// run the recording again (a worker does, when a batch runs out of device memory).
pub enum Pcm<'a> {
    Borrowed(&'a [f32]),
    Shared(std::sync::Arc<Vec<f32>>),
}

impl std::ops::Deref for Pcm<'_> {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Pcm::Borrowed(samples) => samples,
            Pcm::Shared(samples) => samples,
        }
    }
}

/// Input `i`, which is not answered yet: work of answered inputs is never looked at.
fn input_of<'b, 'a>(inputs: &'b [Option<TranscribeInput<'a>>], i: usize) -> &'b TranscribeInput<'a> {
    inputs[i].as_ref().expect("an input is answered only when no work of it is looked at again")
}

/// Audio waiting to be encoded and decoded: a window of an input, the untranscribed end of one
/// ([`untranscribed_speech`]), or a trimmed one again over the full 30 s.
#[derive(Debug, Clone, Copy)]
struct Work {
    input: usize,
    window: usize,
    /// Samples of the input.
    range: (usize, usize),
    /// Encoder positions it runs over ([`encoder_positions`]).
    positions: usize,
    /// The end of a window after its first pass, which gets no tail of its own.
    tail: bool,
}

/// What a model folder says of decoding besides its weights: CTranslate2's `config.json`, or
/// what [`hf`] reads from a Hugging Face folder's `generation_config.json` under these names.
#[derive(serde::Deserialize)]
struct DecodingRules {
    #[serde(default)]
    suppress_ids: Vec<u32>,
    #[serde(default)]
    suppress_ids_begin: Vec<u32>,
    #[serde(default)]
    lang_ids: Vec<u32>,
    /// `[layer, head]` pairs; absent in older conversions.
    #[serde(default)]
    alignment_heads: Vec<(usize, usize)>,
}

fn token(tok: &Tokenizer, s: &str) -> Result<u32> {
    tok.token_to_id(s)
        .ok_or_else(|| anyhow!("tokenizer.json has no {s} token"))
}

impl Whisper {
    /// Loads a Whisper folder in either format: CTranslate2's (`model.bin`, as faster-whisper
    /// reads it) or Hugging Face's (`config.json`, `generation_config.json`, safetensors, as
    /// `WhisperForConditionalGeneration` saves it: openai/whisper-*, distil-whisper,
    /// fine-tunes), computing in `precision`.
    pub fn load_in(dir: &Path, device: &Device, precision: Precision) -> Result<Whisper> {
        if dir.join("model.bin").is_file() {
            Self::load_ct2_in(dir, device, precision)
        } else {
            Self::load_hf_in(dir, device, precision)
        }
    }

    /// Loads a Hugging Face Whisper folder ([`hf`]): `config.json`, `generation_config.json`
    /// (suppressed tokens, languages, alignment heads), `tokenizer.json` and the weights
    /// (`model.safetensors`, an fp16 variant, or shards with an index), F32, F16 or BF16.
    pub fn load_hf_in(dir: &Path, device: &Device, precision: Precision) -> Result<Whisper> {
        let hf::HfWhisper { tensors, config, rules, embeddings_f16 } = hf::read(dir)?;
        // As for CTranslate2's F16 files: F16 token embeddings hold what the file holds.
        let embeddings_in_f16 = embeddings_f16 && device.is_cpu() && precision.dtype(device) == DType::F32;
        Self::assemble(dir, tensors, config, rules, embeddings_in_f16, device, precision)
    }

    /// Loads a CTranslate2 (faster-whisper) model folder: `model.bin` (F32/F16/BF16 weights;
    /// int8-quantised files are refused), `config.json` (`suppress_ids`, `suppress_ids_begin`,
    /// `lang_ids`; missing keys default to empty) and `tokenizer.json`.
    /// Weights are converted to F32 on the CPU, then to the precision's dtype on `device`.
    pub fn load_ct2(dir: &Path, device: &Device) -> Result<Whisper> {
        Self::load_ct2_in(dir, device, Precision::Auto)
    }

    /// [`Self::load_ct2`] computing in `precision` (F32 on the CPU and F16 on a GPU for
    /// [`Precision::Auto`]).
    pub fn load_ct2_in(dir: &Path, device: &Device, precision: Precision) -> Result<Whisper> {
        let dtype = precision.dtype(device);
        let bin_path = dir.join("model.bin");
        let bytes =
            std::fs::read(&bin_path).with_context(|| format!("reading {}", bin_path.display()))?;
        let vars = ct2::read_model_bin(&bytes)
            .with_context(|| format!("parsing {}", bin_path.display()))?;
        drop(bytes);
        // F16 token embeddings for F32 on the CPU hold what the file holds, in half the bytes.
        let embeddings_in_f16 = device.is_cpu()
            && dtype == DType::F32
            && vars.get("decoder/embeddings/weight").is_some_and(|v| v.dtype == ct2::DTYPE_F16);
        let ct2::Ct2Whisper { tensors, config } = ct2::to_candle(&vars)?;
        drop(vars);
        let cfg_path = dir.join("config.json");
        let rules: DecodingRules = serde_json::from_slice(
            &std::fs::read(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?,
        )
        .with_context(|| format!("parsing {}", cfg_path.display()))?;
        Self::assemble(dir, tensors, config, rules, embeddings_in_f16, device, precision)
    }

    /// The model from its weights under candle's names (F32 on the CPU), its architecture, its
    /// decoding rules and `dir/tokenizer.json`.
    fn assemble(
        dir: &Path,
        tensors: std::collections::HashMap<String, candle_core::Tensor>,
        mut config: Config,
        rules: DecodingRules,
        embeddings_in_f16: bool,
        device: &Device,
        precision: Precision,
    ) -> Result<Whisper> {
        let dtype = precision.dtype(device);
        let weights_bytes: u64 = tensors.values().map(|t| (t.elem_count() * dtype.size_in_bytes()) as u64).sum();
        config.suppress_tokens = rules.suppress_ids.clone();

        let tok_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow!("loading {}: {e}", tok_path.display()))?;

        let weights_bytes = if embeddings_in_f16 {
            weights_bytes - (config.vocab_size * config.d_model * 2) as u64
        } else {
            weights_bytes
        };
        let vb = VarBuilder::from_tensors(tensors, dtype, device);
        // Products in BF16 where the CPU has them only when chosen (`Bf16Products`): they tip
        // close calls, and the default computes what the reference does.
        let bf16_products = device.is_cpu() && dtype == DType::F32 && precision == Precision::Bf16Products;
        let decoder = decoder::Decoder::load(vb.pp("model.decoder"), &config, embeddings_in_f16, bf16_products)
            .context("building the whisper decoder")?;
        let encoder = encoder::Encoder::load(vb.pp("model.encoder"), &config, bf16_products)
            .context("building the whisper encoder")?;
        let weights_bytes = weights_bytes + decoder.logits_bf16_bytes() as u64
            - (encoder.bytes_saved() + decoder.bytes_saved()) as u64;

        let no_timestamps = token(&tokenizer, m::NO_TIMESTAMPS_TOKEN)?;
        let specials = Specials {
            sot: token(&tokenizer, m::SOT_TOKEN)?,
            eot: token(&tokenizer, m::EOT_TOKEN)?,
            transcribe: tokenizer.token_to_id(m::TRANSCRIBE_TOKEN),
            translate: tokenizer.token_to_id(m::TRANSLATE_TOKEN),
            no_timestamps,
            // Timestamp tokens follow <|notimestamps|> in every Whisper vocabulary.
            timestamp_begin: no_timestamps + 1,
            no_speech: m::NO_SPEECH_TOKENS
                .iter()
                .find_map(|t| tokenizer.token_to_id(t)),
            prev: tokenizer.token_to_id("<|startofprev|>"),
            suppress: rules.suppress_ids,
            suppress_begin: rules.suppress_ids_begin,
        };
        // A vocabulary of 51864 is English-only; multilingual ones have the 99+ language tokens.
        let multilingual = config.vocab_size >= 51865;
        let languages = if multilingual {
            rules
                .lang_ids
                .iter()
                .filter_map(|&id| {
                    let t = tokenizer.id_to_token(id)?;
                    let code = t.strip_prefix("<|")?.strip_suffix("|>")?.to_string();
                    Some((id, code))
                })
                .collect()
        } else {
            Vec::new()
        };
        if multilingual && languages.is_empty() {
            bail!("multilingual model but config.json has no usable lang_ids");
        }
        // Without the model's own list, OpenAI's default: every head of the later half.
        let alignment_heads = if rules.alignment_heads.is_empty() {
            let layers = config.decoder_layers;
            (layers / 2..layers).flat_map(|l| (0..config.decoder_attention_heads).map(move |h| (l, h))).collect()
        } else {
            rules.alignment_heads.clone()
        };
        let mut whisper = Whisper {
            filters: mel::mel_filters(config.num_mel_bins),
            config,
            encoder,
            decoder,
            tokenizer,
            specials,
            languages,
            alignment_heads,
            device: device.clone(),
            weights_bytes,
            last_decode: DecodeStats::default(),
            picker: None,
        };
        whisper.set_device_picks(!device.is_cpu())?;
        Ok(whisper)
    }

    /// Picks tokens on the model's device, the token rules applied as masks: greedy rows copy
    /// three numbers back, beam search's rows their `2 x beam_size` candidates, instead of
    /// every row's 51,864 logits copied to the host and read there. Default: on for a GPU,
    /// where that copy and read left the device idle for most of a step; off on the CPU, where
    /// the host path is faster. Both pick the same tokens; log-probabilities agree to rounding.
    /// Sampling (the temperature fallback) stays on the host.
    pub fn set_device_picks(&mut self, on: bool) -> Result<()> {
        self.picker = if on { Some(decode::DevicePicker::new(&self.specials, self.config.vocab_size, &self.device)?) } else { None };
        Ok(())
    }

    /// What the decoding of the last [`Whisper::transcribe_many`] (or [`Whisper::transcribe`])
    /// did: steps, windows, and windows that joined a running batch.
    pub fn last_decode_stats(&self) -> DecodeStats {
        self.last_decode
    }

    /// Bytes of weights held (in the precision loaded).
    pub fn weights_bytes(&self) -> u64 {
        self.weights_bytes
    }

    /// Runs `windows` windows of silence through the encoder and one decoder step of
    /// `beam_size` hypotheses each (each a decoder row attending to its window's cross-attention
    /// keys, as in a beam search), picking as a batch picks: the memory a batch
    /// of that size needs at its peak. A model that fails here is not fit to serve.
    pub fn warmup(&mut self, windows: usize, beam_size: usize) -> Result<()> {
        let (windows, beams) = (windows.max(1), beam_size.max(1));
        let silence = vec![0f32; m::N_SAMPLES];
        let mel = mel::window_mel(&self.config, &self.filters, &silence, (0, silence.len()), m::N_FRAMES, FeaturePadding::Zeros, &self.device)?;
        let mels = candle_core::Tensor::cat(&vec![mel; windows], 0)?;
        let features = self.encoder.forward(&mels, None)?;
        drop(mels);
        let cross = self.decoder.cross_kv(&features, None)?;
        drop(features);
        let cross = match beams {
            1 => cross,
            _ => cross.select(&(0..windows).flat_map(|w| std::iter::repeat_n(w, beams)).collect::<Vec<_>>())?,
        };
        let rows = windows * beams;
        let input = candle_core::Tensor::from_vec(vec![self.specials.sot; rows], (rows, 1), &self.device)?;
        let mut cache = self.decoder.new_cache();
        let ys = self.decoder.forward(&input, &cross, &mut cache)?;
        let finite = match &self.picker {
            Some(picker) => picker.warm(&self.decoder.logits_on_device(&ys, 0)?, &self.specials, beams)?,
            None => self.decoder.logits_vecs(&ys, 0)?.iter().flatten().all(|x| x.is_finite()),
        };
        if !finite {
            bail!("warmup produced non-finite logits");
        }
        Ok(())
    }

    /// The logits after `tokens` (a decoder prompt such as `<|startoftranscript|><|en|>...`)
    /// for a recording's first window under [`Padding::Full`]: what the parity tests compare
    /// with a reference implementation's, before any rule picks a token.
    pub fn prompt_logits(&self, pcm: &[f32], tokens: &[u32]) -> Result<Vec<f32>> {
        let first = window_cuts(pcm)[0];
        let mel = mel::window_mel(&self.config, &self.filters, pcm, first, m::N_FRAMES, FeaturePadding::Zeros, &self.device)?;
        let features = self.encoder.forward(&mel, None)?;
        let cross = self.decoder.cross_kv(&features, None)?;
        let input = candle_core::Tensor::from_vec(tokens.to_vec(), (1, tokens.len()), &self.device)?;
        let ys = self.decoder.forward(&input, &cross, &mut self.decoder.new_cache())?;
        Ok(self.decoder.logits_vecs(&ys, tokens.len() - 1)?.remove(0))
    }

    /// The log-mel features of a recording's first window as the encoder sees it under
    /// [`Padding::Full`]: `n_mels x 3000` row-major (80 or 128 mels), the frames past the
    /// window's audio as `padding` fills them: faster-whisper's ([`FeaturePadding::Zeros`]) or
    /// OpenAI's, for the parity test.
    pub fn features(&self, pcm: &[f32], padding: FeaturePadding) -> Vec<f32> {
        let first = window_cuts(pcm)[0];
        mel::log_mel(pcm, first, &self.filters, self.config.num_mel_bins, m::N_FRAMES, padding)
    }

    /// Whether the model handles languages other than English (and language detection).
    pub fn is_multilingual(&self) -> bool {
        !self.languages.is_empty()
    }

    /// Picks the most likely language token for an encoded window.
    fn detect_language(&self, cross: &decoder::CrossKv) -> Result<(u32, String)> {
        let input = candle_core::Tensor::new(&[self.specials.sot], &self.device)?.unsqueeze(0)?;
        let mut cache = self.decoder.new_cache();
        let ys = self.decoder.forward(&input, cross, &mut cache)?;
        let logits = self.decoder.logits_vecs(&ys, 0)?.swap_remove(0);
        self.languages
            .iter()
            .max_by(|a, b| logits[a.0 as usize].total_cmp(&logits[b.0 as usize]))
            .cloned()
            .ok_or_else(|| anyhow!("no language tokens"))
    }

    /// Transcribes 16 kHz mono PCM (see [`crate::audio::decode_mono_16k`]).
    ///
    /// Audio is cut into consecutive windows of at most 30 s, each cut moved back up to 5 s
    /// into the quietest 200 ms so it falls in a pause (about one window per 27.5 s of speech,
    /// at least [`windows_for`] of them); segment times are offset by the window start and
    /// clamped to the audio length. `progress(done_windows, total_windows)` is called once per
    /// window as it finishes. Up to 8 windows decode together
    /// (one read of the decoder weights per step for all of them).
    /// Beam search or greedy decoding ([`TranscribeOptions::beam_size`]), at most 224 tokens
    /// per window, with OpenAI's temperature fallback
    /// (0.2 ... 1.0) for windows that decode badly; windows judged silent (no-speech probability
    /// > 0.6 and low confidence) yield no segments.
    pub fn transcribe(
        &mut self,
        pcm: &[f32],
        opts: &TranscribeOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Transcript> {
        self.transcribe_many(&[(pcm, opts)], DECODE_BATCH, &|_| false, &mut |_, p| progress(p.done, p.total))
            .pop()
            .expect("one result per input")
    }

    /// Transcribes several recordings together: their windows, in input order, decode
    /// `window_batch` at a time (at least 1), so short clips share decoder steps. Where the
    /// decoder allows it ([`decode::WindowBatch`]: F32 on CPUs with AVX-512 BF16) a window that
    /// finishes hands its row to the next one at once (continuous batching); elsewhere the next
    /// windows start when the whole batch is done. Each recording's transcript is the same as
    /// [`Whisper::transcribe`] gives for it alone: windows keep their own sampling seeds and the
    /// rows of a batch do not interact.
    /// `progress(input, progress)` is called once per window as it finishes ([`Progress`]).
    /// `canceled(input)` is asked before each of its windows is encoded: a canceled input's
    /// remaining windows are skipped and its result is an error.
    /// One result per input, in order; an input that fails (say, an unknown language code) does
    /// not fail the others.
    pub fn transcribe_many(
        &mut self,
        inputs: &[(&[f32], &TranscribeOptions)],
        window_batch: usize,
        canceled: &dyn Fn(usize) -> bool,
        progress: &mut dyn FnMut(usize, Progress<'_>),
    ) -> Vec<Result<Transcript>> {
        let mut all = Some(inputs.iter().map(|&(pcm, options)| TranscribeInput { pcm: Pcm::Borrowed(pcm), options: Cow::Borrowed(options) }).collect::<Vec<_>>());
        let mut results: Vec<Option<Result<Transcript>>> = inputs.iter().map(|_| None).collect();
        self.transcribe_continuous(window_batch, &mut || all.take().unwrap_or_default(), canceled, progress, &mut |i, r| results[i] = Some(r));
        results.into_iter().map(|r| r.expect("every input is answered")).collect()
    }

    /// [`Whisper::transcribe_many`] for recordings that keep coming: `admit()` hands over more
    /// (numbered from 0 in the order handed over) and is asked again whenever fewer than
    /// `window_batch` windows wait to be encoded, so new recordings join the running batch;
    /// the call returns once `admit()` gives nothing and every recording is answered.
    /// `done(input, result)` answers each recording as soon as its last window is decoded (or
    /// it fails), not when the whole batch ends, and the recording's samples are dropped then.
    pub fn transcribe_continuous<'a>(
        &mut self,
        window_batch: usize,
        admit: &mut dyn FnMut() -> Vec<TranscribeInput<'a>>,
        canceled: &dyn Fn(usize) -> bool,
        progress: &mut dyn FnMut(usize, Progress<'_>),
        done: &mut dyn FnMut(usize, Result<Transcript>),
    ) {
        let capacity = window_batch.max(1);
        let mut inputs: Vec<Option<TranscribeInput<'a>>> = Vec::new();
        let mut items: Vec<Pending> = Vec::new();
        // Inputs not answered yet.
        let mut open: Vec<usize> = Vec::new();
        let mut queue: VecDeque<Work> = VecDeque::new();
        // Every window encoded, by tag.
        let mut works: Vec<Work> = Vec::new();
        let (tokenizer, eot) = (&self.tokenizer, self.specials.eot);
        let text = move |ids: &[u32]| {
            let ids: Vec<u32> = ids.iter().copied().filter(|&t| t < eot).collect();
            tokenizer.decode(&ids, true).unwrap_or_default()
        };
        let mut batch = decode::WindowBatch::new(&self.decoder, &self.specials, &text, capacity).with_picker(self.picker.as_ref());
        loop {
            let mut arrived = 0;
            if queue.len() < capacity {
                for input in admit() {
                    arrived += 1;
                    let i = inputs.len();
                    let windows = window_cuts(&input.pcm);
                    let total = windows.len();
                    let (language, mut error) = match self.resolve_language(&input.options) {
                        Ok(l) => (l, None),
                        Err(e) => (None, Some(e)),
                    };
                    let prompt = match self.prompt_tokens(&input.options) {
                        Ok(p) => p,
                        Err(e) => {
                            error.get_or_insert(e);
                            Vec::new()
                        }
                    };
                    if error.is_none() {
                        let padding = input.options.padding;
                        queue.extend(windows.iter().enumerate().map(|(w, &range)| Work { input: i, window: w, range, positions: encoder_positions(padding, range.1 - range.0), tail: false }));
                    }
                    // An embedding needs no language: nothing is decoded.
                    let language = if input.options.embed { Some((None, String::new())) } else { language };
                    items.push(Pending { window_segments: vec![Vec::new(); total], open: vec![1; total], done: 0, total, language, error, prompt, leading: 0, text: String::new(), pooled: vec![None; total] });
                    inputs.push(Some(input));
                    open.push(i);
                }
            }
            let room = batch.room();
            // A running batch takes more windows once a quarter of it is free: encoding a window
            // or two at a time would waste the encoder's wide products.
            if room > 0 && !queue.is_empty() && (batch.running() == 0 || room * 4 >= capacity) {
                let mut taken = Vec::new();
                while taken.len() < room {
                    let Some(work) = queue.pop_front() else { break };
                    let item = &mut items[work.input];
                    if item.error.is_none() && canceled(work.input) {
                        item.error = Some(anyhow!("canceled"));
                    }
                    // A failed or canceled input's remaining windows are skipped.
                    if item.error.is_none() {
                        taken.push(work);
                    }
                }
                match self.encode(&inputs, &taken, &mut items) {
                    Ok(crosses) => {
                        for (work, (cross, features)) in taken.into_iter().zip(crosses) {
                            let opts = &input_of(&inputs, work.input).options;
                            if opts.embed {
                                let item = &mut items[work.input];
                                match pool(features.as_ref(), work.range) {
                                    Ok(p) => item.pooled[work.window] = Some(p),
                                    Err(e) => {
                                        item.error.get_or_insert(e);
                                        continue;
                                    }
                                }
                                item.open[work.window] = 0;
                                item.done += 1;
                                progress(work.input, Progress { done: item.done, total: item.total, text: "" });
                                continue;
                            }
                            let Some(cross) = cross else {
                                items[work.input].error.get_or_insert_with(|| anyhow!("a decoded window was encoded without its cross-attention"));
                                continue;
                            };
                            let tag = works.len();
                            works.push(work);
                            batch.add(decode::Window {
                                tag,
                                cross,
                                prompt: self.prompt(opts, &items[work.input]),
                                timestamps: opts.timestamps,
                                temperature: opts.temperature.clamp(0.0, 1.0),
                                beam_size: opts.beam_size.clamp(1, MAX_BEAM_SIZE),
                                fallback: opts.fallback,
                                features,
                                // Seeds follow the window's place in its own recording, so
                                // batching cannot change what a fallback samples.
                                seed: work.window as u64 + 1,
                                give_up: work.positions < FULL_POSITIONS,
                            });
                        }
                    }
                    Err(e) => {
                        // Which row broke cannot be told apart: every input encoded together fails.
                        let message = format!("{e:#}");
                        for work in taken {
                            items[work.input].error.get_or_insert_with(|| anyhow!("{message}"));
                        }
                    }
                }
            }
            if !batch.is_idle() {
                match batch.step() {
                    Ok(finished) => {
                        for (tag, decoded) in finished {
                            self.finish_work(&inputs, works[tag], decoded, &mut items, &mut queue, progress);
                        }
                    }
                    Err(e) => {
                        let message = format!("{e:#}");
                        for tag in batch.drain() {
                            items[works[tag].input].error.get_or_insert_with(|| anyhow!("{message}"));
                        }
                    }
                }
            }
            // Answer the inputs that are done or failed (a failed one's rows still decoding
            // are ignored when they finish).
            open.retain(|&i| {
                let item = &mut items[i];
                if item.error.is_none() && item.done < item.total {
                    return true;
                }
                let input = inputs[i].take().expect("answered once");
                let result = match item.error.take() {
                    Some(e) => Err(e),
                    None => {
                        let segments: Vec<Segment> = std::mem::take(&mut item.window_segments).into_iter().flatten().collect();
                        let text = segments.iter().map(|s| s.text.as_str()).collect::<Vec<_>>().join(" ");
                        let embedding = input.options.embed.then(|| embedding_of(std::mem::take(&mut item.pooled)));
                        Ok(Transcript {
                            embedding,
                            text,
                            language: item.language.as_ref().map(|(_, c)| c.clone()).unwrap_or_else(|| "en".into()),
                            duration: input.pcm.len() as f64 / m::SAMPLE_RATE as f64,
                            segments,
                        })
                    }
                };
                // Marked failed so that rows still decoding for it are ignored.
                item.error = Some(anyhow!("answered"));
                done(i, result);
                false
            });
            // Done once everything is answered and `admit()`, asked at the top of this round,
            // had nothing more.
            if arrived == 0 && batch.is_idle() && queue.is_empty() && open.is_empty() {
                break;
            }
        }
        let stats = batch.stats();
        drop(batch);
        self.last_decode = stats;
    }

    /// The decoder prompt of an input whose language is resolved: its text prompt after
    /// `<|startofprev|>`, then the SOT sequence.
    fn prompt(&self, opts: &TranscribeOptions, item: &Pending) -> Vec<u32> {
        let mut prompt = Vec::new();
        if let (Some(prev), false) = (self.specials.prev, item.prompt.is_empty()) {
            prompt.push(prev);
            prompt.extend_from_slice(&item.prompt);
        }
        prompt.extend(self.sot_sequence(opts.task, item));
        if !opts.timestamps {
            prompt.push(self.specials.no_timestamps);
        }
        prompt
    }

    /// SOT, then the language and task tokens on multilingual models.
    fn sot_sequence(&self, task: Task, item: &Pending) -> Vec<u32> {
        let mut sequence = vec![self.specials.sot];
        if self.is_multilingual() {
            sequence.extend(item.language.as_ref().and_then(|(token, _)| *token));
            sequence.extend(match task {
                Task::Transcribe => self.specials.transcribe,
                Task::Translate => self.specials.translate,
            });
        }
        sequence
    }

    /// The tokens of the text prompt (` ` and the trimmed text, as OpenAI's), its last 223:
    /// with the SOT sequence and 224 sampled tokens they fit the 448-token context.
    fn prompt_tokens(&self, opts: &TranscribeOptions) -> Result<Vec<u32>> {
        let Some(text) = opts.prompt.as_deref().map(str::trim).filter(|t| !t.is_empty()) else { return Ok(Vec::new()) };
        if self.specials.prev.is_none() {
            bail!("this model's vocabulary has no <|startofprev|> token to take a prompt");
        }
        let encoding = self.tokenizer.encode(format!(" {text}"), false).map_err(|e| anyhow!("tokenizing the prompt: {e}"))?;
        let ids = encoding.get_ids();
        let keep = self.decoder.max_positions() / 2 - 1;
        Ok(ids[ids.len().saturating_sub(keep)..].to_vec())
    }

    /// Takes in a decoded piece of audio: its segments go to its window, the untranscribed end
    /// of a window's first pass goes back to the queue, and so does a trimmed window whose
    /// greedy decode looked wrong (`None`: a loop, low confidence), over the full 30 s as
    /// Whisper was trained, before any temperature fallback.
    fn finish_work(
        &self,
        inputs: &[Option<TranscribeInput<'_>>],
        work: Work,
        decoded: Option<decode::Decoded>,
        items: &mut [Pending],
        queue: &mut VecDeque<Work>,
        progress: &mut dyn FnMut(usize, Progress<'_>),
    ) {
        let item = &mut items[work.input];
        if item.error.is_some() {
            return;
        }
        let Some(d) = decoded else {
            queue.push_front(Work { positions: FULL_POSITIONS, ..work });
            return;
        };
        let sr = m::SAMPLE_RATE as f64;
        let (start, end) = work.range;
        let mut segments = Vec::new();
        if !d.is_silence() {
            let found = self.segments_of(&d.tokens, start as f64 / sr, end as f64 / sr).and_then(|mut timed| {
                if let Some((cross, features)) = &d.audio {
                    let task = input_of(inputs, work.input).options.task;
                    self.time_words(task, item, work.range, cross, features, &mut timed)?;
                }
                Ok(timed)
            });
            match found {
                Ok(timed) => segments.extend(timed.into_iter().map(|(s, _)| s).filter(|s| !s.text.is_empty())),
                Err(e) => {
                    item.error = Some(e);
                    return;
                }
            }
        }
        // Whisper may end a window early, at a timestamp well before its end, leaving speech
        // after it untranscribed (OpenAI's loop resumes the next window from that timestamp).
        // Such a tail runs again on its own.
        if !work.tail {
            if let Some(last) = segments.last() {
                let tail = (((last.end * sr) as usize).clamp(start, end), end);
                let input = input_of(inputs, work.input);
                if untranscribed_speech(&input.pcm, work.range, tail) {
                    let positions = encoder_positions(input.options.padding, tail.1 - tail.0);
                    queue.push_front(Work { range: tail, positions, tail: true, ..work });
                    item.open[work.window] += 1;
                }
            }
        }
        item.window_segments[work.window].extend(segments);
        item.open[work.window] -= 1;
        if item.open[work.window] == 0 {
            item.done += 1;
            while item.leading < item.total && item.open[item.leading] == 0 {
                for s in &item.window_segments[item.leading] {
                    if !item.text.is_empty() {
                        item.text.push(' ');
                    }
                    item.text.push_str(&s.text);
                }
                item.leading += 1;
            }
            progress(work.input, Progress { done: item.done, total: item.total, text: &item.text });
        }
    }

    /// Times the words of a window's `segments` (each with its text tokens): one decoder pass
    /// over the SOT sequence, `<|notimestamps|>`, the text and EOT keeps the alignment heads'
    /// cross-attention over the window's audio (`range`, samples of the recording), which
    /// [`words`] aligns to the tokens.
    fn time_words(
        &self,
        task: Task,
        item: &Pending,
        range: (usize, usize),
        cross: &decoder::CrossKv,
        features: &candle_core::Tensor,
        segments: &mut [(Segment, Vec<u32>)],
    ) -> Result<()> {
        let text: Vec<u32> = segments.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        if text.is_empty() {
            return Ok(());
        }
        let sot = self.sot_sequence(task, item);
        let eot = self.specials.eot;
        let mut tokens = sot.clone();
        tokens.push(self.specials.no_timestamps);
        tokens.extend_from_slice(&text);
        tokens.push(eot);
        // The encoder positions that hold the window's audio (two mel frames each).
        let positions = ((range.1 - range.0) / m::HOP_LENGTH / 2).max(1).min(features.dim(0)?);
        if positions == 0 {
            return Ok(());
        }
        let features = features.narrow(0, 0, positions)?;
        let (heads, hidden) = self.decoder.cross_weights(&tokens, cross, &features, &self.alignment_heads)?;
        let matrix = words::Attention { heads }.matrix(sot.len());
        let cost: Vec<Vec<f32>> = matrix.into_iter().map(|row| row.into_iter().map(|x| -x).collect()).collect();
        let path = words::dtw(&cost);
        // Each text token's probability among the text tokens, from the position before it.
        let (_, len, d) = hidden.dims3()?;
        let rows = hidden.narrow(1, sot.len(), text.len().min(len - sot.len()))?.reshape(((), 1, d))?;
        let probabilities: Vec<f64> = self
            .decoder
            .logits_vecs(&rows, 0)?
            .iter()
            .zip(&text)
            .map(|(logits, &t)| {
                let text_logits = &logits[..eot as usize];
                f64::from(text_logits[t as usize] - tern_kernels::cpu_kernels::log_sum_exp(text_logits)).exp().clamp(0.0, 1.0)
            })
            .collect();
        let mut with_eot = text.clone();
        with_eot.push(eot);
        let language = item.language.as_ref().map_or("en", |(_, code)| code.as_str());
        let spaces = !matches!(language, "zh" | "ja" | "th" | "lo" | "my" | "yue");
        let decode = |ids: &[u32]| self.tokenizer.decode(ids, false).unwrap_or_default();
        let split = words::split_words(&with_eot, eot, spaces, &decode);
        let mut timings = words::timings(&split, &path, &probabilities);
        let median = words::tidy(&mut timings);
        let sr = m::SAMPLE_RATE as f64;
        let (offset, window_end) = (range.0 as f64 / sr, range.1 as f64 / sr);
        let mut places: Vec<_> = segments.iter_mut().map(|(s, t)| (&mut s.start, &mut s.end, t.len(), &mut s.words)).collect();
        words::place(&timings, median, offset, &mut places, offset);
        for (s, _) in segments.iter_mut() {
            s.end = s.end.min(window_end);
            s.start = s.start.clamp(offset, s.end);
        }
        Ok(())
    }

    /// The language to decode with: `None` when it must be detected from the first window.
    fn resolve_language(&self, opts: &TranscribeOptions) -> Result<Option<(Option<u32>, String)>> {
        if !self.is_multilingual() {
            // English-only models take no language or task token.
            return Ok(Some((None, "en".to_string())));
        }
        match &opts.language {
            Some(code) => {
                let id = self
                    .languages
                    .iter()
                    .find(|(_, c)| c == code)
                    .map(|(id, _)| *id)
                    .ok_or_else(|| anyhow!("unknown language code {code:?}"))?;
                Ok(Some((Some(id), code.clone())))
            }
            None => Ok(None),
        }
    }

    /// Encodes the audio of `works` and returns each one's cross-attention keys/values (one
    /// row each; none for a window that is embedded, not decoded), detecting the language of
    /// inputs that need it from their first window. A window whose input asks for word
    /// timestamps or an embedding also gets its encoder output.
    #[allow(clippy::type_complexity)]
    fn encode(&self, inputs: &[Option<TranscribeInput<'_>>], works: &[Work], items: &mut [Pending]) -> Result<Vec<(Option<decoder::CrossKv>, Option<candle_core::Tensor>)>> {
        let positions: Vec<usize> = works.iter().map(|w| w.positions).collect();
        // Windows run through the encoder in groups (see `encoder_groups`); a window shorter
        // than its group's longest gets zero mel frames after its own, which the encoder
        // ignores, and the decoder attends to its own frames only.
        let mut crosses: Vec<Option<decoder::CrossKv>> = vec![None; works.len()];
        let mut features: Vec<Option<candle_core::Tensor>> = vec![None; works.len()];
        // The encoder output of a window is kept for word timestamps and for embeddings.
        let keeps_features = |r: usize| {
            let options = &input_of(inputs, works[r].input).options;
            options.word_timestamps || options.embed
        };
        // Only windows that decode attend to their encoder output; the cross-attention keys and
        // values of an embedded window would be projections for nothing.
        let decodes = |r: usize| !input_of(inputs, works[r].input).options.embed;
        let mixed = self.encoder.takes_lengths();
        // Where the encoder and the cross-attention take windows end to end, all of them go
        // through as one group with no padding at all.
        let ragged = self.encoder.takes_ragged() && self.decoder.packs_cross();
        let groups = if ragged {
            vec![(0..works.len()).collect()]
        } else {
            encoder_groups(&positions, mixed)
        };
        for rows in groups {
            let longest = rows.iter().map(|&r| positions[r]).max().unwrap_or(0);
            let (config, filters, device) = (&self.config, &self.filters, &self.device);
            // Each window's spectrogram is a serial FFT loop: one window per core.
            let mels = rows
                .par_iter()
                .map(|&r| {
                    let input = input_of(inputs, works[r].input);
                    mel::window_mel(config, filters, &input.pcm, works[r].range, 2 * positions[r], input.options.feature_padding, device)
                })
                .collect::<Result<Vec<_>>>()?;
            // The places in the group of the windows that decode, in order: the cross-attention's
            // rows.
            let decoding: Vec<usize> = (0..rows.len()).filter(|&k| decodes(rows[k])).collect();
            let cross = if ragged {
                let (encoded, lens) = self.encoder.forward_ragged(&mels)?;
                drop(mels);
                let (mut kept, mut kept_lens) = (Vec::with_capacity(decoding.len()), Vec::with_capacity(decoding.len()));
                let mut at = 0;
                for (k, &r) in rows.iter().enumerate() {
                    let window = encoded.narrow(0, at, lens[k])?;
                    if keeps_features(r) {
                        // A copy: a view would keep the whole group's output alive.
                        features[r] = Some(window.copy()?);
                    }
                    if decodes(r) {
                        kept.push(window);
                        kept_lens.push(lens[k]);
                    }
                    at += lens[k];
                }
                if kept.len() == rows.len() {
                    drop(kept);
                    Some(self.decoder.cross_kv_ragged(&encoded, &lens)?)
                } else if kept.is_empty() {
                    None
                } else {
                    Some(self.decoder.cross_kv_ragged(&candle_core::Tensor::cat(&kept, 0)?, &kept_lens)?)
                }
            } else {
                let mels = mels
                    .iter()
                    .zip(&rows)
                    .map(|(mel, &r)| mel.pad_with_zeros(2, 0, 2 * (longest - positions[r])))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                let lens: Vec<usize> = rows.iter().map(|&r| positions[r]).collect();
                let encoded = self.encoder.forward(&candle_core::Tensor::cat(&mels, 0)?, mixed.then_some(lens.as_slice()))?;
                drop(mels);
                for (k, &r) in rows.iter().enumerate() {
                    if keeps_features(r) {
                        features[r] = Some(encoded.get(k)?.narrow(0, 0, lens[k])?.copy()?);
                    }
                }
                if decoding.len() == rows.len() {
                    Some(self.decoder.cross_kv(&encoded, Some(&lens))?)
                } else if decoding.is_empty() {
                    None
                } else {
                    let kept: Vec<u32> = decoding.iter().map(|&k| k as u32).collect();
                    let lens: Vec<usize> = decoding.iter().map(|&k| lens[k]).collect();
                    let encoded = encoded.index_select(&candle_core::Tensor::new(kept.as_slice(), encoded.device())?, 0)?;
                    Some(self.decoder.cross_kv(&encoded, Some(&lens))?)
                }
            };
            if let Some(cross) = cross {
                for (row, &k) in decoding.iter().enumerate() {
                    crosses[rows[k]] = Some(cross.row(row)?);
                }
            }
        }
        for (work, cross) in works.iter().zip(&crosses) {
            if let (None, Some(cross)) = (&items[work.input].language, cross) {
                let (id, code) = self.detect_language(cross)?;
                items[work.input].language = Some((Some(id), code));
            }
        }
        Ok(crosses.into_iter().zip(features).collect())
    }

    /// Splits a window's tokens at timestamp tokens into segments, each with its text tokens;
    /// text after the last timestamp (or a window without timestamps) runs to the window end.
    /// Segments whose text is blank are kept (their tokens count for word timestamps), with
    /// empty text.
    fn segments_of(&self, tokens: &[u32], offset: f64, window_end: f64) -> Result<Vec<(Segment, Vec<u32>)>> {
        let mut out = Vec::new();
        let tb = self.specials.timestamp_begin;
        let mut seg_start = offset;
        let mut text_tokens: Vec<u32> = Vec::new();
        let mut flush = |text_tokens: &mut Vec<u32>, start: f64, end: f64| -> Result<()> {
            if text_tokens.is_empty() {
                return Ok(());
            }
            let text = self
                .tokenizer
                .decode(text_tokens, true)
                .map_err(|e| anyhow!("detokenizing: {e}"))?;
            let text = text.trim().to_string();
            let start = start.min(window_end);
            out.push((Segment { start, end: end.clamp(start, window_end), text, words: None }, std::mem::take(text_tokens)));
            Ok(())
        };
        for &t in tokens {
            if t >= tb {
                let time = offset + (t - tb) as f64 * TIMESTAMP_STEP;
                flush(&mut text_tokens, seg_start, time)?;
                seg_start = time;
            } else if t < self.specials.eot {
                text_tokens.push(t);
            }
        }
        flush(&mut text_tokens, seg_start, window_end)?;
        Ok(out)
    }
}

/// A window's encoder output `(positions, d_model)` summed over the positions that hold its
/// audio (`range`, samples; 320 per position), and their count.
fn pool(features: Option<&candle_core::Tensor>, range: (usize, usize)) -> Result<(Vec<f32>, usize, (usize, usize))> {
    let features = features.context("an embedded window keeps its encoder output")?;
    let audio = (range.1 - range.0).div_ceil(2 * m::HOP_LENGTH).clamp(1, features.dim(0)?);
    let sum = features.narrow(0, 0, audio)?.to_dtype(DType::F32)?.sum(0)?.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    Ok((sum, audio, range))
}

/// A recording's [`AudioEmbedding`] from its windows' pooled sums: each window's mean, and the
/// mean over every audio position of the recording, each scaled to unit length.
fn embedding_of(pooled: Vec<Option<(Vec<f32>, usize, (usize, usize))>>) -> AudioEmbedding {
    let sr = m::SAMPLE_RATE as f64;
    let mut total: Vec<f32> = Vec::new();
    let mut windows = Vec::new();
    for (sum, positions, range) in pooled.into_iter().flatten() {
        if total.is_empty() {
            total = vec![0.0; sum.len()];
        }
        total.iter_mut().zip(&sum).for_each(|(t, s)| *t += s);
        let mean = sum.iter().map(|s| s / positions as f32).collect();
        windows.push(WindowEmbedding { start: range.0 as f64 / sr, end: range.1 as f64 / sr, vector: unit(mean) });
    }
    AudioEmbedding { vector: unit(total), windows }
}

#[cfg(test)]
mod tests {
    use super::{encoder_groups, m, window_cuts, windows_for};

    /// `seconds` of a 440 Hz tone ("speech") with silent gaps at `gaps` (start, end) seconds.
    fn speech_with_gaps(seconds: f64, gaps: &[(f64, f64)]) -> Vec<f32> {
        let sr = m::SAMPLE_RATE as f64;
        (0..(seconds * sr) as usize)
            .map(|i| {
                let t = i as f64 / sr;
                if gaps.iter().any(|&(a, b)| t >= a && t < b) { 0.0 } else { (t * 440.0 * std::f64::consts::TAU).sin() as f32 * 0.3 }
            })
            .collect()
    }

    /// The cuts tile the audio in windows of at most 30 s, each but the last at least 25 s, at
    /// least as many as the audio costs.
    fn check_tiling(pcm: &[f32], cuts: &[(usize, usize)]) {
        assert!(cuts.len() >= windows_for(pcm.len() as f64 / m::SAMPLE_RATE as f64), "{cuts:?}");
        assert_eq!(cuts[0].0, 0);
        assert_eq!(cuts.last().unwrap().1, pcm.len());
        for pair in cuts.windows(2) {
            assert_eq!(pair[0].1, pair[1].0, "{cuts:?}");
        }
        assert!(cuts.iter().all(|(a, b)| b > a && b - a <= m::N_SAMPLES), "{cuts:?}");
        assert!(cuts[..cuts.len() - 1].iter().all(|(a, b)| b - a >= m::N_SAMPLES - super::CUT_LOOKBACK_SAMPLES), "{cuts:?}");
    }

    #[test]
    fn cuts_land_in_pauses_and_tile_the_audio() {
        let sr = m::SAMPLE_RATE as f64;
        // 100 s. Pauses at 27.0-27.4 s and 55.0-55.5 s; the first window could end anywhere
        // from 25 s to 30 s and takes the pause, the second (from 27.2 s) takes its own.
        let pcm = speech_with_gaps(100.0, &[(27.0, 27.4), (55.0, 55.5)]);
        let cuts = window_cuts(&pcm);
        check_tiling(&pcm, &cuts);
        let first = cuts[0].1 as f64 / sr;
        let second = cuts[1].1 as f64 / sr;
        assert!((27.0..27.4).contains(&first), "first cut at {first} s");
        assert!((55.0..55.5).contains(&second), "second cut at {second} s");
    }

    /// A recording whose length is a multiple of 30 s, with a pause 2 s before every 30 s mark:
    /// every cut still lands in a pause (cut to 30 s windows, as many as the recording costs,
    /// the cuts after the first few pauses had no room left and fell on the marks).
    #[test]
    fn every_cut_of_a_long_recording_finds_its_pause() {
        let sr = m::SAMPLE_RATE as f64;
        let pauses: Vec<(f64, f64)> = (1..20).map(|k| (28.0 * k as f64 - 0.4, 28.0 * k as f64)).collect();
        let pcm = speech_with_gaps(540.0, &pauses);
        let cuts = window_cuts(&pcm);
        check_tiling(&pcm, &cuts);
        assert!(cuts.len() > windows_for(540.0), "{} windows", cuts.len());
        for (k, &(_, end)) in cuts[..cuts.len() - 1].iter().enumerate() {
            let at = end as f64 / sr;
            assert!(pauses.iter().any(|&(a, b)| (a..b).contains(&at)), "cut {k} at {at} s, not in a pause");
        }
    }

    #[test]
    fn short_audio_is_one_window() {
        let short = speech_with_gaps(7.0, &[]);
        assert_eq!(window_cuts(&short), vec![(0, short.len())]);
        let whole = speech_with_gaps(30.0, &[]);
        assert_eq!(window_cuts(&whole), vec![(0, whole.len())]);
        assert_eq!(window_cuts(&[]), vec![(0, 0)]);
    }

    #[test]
    fn encoder_groups_bound_the_padding_or_keep_equal_lengths() {
        let positions = [300, 1500, 250, 290, 1500, 100, 241];
        // Longest first; a row joins while it is at least 80% of its group's longest.
        assert_eq!(encoder_groups(&positions, true), vec![vec![1, 4], vec![0, 3, 2, 6], vec![5]]);
        assert_eq!(encoder_groups(&positions, false), vec![vec![1, 4], vec![0], vec![3], vec![2], vec![6], vec![5]]);
        assert!(encoder_groups(&[], true).is_empty());
    }
}
