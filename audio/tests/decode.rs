//! Decoding and probing uploads. Uses one LibriVox clip from the models dir (see whisper.rs);
//! the synthetic cases build their bytes here and always run.

use std::path::PathBuf;

use tern_audio::{
    decode_mono_16k, decode_mono_16k_within, estimate_from_prefix, probe_duration,
    probe_duration_within, probe_prefix, AudioError, SAMPLE_RATE,
};

fn clip() -> Option<Vec<u8>> {
    let dir = std::env::var_os("TERN_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tern/models")
        });
    let path = dir.join("testdata/librivox/sense_and_sensibility_01_austen_64kb-0880.wav");
    match std::fs::read(&path) {
        Ok(b) => Some(b),
        Err(e) => {
            let msg = format!("{} unreadable ({e}); set TERN_MODELS_DIR", path.display());
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{msg}");
            }
            eprintln!("SKIPPED: {msg}");
            None
        }
    }
}

/// A canonical 44-byte-header PCM WAV.
fn wav(rate: u32, channels: u16, samples: &[i16]) -> Vec<u8> {
    let data_len = (samples.len() * 2) as u32;
    let mut b = Vec::new();
    b.extend_from_slice(b"RIFF");
    b.extend_from_slice(&(36 + data_len).to_le_bytes());
    b.extend_from_slice(b"WAVEfmt ");
    b.extend_from_slice(&16u32.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes()); // PCM
    b.extend_from_slice(&channels.to_le_bytes());
    b.extend_from_slice(&rate.to_le_bytes());
    b.extend_from_slice(&(rate * channels as u32 * 2).to_le_bytes());
    b.extend_from_slice(&(channels * 2).to_le_bytes());
    b.extend_from_slice(&16u16.to_le_bytes());
    b.extend_from_slice(b"data");
    b.extend_from_slice(&data_len.to_le_bytes());
    for s in samples {
        b.extend_from_slice(&s.to_le_bytes());
    }
    b
}

#[test]
fn probe_matches_decoded_length() {
    let Some(bytes) = clip() else { return };
    let pcm = decode_mono_16k(&bytes).unwrap();
    let probed = probe_duration(&bytes).unwrap();
    let decoded = pcm.len() as f64 / SAMPLE_RATE as f64;
    assert!((probed - decoded).abs() < 0.01, "{probed} vs {decoded}");
    // The clip's s16 data is 2 bytes per sample after a 44-byte header.
    assert!(((bytes.len() - 44) as f64 / 2.0 / 16_000.0 - probed).abs() < 0.01);
    assert!(pcm.iter().all(|s| (-1.0..=1.0).contains(s)));
    assert!(pcm.iter().any(|s| s.abs() > 0.01), "decoded silence");
}

#[test]
fn garbage_is_unreadable() {
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    for input in [&garbage[..], b"", b"RIFF"] {
        let e = decode_mono_16k(input).unwrap_err();
        assert!(matches!(e, AudioError::Unreadable(_)), "{e:?}");
        assert_eq!(e.code(), "audio_unreadable");
        assert_eq!(
            probe_duration(input).unwrap_err().code(),
            "audio_unreadable"
        );
    }
}

#[test]
fn header_without_samples_is_empty() {
    let bytes = wav(16_000, 1, &[]);
    let e = decode_mono_16k(&bytes).unwrap_err();
    assert!(matches!(e, AudioError::Empty), "{e:?}");
    assert_eq!(e.code(), "audio_empty");
    assert_eq!(probe_duration(&bytes).unwrap_err().code(), "audio_empty");
}

#[test]
fn a_truncated_wav_is_unreadable() {
    let Some(bytes) = clip() else { return };
    // The header claims ~3 s; the data stops after 478 samples: cut short in transfer.
    let err = decode_mono_16k(&bytes[..1000]).unwrap_err();
    assert_eq!(err.code(), "audio_unreadable", "{err:?}");
    assert!(err.to_string().contains("truncated"), "{err}");
}

#[test]
fn stereo_44k1_is_downmixed_and_resampled() {
    // 1 s of a 440 Hz tone on the left channel only, 44.1 kHz stereo.
    let rate = 44_100u32;
    let samples: Vec<i16> = (0..rate)
        .flat_map(|i| {
            let v = (f64::sin(2.0 * std::f64::consts::PI * 440.0 * i as f64 / rate as f64)
                * 16_000.0) as i16;
            [v, 0]
        })
        .collect();
    let bytes = wav(rate, 2, &samples);
    assert!((probe_duration(&bytes).unwrap() - 1.0).abs() < 1e-9);
    let pcm = decode_mono_16k(&bytes).unwrap();
    assert!((pcm.len() as i64 - 16_000).abs() <= 16, "{}", pcm.len());
    // Mean of the two channels: peak about 16000 / 32768 / 2.
    let peak = pcm[1000..15000].iter().fold(0f32, |m, s| m.max(s.abs()));
    assert!((peak - 0.244).abs() < 0.02, "{peak}");
}

#[test]
fn error_codes_are_stable() {
    assert_eq!(
        AudioError::TooLong {
            seconds: 5.0,
            limit: 1.0
        }
        .code(),
        "audio_too_long"
    );
    assert_eq!(AudioError::Empty.code(), "audio_empty");
    assert_eq!(
        AudioError::Unreadable("x".into()).code(),
        "audio_unreadable"
    );
}

/// A WAV header that states `seconds` of 8 kHz mono 16-bit audio, followed by one second of it.
fn wav_stating(seconds: u32) -> Vec<u8> {
    let mut bytes = wav(8_000, 1, &vec![0i16; 8_000]);
    let data_len = seconds * 8_000 * 2;
    bytes[4..8].copy_from_slice(&(36 + data_len).to_le_bytes());
    bytes[40..44].copy_from_slice(&data_len.to_le_bytes());
    bytes
}

/// A recording whose header states ten hours is refused from the header, before any sample is
/// decoded, by the worker's decode and the API's probe alike; the header alone (a file's first
/// bytes) tells the length.
#[test]
fn a_recording_longer_than_the_limit_is_refused_from_its_header() {
    let ten_hours = wav_stating(36_000);
    assert_eq!(probe_prefix(&ten_hours[..1024]).unwrap(), Some(36_000.0));
    match decode_mono_16k_within(&ten_hours, 60.0) {
        Err(AudioError::TooLong { seconds, limit }) => assert_eq!((seconds, limit), (36_000.0, 60.0)),
        other => panic!("expected too long, got {:?}", other.map(|p| p.len())),
    }
    assert_eq!(probe_duration_within(&ten_hours, 60.0).unwrap_err().code(), "audio_too_long");
    // Within the limit the same header is a truncated file, as before.
    assert_eq!(decode_mono_16k(&ten_hours).unwrap_err().code(), "audio_unreadable");
    let second = wav(8_000, 1, &vec![0i16; 8_000]);
    assert_eq!(decode_mono_16k_within(&second, 1.0).unwrap().len(), 16_000);
    assert!(probe_duration_within(&second, 0.5).is_err());
}

/// `frames` silent MPEG-1 Layer III frames (128 kbit/s, 44.1 kHz, mono), with no Xing or VBRI
/// header: a stream whose duration its headers do not state.
fn headerless_mp3(frames: usize) -> Vec<u8> {
    // 144 * 128000 / 44100 = 417 bytes a frame (no padding); zero side information decodes
    // to silence.
    let mut frame = vec![0u8; 417];
    frame[..4].copy_from_slice(&[0xFF, 0xFB, 0x90, 0xC4]);
    frame.repeat(frames)
}

/// Issue 20, item 1: a long MP3 without a duration header is measured from its first bytes and
/// its size, so the API never reads a whole upload to price or refuse it.
#[test]
fn a_headerless_mp3_is_measured_from_its_first_megabyte() {
    let frames = 25_000; // 653 s, 10.4 MB
    let mp3 = headerless_mp3(frames);
    let seconds = frames as f64 * 1152.0 / 44_100.0;
    assert_eq!(
        probe_prefix(&mp3[..tern_audio::HEADER_PREFIX_BYTES]).unwrap(),
        None,
        "no header states it"
    );
    let exact = probe_duration(&mp3).unwrap();
    assert!(
        (exact - seconds).abs() < 0.1,
        "decoded {exact} s, built {seconds} s"
    );
    let estimate =
        estimate_from_prefix(&mp3[..tern_audio::HEADER_PREFIX_BYTES], mp3.len() as u64).unwrap();
    assert!(
        (estimate - seconds).abs() / seconds < 0.01,
        "estimated {estimate} s of {seconds} s"
    );
    // The whole file as its own prefix is exact.
    let short = headerless_mp3(100);
    let whole = estimate_from_prefix(&short, short.len() as u64).unwrap();
    assert!((whole - 100.0 * 1152.0 / 44_100.0).abs() < 0.05, "{whole}");
    assert!(estimate_from_prefix(b"not audio at all, not even close", 1 << 30).is_err());
}
