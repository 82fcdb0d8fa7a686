//! Greedy decoding of one 30 s window, with OpenAI's token rules (suppression, timestamp pairing)
//! applied on the CPU logits vector, and temperature fallback.

use anyhow::Result;
use candle_core::Tensor;
use rayon::prelude::*;

use super::decoder::{CrossKv, Decoder, SelfKv};
use tern_kernels::cpu_kernels::log_sum_exp;

/// Special token ids and suppression lists, resolved once at load time.
#[derive(Debug, Clone)]
pub(crate) struct Specials {
    pub sot: u32,
    pub eot: u32,
    pub transcribe: Option<u32>,
    pub translate: Option<u32>,
    pub no_timestamps: u32,
    /// First timestamp token (`<|0.00|>`); each later id is +0.02 s.
    pub timestamp_begin: u32,
    pub no_speech: Option<u32>,
    /// `<|startofprev|>`: a text prompt follows it, before the SOT.
    pub prev: Option<u32>,
    /// From config.json `suppress_ids`: never sampled.
    pub suppress: Vec<u32>,
    /// From config.json `suppress_ids_begin`: not sampled as the first token (blank, EOT).
    pub suppress_begin: Vec<u32>,
}

/// Whisper's limit of sampled tokens per window (half the 448-token text context).
pub(crate) const SAMPLE_LEN: usize = 224;
/// Latest first timestamp allowed (1.0 s, in 0.02 s steps), as OpenAI's `max_initial_timestamp`.
const MAX_INITIAL_TIMESTAMP_INDEX: u32 = 50;
/// Fallback thresholds and temperatures from OpenAI's `transcribe()`: a window that decodes
/// badly runs again at its temperature plus 0.2, up to 1.0.
const TEMPERATURE_STEP: f64 = 0.2;
const MAX_TEMPERATURE: f64 = 1.0;
const LOGPROB_THRESHOLD: f64 = -1.0;
const COMPRESSION_RATIO_THRESHOLD: f64 = 2.4;
pub(crate) const NO_SPEECH_THRESHOLD: f64 = 0.6;

/// Result of decoding one window.
#[derive(Clone)]
pub(crate) struct Decoded {
    /// Sampled tokens, without the prompt and without EOT.
    pub tokens: Vec<u32>,
    pub avg_logprob: f64,
    pub no_speech_prob: f64,
    /// The window's keys/values and encoder output, handed back where it asked for word
    /// timestamps ([`Window::features`]).
    pub audio: Option<(CrossKv, Tensor)>,
}

impl Decoded {
    /// Whether this is likely silence that Whisper hallucinated over (OpenAI's no-speech rule).
    pub fn is_silence(&self) -> bool {
        self.no_speech_prob > NO_SPEECH_THRESHOLD && self.avg_logprob < LOGPROB_THRESHOLD
    }
}

/// Small deterministic PRNG (xorshift64*) for temperature sampling: reproducible runs without
/// another dependency.
#[derive(Clone)]
struct Rng(u64);
impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&l| l - lse).collect()
}

/// OpenAI's `SuppressTokens`, `SuppressBlank` and `ApplyTimestampRules` on one logits row.
fn apply_rules(logits: &mut [f32], sampled: &[u32], sp: &Specials, timestamps: bool) {
    let neg = f32::NEG_INFINITY;
    let n = logits.len();
    let vocab = n as u32;
    for &t in &sp.suppress {
        if t < vocab {
            logits[t as usize] = neg;
        }
    }
    // Special tokens other than EOT (sot, task, language, no-speech, notimestamps) are prompt
    // tokens only.
    for t in (sp.eot + 1)..sp.timestamp_begin.min(vocab) {
        logits[t as usize] = neg;
    }
    if sampled.is_empty() {
        for &t in &sp.suppress_begin {
            if t < vocab {
                logits[t as usize] = neg;
            }
        }
    }
    let tb = sp.timestamp_begin as usize;
    if !timestamps {
        logits[tb.min(n)..].fill(neg);
        return;
    }
    let is_ts = |t: u32| t >= sp.timestamp_begin;
    let last_was_ts = sampled.last().is_some_and(|&t| is_ts(t));
    let penult_was_ts = sampled.len() < 2 || is_ts(sampled[sampled.len() - 2]);
    if last_was_ts {
        if penult_was_ts {
            // A segment just closed and reopened: text must follow.
            logits[tb..].fill(neg);
        } else {
            // A segment's text just ended: the next token is a timestamp or EOT.
            logits[..sp.eot as usize].fill(neg);
        }
    }
    if let Some(&last_ts) = sampled.iter().rev().find(|&&t| is_ts(t)) {
        // Timestamps never decrease, and segments have nonzero length.
        let floor = if last_was_ts && !penult_was_ts {
            last_ts
        } else {
            last_ts + 1
        };
        logits[tb..(floor as usize).min(n)].fill(neg);
    }
    if sampled.is_empty() {
        // The first token is a timestamp, at most 1 s in.
        logits[..tb].fill(neg);
        let max_initial = tb + MAX_INITIAL_TIMESTAMP_INDEX as usize;
        if max_initial + 1 < logits.len() {
            logits[max_initial + 1..].fill(neg);
        }
    }
    // If timestamps together are likelier than any single text token, force a timestamp.
    // (Compared on raw logits: the log-softmax shifts both sides by the same amount.)
    let ts_lse = log_sum_exp(&logits[tb..]);
    let text_max = logits[..tb].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if ts_lse > text_max {
        logits[..tb].fill(neg);
    }
}

/// Picks the next token: argmax at temperature 0, else a sample from softmax(logits / t).
fn pick(logits: &[f32], temperature: f64, rng: &mut Rng) -> u32 {
    if temperature <= 0.0 {
        return logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap_or(0);
    }
    let scaled: Vec<f32> = logits.iter().map(|&l| l / temperature as f32).collect();
    let lp = log_softmax(&scaled);
    let mut r = rng.next_f64();
    for (i, &l) in lp.iter().enumerate() {
        r -= (l as f64).exp();
        if r <= 0.0 {
            return i as u32;
        }
    }
    // Rounding left a little mass: take the argmax.
    pick(logits, 0.0, rng)
}

/// Crude stand-in for OpenAI's gzip compression ratio, to catch repetition loops without a
/// compression dependency: tokens / distinct token 3-grams. A looping output scores high; normal
/// speech stays near 1.
fn repetition_ratio(tokens: &[u32]) -> f64 {
    if tokens.len() < 6 {
        return 1.0;
    }
    let grams: std::collections::HashSet<&[u32]> = tokens.windows(3).collect();
    tokens.len() as f64 / (grams.len() + 2) as f64
}

fn needs_fallback(d: &Decoded) -> bool {
    let degenerate = repetition_ratio(&d.tokens) > COMPRESSION_RATIO_THRESHOLD
        || d.avg_logprob < LOGPROB_THRESHOLD;
    // Silence: retrying only produces other hallucinations.
    degenerate && d.no_speech_prob <= NO_SPEECH_THRESHOLD
}

/// A window to decode: its cross-attention keys/values (one row), prompt and options.
#[derive(Clone)]
pub(crate) struct Window {
    /// The caller's name for the window, handed back with its result.
    pub tag: usize,
    pub cross: CrossKv,
    pub prompt: Vec<u32>,
    pub timestamps: bool,
    /// The first temperature tried: 0 decodes greedily.
    pub temperature: f64,
    /// The window's encoder output `(frames, d_model)`, kept where word timestamps are asked
    /// for: handed back with its result.
    pub features: Option<Tensor>,
    /// Seeds the sampling of the temperature fallback.
    pub seed: u64,
    /// Give up (result `None`) instead of the temperature fallback when greedy decoding looks
    /// degenerate: the caller has a better retry (the full 30 s of a trimmed window).
    pub give_up: bool,
}

/// A window in the running batch, at one temperature.
struct Row {
    window: Window,
    temperature: f64,
    rng: Rng,
    /// The prompt, then the tokens sampled so far.
    tokens: Vec<u32>,
    /// Tokens fed through the decoder so far.
    fed: usize,
    sum_logprob: f64,
    no_speech_prob: f64,
    /// The best degenerate result of the lower temperatures.
    best: Option<Decoded>,
    /// Sampled EOT or its last token; it stays in a batch whose rows cannot join until it
    /// compacts.
    finished: bool,
    /// Its result was handed out.
    reported: bool,
}

impl Row {
    fn new(window: Window, temperature: f64, rng: Rng, best: Option<Decoded>) -> Row {
        let tokens = window.prompt.clone();
        Row { window, temperature, rng, tokens, fed: 0, sum_logprob: 0.0, no_speech_prob: 0.0, best, finished: false, reported: false }
    }

    /// Whether the token just fed was the SOT, where OpenAI reads the no-speech probability.
    fn just_fed_sot(&self, sp: &Specials) -> bool {
        sp.no_speech.is_some() && self.fed > 0 && self.window.prompt.iter().position(|&t| t == sp.sot) == Some(self.fed - 1)
    }

    fn sampled(&self) -> &[u32] {
        &self.tokens[self.window.prompt.len()..]
    }

    fn decoded(&self) -> Decoded {
        let tokens = self.sampled().to_vec();
        Decoded { avg_logprob: self.sum_logprob / tokens.len().max(1) as f64, tokens, no_speech_prob: self.no_speech_prob, audio: None }
    }

    /// Its result with what it keeps for word timestamps.
    fn answer(&self, mut d: Decoded) -> Decoded {
        d.audio = self.window.features.clone().map(|f| (self.window.cross.clone(), f));
        d
    }
}

/// Greedy decoding of many windows at once, one token per row per step (self-attention
/// cache), with OpenAI's temperature fallback. Each row stops at its own EOT and, where the
/// decoder keeps one cache per row and packed cross-attention (F32 on CPUs with AVX-512 BF16),
/// leaves the batch at once, and a window waiting takes its place at the next step: the short
/// clips of a batch end many steps before its longest, and every step costs in proportion to
/// its rows. Elsewhere rows join only an empty batch, and finished rows are fed EOT (outputs
/// ignored) until they are a quarter of it, then leave together.
///
/// A row's result does not depend on the rows decoding beside it: each row feeds its own
/// prompt, keeps its own seed, and (with one cache per row) attends over its own positions.
pub(crate) struct WindowBatch<'a> {
    decoder: &'a Decoder,
    sp: &'a Specials,
    capacity: usize,
    rows: Vec<Row>,
    kv: SelfKv,
    /// The rows' cross-attention keys/values, in row order; `None` while it must be rebuilt.
    cross: Option<CrossKv>,
    /// Windows waiting for a row: new ones and fallbacks at the next temperature.
    waiting: std::collections::VecDeque<Row>,
    stats: DecodeStats,
}

/// What a [`WindowBatch`] did: for logs, and to tell that rows joined running batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Decoding steps taken (each one token for every row).
    pub steps: usize,
    /// Windows seated, fallback reruns included.
    pub seated: usize,
    /// Of those, windows that joined while other rows were decoding.
    pub joined_running: usize,
}

impl<'a> WindowBatch<'a> {
    /// An empty batch of at most `capacity` rows (at least 1).
    pub fn new(decoder: &'a Decoder, sp: &'a Specials, capacity: usize) -> Self {
        WindowBatch { decoder, sp, capacity: capacity.max(1), rows: Vec::new(), kv: decoder.new_self_kv(), cross: None, waiting: Default::default(), stats: DecodeStats::default() }
    }

    /// Whether windows join while others decode: one cache per row, and cross-attention keys
    /// that join without copies.
    fn rows_join(&self) -> bool {
        self.kv.per_row() && self.decoder.packs_cross()
    }

    /// How many more windows [`Self::add`] may take now: free rows not claimed by waiting
    /// windows, or 0 while a batch whose rows cannot join is running.
    pub fn room(&self) -> usize {
        if !self.rows.is_empty() && !self.rows_join() {
            return 0;
        }
        self.capacity.saturating_sub(self.rows.len() + self.waiting.len())
    }

    /// What the batch did so far.
    pub fn stats(&self) -> DecodeStats {
        self.stats
    }

    /// Rows decoding now.
    pub fn running(&self) -> usize {
        self.rows.len()
    }

    /// Whether no window is decoding or waiting.
    pub fn is_idle(&self) -> bool {
        self.rows.is_empty() && self.waiting.is_empty()
    }

    /// Queues a window; it starts decoding at the next step with room.
    pub fn add(&mut self, window: Window) {
        let (rng, temperature) = (Rng(window.seed | 1), window.temperature);
        self.waiting.push_back(Row::new(window, temperature, rng, None));
    }

    /// Takes every window out, decoding or waiting; the tags of those not reported yet. For a
    /// failed step.
    pub fn drain(&mut self) -> Vec<usize> {
        self.cross = None;
        self.kv = self.decoder.new_self_kv();
        self.rows.drain(..).chain(self.waiting.drain(..)).filter(|r| !r.reported).map(|r| r.window.tag).collect()
    }

    /// Seats waiting windows in free rows.
    fn seat(&mut self) -> Result<()> {
        let joins = self.rows_join();
        if self.waiting.is_empty() || (!self.rows.is_empty() && !joins) {
            return Ok(());
        }
        let free = self.capacity.saturating_sub(self.rows.len()).min(self.waiting.len());
        let mut seated: Vec<Row> = self.waiting.drain(..free).collect();
        if seated.is_empty() {
            return Ok(());
        }
        if self.rows.is_empty() {
            self.kv = self.decoder.new_self_kv();
            self.cross = None;
        }
        if self.kv.per_row() {
            // Prompts of several tokens (multilingual models) go through in one pass but for
            // their last token, which the next step feeds and samples after.
            seated.sort_by_key(|r| r.window.prompt.len());
            for same in seated.chunk_by_mut(|a, b| a.window.prompt.len() == b.window.prompt.len()) {
                let len = same[0].window.prompt.len();
                let room = (len + SAMPLE_LEN).min(self.decoder.max_positions());
                if len < 2 {
                    same.iter().for_each(|_| self.decoder.push_row(&mut self.kv, room));
                    continue;
                }
                let fed = len - 1;
                let tokens: Vec<u32> = same.iter().flat_map(|r| r.window.prompt[..fed].iter().copied()).collect();
                let tokens = Tensor::from_vec(tokens, (same.len(), fed), self.decoder.device())?;
                let cross = CrossKv::join(&same.iter().map(|r| &r.window.cross).collect::<Vec<_>>())?;
                let hidden = self.decoder.prefill_rows(&tokens, &cross, &mut self.kv, room)?;
                let sot = same[0].window.prompt.iter().position(|&t| t == self.sp.sot);
                if let (Some(ns), Some(sot)) = (self.sp.no_speech, sot.filter(|&p| p < fed)) {
                    // OpenAI reads the no-speech probability at the SOT position.
                    for (r, l) in same.iter_mut().zip(self.decoder.logits_vecs(&hidden, sot)?) {
                        r.no_speech_prob = f64::from(l[ns as usize] - log_sum_exp(&l)).exp();
                    }
                }
                same.iter_mut().for_each(|r| r.fed = fed);
            }
        }
        let mut parts: Vec<&CrossKv> = Vec::with_capacity(2);
        if let Some(c) = &self.cross {
            parts.push(c);
        }
        parts.extend(seated.iter().map(|r| &r.window.cross));
        let cross = CrossKv::join(&parts)?;
        self.cross = Some(cross);
        self.stats.seated += seated.len();
        if !self.rows.is_empty() {
            self.stats.joined_running += seated.len();
        }
        self.rows.extend(seated);
        Ok(())
    }

    /// Drops finished rows from the batch: at once where rows join, else once they are a
    /// quarter of it.
    fn compact(&mut self) -> Result<()> {
        let finished = self.rows.iter().filter(|r| r.finished).count();
        if finished == 0 || (!self.rows_join() && finished * 4 < self.rows.len() && finished < self.rows.len()) {
            return Ok(());
        }
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&j| !self.rows[j].finished).collect();
        if keep.is_empty() {
            self.rows.clear();
            self.cross = None;
            self.kv = self.decoder.new_self_kv();
            return Ok(());
        }
        self.kv.select(&keep)?;
        self.cross = Some(self.cross.as_ref().expect("rows have keys").select(&keep)?);
        let mut rows: Vec<Option<Row>> = std::mem::take(&mut self.rows).into_iter().map(Some).collect();
        self.rows = keep.iter().map(|&j| rows[j].take().expect("kept once")).collect();
        Ok(())
    }

    /// Seats waiting windows, feeds every row its next token, and samples where the prompt is
    /// fed. Returns the windows that finished: `(tag, result)`, `None` for a window that gave
    /// up (see [`Window::give_up`]).
    pub fn step(&mut self) -> Result<Vec<(usize, Option<Decoded>)>> {
        self.seat()?;
        if self.rows.is_empty() {
            return Ok(Vec::new());
        }
        let sp = self.sp;
        let tokens: Vec<u32> = self.rows.iter().map(|r| r.tokens.get(r.fed).copied().unwrap_or(sp.eot)).collect();
        let hidden = self.decoder.step(&tokens, self.cross.as_ref().expect("rows have keys"), &mut self.kv)?;
        self.stats.steps += 1;
        // Logits only for rows that read them: at the SOT (no-speech probability) or at the
        // end of what they were fed (the next token).
        let is_wanted: Vec<bool> = self
            .rows
            .iter_mut()
            .map(|r| {
                r.fed += 1;
                !r.finished && (r.just_fed_sot(sp) || r.fed == r.tokens.len())
            })
            .collect();
        let wanted: Vec<usize> = (0..is_wanted.len()).filter(|&j| is_wanted[j]).collect();
        let logits = if wanted.is_empty() {
            Vec::new()
        } else {
            let index = Tensor::from_vec(wanted.iter().map(|&j| j as u32).collect::<Vec<_>>(), wanted.len(), hidden.device())?;
            self.decoder.logits_vecs(&hidden.index_select(&index, 0)?, 0)?
        };
        let max_ctx = self.decoder.max_positions();
        let picked: Vec<&mut Row> = self.rows.iter_mut().zip(is_wanted).filter(|(_, w)| *w).map(|(r, _)| r).collect();
        // The rules and picks of the rows are independent: a few passes over 51k logits each.
        picked.into_par_iter().zip(logits).for_each(|(r, mut logits)| {
            if let (Some(ns), true) = (sp.no_speech, r.just_fed_sot(sp)) {
                r.no_speech_prob = f64::from(logits[ns as usize] - log_sum_exp(&logits)).exp();
            }
            if r.fed < r.tokens.len() {
                return;
            }
            apply_rules(&mut logits, r.sampled(), sp, r.window.timestamps);
            let next = pick(&logits, r.temperature, &mut r.rng);
            if next == sp.eot {
                r.finished = true;
                return;
            }
            r.sum_logprob += f64::from(logits[next as usize] - log_sum_exp(&logits));
            r.tokens.push(next);
            if r.sampled().len() >= SAMPLE_LEN || r.tokens.len() >= max_ctx {
                r.finished = true;
            }
        });
        let mut out = Vec::new();
        let mut rerun = Vec::new();
        for r in self.rows.iter_mut().filter(|r| r.finished && !r.reported) {
            r.reported = true;
            let d = r.decoded();
            if !needs_fallback(&d) {
                out.push((r.window.tag, Some(r.answer(d))));
                continue;
            }
            let first_pass = r.best.is_none();
            if first_pass && r.window.give_up {
                out.push((r.window.tag, None));
                continue;
            }
            let best = match r.best.take() {
                Some(b) if b.avg_logprob >= d.avg_logprob => b,
                _ => d,
            };
            let next = r.temperature + TEMPERATURE_STEP;
            if next > MAX_TEMPERATURE + 1e-6 {
                out.push((r.window.tag, Some(r.answer(best))));
                continue;
            }
            // The sampler goes on from where this temperature left it, as OpenAI's does.
            rerun.push(Row::new(r.window.clone(), next, r.rng.clone(), Some(best)));
        }
        self.waiting.extend(rerun);
        self.compact()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetition_ratio_flags_loops() {
        let normal: Vec<u32> = (0..40).collect();
        assert!(repetition_ratio(&normal) < 1.1);
        let looped: Vec<u32> = (0..40).map(|i| i % 3).collect();
        assert!(repetition_ratio(&looped) > COMPRESSION_RATIO_THRESHOLD);
    }
}
