//! Log-mel features. candle-transformers computes the spectrogram but ships no filterbank, so the
//! Slaney-style filterbank Whisper was trained with (librosa's `mel(htk=False, norm="slaney")`)
//! is computed here.

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_transformers::models::whisper::{self as m, Config};

// Slaney mel scale: linear (200/3 Hz per mel) below 1 kHz, logarithmic above.
const F_SP: f64 = 200.0 / 3.0;
const MIN_LOG_HZ: f64 = 1000.0;
const MIN_LOG_MEL: f64 = MIN_LOG_HZ / F_SP;

fn log_step() -> f64 {
    6.4f64.ln() / 27.0
}

fn hz_to_mel(f: f64) -> f64 {
    if f >= MIN_LOG_HZ {
        MIN_LOG_MEL + (f / MIN_LOG_HZ).ln() / log_step()
    } else {
        f / F_SP
    }
}

fn mel_to_hz(mel: f64) -> f64 {
    if mel >= MIN_LOG_MEL {
        MIN_LOG_HZ * (log_step() * (mel - MIN_LOG_MEL)).exp()
    } else {
        mel * F_SP
    }
}

/// Filterbank as `n_mels x (N_FFT / 2 + 1)` row-major weights, the layout `pcm_to_mel` reads.
pub(crate) fn mel_filters(n_mels: usize) -> Vec<f32> {
    let sr = m::SAMPLE_RATE as f64;
    let n_freqs = m::N_FFT / 2 + 1;
    let fft_freqs: Vec<f64> = (0..n_freqs)
        .map(|i| i as f64 * sr / m::N_FFT as f64)
        .collect();
    let (lo, hi) = (hz_to_mel(0.0), hz_to_mel(sr / 2.0));
    let mel_f: Vec<f64> = (0..n_mels + 2)
        .map(|i| mel_to_hz(lo + (hi - lo) * i as f64 / (n_mels + 1) as f64))
        .collect();
    let mut w = vec![0f32; n_mels * n_freqs];
    for i in 0..n_mels {
        // Slaney normalisation: each triangle has unit area.
        let enorm = 2.0 / (mel_f[i + 2] - mel_f[i]);
        for (j, &f) in fft_freqs.iter().enumerate() {
            let lower = (f - mel_f[i]) / (mel_f[i + 1] - mel_f[i]);
            let upper = (mel_f[i + 2] - f) / (mel_f[i + 2] - mel_f[i + 1]);
            w[i * n_freqs + j] = (lower.min(upper).max(0.0) * enorm) as f32;
        }
    }
    w
}

/// Log-mel of one window (at most 30 s of 16 kHz samples) as a `(1, n_mels, frames)` tensor:
/// the first `frames` (at most 3000) of the window zero-padded to 30 s as Whisper expects, with
/// the normalisation of the whole padded window.
pub(crate) fn window_mel(
    cfg: &Config,
    filters: &[f32],
    samples: &[f32],
    frames: usize,
    device: &Device,
) -> Result<Tensor> {
    let n_mels = cfg.num_mel_bins;
    let mut mel = log_mel(samples, filters, n_mels);
    let frames = frames.min(m::N_FRAMES);
    if frames < m::N_FRAMES {
        for j in 0..n_mels {
            mel.copy_within(j * m::N_FRAMES..j * m::N_FRAMES + frames, j * frames);
        }
        mel.truncate(n_mels * frames);
    }
    Ok(Tensor::from_vec(mel, (1, n_mels, frames), device)?)
}

/// Whisper's log-mel spectrogram of one window, `n_mels x N_FRAMES` row-major.
///
/// Same maths as candle's `pcm_to_mel` (Hann window, frames at every hop with no centring,
/// power spectrum with the mirrored half folded in, log10 floored at 1e-10, clamped to max - 8,
/// then `/4 + 1`), but with a real FFT from realfft and no thread spawning: candle's radix-2
/// FFT recursion bottoms out in a 25-point DFT and took ~250 ms per window, this takes a few ms.
pub(crate) fn log_mel(samples: &[f32], filters: &[f32], n_mels: usize) -> Vec<f32> {
    use realfft::RealFftPlanner;
    let samples = &samples[..samples.len().min(m::N_SAMPLES)];
    let n_fft = m::N_FFT;
    let n_bins = n_fft / 2 + 1;
    let hop = m::HOP_LENGTH;
    let n_frames = m::N_FRAMES;
    let hann: Vec<f32> = (0..n_fft)
        .map(|i| 0.5 * (1.0 - (2.0 * std::f32::consts::PI * i as f32 / n_fft as f32).cos()))
        .collect();
    let fft = RealFftPlanner::<f32>::new().plan_fft_forward(n_fft);
    let mut frame = fft.make_input_vec();
    let mut spectrum = fft.make_output_vec();
    let mut scratch = fft.make_scratch_vec();
    let mut power = vec![0f32; n_bins];
    // Each triangle covers a few dozen of the 201 bins: summing only its nonzero span gives the
    // same sums (the rest adds zeros) at a tiny fraction of the work, which was a twentieth of
    // a batched transcription's time.
    let spans: Vec<(usize, usize)> = filters
        .chunks_exact(n_bins)
        .take(n_mels)
        .map(|row| {
            let first = row.iter().position(|&w| w != 0.0).unwrap_or(0);
            let last = row.iter().rposition(|&w| w != 0.0).map_or(first, |l| l + 1);
            (first, last)
        })
        .collect();
    // Frames past the audio are silence: log10 of the 1e-10 floor, as for zero padding.
    let mut mel = vec![1e-10f32.log10(); n_mels * n_frames];
    let end = (samples.len() / hop + 1).min(n_frames);
    for i in 0..end {
        let offset = i * hop;
        let avail = (samples.len() - offset).min(n_fft);
        for j in 0..avail {
            frame[j] = hann[j] * samples[offset + j];
        }
        frame[avail..].fill(0.0);
        fft.process_with_scratch(&mut frame, &mut spectrum, &mut scratch)
            .expect("buffer sizes come from the planner");
        for (k, c) in spectrum.iter().enumerate() {
            let p = c.re * c.re + c.im * c.im;
            // candle (after whisper.cpp) adds the mirrored bin N-k for k in 1..N/2: double them.
            power[k] = if k >= 1 && k < n_fft / 2 { 2.0 * p } else { p };
        }
        for (j, &(first, last)) in spans.iter().enumerate() {
            let row = &filters[j * n_bins + first..j * n_bins + last];
            let sum: f32 = row.iter().zip(&power[first..last]).map(|(w, p)| w * p).sum();
            mel[j * n_frames + i] = sum.max(1e-10).log10();
        }
    }
    let mmax = mel.iter().copied().fold(f32::NEG_INFINITY, f32::max) - 8.0;
    for v in mel.iter_mut() {
        *v = v.max(mmax) / 4.0 + 1.0;
    }
    mel
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slaney_scale_round_trips_and_filters_are_sane() {
        for f in [0.0, 500.0, 1000.0, 4000.0, 8000.0] {
            assert!((mel_to_hz(hz_to_mel(f)) - f).abs() < 1e-6);
        }
        let w = mel_filters(80);
        assert_eq!(w.len(), 80 * 201);
        // Every filter covers at least one bin and none is negative.
        for i in 0..80 {
            let row = &w[i * 201..(i + 1) * 201];
            assert!(row.iter().all(|&v| v >= 0.0));
            assert!(row.iter().any(|&v| v > 0.0), "filter {i} is empty");
        }
    }

    /// The realfft path must reproduce candle's `pcm_to_mel` (first 3000 frames).
    #[test]
    fn log_mel_matches_candle() {
        let cfg = Config {
            num_mel_bins: 80,
            max_source_positions: 1500,
            d_model: 384,
            encoder_attention_heads: 6,
            encoder_layers: 4,
            vocab_size: 51864,
            max_target_positions: 448,
            decoder_attention_heads: 6,
            decoder_layers: 4,
            suppress_tokens: vec![],
        };
        let filters = mel_filters(80);
        for secs in [0.3f32, 7.0, 30.0] {
            let n = (secs * 16_000.0) as usize;
            let mut x = 12345u32;
            let samples: Vec<f32> = (0..n)
                .map(|i| {
                    x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    let noise = (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                    0.3 * (i as f32 * 0.05).sin() + 0.05 * noise
                })
                .collect();
            let ours = log_mel(&samples, &filters, 80);
            let theirs = m::audio::pcm_to_mel(&cfg, &samples, &filters);
            let n_len = theirs.len() / 80;
            let mut worst = 0f32;
            for j in 0..80 {
                for i in 0..m::N_FRAMES {
                    worst = worst.max((ours[j * m::N_FRAMES + i] - theirs[j * n_len + i]).abs());
                }
            }
            assert!(worst < 1e-3, "{secs} s: max difference {worst}");
        }
    }
}
