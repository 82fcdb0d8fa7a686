//! Word error rate and speed, in-process, of the LibriVox clips (four copies of the five, as
//! the service benchmark uses) with full or trimmed window padding, one clip at a time and
//! batched.
//! Usage: cargo run --release --example wer_by_padding -- MODEL_DIR LIBRIVOX_DIR [PADDING...]
//! PADDING: `full` (the whole 30 s window, as Whisper was trained) or a margin in seconds;
//! default `full`. Window batches from PADDING_BATCHES (comma-separated, default `1,16`), beam
//! sizes from WHISPER_BEAMS (comma-separated, default `5`; 1 is greedy).

use tern_models::wer::{word_errors, words};
use std::time::Instant;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use candle_core::Device;
use tern_models::audio::decode_mono_16k;
use tern_models::whisper::{Padding, TranscribeOptions, Whisper};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, librivox, margins @ ..] = args.as_slice() else {
        anyhow::bail!("usage: wer_by_padding MODEL_DIR LIBRIVOX_DIR [MARGIN_SECONDS...]");
    };
    let mut whisper = Whisper::load_ct2(std::path::Path::new(dir), &Device::Cpu)?;
    let refs = std::fs::read_to_string(format!("{librivox}/transcription"))?;
    let clips: Vec<(Vec<f32>, String)> = refs
        .lines()
        .filter_map(|line| {
            let (text, id) = line.rsplit_once(" (")?;
            let id = id.trim_end_matches(')');
            let text = text.replace("<s>", "").replace("</s>", "");
            let pcm = decode_mono_16k(&std::fs::read(format!("{librivox}/{id}.wav")).ok()?).ok()?;
            Some((pcm, text.trim().to_string()))
        })
        .collect();
    // Four copies of the five clips make the benchmark's twenty.
    let clips: Vec<(Vec<f32>, String)> = (0..4).flat_map(|_| clips.iter().cloned()).collect();
    let audio: f64 = clips.iter().map(|(p, _)| p.len() as f64 / 16000.0).sum();
    let margins: Vec<String> = if margins.is_empty() { vec!["full".into()] } else { margins.to_vec() };
    let beams: Vec<usize> = std::env::var("WHISPER_BEAMS").ok().map(|s| s.split(',').filter_map(|b| b.parse().ok()).collect()).unwrap_or(vec![5]);
    for (margin, beam) in margins.iter().flat_map(|m| beams.iter().map(move |&b| (m, b))) {
        let opts = TranscribeOptions {
            padding: margin.parse::<Padding>().map_err(anyhow::Error::msg)?,
            beam_size: beam,
            ..TranscribeOptions::default()
        };
        let batches: Vec<usize> = std::env::var("PADDING_BATCHES").ok().map(|s| s.split(',').filter_map(|b| b.parse().ok()).collect()).unwrap_or(vec![1, 16]);
        for batch in batches {
            let inputs: Vec<(&[f32], &TranscribeOptions)> =
                clips.iter().map(|(p, _)| (p.as_slice(), &opts)).collect();
            let t = Instant::now();
            let out = whisper.transcribe_many(&inputs, batch, &|_| false, &mut |_, _| {});
            let took = t.elapsed().as_secs_f64();
            let (mut errors, mut total) = (0, 0);
            for ((_, reference), tr) in clips.iter().zip(&out) {
                let tr = tr.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
                let r = words(reference);
                errors += word_errors(&r, &words(&tr.text));
                total += r.len();
                if batch == 1 {
                    println!("  {}", tr.text);
                }
            }
            println!(
                "padding {margin} beam {beam} batch {batch}: WER {:.1}% ({errors}/{total}), {audio:.1} s audio in {took:.2} s = {:.1}x real time",
                100.0 * errors as f64 / total as f64,
                audio / took
            );
        }
    }
    Ok(())
}
