//! Whisper speech-to-text on candle, loading faster-whisper (CTranslate2) model folders directly
//! so no converted copy of the weights is needed on disk.
//!
//! Audio is processed in fixed 30 s windows (Whisper's input size): each window is encoded,
//! decoded greedily with temperature fallback, and its segments are offset by the window start.

mod attention;
mod ct2;
mod decode;
mod decoder;
mod encoder;
mod mel;

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use candle_nn::VarBuilder;
use candle_transformers::models::whisper::{self as m, Config};

use crate::precision::Precision;
use tokenizers::Tokenizer;

use decode::Specials;

/// Length of one Whisper window in seconds: every window costs a full encoder pass.
const WINDOW_SECONDS: f64 = m::CHUNK_LENGTH as f64;
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
    /// How much of a short window's padding the encoder runs over. Default
    /// [`Padding::DEFAULT_TRIMMED`].
    pub padding: Padding,
}

impl Default for TranscribeOptions {
    /// Auto language, transcribe, timestamps on, padding trimmed to 2 s.
    fn default() -> Self {
        TranscribeOptions {
            language: None,
            task: Task::Transcribe,
            timestamps: true,
            padding: Padding::DEFAULT_TRIMMED,
        }
    }
}

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
    filters: Vec<f32>,
    device: Device,
    weights_bytes: u64,
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
    /// Trimmed with a 2 s margin.
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

/// Number of 30 s windows audio of `seconds` costs: `ceil(seconds / 30)`, at least 1 (empty or
/// sub-second audio still costs one encoder pass).
pub fn windows_for(seconds: f64) -> usize {
    if !seconds.is_finite() || seconds <= 0.0 {
        return 1;
    }
    ((seconds / WINDOW_SECONDS).ceil() as usize).max(1)
}

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

/// Sample range of window `w` of `pcm`.
fn window_bounds(pcm: &[f32], w: usize) -> (usize, usize) {
    let start = (w * m::N_SAMPLES).min(pcm.len());
    (start, (start + m::N_SAMPLES).min(pcm.len()))
}

/// A recording's transcript while [`Whisper::transcribe_many`] builds it.
struct Pending {
    /// Windows the recording costs.
    total: usize,
    /// `None` until detected from the first window.
    language: Option<(Option<u32>, String)>,
    segments: Vec<Segment>,
    error: Option<anyhow::Error>,
}

#[derive(serde::Deserialize)]
struct Ct2Config {
    #[serde(default)]
    suppress_ids: Vec<u32>,
    #[serde(default)]
    suppress_ids_begin: Vec<u32>,
    #[serde(default)]
    lang_ids: Vec<u32>,
}

fn token(tok: &Tokenizer, s: &str) -> Result<u32> {
    tok.token_to_id(s)
        .ok_or_else(|| anyhow!("tokenizer.json has no {s} token"))
}

impl Whisper {
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
        let ct2::Ct2Whisper {
            tensors,
            mut config,
        } = ct2::to_candle(&vars)?;
        drop(vars);
        let weights_bytes = tensors.values().map(|t| (t.elem_count() * dtype.size_in_bytes()) as u64).sum();

        let cfg_path = dir.join("config.json");
        let ct2_cfg: Ct2Config = serde_json::from_slice(
            &std::fs::read(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?,
        )
        .with_context(|| format!("parsing {}", cfg_path.display()))?;
        config.suppress_tokens = ct2_cfg.suppress_ids.clone();

        let tok_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow!("loading {}: {e}", tok_path.display()))?;

        let vb = VarBuilder::from_tensors(tensors, dtype, device);
        let decoder = decoder::Decoder::load(vb.pp("model.decoder"), &config)
            .context("building the whisper decoder")?;
        let encoder = encoder::Encoder::load(vb.pp("model.encoder"), &config)
            .context("building the whisper encoder")?;

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
            suppress: ct2_cfg.suppress_ids,
            suppress_begin: ct2_cfg.suppress_ids_begin,
        };
        // A vocabulary of 51864 is English-only; multilingual ones have the 99+ language tokens.
        let multilingual = config.vocab_size >= 51865;
        let languages = if multilingual {
            ct2_cfg
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
        Ok(Whisper {
            filters: mel::mel_filters(config.num_mel_bins),
            config,
            encoder,
            decoder,
            tokenizer,
            specials,
            languages,
            device: device.clone(),
            weights_bytes,
        })
    }

    /// Bytes of weights held (in the precision loaded).
    pub fn weights_bytes(&self) -> u64 {
        self.weights_bytes
    }

    /// Runs `windows` windows of silence through the encoder and one decoder step, the memory
    /// a batch of that size needs at its peak. A model that fails here is not fit to serve.
    pub fn warmup(&mut self, windows: usize) -> Result<()> {
        let silence = vec![0f32; m::N_SAMPLES];
        let mel = mel::window_mel(&self.config, &self.filters, &silence, m::N_FRAMES, &self.device)?;
        let mels = candle_core::Tensor::cat(&vec![mel; windows.max(1)], 0)?;
        let features = self.encoder.forward(&mels, None)?;
        drop(mels);
        let cross = self.decoder.cross_kv(&features, None)?;
        drop(features);
        let sot = vec![self.specials.sot; windows.max(1)];
        let input = candle_core::Tensor::from_vec(sot, (windows.max(1), 1), &self.device)?;
        let mut cache = self.decoder.new_cache();
        let ys = self.decoder.forward(&input, &cross, &mut cache)?;
        let logits = self.decoder.logits_vecs(&ys, 0)?;
        if logits.iter().flatten().any(|x| !x.is_finite()) {
            bail!("warmup produced non-finite logits");
        }
        Ok(())
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
    /// Audio is cut into consecutive 30 s windows (a word straddling a cut may be split or
    /// garbled); segment times are offset by the window start and clamped to the audio length.
    /// `progress(done_windows, total_windows)` is called once per window, in order; `total_windows`
    /// is [`windows_for`] of the duration. Up to 8 windows are encoded and decoded as one batch
    /// (one read of the decoder weights per step for all of them), so calls come in bursts.
    /// Greedy decoding, at most 224 tokens per window, with OpenAI's temperature fallback
    /// (0.2 ... 1.0) for windows that decode badly; windows judged silent (no-speech probability
    /// > 0.6 and low confidence) yield no segments.
    pub fn transcribe(
        &mut self,
        pcm: &[f32],
        opts: &TranscribeOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Transcript> {
        self.transcribe_many(&[(pcm, opts)], DECODE_BATCH, &|_| false, &mut |_, done, total| progress(done, total))
            .pop()
            .expect("one result per input")
    }

    /// Transcribes several recordings together: their windows, in input order, are encoded and
    /// decoded `window_batch` at a time (at least 1), so short clips share decoder steps. Each
    /// recording's transcript is the same as [`Whisper::transcribe`] gives for it alone: windows
    /// keep their own sampling seeds and the rows of a batch do not interact.
    /// `progress(input, done_windows, total_windows)` is called once per window.
    /// `canceled(input)` is asked before each batch of windows: a canceled input's remaining
    /// windows are skipped and its result is an error.
    /// One result per input, in order; an input that fails (say, an unknown language code) does
    /// not fail the others.
    pub fn transcribe_many(
        &mut self,
        inputs: &[(&[f32], &TranscribeOptions)],
        window_batch: usize,
        canceled: &dyn Fn(usize) -> bool,
        progress: &mut dyn FnMut(usize, usize, usize),
    ) -> Vec<Result<Transcript>> {
        let sr = m::SAMPLE_RATE;
        let mut items: Vec<Pending> = inputs
            .iter()
            .map(|(pcm, opts)| {
                let total = windows_for(pcm.len() as f64 / sr as f64);
                let (language, error) = match self.resolve_language(opts) {
                    Ok(l) => (l, None),
                    Err(e) => (None, Some(e)),
                };
                Pending { total, language, segments: Vec::new(), error }
            })
            .collect();
        let windows: Vec<(usize, usize)> = items
            .iter()
            .enumerate()
            .filter(|(_, it)| it.error.is_none())
            .flat_map(|(i, it)| (0..it.total).map(move |w| (i, w)))
            .collect();
        for chunk in windows.chunks(window_batch.max(1)) {
            for &(i, _) in chunk {
                if items[i].error.is_none() && canceled(i) {
                    items[i].error = Some(anyhow!("canceled"));
                }
            }
            // A failed or canceled input's remaining windows are skipped.
            let chunk: Vec<(usize, usize)> =
                chunk.iter().copied().filter(|&(i, _)| items[i].error.is_none()).collect();
            if chunk.is_empty() {
                continue;
            }
            if let Err(e) = self.run_windows(inputs, &chunk, &mut items, progress) {
                // Which row broke cannot be told apart: every input in the chunk fails.
                let message = format!("{e:#}");
                for &(i, _) in &chunk {
                    items[i].error.get_or_insert_with(|| anyhow!("{message}"));
                }
            }
        }
        inputs
            .iter()
            .zip(items)
            .map(|((pcm, _), it)| {
                if let Some(e) = it.error {
                    return Err(e);
                }
                let text = it.segments.iter().map(|s| s.text.as_str()).collect::<Vec<_>>().join(" ");
                Ok(Transcript {
                    text,
                    language: it.language.map(|(_, c)| c).unwrap_or_else(|| "en".into()),
                    duration: pcm.len() as f64 / sr as f64,
                    segments: it.segments,
                })
            })
            .collect()
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

    /// Encodes the windows of `chunk` over `positions[row]` encoder positions each and decodes
    /// them; `None` for a trimmed row whose greedy decode needs a fallback.
    fn encode_and_decode(
        &mut self,
        inputs: &[(&[f32], &TranscribeOptions)],
        chunk: &[(usize, usize)],
        positions: &[usize],
        items: &mut [Pending],
    ) -> Result<Vec<Option<decode::Decoded>>> {
        // Windows run through the encoder in groups (see `encoder_groups`); a window shorter
        // than its group's longest gets zero mel frames after its own, which the encoder ignores.
        let mut features: Vec<Option<candle_core::Tensor>> = vec![None; chunk.len()];
        let mixed = self.encoder.takes_lengths();
        for rows in encoder_groups(positions, mixed) {
            let longest = rows.iter().map(|&r| positions[r]).max().unwrap_or(0);
            let mels = rows
                .iter()
                .map(|&r| {
                    let (i, w) = chunk[r];
                    let pcm = inputs[i].0;
                    let (start, end) = window_bounds(pcm, w);
                    let p = positions[r];
                    let mel = mel::window_mel(&self.config, &self.filters, &pcm[start..end], 2 * p, &self.device)?;
                    Ok(mel.pad_with_zeros(2, 0, 2 * (longest - p))?)
                })
                .collect::<Result<Vec<_>>>()?;
            let lens: Vec<usize> = rows.iter().map(|&r| positions[r]).collect();
            let encoded =
                self.encoder.forward(&candle_core::Tensor::cat(&mels, 0)?, mixed.then_some(lens.as_slice()))?;
            for (k, &r) in rows.iter().enumerate() {
                features[r] = Some(encoded.narrow(0, k, 1)?.narrow(1, 0, positions[r])?);
            }
        }
        let mut features: Vec<candle_core::Tensor> =
            features.into_iter().map(|f| f.expect("every row has a length")).collect();
        // Rows encoded over fewer positions are zero-padded to the longest; the decoder masks
        // the padding, so a row decodes as it would alone.
        let longest = positions.iter().copied().max().unwrap_or(0);
        for (f, &p) in features.iter_mut().zip(positions) {
            if p < longest {
                let (b, _, d) = f.dims3()?;
                let pad = candle_core::Tensor::zeros((b, longest - p, d), f.dtype(), f.device())?;
                *f = candle_core::Tensor::cat(&[&*f, &pad], 1)?;
            }
        }
        let cross = self.decoder.cross_kv(&candle_core::Tensor::cat(&features, 0)?, Some(positions))?;
        drop(features);
        for (row, &(i, _)) in chunk.iter().enumerate() {
            if items[i].language.is_none() {
                let (id, code) = self.detect_language(&cross.row(row)?)?;
                items[i].language = Some((Some(id), code));
            }
        }
        // Rows that share a prompt decode together; prompts differ by language, task and
        // timestamps.
        let mut groups: Vec<(Vec<u32>, bool, Vec<usize>)> = Vec::new();
        for (row, &(i, _)) in chunk.iter().enumerate() {
            let opts = inputs[i].1;
            let (lang_token, _) = items[i].language.as_ref().expect("resolved above");
            let mut prompt = vec![self.specials.sot];
            if self.is_multilingual() {
                prompt.extend(lang_token);
                prompt.extend(match opts.task {
                    Task::Transcribe => self.specials.transcribe,
                    Task::Translate => self.specials.translate,
                });
            }
            if !opts.timestamps {
                prompt.push(self.specials.no_timestamps);
            }
            match groups.iter_mut().find(|(p, t, _)| *p == prompt && *t == opts.timestamps) {
                Some((_, _, rows)) => rows.push(row),
                None => groups.push((prompt, opts.timestamps, vec![row])),
            }
        }
        let mut decoded: Vec<Option<decode::Decoded>> = (0..chunk.len()).map(|_| None).collect();
        for (prompt, timestamps, rows) in groups {
            let selected;
            let rows_cross = if rows.len() == chunk.len() {
                &cross
            } else {
                selected = cross.select(&rows)?;
                &selected
            };
            // Seeds follow the window's place in its own recording, so batching cannot change
            // what a fallback samples.
            let seeds: Vec<u64> = rows.iter().map(|&r| chunk[r].1 as u64 + 1).collect();
            let trimmed: Vec<bool> = rows.iter().map(|&r| positions[r] < FULL_POSITIONS).collect();
            let out = decode::decode_with_fallback(
                &self.decoder,
                rows_cross,
                &prompt,
                &self.specials,
                timestamps,
                &seeds,
                &trimmed,
            )?;
            for (r, d) in rows.into_iter().zip(out) {
                decoded[r] = d;
            }
        }
        Ok(decoded)
    }

    /// Encodes and decodes one batch of windows (`(input, window)` pairs, each input's windows
    /// in order) and appends their segments to the inputs' items.
    fn run_windows(
        &mut self,
        inputs: &[(&[f32], &TranscribeOptions)],
        chunk: &[(usize, usize)],
        items: &mut [Pending],
        progress: &mut dyn FnMut(usize, usize, usize),
    ) -> Result<()> {
        let sr = m::SAMPLE_RATE;
        let positions: Vec<usize> = chunk
            .iter()
            .map(|&(i, w)| {
                let (start, end) = window_bounds(inputs[i].0, w);
                encoder_positions(inputs[i].1.padding, end - start)
            })
            .collect();
        let mut decoded = self.encode_and_decode(inputs, chunk, &positions, items)?;
        // A trimmed window whose greedy decode looks wrong (a loop, low confidence) runs again
        // over the full 30 s, as Whisper was trained, before any temperature fallback.
        let redo: Vec<usize> = (0..chunk.len()).filter(|&r| decoded[r].is_none()).collect();
        if !redo.is_empty() {
            let again: Vec<(usize, usize)> = redo.iter().map(|&r| chunk[r]).collect();
            let full = vec![FULL_POSITIONS; again.len()];
            for (r, d) in redo.into_iter().zip(self.encode_and_decode(inputs, &again, &full, items)?) {
                decoded[r] = d;
            }
        }
        for (&(i, w), d) in chunk.iter().zip(decoded) {
            let d = d.expect("every row decoded");
            let pcm = inputs[i].0;
            let (_, end) = window_bounds(pcm, w);
            if !d.is_silence() {
                let offset = (w * m::N_SAMPLES) as f64 / sr as f64;
                let mut segments = Vec::new();
                self.segments_of(&d.tokens, offset, end as f64 / sr as f64, &mut segments)?;
                items[i].segments.extend(segments);
            }
            progress(i, w + 1, items[i].total);
        }
        Ok(())
    }

    /// Splits a window's tokens at timestamp tokens into segments; text after the last
    /// timestamp (or a window without timestamps) runs to the window end.
    fn segments_of(
        &self,
        tokens: &[u32],
        offset: f64,
        window_end: f64,
        out: &mut Vec<Segment>,
    ) -> Result<()> {
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
            text_tokens.clear();
            let text = text.trim().to_string();
            if !text.is_empty() {
                let start = start.min(window_end);
                out.push(Segment {
                    start,
                    end: end.clamp(start, window_end),
                    text,
                });
            }
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::encoder_groups;

    #[test]
    fn encoder_groups_bound_the_padding_or_keep_equal_lengths() {
        let positions = [300, 1500, 250, 290, 1500, 100, 241];
        // Longest first; a row joins while it is at least 80% of its group's longest.
        assert_eq!(encoder_groups(&positions, true), vec![vec![1, 4], vec![0, 3, 2, 6], vec![5]]);
        assert_eq!(encoder_groups(&positions, false), vec![vec![1, 4], vec![0], vec![3], vec![2], vec![6], vec![5]]);
        assert!(encoder_groups(&[], true).is_empty());
    }
}
