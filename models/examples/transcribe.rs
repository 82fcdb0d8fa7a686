//! Transcribes audio files with a CT2 Whisper folder and prints the transcript and timing.
//! Usage: cargo run --release --example transcribe -- MODEL_DIR FILE...

use std::time::Instant;

// The worker's allocator, so timings match the service.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use candle_core::Device;
use tern_models::audio::decode_mono_16k;
use tern_models::whisper::{TranscribeOptions, Whisper};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, files) = args
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("usage: transcribe MODEL_DIR FILE..."))?;
    let mut whisper = Whisper::load_ct2(std::path::Path::new(dir), &Device::Cpu)?;
    for f in files {
        let pcm = decode_mono_16k(&std::fs::read(f)?)?;
        let t = Instant::now();
        let tr = whisper.transcribe(&pcm, &TranscribeOptions::default(), &mut |_, _| {})?;
        let took = t.elapsed().as_secs_f64();
        println!(
            "{f}: {:.2} s audio in {took:.2} s ({:.1} audio-s/s): {}",
            tr.duration,
            tr.duration / took,
            tr.text
        );
    }
    Ok(())
}
