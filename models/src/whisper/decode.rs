//! Decoding of 30 s windows, many at once: greedy, by beam search or sampled, with the token
//! rules of faster-whisper (suppression, timestamp pairing) and temperature fallback. The rules
//! run on host logits, or for greedy rows as masks on the device ([`DevicePicker`]).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
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

/// The tokens never sampled, whatever came before: the model's suppress list (without one,
/// every special token but EOT) and `<|notimestamps|>`.
fn suppress_always(logits: &mut [f32], sp: &Specials) {
    let neg = f32::NEG_INFINITY;
    let vocab = logits.len() as u32;
    for &t in &sp.suppress {
        if t < vocab {
            logits[t as usize] = neg;
        }
    }
    if sp.suppress.is_empty() {
        for t in (sp.eot + 1)..sp.timestamp_begin.min(vocab) {
            logits[t as usize] = neg;
        }
    }
    if sp.no_timestamps < vocab {
        logits[sp.no_timestamps as usize] = neg;
    }
}

/// The token rules of faster-whisper's decoder (CTranslate2's `disable_ids`,
/// `disable_ids_begin` and `ApplyTimestampRules`, themselves OpenAI's `SuppressTokens`,
/// `SuppressBlank` and `ApplyTimestampRules`) on one logits row: [`suppress_always`], the
/// first token's suppression, the limits of [`PickLimits::of`], then the forced timestamp.
fn apply_rules(logits: &mut [f32], sampled: &[u32], sp: &Specials, timestamps: bool) {
    let neg = f32::NEG_INFINITY;
    let n = logits.len();
    suppress_always(logits, sp);
    if sampled.is_empty() {
        for &t in &sp.suppress_begin {
            if (t as usize) < n {
                logits[t as usize] = neg;
            }
        }
    }
    let limits = PickLimits::of(sampled, sp, timestamps, n as u32);
    let tb = (sp.timestamp_begin as usize).min(n);
    logits[..(limits.low_from as usize).min(tb)].fill(neg);
    logits[tb..(limits.ts_from as usize).clamp(tb, n)].fill(neg);
    logits[(limits.ts_to as usize).clamp(tb, n)..].fill(neg);
    if !timestamps || sampled.is_empty() {
        return;
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

/// Where a hypothesis may pick its next token under the timestamp rules, from what it sampled
/// alone: the rules of [`apply_rules`] but the forced timestamp, which needs the logits. The
/// host ([`apply_rules`]) and the device ([`DevicePicker`]) both apply them. Token ids as F32
/// (exact below 2^24).
#[derive(Debug, Clone, Copy, PartialEq)]
struct PickLimits {
    /// Tokens below the first timestamp are allowed from this id (0: all; EOT: only EOT and
    /// after; the first timestamp: none).
    low_from: f32,
    /// Timestamps allowed: `[ts_from, ts_to)`.
    ts_from: f32,
    ts_to: f32,
    /// 1 at the first sampled token, where `suppress_begin` applies.
    begin: f32,
}

impl PickLimits {
    /// The limits for a hypothesis that has sampled `sampled` (prompt excluded).
    fn of(sampled: &[u32], sp: &Specials, timestamps: bool, vocab: u32) -> PickLimits {
        let (tb, v) = (sp.timestamp_begin as f32, vocab as f32);
        let begin = if sampled.is_empty() { 1.0 } else { 0.0 };
        if !timestamps {
            return PickLimits {
                low_from: 0.0,
                ts_from: v,
                ts_to: v,
                begin,
            };
        }
        if sampled.is_empty() {
            // The first token is a timestamp, at most 1 s in.
            let last = (sp.timestamp_begin + MAX_INITIAL_TIMESTAMP_INDEX + 1).min(vocab) as f32;
            return PickLimits {
                low_from: tb,
                ts_from: tb,
                ts_to: last,
                begin,
            };
        }
        let is_ts = |t: u32| t >= sp.timestamp_begin;
        let last_was_ts = sampled.last().is_some_and(|&t| is_ts(t));
        let penult_was_ts = sampled.len() < 2 || is_ts(sampled[sampled.len() - 2]);
        let mut limits = PickLimits {
            low_from: 0.0,
            ts_from: tb,
            ts_to: v,
            begin,
        };
        if last_was_ts {
            if penult_was_ts {
                // A segment just closed and reopened: text must follow.
                limits.ts_from = v;
            } else {
                // A segment's text just ended: the next token is a timestamp or EOT.
                limits.low_from = sp.eot as f32;
            }
        }
        if let Some(&last_ts) = sampled.iter().rev().find(|&&t| is_ts(t)) {
            // Timestamps never decrease (CTranslate2 allows an equal one after text, where
            // OpenAI demands a later one, so no segment has zero length).
            limits.ts_from = limits.ts_from.max(last_ts as f32);
        }
        limits
    }
}

/// Picks on the decoder's device: [`apply_rules`] as masks over the logits of all rows at
/// once, then the argmax (greedy, [`DevicePicker::pick`]) or beam search's candidates
/// ([`DevicePicker::top`]), so a step copies a few numbers per row to the host instead of
/// 51,864 logits, and the host does not read them. The tokens are those of the host path;
/// log-probabilities agree to rounding.
pub(crate) struct DevicePicker {
    /// `(1, vocab)` F32: 1 where a token below the first timestamp may be sampled at all.
    low_ok: Tensor,
    /// `(1, vocab)` F32: 1 at the timestamp tokens.
    timestamps: Tensor,
    /// `(1, vocab)` F32: 1 at the tokens not sampled first (`suppress_begin`).
    begin_bad: Tensor,
    /// `(1, vocab)` F32: the token ids.
    ids: Tensor,
    no_speech: Option<usize>,
}

/// What masks out a token: far below any logit, but finite, so that a row with nothing
/// allowed in a region still has a finite log-sum-exp.
const MASKED: f64 = -1e30;

impl DevicePicker {
    pub fn new(sp: &Specials, vocab: usize, device: &Device) -> Result<DevicePicker> {
        let tb = (sp.timestamp_begin as usize).min(vocab);
        let mut never = vec![0f32; vocab];
        suppress_always(&mut never, sp);
        let allowed = |region: std::ops::Range<usize>| -> Vec<f32> {
            never.iter().enumerate().map(|(i, &l)| if region.contains(&i) && l.is_finite() { 1.0 } else { 0.0 }).collect()
        };
        let (low, timestamps) = (allowed(0..tb), allowed(tb..vocab));
        let mut begin_bad = vec![0f32; vocab];
        for &t in &sp.suppress_begin {
            if (t as usize) < vocab {
                begin_bad[t as usize] = 1.0;
            }
        }
        let ids: Vec<f32> = (0..vocab).map(|i| i as f32).collect();
        let row = |v: Vec<f32>| Tensor::from_vec(v, (1, vocab), device);
        Ok(DevicePicker {
            low_ok: row(low)?,
            timestamps: row(timestamps)?,
            begin_bad: row(begin_bad)?,
            ids: row(ids)?,
            no_speech: sp.no_speech.map(|t| t as usize).filter(|&t| t < vocab),
        })
    }

    /// The vocabulary its masks span.
    fn vocab(&self) -> u32 {
        self.ids.dim(1).map_or(0, |v| v as u32)
    }

    /// `(token, log-probability after the rules, no-speech log-probability before them)` for
    /// each row of `logits` `(rows, vocab)`, under its limits.
    fn pick(&self, logits: &Tensor, limits: &[PickLimits]) -> Result<Vec<(u32, f32, f32)>> {
        let (ruled, no_speech) = self.ruled(logits, limits)?;
        let next = ruled.argmax_keepdim(1)?;
        let logprob = (ruled.gather(&next, 1)? - log_sum_exp_rows(&ruled)?)?;
        let out = Tensor::cat(&[next.to_dtype(DType::F32)?, logprob, no_speech], 1)?
            .to_device(&Device::Cpu)?
            .to_vec2::<f32>()?;
        Ok(out.into_iter().map(|r| (r[0] as u32, r[1], r[2])).collect())
    }

    /// Beam search's picks: each row's `k` likeliest tokens after the rules, likeliest first
    /// (the first of equal ones first, as [`top_k`]), with their log-probabilities, and the
    /// row's no-speech log-probability before the rules. `k` argmax passes over the rows, each
    /// masking the token it took, so a step copies `2k + 1` numbers a row instead of 51,864.
    /// Fewer than `k` where the rules allow fewer tokens.
    fn top(&self, logits: &Tensor, limits: &[PickLimits], k: usize) -> Result<Vec<(Vec<(u32, f32)>, f32)>> {
        let (ruled, no_speech) = self.ruled(logits, limits)?;
        let lse = log_sum_exp_rows(&ruled)?;
        let mut work = ruled;
        let mut columns = Vec::with_capacity(2 * k + 1);
        for i in 0..k {
            let next = work.argmax_keepdim(1)?;
            columns.push(next.to_dtype(DType::F32)?);
            columns.push((work.gather(&next, 1)? - &lse)?);
            if i + 1 < k {
                let taken = self.ids.broadcast_eq(&next.to_dtype(DType::F32)?)?.to_dtype(DType::F32)?;
                work = (work + taken.affine(MASKED, 0.0)?)?;
            }
        }
        columns.push(no_speech);
        let out = Tensor::cat(&columns, 1)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
        // A masked token's log-probability is about MASKED: the rules ruled it out.
        let allowed = (MASKED / 2.0) as f32;
        Ok(out
            .into_iter()
            .map(|r| {
                let top = r[..2 * k].chunks_exact(2).filter(|c| c[1] > allowed).map(|c| (c[0] as u32, c[1])).collect();
                (top, r[2 * k])
            })
            .collect())
    }

    /// The picks of a first step of `beams` hypotheses a row over `logits` (greedy for one), as
    /// a batch makes them, for a warmup to measure their memory; whether their
    /// log-probabilities came out finite.
    pub fn warm(&self, logits: &Tensor, sp: &Specials, beams: usize) -> Result<bool> {
        let limits = vec![PickLimits::of(&[], sp, true, self.vocab()); logits.dim(0)?];
        Ok(match beams {
            0 | 1 => self.pick(logits, &limits)?.iter().all(|p| p.1.is_finite() && p.2.is_finite()),
            _ => self.top(logits, &limits, 2 * beams)?.iter().all(|(top, ns)| ns.is_finite() && !top.is_empty() && top.iter().all(|c| c.1.is_finite())),
        })
    }

    /// The rows' logits with every token the rules rule out at [`MASKED`], and each row's
    /// no-speech log-probability before the rules, `(rows, 1)`.
    fn ruled(&self, logits: &Tensor, limits: &[PickLimits]) -> Result<(Tensor, Tensor)> {
        let rows = limits.len();
        let l = logits.to_dtype(DType::F32)?.contiguous()?;
        let flat: Vec<f32> = limits
            .iter()
            .flat_map(|m| [m.low_from, m.ts_from, m.ts_to, m.begin])
            .collect();
        let lim = Tensor::from_vec(flat, (rows, 4), l.device())?;
        let col = |i: usize| lim.narrow(1, i, 1);
        let at_least =
            |c: &Tensor| -> Result<Tensor> { Ok(self.ids.broadcast_ge(c)?.to_dtype(DType::F32)?) };
        let keep = col(3)?.broadcast_mul(&self.begin_bad)?.affine(-1.0, 1.0)?;
        let low = self
            .low_ok
            .broadcast_mul(&at_least(&col(0)?)?)?
            .mul(&keep)?;
        let below_to = self.ids.broadcast_lt(&col(2)?)?.to_dtype(DType::F32)?;
        let ts = self
            .timestamps
            .broadcast_mul(&at_least(&col(1)?)?)?
            .mul(&below_to)?
            .mul(&keep)?;
        let masked = |allowed: &Tensor| -> Result<Tensor> {
            Ok((l.mul(allowed)? + allowed.affine(-MASKED, MASKED)?)?)
        };
        let text_max = masked(&low)?.max_keepdim(1)?;
        let ts_lse = log_sum_exp_rows(&masked(&ts)?)?;
        // Timestamps forced where together likelier than any text token.
        let text_left = ts_lse
            .gt(&text_max)?
            .to_dtype(DType::F32)?
            .affine(-1.0, 1.0)?;
        let ruled = masked(&(ts + low.broadcast_mul(&text_left)?)?)?;
        let no_speech = match self.no_speech {
            Some(t) => (l.narrow(1, t, 1)? - log_sum_exp_rows(&l)?)?,
            None => Tensor::zeros((rows, 1), DType::F32, l.device())?,
        };
        Ok((ruled, no_speech))
    }
}

/// `log(sum(exp(x)))` over each row of `(rows, n)`, kept as `(rows, 1)`.
fn log_sum_exp_rows(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(1)?;
    Ok((x.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()? + max)?)
}

/// What a row picks from after a step.
enum Scores {
    /// The logits of each of its beams, on the host.
    Logits(Vec<Vec<f32>>),
    /// A greedy pick made by [`DevicePicker`].
    Picked {
        token: u32,
        logprob: f32,
        no_speech: f32,
    },
    /// Each beam's likeliest tokens after the rules, with their log-probabilities, picked by
    /// [`DevicePicker::top`]; the first beam's no-speech log-probability.
    Top {
        beams: Vec<Vec<(u32, f32)>>,
        no_speech: f32,
    },
}

/// Where a row's next tokens are picked.
#[derive(Clone, Copy)]
enum Route {
    /// On the host, from its beams' logits.
    Host,
    /// Greedily on the device ([`DevicePicker::pick`]).
    Picked,
    /// Beam search's candidates on the device ([`DevicePicker::top`]).
    Top,
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

    /// Whether it decodes greedily: one hypothesis at temperature 0, which [`DevicePicker`] can
    /// pick for.
    fn greedy(&self) -> bool {
        self.temperature <= 0.0 && self.width() == 1
    }

    /// Whether it decodes by beam search, whose candidates [`DevicePicker::top`] can pick.
    fn beam_search(&self) -> bool {
        self.temperature <= 0.0 && self.width() > 1
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

    /// Takes the logits of its beams (or the device's greedy pick) after a step that fed the SOT
    /// or the end of what it was fed, and picks: the greedy or sampled token, or the next beams as faster-whisper's
    /// beam search (CTranslate2's `BeamSearch`, patience 1, length penalty 1): of the `2 *
    /// width` likeliest continuations of all beams, the first `width` go on, but those ending
    /// in EOT, which finish and leave their place to the next continuation that does not end.
    /// The search ends once `width` hypotheses have finished.
    fn advance(&mut self, scores: Scores, sp: &Specials, max_ctx: usize) {
        if let (Some(ns), true) = (sp.no_speech, self.just_fed_sot(sp)) {
            let logprob = match &scores {
                Scores::Logits(logits) => logits.first().map(|first| first[ns as usize] - log_sum_exp(first)),
                Scores::Picked { no_speech, .. } | Scores::Top { no_speech, .. } => Some(*no_speech),
            };
            if let Some(l) = logprob {
                self.no_speech_prob = f64::from(l).exp();
            }
        }
        if self.fed < self.beams[0].tokens.len() {
            return;
        }
        let width = self.width();
        let begin = self.window.prompt.len();
        // (log-probability of the hypothesis, beam it extends, token)
        let mut candidates: Vec<(f64, usize, u32)> = Vec::new();
        match scores {
            Scores::Picked { token, logprob, .. } => candidates.push((self.beams[0].sum_logprob + f64::from(logprob), 0, token)),
            Scores::Top { beams, .. } => {
                for (j, (beam, top)) in self.beams.iter().zip(beams).enumerate() {
                    candidates.extend(top.into_iter().take(2 * width).map(|(t, l)| (beam.sum_logprob + f64::from(l), j, t)));
                }
            }
            Scores::Logits(mut logits) => {
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
    /// Picks greedy and beam-search rows' tokens on the device; `None`: every row's logits go
    /// to the host.
    picker: Option<&'a DevicePicker>,
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
    /// Rows (hypotheses) whose next tokens were picked on the device ([`DevicePicker`]) rather
    /// than from host logits, over all steps.
    pub picked_on_device: usize,
}

impl<'a> WindowBatch<'a> {
    /// An empty batch of at most `capacity` windows (at least 1); a window searching with `n`
    /// beams holds `n` decoder rows.
    pub fn new(decoder: &'a Decoder, sp: &'a Specials, text: &'a (dyn Fn(&[u32]) -> String + Sync), capacity: usize) -> Self {
        WindowBatch { decoder, sp, text, capacity: capacity.max(1), rows: Vec::new(), kv: decoder.new_self_kv(), cross: None, waiting: Default::default(), picker: None, stats: DecodeStats::default() }
    }

    /// Picks the tokens of greedy rows with `picker`, on the device, instead of on host logits.
    pub fn with_picker(mut self, picker: Option<&'a DevicePicker>) -> Self {
        self.picker = picker;
        self
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
        // end of what they were fed (the next token); greedy and beam rows picked on the device
        // where it can.
        let (mut on_host, mut on_device, mut on_device_beams): (Vec<u32>, Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new(), Vec::new());
        let (mut limits, mut beam_limits) = (Vec::new(), Vec::new());
        let mut top_k = 0;
        let vocab = self.picker.map_or(0, DevicePicker::vocab);
        let mut at = 0;
        let routes: Vec<Option<Route>> = self
            .rows
            .iter_mut()
            .zip(&held)
            .map(|(r, &n)| {
                r.fed += 1;
                let want = !r.finished && (r.just_fed_sot(sp) || r.fed == r.beams[0].tokens.len());
                let limits_of = |b: &Beam| PickLimits::of(b.tokens.get(r.window.prompt.len()..).unwrap_or_default(), sp, r.window.timestamps, vocab);
                let route = match self.picker {
                    Some(_) if r.greedy() && n == 1 => Route::Picked,
                    Some(_) if r.beam_search() => Route::Top,
                    _ => Route::Host,
                };
                if want {
                    match route {
                        Route::Picked => {
                            on_device.push(at as u32);
                            limits.push(limits_of(&r.beams[0]));
                        }
                        Route::Top => {
                            on_device_beams.extend((at..at + n).map(|k| k as u32));
                            beam_limits.extend(r.beams.iter().map(limits_of));
                            top_k = top_k.max(2 * r.width());
                        }
                        Route::Host => on_host.extend((at..at + n).map(|k| k as u32)),
                    }
                }
                at += n;
                want.then_some(route)
            })
            .collect();
        let select = |rows: Vec<u32>| -> Result<Tensor> {
            let n = rows.len();
            Ok(hidden.index_select(&Tensor::from_vec(rows, n, hidden.device())?, 0)?)
        };
        let mut host_logits = if on_host.is_empty() { Vec::new() } else { self.decoder.logits_vecs(&select(on_host)?, 0)? }.into_iter();
        let picks = match self.picker {
            Some(picker) if !on_device.is_empty() => picker.pick(&self.decoder.logits_on_device(&select(on_device)?, 0)?, &limits)?,
            _ => Vec::new(),
        };
        let tops = match self.picker {
            Some(picker) if !on_device_beams.is_empty() => picker.top(&self.decoder.logits_on_device(&select(on_device_beams)?, 0)?, &beam_limits, top_k)?,
            _ => Vec::new(),
        };
        self.stats.picked_on_device += picks.len() + tops.len();
        let mut picks = picks.into_iter();
        let mut tops = tops.into_iter();
        let max_ctx = self.decoder.max_positions();
        let picked: Vec<(&mut Row, Scores)> = self
            .rows
            .iter_mut()
            .zip(routes)
            .zip(&held)
            .filter_map(|((r, route), &n)| {
                let scores = match route? {
                    Route::Picked => {
                        let (token, logprob, no_speech) = picks.next().expect("a pick per device row");
                        Scores::Picked { token, logprob, no_speech }
                    }
                    Route::Top => {
                        let (beams, no_speech): (Vec<_>, Vec<f32>) = tops.by_ref().take(n).unzip();
                        Scores::Top { beams, no_speech: no_speech.first().copied().unwrap_or(0.0) }
                    }
                    Route::Host => Scores::Logits(host_logits.by_ref().take(n).collect()),
                };
                Some((r, scores))
            })
            .collect();
        // The rules and picks of the windows are independent: a few passes over 51k logits
        // per hypothesis on the host.
        picked.into_par_iter().for_each(|(r, scores)| r.advance(scores, sp, max_ctx));
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

    /// Specials of a 200-token vocabulary, laid out as Whisper's (timestamps last).
    fn small_vocabulary() -> (Specials, usize) {
        let sp = Specials {
            sot: 101,
            eot: 100,
            transcribe: Some(103),
            translate: Some(102),
            no_timestamps: 106,
            timestamp_begin: 107,
            no_speech: Some(105),
            prev: Some(104),
            suppress: vec![1, 5, 102, 104],
            suppress_begin: vec![50, 100],
        };
        (sp, 200)
    }

    /// 2,000 rows of peaked random logits (so that timestamps sometimes outweigh the text
    /// together), each with a random history of up to 6 tokens and timestamps on in 4 of 5.
    fn random_rows(vocab: usize) -> Vec<(Vec<f32>, Vec<u32>, bool)> {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut rows: Vec<(Vec<f32>, Vec<u32>, bool)> = Vec::new();
        for i in 0..2000 {
            let logits: Vec<f32> = (0..vocab)
                .map(|_| (rng.next_f64() * 8.0 - 4.0).powi(3) as f32 / 8.0)
                .collect();
            let len = i % 7;
            let sampled: Vec<u32> = (0..len)
                .map(|_| {
                    if rng.next_f64() < 0.5 {
                        (rng.next_f64() * 100.0) as u32
                    } else {
                        107 + (rng.next_f64() * 93.0) as u32
                    }
                })
                .collect();
            rows.push((logits, sampled, i % 5 != 0));
        }
        rows
    }

    /// Beam search's candidates picked on the device are the host's: the same tokens in the
    /// same order, log-probabilities to rounding, fewer where the rules allow fewer.
    #[test]
    fn device_top_candidates_are_the_hosts() {
        let (sp, vocab) = small_vocabulary();
        let picker = DevicePicker::new(&sp, vocab, &Device::Cpu).unwrap();
        let rows = random_rows(vocab);
        let limits: Vec<PickLimits> = rows.iter().map(|(_, s, ts)| PickLimits::of(s, &sp, *ts, vocab as u32)).collect();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.0.iter().copied()).collect();
        let k = 10;
        let tops = picker.top(&Tensor::from_vec(flat, (rows.len(), vocab), &Device::Cpu).unwrap(), &limits, k).unwrap();
        let mut fewer = 0;
        for ((logits, sampled, timestamps), (top, no_speech)) in rows.iter().zip(tops) {
            let mut l = logits.clone();
            apply_rules(&mut l, sampled, &sp, *timestamps);
            let lse = log_sum_exp(&l);
            let want = top_k(&l, k);
            let tokens = |t: &[(u32, f32)]| t.iter().map(|c| c.0).collect::<Vec<_>>();
            assert_eq!(tokens(&top), tokens(&want), "history {sampled:?}, timestamps {timestamps}");
            for (&(_, got), &(_, logit)) in top.iter().zip(&want) {
                assert!((got - (logit - lse)).abs() < 1e-4, "{got} against {}", logit - lse);
            }
            assert!((no_speech - (logits[105] - log_sum_exp(logits))).abs() < 1e-4);
            fewer += usize::from(want.len() < k);
        }
        // Some rows' rules allow fewer tokens than asked for.
        assert!(fewer > 10, "{fewer}");
    }

    /// The warmup's picks run for greedy and beam rows, and tell non-finite logits.
    #[test]
    fn warm_picks_tell_non_finite_logits() {
        let (sp, vocab) = small_vocabulary();
        let picker = DevicePicker::new(&sp, vocab, &Device::Cpu).unwrap();
        let mut flat: Vec<f32> = random_rows(vocab).into_iter().take(6).flat_map(|r| r.0).collect();
        let logits = |flat: &[f32]| Tensor::from_slice(flat, (6, vocab), &Device::Cpu).unwrap();
        for beams in [1, 5] {
            assert!(picker.warm(&logits(&flat), &sp, beams).unwrap(), "beams {beams}");
        }
        flat[3 * vocab + 120] = f32::NAN;
        for beams in [1, 5] {
            assert!(!picker.warm(&logits(&flat), &sp, beams).unwrap(), "beams {beams}, a NaN");
        }
    }

    /// Random logits over a small vocabulary, where every rule binds often: the device's masks
    /// pick the token the host's rules pick, with its log-probability, after every kind of
    /// history (none, text, one or two timestamps), with and without timestamps.
    #[test]
    fn device_picks_apply_the_host_rules() {
        let (sp, vocab) = small_vocabulary();
        let picker = DevicePicker::new(&sp, vocab, &Device::Cpu).unwrap();
        let rows = random_rows(vocab);
        let limits: Vec<PickLimits> = rows
            .iter()
            .map(|(_, s, ts)| PickLimits::of(s, &sp, *ts, vocab as u32))
            .collect();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.0.iter().copied()).collect();
        let picks = picker
            .pick(
                &Tensor::from_vec(flat, (rows.len(), vocab), &Device::Cpu).unwrap(),
                &limits,
            )
            .unwrap();
        let mut forced = 0;
        for ((logits, sampled, timestamps), (token, logprob, no_speech)) in rows.iter().zip(picks) {
            let mut l = logits.clone();
            apply_rules(&mut l, sampled, &sp, *timestamps);
            let want = pick(&l, 0.0, &mut Rng(1));
            assert_eq!(token, want, "history {sampled:?}, timestamps {timestamps}");
            assert!(
                (logprob - (l[want as usize] - log_sum_exp(&l))).abs() < 1e-4,
                "{logprob}"
            );
            assert!((no_speech - (logits[105] - log_sum_exp(logits))).abs() < 1e-4);
            forced += usize::from(
                *timestamps
                    && want >= 107
                    && logits[..107].iter().zip(&l).any(|(a, b)| {
                        a.is_finite() && *b == f32::NEG_INFINITY && *a > logits[want as usize]
                    }),
            );
        }
        // Timestamps won over likelier text tokens in some rows.
        assert!(forced > 50, "{forced}");
    }

    #[test]
    fn top_k_takes_the_likeliest_first_and_skips_suppressed() {
        let logits = [0.5, f32::NEG_INFINITY, 2.0, -1.0, 1.5, 2.0];
        assert_eq!(top_k(&logits, 3), vec![(2, 2.0), (5, 2.0), (4, 1.5)]);
        assert_eq!(top_k(&[f32::NEG_INFINITY, 0.0], 4), vec![(1, 0.0)]);
    }
}
