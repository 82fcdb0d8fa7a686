//! Word timestamps of Whisper tiny.en (F32, full 30 s padding, as faster-whisper pads) on every
//! LibriVox test clip, as JSON `{clip: [[word, start, end], ...]}` on stdout, for
//! scripts/peers/faster_whisper_words.py to compare with faster-whisper's.
//!
//! `TERN_MODELS_DIR=... cargo run --release -p tern-models --example word_times > tern_words.json`

use candle_core::Device;
use tern_models::audio::decode_mono_16k;
use tern_models::whisper::{TranscribeOptions, Whisper};
fn main() {
    let dir = std::path::PathBuf::from(std::env::var("TERN_MODELS_DIR").expect("TERN_MODELS_DIR: the models folder (scripts/models.sh)"));
    let mut w = Whisper::load_ct2_in(&dir.join("whisper-tiny.en"), &Device::Cpu, tern_models::precision::Precision::F32).unwrap();
    let mut out = serde_json::Map::new();
    let mut names: Vec<_> = std::fs::read_dir(dir.join("testdata/librivox")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "wav")).collect();
    names.sort();
    for p in names {
        let pcm = decode_mono_16k(&std::fs::read(&p).unwrap()).unwrap();
        let o = TranscribeOptions { word_timestamps: true, padding: tern_models::whisper::Padding::Full, ..Default::default() };
        let t = w.transcribe(&pcm, &o, &mut |_, _| {}).unwrap();
        let words: Vec<_> = t.segments.iter().flat_map(|s| s.words.clone().unwrap()).map(|w| serde_json::json!([w.word, w.start, w.end])).collect();
        out.insert(p.file_name().unwrap().to_str().unwrap().to_string(), words.into());
    }
    println!("{}", serde_json::Value::Object(out));
}
