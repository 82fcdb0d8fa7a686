//! Audio input: probing durations and decoding uploads to the 16 kHz mono f32 PCM Whisper wants,
//! within a duration limit, so that no recording, however long, costs more memory than the
//! limit's worth of samples. The API probes with it (and so does not link the models); the
//! workers decode with it.
//!
//! Decoding is pure Rust (symphonia for containers/codecs, rubato for resampling) so the crate
//! builds without C toolchains or system libraries.

use std::io::Cursor;

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Fft, FixedSync, Resampler};
use symphonia::core::codecs::audio::{AudioCodecParameters, AudioDecoderOptions};
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, FormatReader, TrackType};
use symphonia::core::io::{MediaSourceStream, ReadOnlySource};
use symphonia::core::meta::MetadataOptions;

/// Sample rate (Hz) of the PCM that [`decode_mono_16k`] returns and Whisper consumes.
pub const SAMPLE_RATE: u32 = 16_000;

/// Whisper's window: a transcription costs one unit per started 30 s.
pub const WINDOW_SECONDS: f64 = 30.0;

/// Bytes of a file's start that hold the headers of WAV, FLAC and MP3 files whose headers state
/// their length: what [`probe_prefix`] needs.
pub const HEADER_PREFIX_BYTES: usize = 1 << 20;

/// Number of 30 s windows audio of `seconds` costs: `ceil(seconds / 30)`, at least 1 (empty or
/// sub-second audio still costs one encoder pass).
pub fn windows_for(seconds: f64) -> usize {
    if !seconds.is_finite() || seconds <= 0.0 {
        return 1;
    }
    ((seconds / WINDOW_SECONDS).ceil() as usize).max(1)
}

/// Why an upload cannot be turned into audio. Each variant has a stable machine code, see
/// [`AudioError::code`].
#[derive(Debug, thiserror::Error)]
pub enum AudioError {
    /// Not a decodable WAV/FLAC/MP3/OGG-Vorbis stream: unknown container or codec, corrupt or
    /// truncated before any audio. Code `audio_unreadable`. The string is the decoder's reason.
    #[error("audio is unreadable: {0}")]
    Unreadable(String),
    /// The stream is valid but holds no samples. Code `audio_empty`.
    #[error("audio is empty")]
    Empty,
    /// The audio is longer than the caller's limit (both in seconds). Code `audio_too_long`.
    /// Raised from the headers before decoding where they state the length, else as soon as
    /// the decoded audio passes the limit.
    #[error("the audio lasts at least {seconds:.1} s; the limit is {limit:.0} s")]
    TooLong {
        /// Duration of the audio: the whole, from the headers, or what was decoded before
        /// decoding stopped.
        seconds: f64,
        /// The limit it exceeded.
        limit: f64,
    },
}

impl AudioError {
    /// Stable machine-readable code: `audio_unreadable`, `audio_empty` or `audio_too_long`.
    pub fn code(&self) -> &'static str {
        match self {
            AudioError::Unreadable(_) => "audio_unreadable",
            AudioError::Empty => "audio_empty",
            AudioError::TooLong { .. } => "audio_too_long",
        }
    }
}

/// An opened container and what its headers say of the default audio track.
struct Opened {
    format: Box<dyn FormatReader + 'static>,
    track_id: u32,
    params: AudioCodecParameters,
    /// Frames the header declares, when it does.
    frames: Option<u64>,
}

fn open(bytes: &[u8]) -> Result<Opened, AudioError> {
    // symphonia wants an owned source; one copy of the upload is cheap next to decoding it.
    open_source(Cursor::new(bytes.to_vec()))
}

fn open_source(source: Cursor<Vec<u8>>) -> Result<Opened, AudioError> {
    // Unseekable on purpose: given a seekable source of known length, symphonia estimates an
    // MP3's frame count from its byte length where no Xing/VBRI header states it. Of a prefix,
    // that is the prefix's duration; of a variable bitrate, a guess that makes the whole file
    // look truncated. Unseekable, `num_frames` is only ever what a header states.
    let mss = MediaSourceStream::new(Box::new(ReadOnlySource::new(source)), Default::default());
    let format = symphonia::default::get_probe()
        .probe(
            &Hint::new(),
            mss,
            FormatOptions::default(),
            MetadataOptions::default(),
        )
        .map_err(|e| AudioError::Unreadable(e.to_string()))?;
    let track = format
        .default_track(TrackType::Audio)
        .ok_or_else(|| AudioError::Unreadable("no audio track".into()))?;
    let params = track
        .codec_params
        .as_ref()
        .and_then(|p| p.audio())
        .ok_or_else(|| AudioError::Unreadable("track has no audio codec parameters".into()))?
        .clone();
    let (track_id, frames) = (track.id, track.num_frames);
    Ok(Opened { format, track_id, params, frames })
}

impl Opened {
    /// The duration the headers state, if they do.
    fn declared_seconds(&self) -> Option<f64> {
        match (self.frames, self.params.sample_rate) {
            (Some(frames), Some(rate)) if rate > 0 => Some(frames as f64 / rate as f64),
            _ => None,
        }
    }
}

/// What [`decode_interleaved`] gives: the samples (when kept), frames, channels, sample rate.
struct Decoded {
    interleaved: Vec<f32>,
    frames: u64,
    /// Bytes of the packets decoded: the audio's share of the bytes read.
    packet_bytes: u64,
    channels: usize,
    rate: u32,
}

/// Decodes every packet of the track, keeping the interleaved f32 samples when `keep` (else
/// only counting frames, in memory of one packet). Stops with [`AudioError::TooLong`] once
/// the audio passes `limit` seconds: at once when the headers state a longer duration, else
/// when the decoded frames pass it, so at most the limit's worth of samples is ever held.
fn decode_interleaved(bytes: &[u8], limit: f64, keep: bool) -> Result<Decoded, AudioError> {
    let opened = open(bytes)?;
    if let Some(seconds) = opened.declared_seconds() {
        if seconds > limit {
            return Err(AudioError::TooLong { seconds, limit });
        }
    }
    let Opened { mut format, track_id, params, frames } = opened;
    // Frames the container declares (WAV, FLAC do): fewer decoded means the file was cut short.
    let declared_frames = frames;
    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(&params, &AudioDecoderOptions::default())
        .map_err(|e| AudioError::Unreadable(e.to_string()))?;

    let mut samples: Vec<f32> = Vec::new();
    let mut chunk: Vec<f32> = Vec::new();
    let mut decoded_frames = 0u64;
    let mut packet_bytes = 0u64;
    let mut channels = params.channels.as_ref().map(|c| c.count()).unwrap_or(0);
    let mut rate = params.sample_rate.unwrap_or(0);
    let mut decoded_any = false;
    let mut last_error: Option<String> = None;
    loop {
        let packet = match format.next_packet() {
            Ok(Some(p)) => p,
            Ok(None) => break,
            // A truncated file ends in an I/O error: keep what decoded before it.
            Err(e) => {
                last_error = Some(e.to_string());
                break;
            }
        };
        if packet.track_id != track_id {
            continue;
        }
        match decoder.decode(&packet) {
            Ok(buf) => {
                decoded_any = true;
                packet_bytes += packet.data.len() as u64;
                channels = buf.spec().channels().count();
                rate = buf.spec().rate();
                decoded_frames += buf.frames() as u64;
                if rate > 0 && decoded_frames as f64 / rate as f64 > limit {
                    return Err(AudioError::TooLong { seconds: decoded_frames as f64 / rate as f64, limit });
                }
                if keep {
                    chunk.clear();
                    buf.copy_to_vec_interleaved(&mut chunk);
                    samples.extend_from_slice(&chunk);
                }
            }
            // Corrupt packets are skipped, as players do; a file with none good is unreadable.
            Err(SymError::DecodeError(e)) => last_error = Some(e.to_string()),
            Err(SymError::IoError(e)) => last_error = Some(e.to_string()),
            Err(e) => {
                last_error = Some(e.to_string());
                break;
            }
        }
    }
    if decoded_frames == 0 {
        return match (decoded_any, last_error) {
            (false, Some(e)) => Err(AudioError::Unreadable(e)),
            _ => Err(AudioError::Empty),
        };
    }
    if channels == 0 || rate == 0 {
        return Err(AudioError::Unreadable(
            "unknown channel count or sample rate".into(),
        ));
    }
    if let Some(declared) = declared_frames {
        // A few frames of slack for codecs whose last packet is padded or trimmed.
        if decoded_frames + u64::from(rate / 100) < declared {
            return Err(AudioError::Unreadable(format!(
                "truncated: the header declares {declared} frames, only {decoded_frames} are present"
            )));
        }
    }
    Ok(Decoded {
        interleaved: samples,
        frames: decoded_frames,
        packet_bytes,
        channels,
        rate,
    })
}

/// [`probe_duration_within`] with no limit.
pub fn probe_duration(bytes: &[u8]) -> Result<f64, AudioError> {
    probe_duration_within(bytes, f64::INFINITY)
}

/// Duration in seconds. Taken from the container/codec headers where they state it
/// (`n_frames / sample_rate`, so a WAV is never decoded just to probe it); streams whose headers
/// do not say (e.g. some MP3/OGG) are decoded to count frames, keeping no samples, and the
/// count stops past `limit` seconds.
///
/// Errors: [`AudioError::Unreadable`] for anything symphonia cannot open, [`AudioError::Empty`]
/// when the stream holds zero frames, [`AudioError::TooLong`] past `limit`.
pub fn probe_duration_within(bytes: &[u8], limit: f64) -> Result<f64, AudioError> {
    let opened = open(bytes)?;
    if let Some(seconds) = opened.declared_seconds() {
        if opened.frames == Some(0) {
            return Err(AudioError::Empty);
        }
        return match seconds > limit {
            true => Err(AudioError::TooLong { seconds, limit }),
            false => Ok(seconds),
        };
    }
    drop(opened);
    let decoded = decode_interleaved(bytes, limit, false)?;
    Ok(decoded.frames as f64 / decoded.rate as f64)
}

/// The duration the headers in `prefix`, the first bytes of a file (at least
/// [`HEADER_PREFIX_BYTES`] of it, or all), state, without the rest of the file: `Ok(None)`
/// when they do not say (then probe the whole file with [`probe_duration_within`]).
pub fn probe_prefix(prefix: &[u8]) -> Result<Option<f64>, AudioError> {
    let opened = open(prefix)?;
    Ok(opened.declared_seconds())
}

/// The duration of a file of `total_bytes` whose headers do not state it (an MP3 without a
/// Xing/VBRI header, an OGG stream), from `prefix`, its first bytes: the seconds per byte of
/// the audio packets in the prefix times the file's audio bytes, as ffprobe estimates from the
/// bitrate. Exact when `prefix` is the whole file; close for constant bitrates; a variable
/// bitrate can make it err either way, so it prices and screens a job, while the worker's
/// decode enforces the limit exactly. Reads nothing past `prefix`.
///
/// Errors: [`AudioError::Unreadable`] or [`AudioError::Empty`] when the prefix holds no
/// decodable audio.
pub fn estimate_from_prefix(prefix: &[u8], total_bytes: u64) -> Result<f64, AudioError> {
    let decoded = decode_interleaved(prefix, f64::INFINITY, false)?;
    let seconds = decoded.frames as f64 / decoded.rate as f64;
    if prefix.len() as u64 >= total_bytes || decoded.packet_bytes == 0 {
        return Ok(seconds);
    }
    // Headers and tags ahead of the audio are not audio: only the rest of the file scales.
    let overhead = (prefix.len() as u64).saturating_sub(decoded.packet_bytes);
    let audio_bytes = total_bytes.saturating_sub(overhead);
    Ok(seconds * audio_bytes as f64 / decoded.packet_bytes as f64)
}

/// [`decode_mono_16k_within`] with no limit: for audio already known to be short (test
/// speech, health checks), never for a job's input.
pub fn decode_mono_16k(bytes: &[u8]) -> Result<Vec<f32>, AudioError> {
    decode_mono_16k_within(bytes, f64::INFINITY)
}

/// Decodes WAV/FLAC/MP3/OGG-Vorbis bytes, downmixes to mono (channel mean) and resamples to
/// [`SAMPLE_RATE`] with rubato's FFT resampler. Returns f32 samples in [-1, 1].
///
/// Corrupt packets are skipped, as players do. A file whose container declares more frames than
/// it holds (cut short in transfer) is [`AudioError::Unreadable`].
/// Errors: [`AudioError::Unreadable`] when nothing can be decoded or the file is truncated, [`AudioError::Empty`] when the
/// stream decodes to no samples, [`AudioError::TooLong`] past `limit` seconds (decoding stops
/// there: see [`decode_interleaved`]).
pub fn decode_mono_16k_within(bytes: &[u8], limit: f64) -> Result<Vec<f32>, AudioError> {
    let Decoded { interleaved, channels, rate, .. } = decode_interleaved(bytes, limit, true)?;
    let mono: Vec<f32> = if channels == 1 {
        interleaved
    } else {
        interleaved
            .chunks_exact(channels)
            .map(|f| f.iter().sum::<f32>() / channels as f32)
            .collect()
    };
    let mono = if rate == SAMPLE_RATE {
        mono
    } else {
        resample(&mono, rate)?
    };
    if mono.is_empty() {
        return Err(AudioError::Empty);
    }
    Ok(mono.into_iter().map(|s| s.clamp(-1.0, 1.0)).collect())
}

/// Resamples mono audio from `rate` to [`SAMPLE_RATE`].
fn resample(input: &[f32], rate: u32) -> Result<Vec<f32>, AudioError> {
    let err = |e: &dyn std::fmt::Display| AudioError::Unreadable(format!("resampling: {e}"));
    let mut resampler = Fft::<f32>::new(
        rate as usize,
        SAMPLE_RATE as usize,
        1024,
        1,
        FixedSync::Input,
    )
    .map_err(|e| err(&e))?;
    let needed = resampler.process_all_needed_output_len(input.len());
    let mut out = vec![0f32; needed];
    let buf_in = InterleavedSlice::new(input, 1, input.len()).map_err(|e| err(&e))?;
    let mut buf_out = InterleavedSlice::new_mut(&mut out, 1, needed).map_err(|e| err(&e))?;
    let (_consumed, produced) = resampler
        .process_all_into_buffer(&buf_in, &mut buf_out, input.len(), None)
        .map_err(|e| err(&e))?;
    out.truncate(produced);
    Ok(out)
}
