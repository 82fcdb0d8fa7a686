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

/// What a window's features hold past its audio.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FeaturePadding {
    /// 0.0, as faster-whisper's `pad_or_trim` fills its features, after the audio's last frame
    /// (the end reflected, after 160 zeros). The default: tern's transcripts are tested equal
    /// to faster-whisper's.
    #[default]
    Zeros,
    /// The log-mel of silence, as OpenAI's `transcribe` and transformers' feature extractor
    /// compute it (the audio followed by 30 s of zeros): frames over the audio's end read
    /// zeros after it, and frames past it hold the floor, 8 below the loudest frame.
    Silence,
}

impl std::str::FromStr for FeaturePadding {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "zeros" => Ok(FeaturePadding::Zeros),
            "silence" => Ok(FeaturePadding::Silence),
            other => Err(format!("feature padding is zeros or silence, not {other:?}")),
        }
    }
}

/// Samples of silence faster-whisper appends to a recording before its spectrogram, so its
/// last frame is whole (its `FeatureExtractor(padding=160)`).
const END_PADDING: usize = m::HOP_LENGTH;

/// Log-mel of the window `range` of a recording (16 kHz samples) as a `(1, n_mels, frames)`
/// tensor, as faster-whisper and OpenAI compute it: see [`log_mel`]. The first `frames` (at
/// most 3000) of the window's features, the frames past its audio 0.0.
pub(crate) fn window_mel(
    cfg: &Config,
    filters: &[f32],
    pcm: &[f32],
    range: (usize, usize),
    frames: usize,
    padding: FeaturePadding,
    device: &Device,
) -> Result<Tensor> {
    let n_mels = cfg.num_mel_bins;
    let frames = frames.min(m::N_FRAMES);
    let mel = log_mel(pcm, range, filters, n_mels, frames, padding);
    Ok(Tensor::from_vec(mel, (1, n_mels, frames), device)?)
}

/// Sample `t` of the recording as the reference's centred STFT reads it: the recording with
/// [`END_PADDING`] zeros appended, reflected (without repeating the edge sample) before its
/// start and after its end, as numpy's `pad(mode="reflect")` and torch's `stft(center=True)`.
fn centred_sample(pcm: &[f32], t: isize, padding: FeaturePadding) -> f32 {
    if padding == FeaturePadding::Silence && t >= pcm.len() as isize {
        // The recording goes on in zeros (30 s of them): no reflection at its end.
        return 0.0;
    }
    let n = (pcm.len() + END_PADDING) as isize;
    let mut t = t;
    // One reflection suffices but for recordings shorter than half the FFT; the loop folds on.
    while t < 0 || t >= n {
        t = if t < 0 { -t } else { 2 * (n - 1) - t };
    }
    pcm.get(t as usize).copied().unwrap_or(0.0)
}

/// Whisper's log-mel features of the window `range` of a recording, `n_mels x frames`
/// row-major, equal to faster-whisper's (`FeatureExtractor`, then `pad_or_trim` of a segment)
/// and, over the audio, to OpenAI's `log_mel_spectrogram`:
///
/// - frame `i` is centred on sample `range.0 + 160 i`: a periodic Hann window over 400 samples
///   of the recording, reflected at its start and at its end (after 160 zeros); at a cut
///   inside the recording the frame reads the audio on either side, as the reference's
///   features of the whole recording do;
/// - power spectrum (FFT in f64: the quietest bins lose precision in f32), Slaney filterbank,
///   `log10` floored at 1e-10, clamped to 8 below the window's loudest, then `(x + 4) / 4`;
/// - the window holds `(range.1 - range.0) / 160` frames of audio; at the recording's end one
///   more frame (holding the padding) counts towards the loudest but is not output, as in
///   faster-whisper; frames after the audio are 0.0, as its `pad_or_trim` fills them.
///
/// faster-whisper takes the loudest frame of the whole recording; here it is the window's,
/// which is the same for recordings of one window.
///
/// With [`FeaturePadding::Silence`], the frames over the recording's end read zeros after it
/// (not its reflection), are output while their 400 samples reach into the audio, and the frames
/// after them hold the floor (`max - 8`), as OpenAI's features of the audio padded with silence.
pub(crate) fn log_mel(pcm: &[f32], range: (usize, usize), filters: &[f32], n_mels: usize, frames: usize, padding: FeaturePadding) -> Vec<f32> {
    use realfft::RealFftPlanner;
    let n_fft = m::N_FFT;
    let n_bins = n_fft / 2 + 1;
    let hop = m::HOP_LENGTH;
    let (start, end) = (range.0.min(pcm.len()), range.1.min(pcm.len()));
    let audio = (end - start.min(end)) / hop;
    let at_end = end == pcm.len();
    let (content, measured) = match padding {
        // The frame after the audio at the recording's end counts towards the loudest.
        FeaturePadding::Zeros => (audio.min(frames), audio + usize::from(at_end)),
        FeaturePadding::Silence => {
            // At the recording's end, every frame whose window reaches into the audio.
            let reaching = if at_end { (end - start.min(end) + n_fft / 2).div_ceil(hop) } else { audio };
            (reaching.min(frames), reaching)
        }
    };
    let hann: Vec<f64> = (0..n_fft)
        .map(|i| 0.5 * (1.0 - (2.0 * std::f64::consts::PI * i as f64 / n_fft as f64).cos()))
        .collect();
    let fft = RealFftPlanner::<f64>::new().plan_fft_forward(n_fft);
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
    let mut log = vec![0f32; n_mels * measured];
    for i in 0..measured {
        let first = (start + i * hop) as isize - (n_fft / 2) as isize;
        let inside = first >= 0 && first as usize + n_fft <= pcm.len();
        for (j, slot) in frame.iter_mut().enumerate() {
            let x = if inside { pcm[first as usize + j] } else { centred_sample(pcm, first + j as isize, padding) };
            // The reference windows in f32: round the product there too.
            *slot = f64::from((hann[j] as f32) * x);
        }
        fft.process_with_scratch(&mut frame, &mut spectrum, &mut scratch)
            .expect("buffer sizes come from the planner");
        for (p, c) in power.iter_mut().zip(&spectrum) {
            *p = (c.re * c.re + c.im * c.im) as f32;
        }
        for (j, &(first, last)) in spans.iter().enumerate() {
            let row = &filters[j * n_bins + first..j * n_bins + last];
            let sum: f32 = row.iter().zip(&power[first..last]).map(|(w, p)| w * p).sum();
            log[j * measured + i] = sum.max(1e-10).log10();
        }
    }
    let floor = log.iter().copied().fold(f32::NEG_INFINITY, f32::max) - 8.0;
    let mut mel = match padding {
        FeaturePadding::Zeros => vec![0f32; n_mels * frames],
        // Silence's log-mel is log10(1e-10) = -10, clamped to the floor.
        FeaturePadding::Silence => vec![(floor.max(-10.0) + 4.0) / 4.0; n_mels * frames],
    };
    for j in 0..n_mels {
        for i in 0..content {
            mel[j * frames + i] = (log[j * measured + i].max(floor) + 4.0) / 4.0;
        }
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

    /// Padding as numpy's `pad(mode="reflect")` after the 160 zeros faster-whisper appends.
    #[test]
    fn samples_outside_the_recording_reflect_after_the_end_padding() {
        let pcm = [1.0f32, 2.0, 3.0, 4.0];
        let read = |t: isize| centred_sample(&pcm, t, FeaturePadding::Zeros);
        assert_eq!([read(-3), read(-2), read(-1), read(0), read(3)], [4.0, 3.0, 2.0, 1.0, 4.0]);
        // 4 samples then 160 zeros: index 163 is the last zero, 164 reflects 162 (a zero).
        assert_eq!(read(4), 0.0);
        assert_eq!(read(2 * 163 - 3), 4.0);
    }

    #[test]
    fn a_window_holds_a_frame_per_hop_of_audio_and_zeros_after() {
        let filters = mel_filters(80);
        let pcm: Vec<f32> = (0..16_000 * 3 + 77).map(|i| (i as f32 * 0.05).sin() * 0.3).collect();
        let mel = log_mel(&pcm, (0, pcm.len()), &filters, 80, 3000, FeaturePadding::Zeros);
        let content = pcm.len() / 160;
        for j in 0..80 {
            let row = &mel[j * 3000..(j + 1) * 3000];
            assert!(row[content..].iter().all(|&v| v == 0.0), "mel {j} past the audio");
        }
        let loudest = mel.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert!(loudest.is_finite() && loudest > 0.5, "{loudest}");
        // A window cut inside the recording reads the audio across the cut, as the features of
        // the whole recording do: a steady tone gives the same frames either way.
        let inner = log_mel(&pcm, (16_000, 32_000), &filters, 80, 100, FeaturePadding::Zeros);
        for j in 0..80 {
            for i in 0..100 {
                let whole = mel[j * 3000 + 100 + i];
                assert!((inner[j * 100 + i] - whole).abs() < 1e-3, "mel {j} frame {i}: {} against {whole}", inner[j * 100 + i]);
            }
        }
    }

    /// Silence padding: the frames past the audio hold the floor, 8 below the loudest, as
    /// OpenAI's features of the audio followed by zeros; the audio's frames are the same.
    #[test]
    fn silence_padding_holds_the_floor_past_the_audio() {
        let filters = mel_filters(80);
        let pcm: Vec<f32> = (0..16_000 * 2 + 77).map(|i| (i as f32 * 0.05).sin() * 0.3).collect();
        let zeros = log_mel(&pcm, (0, pcm.len()), &filters, 80, 3000, FeaturePadding::Zeros);
        let silence = log_mel(&pcm, (0, pcm.len()), &filters, 80, 3000, FeaturePadding::Silence);
        let audio = pcm.len() / 160;
        let loudest = silence.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for j in 0..80 {
            // Frames whose window lies inside the audio are the same either way.
            for i in 0..audio - 2 {
                assert_eq!(silence[j * 3000 + i], zeros[j * 3000 + i], "mel {j} frame {i}");
            }
            // Past the frames that reach into the audio: the floor.
            for i in audio + 3..3000 {
                assert!((silence[j * 3000 + i] - (loudest - 2.0)).abs() < 1e-5, "mel {j} frame {i}: {}", silence[j * 3000 + i]);
            }
        }
        assert_eq!("silence".parse::<FeaturePadding>(), Ok(FeaturePadding::Silence));
        assert!("reflect".parse::<FeaturePadding>().is_err());
    }
}
