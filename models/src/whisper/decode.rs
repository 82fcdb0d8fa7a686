//! Greedy decoding of one 30 s window, with OpenAI's token rules (suppression, timestamp pairing)
//! applied on the CPU logits vector, and temperature fallback.

use anyhow::Result;
use candle_core::Tensor;
use rayon::prelude::*;

use super::decoder::{CrossKv, Decoder};
use crate::cpu_kernels::log_sum_exp;

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
    /// From config.json `suppress_ids`: never sampled.
    pub suppress: Vec<u32>,
    /// From config.json `suppress_ids_begin`: not sampled as the first token (blank, EOT).
    pub suppress_begin: Vec<u32>,
}

/// Whisper's limit of sampled tokens per window (half the 448-token text context).
pub(crate) const SAMPLE_LEN: usize = 224;
/// Latest first timestamp allowed (1.0 s, in 0.02 s steps), as OpenAI's `max_initial_timestamp`.
const MAX_INITIAL_TIMESTAMP_INDEX: u32 = 50;
/// Fallback thresholds and temperatures from OpenAI's `transcribe()`.
pub(crate) const TEMPERATURES: [f64; 6] = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0];
const LOGPROB_THRESHOLD: f64 = -1.0;
const COMPRESSION_RATIO_THRESHOLD: f64 = 2.4;
pub(crate) const NO_SPEECH_THRESHOLD: f64 = 0.6;

/// Result of decoding one window.
#[derive(Debug, Clone)]
pub(crate) struct Decoded {
    /// Sampled tokens, without the prompt and without EOT.
    pub tokens: Vec<u32>,
    pub avg_logprob: f64,
    pub no_speech_prob: f64,
}

impl Decoded {
    /// Whether this is likely silence that Whisper hallucinated over (OpenAI's no-speech rule).
    pub fn is_silence(&self) -> bool {
        self.no_speech_prob > NO_SPEECH_THRESHOLD && self.avg_logprob < LOGPROB_THRESHOLD
    }
}

/// Small deterministic PRNG (xorshift64*) for temperature sampling: reproducible runs without
/// another dependency.
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

/// Decodes a batch of windows (one row of `cross` each, all with the same prompt) at one
/// temperature, feeding only the new token per row at each step after the prompt
/// (self-attention cache). Each row stops at its own EOT. Finished rows are fed EOT (their
/// outputs ignored) until they are a quarter of the batch, then leave it with their caches:
/// the short clips of a batch end many steps before its longest, and every step costs in
/// proportion to its rows.
fn decode_batch(
    decoder: &Decoder,
    cross: &CrossKv,
    prompt: &[u32],
    sp: &Specials,
    timestamps: bool,
    temperature: f64,
    rngs: &mut [Rng],
) -> Result<Vec<Decoded>> {
    let device = decoder.device().clone();
    let max_ctx = decoder.max_positions();
    let batch = rngs.len();
    let mut cache = decoder.new_cache();
    let mut tokens: Vec<Vec<u32>> = vec![prompt.to_vec(); batch];
    let mut done = vec![false; batch];
    let mut sum_logprob = vec![0f64; batch];
    let mut no_speech_prob = vec![0f64; batch];
    // The original row of each row of the running batch, ascending, and the cross-attention
    // keys/values of those rows once some have left.
    let mut active: Vec<usize> = (0..batch).collect();
    let mut active_cross: Option<CrossKv> = None;
    for i in 0..SAMPLE_LEN {
        if prompt.len() + i >= max_ctx || done.iter().all(|&d| d) {
            break;
        }
        let finished = active.iter().filter(|&&b| done[b]).count();
        if finished > 0 && finished * 4 >= active.len() {
            let keep: Vec<usize> = (0..active.len()).filter(|&j| !done[active[j]]).collect();
            cache = cache.select(&keep)?;
            active_cross = Some(active_cross.as_ref().unwrap_or(cross).select(&keep)?);
            active = keep.iter().map(|&j| active[j]).collect();
        }
        let step_cross = active_cross.as_ref().unwrap_or(cross);
        let pos = cache.len();
        let new: Vec<u32> = active
            .iter()
            .flat_map(|&b| tokens[b][pos..].iter().copied())
            .collect();
        let new_len = new.len() / active.len();
        let input = Tensor::from_vec(new, (active.len(), new_len), &device)?;
        let ys = decoder.forward(&input, step_cross, &mut cache)?;
        if i == 0 {
            if let Some(ns) = sp.no_speech {
                // OpenAI reads the no-speech probability at the SOT position.
                let sot_pos = prompt.iter().position(|&t| t == sp.sot).unwrap_or(0);
                for (j, l) in decoder.logits_vecs(&ys, sot_pos)?.iter().enumerate() {
                    no_speech_prob[active[j]] = f64::from(l[ns as usize] - log_sum_exp(l)).exp();
                }
            }
        }
        let rows = decoder.logits_vecs(&ys, new_len - 1)?;
        let mut in_batch = vec![false; batch];
        active.iter().for_each(|&b| in_batch[b] = true);
        let step_rngs: Vec<&mut Rng> =
            rngs.iter_mut().enumerate().filter(|(b, _)| in_batch[*b]).map(|(_, r)| r).collect();
        // The rules and picks of the rows are independent: a few passes over 51k logits each.
        let picks: Vec<Option<(u32, f64)>> = rows
            .into_par_iter()
            .zip(step_rngs)
            .zip(active.par_iter())
            .map(|((mut logits, rng), &b)| {
                if done[b] {
                    return None;
                }
                apply_rules(&mut logits, &tokens[b][prompt.len()..], sp, timestamps);
                let next = pick(&logits, temperature, rng);
                Some((next, f64::from(logits[next as usize] - log_sum_exp(&logits))))
            })
            .collect();
        for (&b, picked) in active.iter().zip(picks) {
            let Some((next, lp)) = picked else {
                // Keeps this row's cache length in step with the others.
                tokens[b].push(sp.eot);
                continue;
            };
            if next == sp.eot {
                done[b] = true;
                tokens[b].push(sp.eot);
                continue;
            }
            sum_logprob[b] += lp;
            tokens[b].push(next);
        }
    }
    Ok(tokens
        .into_iter()
        .enumerate()
        .map(|(b, t)| {
            let sampled: Vec<u32> = t[prompt.len()..]
                .iter()
                .copied()
                .take_while(|&x| x != sp.eot)
                .collect();
            Decoded {
                avg_logprob: sum_logprob[b] / (sampled.len().max(1)) as f64,
                tokens: sampled,
                no_speech_prob: no_speech_prob[b],
            }
        })
        .collect())
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

/// Decodes a batch of windows (rows of `cross`; `seeds` one per row): greedily all together,
/// then, one window at a time, retries at higher temperatures those whose greedy result looks
/// degenerate (average log-probability below -1 or a repetition loop), as OpenAI's
/// `transcribe()` does. A row marked in `give_up` gets `None` instead of a fallback.
pub(crate) fn decode_with_fallback(
    decoder: &Decoder,
    cross: &CrossKv,
    prompt: &[u32],
    sp: &Specials,
    timestamps: bool,
    seeds: &[u64],
    give_up: &[bool],
) -> Result<Vec<Option<Decoded>>> {
    let mut rngs: Vec<Rng> = seeds.iter().map(|&s| Rng(s | 1)).collect();
    let greedy = decode_batch(decoder, cross, prompt, sp, timestamps, 0.0, &mut rngs)?;
    let mut out = Vec::with_capacity(greedy.len());
    for (b, d) in greedy.into_iter().enumerate() {
        if !needs_fallback(&d) {
            out.push(Some(d));
            continue;
        }
        if give_up.get(b).copied().unwrap_or(false) {
            out.push(None);
            continue;
        }
        let row = cross.row(b)?;
        let rng = &mut rngs[b..b + 1];
        let mut best = d;
        let mut accepted = None;
        for &t in TEMPERATURES[1..].iter() {
            let d = decode_batch(decoder, &row, prompt, sp, timestamps, t, rng)?
                .pop()
                .expect("one row");
            if !needs_fallback(&d) {
                accepted = Some(d);
                break;
            }
            if d.avg_logprob > best.avg_logprob {
                best = d;
            }
        }
        out.push(Some(accepted.unwrap_or(best)));
    }
    Ok(out)
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
