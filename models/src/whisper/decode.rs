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
    /// Log-probability of the tokens and EOT over their count (OpenAI's and faster-whisper's).
    pub avg_logprob: f64,
    /// [`compression_ratio`] of the text.
    pub compression_ratio: f64,
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

/// The token rules of faster-whisper's decoder (CTranslate2's `disable_ids`,
/// `disable_ids_begin` and `ApplyTimestampRules`, themselves OpenAI's `SuppressTokens`,
/// `SuppressBlank` and `ApplyTimestampRules`) on one logits row.
///
/// One rule differs from OpenAI's, as CTranslate2 has it: a timestamp may equal the one
/// before it after text (OpenAI demands a later one, so no segment has zero length).
fn apply_rules(logits: &mut [f32], sampled: &[u32], sp: &Specials, timestamps: bool) {
    let neg = f32::NEG_INFINITY;
    let n = logits.len();
    let vocab = n as u32;
    for &t in &sp.suppress {
        if t < vocab {
            logits[t as usize] = neg;
        }
    }
    if sp.suppress.is_empty() {
        // Without the model's list, no special token but EOT is sampled.
        for t in (sp.eot + 1)..sp.timestamp_begin.min(vocab) {
            logits[t as usize] = neg;
        }
    }
    if sp.no_timestamps < vocab {
        logits[sp.no_timestamps as usize] = neg;
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
    if sampled.is_empty() {
        // The first token is a timestamp, at most 1 s in.
        logits[..tb].fill(neg);
        let max_initial = tb + MAX_INITIAL_TIMESTAMP_INDEX as usize;
        if max_initial + 1 < logits.len() {
            logits[max_initial + 1..].fill(neg);
        }
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
        // Timestamps never decrease.
        logits[tb..(last_ts as usize).min(n)].fill(neg);
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

/// OpenAI's and faster-whisper's compression ratio: bytes of the text over bytes of its zlib
/// stream (level 6, zlib's default). A looping output compresses well and scores high; speech
/// stays near 1 to 2.
pub(crate) fn compression_ratio(text: &str) -> f64 {
    let bytes = text.as_bytes();
    if bytes.is_empty() {
        return 0.0;
    }
    bytes.len() as f64 / miniz_oxide::deflate::compress_to_vec_zlib(bytes, 6).len() as f64
}

/// Whether a decoding looks degenerate (OpenAI's `needs_fallback`): too repetitive or too
/// unsure, unless it is silence, where retrying only produces other hallucinations.
fn needs_fallback(d: &Decoded) -> bool {
    let degenerate = d.compression_ratio > COMPRESSION_RATIO_THRESHOLD || d.avg_logprob < LOGPROB_THRESHOLD;
    degenerate && !(d.no_speech_prob > NO_SPEECH_THRESHOLD && d.avg_logprob < LOGPROB_THRESHOLD)
}

/// The `k` likeliest tokens of a logits row, likeliest first.
fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        if l == f32::NEG_INFINITY || (top.len() == k && l <= top[k - 1].1) {
            continue;
        }
        let at = top.partition_point(|&(_, t)| t >= l);
        top.insert(at, (i as u32, l));
        top.truncate(k);
    }
    top
}

/// A window to decode: its cross-attention keys/values (one row), prompt and options.
#[derive(Clone)]
pub(crate) struct Window {
    /// The caller's name for the window, handed back with its result.
    pub tag: usize,
    pub cross: CrossKv,
    pub prompt: Vec<u32>,
    pub timestamps: bool,
    /// The first temperature tried: 0 decodes greedily, or by beam search.
    pub temperature: f64,
    /// Hypotheses a beam search keeps at temperature 0 (1: greedy). Sampling at a temperature
    /// above 0 draws one.
    pub beam_size: usize,
    /// Whether a window that decodes badly runs again 0.2 hotter (OpenAI's fallback).
    pub fallback: bool,
    /// The window's encoder output `(frames, d_model)`, kept where word timestamps are asked
    /// for: handed back with its result.
    pub features: Option<Tensor>,
    /// Seeds the sampling of the temperature fallback.
    pub seed: u64,
    /// Give up (result `None`) instead of the temperature fallback when its first decoding
    /// looks degenerate: the caller has a better retry (the full 30 s of a trimmed window).
    pub give_up: bool,
}

/// One hypothesis of a window, holding one row of the decoder batch.
#[derive(Clone)]
struct Beam {
    /// The prompt, then the tokens sampled so far.
    tokens: Vec<u32>,
    /// Log-probability of the sampled tokens.
    sum_logprob: f64,
}

/// A window in the running batch, at one temperature.
struct Row {
    window: Window,
    temperature: f64,
    rng: Rng,
    /// Its hypotheses, one decoder row each, all of the same length: one until its first
    /// token, then up to [`Row::width`].
    beams: Vec<Beam>,
    /// Where each beam's cache comes from among the beams before the last step; `None` where
    /// every beam extends its own.
    sources: Option<Vec<usize>>,
    /// Finished hypotheses: sampled tokens without EOT, log-probability with it.
    done: Vec<(Vec<u32>, f64)>,
    /// Tokens fed through the decoder so far (the same for every beam).
    fed: usize,
    no_speech_prob: f64,
    /// The best degenerate result of the lower temperatures.
    best: Option<Decoded>,
    /// Finished: it stays in a batch whose rows cannot join until it compacts.
    finished: bool,
    /// Its result was handed out.
    reported: bool,
}

impl Row {
    fn new(window: Window, temperature: f64, rng: Rng, best: Option<Decoded>) -> Row {
        let beams = vec![Beam { tokens: window.prompt.clone(), sum_logprob: 0.0 }];
        Row { window, temperature, rng, beams, sources: None, done: Vec::new(), fed: 0, no_speech_prob: 0.0, best, finished: false, reported: false }
    }

    /// Hypotheses kept: the beam size at temperature 0, else one sample.
    fn width(&self) -> usize {
        if self.temperature > 0.0 { 1 } else { self.window.beam_size.max(1) }
    }

    /// Whether the token just fed was the SOT, where OpenAI reads the no-speech probability.
    fn just_fed_sot(&self, sp: &Specials) -> bool {
        sp.no_speech.is_some() && self.fed > 0 && self.window.prompt.iter().position(|&t| t == sp.sot) == Some(self.fed - 1)
    }

    /// Its result: of the finished hypotheses the one with the best log-probability per token
    /// (length penalty 1, faster-whisper's default; OpenAI's ranking without one).
    fn decoded(&self, text: &dyn Fn(&[u32]) -> String) -> Decoded {
        let best = self
            .done
            .iter()
            .max_by(|a, b| (a.1 / a.0.len().max(1) as f64).total_cmp(&(b.1 / b.0.len().max(1) as f64)))
            .cloned()
            .unwrap_or_default();
        let (tokens, sum) = best;
        Decoded {
            avg_logprob: sum / (tokens.len() + 1) as f64,
            compression_ratio: compression_ratio(text(&tokens).trim()),
            tokens,
            no_speech_prob: self.no_speech_prob,
            audio: None,
        }
    }

    /// Its result with what it keeps for word timestamps.
    fn answer(&self, mut d: Decoded) -> Decoded {
        d.audio = self.window.features.clone().map(|f| (self.window.cross.clone(), f));
        d
    }

    /// Takes the logits of its beams after a step that fed the SOT or the end of what it was
    /// fed, and picks: the greedy or sampled token, or the next beams as faster-whisper's
    /// beam search (CTranslate2's `BeamSearch`, patience 1, length penalty 1): of the `2 *
    /// width` likeliest continuations of all beams, the first `width` go on, but those ending
    /// in EOT, which finish and leave their place to the next continuation that does not end.
    /// The search ends once `width` hypotheses have finished.
    fn advance(&mut self, mut logits: Vec<Vec<f32>>, sp: &Specials, max_ctx: usize) {
        if let (Some(ns), true, Some(first)) = (sp.no_speech, self.just_fed_sot(sp), logits.first()) {
            self.no_speech_prob = f64::from(first[ns as usize] - log_sum_exp(first)).exp();
        }
        if self.fed < self.beams[0].tokens.len() {
            return;
        }
        let width = self.width();
        let begin = self.window.prompt.len();
        // (log-probability of the hypothesis, beam it extends, token)
        let mut candidates: Vec<(f64, usize, u32)> = Vec::new();
        for (j, (beam, logits)) in self.beams.iter().zip(logits.iter_mut()).enumerate() {
            apply_rules(logits, &beam.tokens[begin..], sp, self.window.timestamps);
            let lse = log_sum_exp(logits);
            if width == 1 {
                let next = pick(logits, self.temperature, &mut self.rng);
                candidates.push((beam.sum_logprob + f64::from(logits[next as usize] - lse), j, next));
            } else {
                candidates.extend(top_k(logits, 2 * width).into_iter().map(|(t, l)| (beam.sum_logprob + f64::from(l - lse), j, t)));
            }
        }
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
        candidates.truncate(2 * width);
        let mut beams = Vec::with_capacity(width);
        let mut sources = Vec::with_capacity(width);
        let mut spare = width;
        for k in 0..width.min(candidates.len()) {
            let mut chosen = candidates[k];
            if chosen.2 == sp.eot {
                self.done.push((self.beams[chosen.1].tokens[begin..].to_vec(), chosen.0));
                match candidates[spare.min(candidates.len())..].iter().position(|c| c.2 != sp.eot) {
                    Some(at) => {
                        chosen = candidates[spare + at];
                        spare += at + 1;
                    }
                    None => {
                        spare = candidates.len();
                        continue;
                    }
                }
            }
            let (score, j, token) = chosen;
            let from = &self.beams[j];
            let mut tokens = Vec::with_capacity(from.tokens.len() + 1);
            tokens.extend_from_slice(&from.tokens);
            tokens.push(token);
            beams.push(Beam { tokens, sum_logprob: score });
            sources.push(j);
        }
        let full = beams.first().is_none_or(|b| b.tokens.len() - begin >= SAMPLE_LEN || b.tokens.len() >= max_ctx);
        if self.done.len() >= width || full {
            if full {
                // Out of room: the beams still open count as finished.
                self.done.extend(beams.iter().map(|b| (b.tokens[begin..].to_vec(), b.sum_logprob)));
            }
            // Its caches stay as they are until it leaves the batch.
            self.finished = true;
            return;
        }
        let moved = sources.len() != self.beams.len() || sources.iter().enumerate().any(|(k, &j)| k != j);
        self.sources = moved.then_some(sources);
        self.beams = beams;
    }
}

/// Decoding of many windows at once, one token per hypothesis per step (self-attention
/// cache): greedy, by beam search, or sampled, with OpenAI's temperature fallback. Each window
/// stops at its own end and, where the decoder keeps one cache per row and packed
/// cross-attention (F32 on CPUs with AVX-512 BF16), leaves the batch at once, and a window
/// waiting takes its place at the next step: the short clips of a batch end many steps
/// before its longest, and every step costs in proportion to its rows. Elsewhere windows join
/// only an empty batch, and finished ones are fed EOT (outputs ignored) until they are a
/// quarter of it, then leave together.
///
/// A window's result does not depend on the windows decoding beside it: each feeds its own
/// prompt, keeps its own seed, and (with one cache per row) attends over its own positions.
pub(crate) struct WindowBatch<'a> {
    decoder: &'a Decoder,
    sp: &'a Specials,
    /// Text of sampled tokens, for the compression ratio.
    text: &'a (dyn Fn(&[u32]) -> String + Sync),
    capacity: usize,
    rows: Vec<Row>,
    kv: SelfKv,
    /// One row per hypothesis of the rows, in row order; `None` while it must be rebuilt.
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
    /// An empty batch of at most `capacity` windows (at least 1); a window searching with `n`
    /// beams holds `n` decoder rows.
    pub fn new(decoder: &'a Decoder, sp: &'a Specials, text: &'a (dyn Fn(&[u32]) -> String + Sync), capacity: usize) -> Self {
        WindowBatch { decoder, sp, text, capacity: capacity.max(1), rows: Vec::new(), kv: decoder.new_self_kv(), cross: None, waiting: Default::default(), stats: DecodeStats::default() }
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

    /// Windows decoding now.
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

    /// Seats waiting windows in free rows (one decoder row each until their first token).
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

    /// Brings the caches in line with the rows: each beam search's beams take the caches of
    /// the beams they extend, and finished windows leave (at once where rows join, else once
    /// they are a quarter of the batch). `held[r]` is the decoder rows row `r` held.
    fn rearrange(&mut self, held: &[usize]) -> Result<()> {
        let finished = self.rows.iter().filter(|r| r.finished).count();
        let leave = finished > 0 && (self.rows_join() || finished * 4 >= self.rows.len() || finished == self.rows.len());
        if !leave && self.rows.iter().all(|r| r.sources.is_none()) {
            return Ok(());
        }
        let mut gather = Vec::new();
        let mut at = 0;
        for (r, &n) in self.rows.iter_mut().zip(held) {
            if !(leave && r.finished) {
                match r.sources.take() {
                    Some(sources) => gather.extend(sources.iter().map(|&j| at + j)),
                    None => gather.extend(at..at + n),
                }
            }
            at += n;
        }
        if leave {
            self.rows.retain(|r| !r.finished);
        }
        if self.rows.is_empty() {
            self.cross = None;
            self.kv = self.decoder.new_self_kv();
            return Ok(());
        }
        self.kv.select(&gather)?;
        self.cross = Some(self.cross.as_ref().expect("rows have keys").select(&gather)?);
        Ok(())
    }

    /// Seats waiting windows, feeds every hypothesis its next token, and samples where the
    /// prompt is fed. Returns the windows that finished: `(tag, result)`, `None` for a window
    /// that gave up (see [`Window::give_up`]).
    pub fn step(&mut self) -> Result<Vec<(usize, Option<Decoded>)>> {
        self.seat()?;
        if self.rows.is_empty() {
            return Ok(Vec::new());
        }
        let sp = self.sp;
        let held: Vec<usize> = self.rows.iter().map(|r| r.beams.len()).collect();
        let tokens: Vec<u32> = self.rows.iter().flat_map(|r| r.beams.iter().map(move |b| b.tokens.get(r.fed).copied().unwrap_or(sp.eot))).collect();
        let hidden = self.decoder.step(&tokens, self.cross.as_ref().expect("rows have keys"), &mut self.kv)?;
        self.stats.steps += 1;
        // Logits only for rows that read them: at the SOT (no-speech probability) or at the
        // end of what they were fed (the next token).
        let mut wanted: Vec<u32> = Vec::new();
        let mut at = 0;
        let is_wanted: Vec<bool> = self
            .rows
            .iter_mut()
            .zip(&held)
            .map(|(r, &n)| {
                r.fed += 1;
                let want = !r.finished && (r.just_fed_sot(sp) || r.fed == r.beams[0].tokens.len());
                if want {
                    wanted.extend((at..at + n).map(|k| k as u32));
                }
                at += n;
                want
            })
            .collect();
        let mut logits = if wanted.is_empty() {
            Vec::new()
        } else {
            let index = Tensor::from_vec(wanted.clone(), wanted.len(), hidden.device())?;
            self.decoder.logits_vecs(&hidden.index_select(&index, 0)?, 0)?
        }
        .into_iter();
        let max_ctx = self.decoder.max_positions();
        let picked: Vec<(&mut Row, Vec<Vec<f32>>)> = self
            .rows
            .iter_mut()
            .zip(is_wanted)
            .zip(&held)
            .filter(|((_, w), _)| *w)
            .map(|((r, _), &n)| (r, logits.by_ref().take(n).collect()))
            .collect();
        // The rules and picks of the windows are independent: a few passes over 51k logits
        // per hypothesis.
        picked.into_par_iter().for_each(|(r, logits)| r.advance(logits, sp, max_ctx));
        let mut out = Vec::new();
        let mut rerun = Vec::new();
        for r in self.rows.iter_mut().filter(|r| r.finished && !r.reported) {
            r.reported = true;
            let d = r.decoded(self.text);
            if !needs_fallback(&d) {
                out.push((r.window.tag, Some(r.answer(d))));
                continue;
            }
            let first_pass = r.best.is_none();
            if first_pass && r.window.give_up {
                out.push((r.window.tag, None));
                continue;
            }
            // Of the degenerate results, the likeliest of those not too repetitive (faster-
            // whisper's choice when every temperature fails).
            let rank = |d: &Decoded| (d.compression_ratio <= COMPRESSION_RATIO_THRESHOLD, d.avg_logprob);
            let best = match r.best.take() {
                Some(b) if rank(&b).0 > rank(&d).0 || (rank(&b).0 == rank(&d).0 && b.avg_logprob >= d.avg_logprob) => b,
                _ => d,
            };
            let next = r.temperature + TEMPERATURE_STEP;
            if !r.window.fallback || next > MAX_TEMPERATURE + 1e-6 {
                out.push((r.window.tag, Some(r.answer(best))));
                continue;
            }
            // The sampler goes on from where this temperature left it, as OpenAI's does.
            rerun.push(Row::new(r.window.clone(), next, r.rng.clone(), Some(best)));
        }
        self.waiting.extend(rerun);
        self.rearrange(&held)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_ratio_flags_loops() {
        let speech = "He was not an ill-disposed young man, unless to be rather cold hearted and rather selfish is to be ill-disposed.";
        assert!(compression_ratio(speech) < 1.5, "{}", compression_ratio(speech));
        let looped = "and then the, ".repeat(12);
        assert!(compression_ratio(&looped) > COMPRESSION_RATIO_THRESHOLD, "{}", compression_ratio(&looped));
        assert_eq!(compression_ratio(""), 0.0);
    }

    #[test]
    fn top_k_takes_the_likeliest_first_and_skips_suppressed() {
        let logits = [0.5, f32::NEG_INFINITY, 2.0, -1.0, 1.5, 2.0];
        assert_eq!(top_k(&logits, 3), vec![(2, 2.0), (5, 2.0), (4, 1.5)]);
        assert_eq!(top_k(&[f32::NEG_INFINITY, 0.0], 4), vec![(1, 0.0)]);
    }
}
