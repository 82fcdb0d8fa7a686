//! Log-mel features. candle-transformers computes the spectrogram but ships no filterbank, so the
//! Slaney-style filterbank Whisper was trained with (librosa's `mel(htk=False, norm="slaney")`)
//! is computed here.

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_transformers::models::whisper::{self as m, Config};

/// Slaney mel scale: linear (200/3 Hz per mel) below 1 kHz, logarithmic above.
fn hz_to_mel(f: f64) -> f64 {
    const F_SP: f64 = 200.0 / 3.0;
    const MIN_LOG_HZ: f64 = 1000.0;
    let min_log_mel = MIN_LOG_HZ / F_SP;
    let logstep = 6.4f64.ln() / 27.0;
    if f >= MIN_LOG_HZ {
        min_log_mel + (f / MIN_LOG_HZ).ln() / logstep
    } else {
        f / F_SP
    }
}

fn mel_to_hz(mel: f64) -> f64 {
    const F_SP: f64 = 200.0 / 3.0;
    const MIN_LOG_HZ: f64 = 1000.0;
    let min_log_mel = MIN_LOG_HZ / F_SP;
    let logstep = 6.4f64.ln() / 27.0;
    if mel >= min_log_mel {
        MIN_LOG_HZ * (logstep * (mel - min_log_mel)).exp()
    } else {
        mel * F_SP
    }
}

/// Filterbank as `n_mels x (N_FFT / 2 + 1)` row-major weights, the layout `pcm_to_mel` reads.
pub(crate) fn mel_filters(n_mels: usize) -> Vec<f32> {
    let sr = m::SAMPLE_RATE as f64;
    let n_freqs = m::N_FFT / 2 + 1;
    let fft_freqs: Vec<f64> = (0..n_freqs).map(|i| i as f64 * sr / m::N_FFT as f64).collect();
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

/// Log-mel of one window (at most 30 s of 16 kHz samples) as a `(1, n_mels, 3000)` tensor;
/// shorter windows are zero-padded to 30 s as Whisper expects.
pub(crate) fn window_mel(cfg: &Config, filters: &[f32], samples: &[f32], device: &Device) -> Result<Tensor> {
    let samples = &samples[..samples.len().min(m::N_SAMPLES)];
    // pcm_to_mel pads to a whole number of half-windows plus one more, so it always yields at
    // least N_FRAMES frames; keep the first N_FRAMES.
    let mel = m::audio::pcm_to_mel(cfg, samples, filters);
    let n_mels = cfg.num_mel_bins;
    let n_len = mel.len() / n_mels;
    let mel = Tensor::from_vec(mel, (1, n_mels, n_len), device)?;
    Ok(mel.narrow(2, 0, m::N_FRAMES.min(n_len))?.contiguous()?)
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
}
