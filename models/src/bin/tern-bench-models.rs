//! `tern-bench-models`: throughput of tern's model backends as the worker runs them, without
//! the service around them, on the CPU or a GPU, so the figures compare with the peers'
//! model-level figures (faster-whisper audio-s/s, sentence-transformers texts/s, llama.cpp
//! tokens/s) and show what a GPU worker does with a batch.
//!
//! - transcribe: `--clips` LibriVox clips (the five of `testdata/librivox` in turn; 20 by default) and one
//!   recording of about `--long-seconds` built from them, at each window budget of
//!   `--budgets`; audio seconds per second, word error rate against the references, and how
//!   many clips transcribed differently from budget 1;
//! - audio-embed: the same clips and recording as vectors (`TranscribeOptions::embed`, the
//!   `audio_embed` kind) at each window budget, audio seconds per second, and the largest
//!   difference from budget 1's vectors;
//! - embed: texts of ~15 tokens at batch sizes `--embed-batches`, texts per second; the cosine
//!   reference value of the facts file and the largest batched-against-single difference;
//! - generate: prompt tokens per second (prefill) and generated tokens per second (decode).
//!
//! Build with `--features bench` (and `cuda` for `--device cuda`); the workspace build does.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tern_models::audio::decode_mono_16k;
use tern_models::embed::Embedder;
use tern_models::generate::{ChatMessage, GenerateOptions, GenerationRequest, Llm, Prompt, WeightLayout};
use tern_models::precision::Precision;
use tern_models::wer::{word_errors, words};
use tern_models::whisper::{Padding, TranscribeOptions, Whisper};

// The allocator the worker uses, so the figures are the worker's.
#[global_allocator]
static ALLOCATOR: tern_models::allocator::MiMalloc = tern_models::allocator::MiMalloc;

#[derive(Parser, Debug)]
#[command(name = "tern-bench-models", version, about = "Measure transcription, embedding and generation throughput of tern's model backends")]
struct Args {
    /// Folder of model weights and test audio (scripts/models.sh fills it).
    #[arg(long, env = "TERN_MODELS_DIR", default_value = "~/.cache/tern/models")]
    models_dir: String,
    /// Device: `cpu`, `cuda[:N]` or `metal[:N]` (GPUs need the matching cargo feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Precision of Whisper: auto (F32 on the CPU, F16 on a GPU), f32, f16, bf16 or
    /// bf16-products (F32 with BF16 products where the CPU has AVX-512 BF16 or AMX).
    /// tf32-products: generation on a GPU multiplies steps of more than 8 requests on TF32.
    #[arg(long, default_value = "auto")]
    precision: Precision,
    /// Sections to run, comma-separated: transcribe, audio-embed, embed, generate,
    /// image (Stable Diffusion, `--image-model`), sampling-check (the device's token picks against the host's on the same random logits),
    /// step-check (the fused decoding step against candle's ops on the same caches).
    #[arg(long, value_delimiter = ',', default_value = "transcribe,audio-embed,embed,generate")]
    only: Vec<String>,
    /// Whisper model folder under the models directory.
    #[arg(long, default_value = "whisper-tiny.en")]
    whisper_model: String,
    /// Window budgets (30 s windows run together) to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    budgets: Vec<usize>,
    /// Short clips per window budget, the LibriVox clips in turn (default 20, four of each).
    #[arg(long, default_value_t = 20)]
    clips: usize,
    /// Length of the long recording, seconds.
    #[arg(long, default_value_t = 120.0)]
    long_seconds: f64,
    /// Writes the long recording's transcript here, the words it was scored against beside it
    /// (`FILE.reference`) and its segments (`FILE.segments`: start, end, text), at each budget
    /// in turn (the last one stays): where the errors are.
    #[arg(long)]
    long_text: Option<std::path::PathBuf>,
    /// Whisper padding of short windows: `full` (the worker's default) or seconds kept after
    /// the audio.
    #[arg(long, default_value = "full")]
    padding: Padding,
    /// What the features hold past a window's audio: `zeros` (faster-whisper's, the worker's
    /// default) or `silence` (OpenAI's reference).
    #[arg(long, default_value = "zeros")]
    feature_padding: tern_models::whisper::FeaturePadding,
    /// Whisper beam size: 1 decodes greedily; 5 (the default) is the worker's and
    /// faster-whisper's default.
    #[arg(long, default_value_t = tern_models::whisper::DEFAULT_BEAM_SIZE)]
    beam_size: usize,
    /// Transcribe without timestamp tokens (`<|notimestamps|>`), as transformers' pipeline
    /// does by default.
    #[arg(long)]
    no_timestamps: bool,
    /// Pick tokens from logits copied to the host, as before device picks (the default on a
    /// CPU); on a GPU greedy and beam-search picks are made on the device
    /// (`Whisper::set_device_picks`).
    #[arg(long)]
    host_picks: bool,
    /// Generation: copy each step's logits to the host and pick the tokens there (the same
    /// rules), as before tokens were picked on the device.
    #[arg(long)]
    host_sampling: bool,
    /// Generation: run decoding steps as candle's ops rather than tern's fused kernels (on a
    /// GPU, dense weights), as before the fused step.
    #[arg(long)]
    unfused_step: bool,
    /// Embedding batch sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,32,128")]
    embed_batches: Vec<usize>,
    /// Texts embedded per batch size.
    #[arg(long, default_value_t = 1024)]
    embed_texts: usize,
    /// Embedding model folder under the models directory.
    #[arg(long, default_value = "all-MiniLM-L6-v2")]
    embed_model: String,
    /// Tokens generated per generation run.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Generation runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    gen_runs: usize,
    /// Requests decoded together for the batched generation figure, comma-separated (1 is the
    /// single-request figure above and is skipped here).
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    gen_batches: Vec<usize>,
    /// Sentences in the long prompt of the prefill figure (~16 tokens each).
    #[arg(long, default_value_t = 60)]
    prefill_sentences: usize,
    /// Language model folder under the models directory.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    llm_model: String,
    /// The language model's matrices: `auto` (tern's own pass on the CPU, dense on a GPU), or
    /// candle's ops with them `quantized` (as stored) or `dense` (dequantized to F32 at load).
    #[arg(long, default_value = "auto")]
    llm_weights: String,
    /// Image generation: a diffusers folder (a path, or a folder under the models directory).
    #[arg(long, default_value = "sd-turbo")]
    image_model: String,
    /// Image generation: images generated together, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    image_batches: Vec<usize>,
    /// Image generation: denoising steps (Euler, no guidance: how the Turbo models run).
    #[arg(long, default_value_t = 1)]
    image_steps: usize,
    /// Image generation: width and height, pixels.
    #[arg(long, default_value_t = 512)]
    image_size: usize,
    /// Image generation: timed runs per batch size after a warmup (the fastest is reported).
    #[arg(long, default_value_t = 2)]
    image_runs: usize,
    /// Also transcribe the clips with faster-whisper (float32, on the same CTranslate2 weights,
    /// `scripts/peers/whisper_reference.py`) through this Python (`scripts/services.sh
    /// faster-whisper` makes one: `$TERN_STATE_DIR/faster-whisper/venv/bin/python`), and print
    /// its word error rate beside tern's, same clips, same normalisation (`wer.rs`).
    #[arg(long, env = "TERN_FASTER_WHISPER_PYTHON")]
    faster_whisper_python: Option<PathBuf>,
}

fn parse_device(s: &str) -> Result<Device> {
    let (kind, ordinal) = match s.split_once(':') {
        Some((k, n)) => (k, n.parse::<usize>().context("device ordinal")?),
        None => (s, 0),
    };
    Ok(match kind {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(ordinal)?,
        "metal" => Device::new_metal(ordinal)?,
        other => bail!("unknown device {other:?}; use cpu, cuda[:N] or metal[:N]"),
    })
}

fn expand_home(path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.into(),
    }
}

fn progress(len: usize, msg: String) -> Result<ProgressBar> {
    let pb = ProgressBar::new(len as u64);
    pb.set_style(ProgressStyle::with_template("{msg:>16} [{bar:30}] {pos}/{len}")?.progress_chars("=> "));
    pb.set_message(msg);
    Ok(pb)
}

fn main() -> Result<()> {
    tern_models::allocator::keep_freed_memory();
    tern_models::cpu_threads::settle_thread_count();
    let args = Args::parse();
    let dir = expand_home(&args.models_dir);
    let device = parse_device(&args.device)?;
    let bf16 = match Precision::cpu_bf16_kernel() {
        Some(kernel) if args.device == "cpu" && args.precision == Precision::Bf16Products => format!(" (BF16 products on {kernel})"),
        _ => String::new(),
    };
    println!("tern-bench-models: device {}, precision {}{bf16}", args.device, args.precision);
    for section in &args.only {
        match section.as_str() {
            "transcribe" => transcribe(&args, &dir, &device)?,
            "audio-embed" => audio_embed(&args, &dir, &device)?,
            "embed" => embed(&args, &dir, &device)?,
            "generate" => generate(&args, &dir, &device)?,
            "sampling-check" => sampling_check(&device)?,
            "step-check" => step_check(&args, &dir, &device)?,
            "image" => image(&args, &dir, &device)?,
            other => bail!("unknown section {other:?}; use transcribe, audio-embed, embed, generate, image, sampling-check or step-check"),
        }
    }
    Ok(())
}

/// Seconds per image and images per minute of a diffusers folder at each `--image-batches`
/// size, prompts encoded, denoised and decoded (what a job costs the worker, less the PNG),
/// printed as JSON lines beside `scripts/peers/diffusers_bench.py run`'s.
fn image(args: &Args, dir: &Path, device: &Device) -> Result<()> {
    use tern_models::diffusion::{BatchShape, Noise, Sample, SchedulerKind, StableDiffusion};
    let folder = if Path::new(&args.image_model).is_dir() { PathBuf::from(&args.image_model) } else { dir.join(&args.image_model) };
    let started = Instant::now();
    let model = StableDiffusion::load(&folder, device, args.precision.dtype(device))?;
    println!("image: {} loaded in {:.1} s ({:.2} GB resident)", folder.display(), started.elapsed().as_secs_f64(), model.resident_bytes() as f64 / 1e9);
    let shape = BatchShape { width: args.image_size, height: args.image_size, steps: args.image_steps, scheduler: SchedulerKind::Euler, guided: false };
    for &batch in &args.image_batches {
        let samples: Vec<Sample> = (0..batch)
            .map(|i| Sample { prompt: "a lighthouse at dusk".into(), negative_prompt: None, guidance: 0.0, noise: Noise::Seed(i as u64) })
            .collect();
        model.generate(shape, &samples, &mut |_, _| true)?;
        let mut best = f64::MAX;
        let mut phases = Default::default();
        for _ in 0..args.image_runs.max(1) {
            let started = Instant::now();
            let (_, timings) = model.generate(shape, &samples, &mut |_, _| true)?;
            let seconds = started.elapsed().as_secs_f64();
            if seconds < best {
                (best, phases) = (seconds, timings);
            }
        }
        let tern_models::diffusion::pipeline::Timings { encode_ms, denoise_ms, decode_ms } = phases;
        println!(
            "{}",
            serde_json::json!({"engine": "tern", "model": folder.file_name().map(|f| f.to_string_lossy()), "device": args.device, "batch": batch,
                "steps": args.image_steps, "size": args.image_size, "seconds": (best * 1000.0).round() / 1000.0,
                "seconds_per_image": (best / batch as f64 * 1000.0).round() / 1000.0, "images_per_minute": (60.0 * batch as f64 / best * 100.0).round() / 100.0,
                "encode_ms": encode_ms, "denoise_ms": denoise_ms, "decode_ms": decode_ms})
        );
    }
    Ok(())
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// A LibriVox clip: its id (the file's stem), 16 kHz samples and reference transcript.
struct Clip {
    id: String,
    pcm: Vec<f32>,
    text: String,
}

/// The LibriVox clips, in the transcription file's order.
fn librivox(dir: &Path) -> Result<Vec<Clip>> {
    let refs = std::fs::read_to_string(dir.join("transcription")).context("test speech missing: run scripts/models.sh")?;
    refs.lines()
        .filter_map(|line| {
            let (text, id) = line.rsplit_once(" (")?;
            let id = id.trim_end_matches(')').to_string();
            Some((text.replace("<s>", "").replace("</s>", "").trim().to_string(), id))
        })
        .map(|(text, id)| {
            let wav = std::fs::read(dir.join(format!("{id}.wav"))).with_context(|| format!("reading {id}.wav"))?;
            Ok(Clip { pcm: decode_mono_16k(&wav)?, id, text })
        })
        .collect()
}

/// The Whisper sections' speech: the LibriVox clips, and one recording of about
/// `--long-seconds` made of them in turn, half a second of silence after each, with its
/// reference words.
struct Speech {
    clips: Vec<Clip>,
    long: Vec<f32>,
    long_words: Vec<String>,
}

impl Speech {
    fn load(args: &Args, dir: &Path) -> Result<Speech> {
        let clips = librivox(&dir.join("testdata/librivox"))?;
        anyhow::ensure!(!clips.is_empty(), "no LibriVox clips found");
        let (mut long, mut long_words) = (Vec::new(), Vec::new());
        for clip in clips.iter().cycle() {
            if long.len() as f64 / 16_000.0 >= args.long_seconds {
                break;
            }
            long.extend_from_slice(&clip.pcm);
            long.extend(std::iter::repeat_n(0.0f32, 8_000));
            long_words.extend(words(&clip.text));
        }
        Ok(Speech { clips, long, long_words })
    }

    /// `n` clips, the LibriVox ones in turn, and their seconds of audio.
    fn short(&self, n: usize) -> (Vec<&Clip>, f64) {
        let short: Vec<&Clip> = self.clips.iter().cycle().take(n).collect();
        let seconds = short.iter().map(|c| c.pcm.len() as f64 / 16_000.0).sum();
        (short, seconds)
    }

    fn long_seconds(&self) -> f64 {
        self.long.len() as f64 / 16_000.0
    }
}

fn transcribe(args: &Args, dir: &Path, device: &Device) -> Result<()> {
    let speech = Speech::load(args, dir)?;
    let (short, short_seconds) = speech.short(args.clips);
    let (long, long_words, long_seconds) = (&speech.long, &speech.long_words, speech.long_seconds());

    let started = Instant::now();
    let mut whisper = Whisper::load_in(&dir.join(&args.whisper_model), device, args.precision)?;
    let largest = args.budgets.iter().copied().max().unwrap_or(1);
    if args.host_picks {
        whisper.set_device_picks(false)?;
    }
    whisper.warmup(largest, args.beam_size)?;
    println!(
        "{}: loaded and warmed up at {largest} windows in {:.2} s ({:.0} MB of weights); {} clips ({short_seconds:.1} s of audio), one {long_seconds:.1} s recording; beam size {}, padding {:?}, picks on the {}",
        args.whisper_model,
        started.elapsed().as_secs_f64(),
        whisper.weights_bytes() as f64 / 1e6,
        short.len(),
        args.beam_size,
        args.padding,
        if args.host_picks || device.is_cpu() { "host" } else { "device" }
    );
    let opts = TranscribeOptions { padding: args.padding, feature_padding: args.feature_padding, beam_size: args.beam_size, timestamps: !args.no_timestamps, ..TranscribeOptions::default() };
    let mut rows = Vec::new();
    let mut alone: Option<Vec<String>> = None;
    for &budget in &args.budgets {
        let inputs: Vec<(&[f32], &TranscribeOptions)> = short.iter().map(|c| (c.pcm.as_slice(), &opts)).collect();
        let pb = progress(inputs.len(), format!("budget {budget}"))?;
        let (t, from) = (Instant::now(), unix_seconds());
        let out = whisper.transcribe_many(&inputs, budget, &|_| false, &mut |_, _| {});
        let short_secs = t.elapsed().as_secs_f64();
        pb.finish_and_clear();
        // For samplers of device use running beside (scripts/gpu/round.sh): the clips' span.
        println!("budget {budget}: clips ran from {from:.3} to {:.3} (unix seconds)", unix_seconds());
        let texts = out
            .into_iter()
            .map(|r| r.map(|t| t.text).map_err(|e| anyhow::anyhow!("{e:#}")))
            .collect::<Result<Vec<_>>>()?;
        let (mut errors, mut total) = (0, 0);
        for (clip, text) in short.iter().zip(&texts) {
            let r = words(&clip.text);
            errors += word_errors(&r, &words(text));
            total += r.len();
        }
        let differ = alone.as_ref().map_or(0, |a| a.iter().zip(&texts).filter(|(a, b)| a != b).count());
        alone.get_or_insert(texts);

        let t = Instant::now();
        let long_out = whisper.transcribe_many(&[(long.as_slice(), &opts)], budget, &|_| false, &mut |_, _| {});
        let long_secs = t.elapsed().as_secs_f64();
        let long_transcript = long_out.into_iter().next().context("one result")?.map_err(|e| anyhow::anyhow!("{e:#}"))?;
        let long_text = long_transcript.text.clone();
        let long_wer = word_errors(&long_words, &words(&long_text)) as f64 / long_words.len().max(1) as f64;
        if let Some(path) = &args.long_text {
            std::fs::write(path, &long_text)?;
            std::fs::write(path.with_extension("reference"), long_words.join(" "))?;
            let segments: Vec<String> = long_transcript.segments.iter().map(|s| format!("{:.2}\t{:.2}\t{}", s.start, s.end, s.text.trim())).collect();
            std::fs::write(path.with_extension("segments"), segments.join("\n"))?;
        }
        rows.push((budget, short_seconds / short_secs, 100.0 * errors as f64 / total as f64, differ, long_seconds / long_secs, 100.0 * long_wer));
    }
    println!(
        "{:>8} {:>16} {:>10} {:>14} {:>16} {:>10}",
        "budget", "clips audio-s/s", "clips WER", "differ from 1", "long audio-s/s", "long WER"
    );
    for (budget, short_rate, wer, differ, long_rate, long_wer) in &rows {
        println!("{budget:>8} {short_rate:>16.1} {wer:>9.1}% {differ:>14} {long_rate:>16.1} {long_wer:>9.1}%");
    }
    if let Some(python) = &args.faster_whisper_python {
        let (theirs, version) = faster_whisper_wer(python, args, dir, &speech.clips, &short)?;
        println!(
            "clips WER, the same clips and normalisation: tern {:.1}% (budget {}, padding {:?}, beam {}), faster-whisper {version} {theirs:.1}% (full padding, beam {}, float32)",
            rows.first().map_or(0.0, |r| r.2),
            rows.first().map_or(0, |r| r.0),
            args.padding,
            args.beam_size,
            args.beam_size
        );
    }
    Ok(())
}

/// Recordings as vectors (`audio_embed`): the clips and the long recording at each window
/// budget, audio seconds per second, and how far each budget's vectors lie from budget 1's.
fn audio_embed(args: &Args, dir: &Path, device: &Device) -> Result<()> {
    let speech = Speech::load(args, dir)?;
    let (short, short_seconds) = speech.short(args.clips);
    let (long, long_seconds) = (&speech.long, speech.long_seconds());
    let mut whisper = Whisper::load_in(&dir.join(&args.whisper_model), device, args.precision)?;
    whisper.warmup(args.budgets.iter().copied().max().unwrap_or(1), 1)?;
    let opts = TranscribeOptions { embed: true, padding: args.padding, ..TranscribeOptions::default() };
    println!("{} audio-embed: {} clips ({short_seconds:.1} s of audio), one {long_seconds:.1} s recording, padding {:?}", args.whisper_model, short.len(), args.padding);
    println!("{:>8} {:>16} {:>16} {:>16}", "budget", "clips audio-s/s", "long audio-s/s", "max |Δ| from 1");
    let mut first: Option<Vec<Vec<f32>>> = None;
    for &budget in &args.budgets {
        let inputs: Vec<(&[f32], &TranscribeOptions)> = short.iter().map(|c| (c.pcm.as_slice(), &opts)).collect();
        let pb = progress(inputs.len(), format!("budget {budget}"))?;
        let t = Instant::now();
        let out = whisper.transcribe_many(&inputs, budget, &|_| false, &mut |_, _| {});
        let short_secs = t.elapsed().as_secs_f64();
        pb.finish_and_clear();
        let vectors = out
            .into_iter()
            .map(|r| r.map_err(|e| anyhow::anyhow!("{e:#}"))?.embedding.map(|e| e.vector).context("no embedding"))
            .collect::<Result<Vec<_>>>()?;
        let t = Instant::now();
        let long_out = whisper.transcribe_many(&[(long.as_slice(), &opts)], budget, &|_| false, &mut |_, _| {});
        let long_secs = t.elapsed().as_secs_f64();
        long_out.into_iter().next().context("one result")?.map_err(|e| anyhow::anyhow!("{e:#}"))?;
        let first = first.get_or_insert_with(|| vectors.clone());
        let apart = first.iter().flatten().zip(vectors.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("{budget:>8} {:>16.1} {:>16.1} {apart:>16.1e}", short_seconds / short_secs, long_seconds / long_secs);
    }
    Ok(())
}

/// faster-whisper's transcripts of the LibriVox clips (`scripts/peers/whisper_reference.py`,
/// greedy or with `--beam-size`), scored as tern's are over `short`: its WER (percent) and
/// version.
fn faster_whisper_wer(python: &Path, args: &Args, dir: &Path, clips: &[Clip], short: &[&Clip]) -> Result<(f64, String)> {
    let librivox = dir.join("testdata/librivox");
    let out = std::env::temp_dir().join(format!("tern-faster-whisper-{}", std::process::id()));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/peers/whisper_reference.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(&script).arg("--models").arg(dir).arg("--out").arg(&out).arg("--model").arg(&args.whisper_model);
    if args.beam_size > 1 {
        cmd.arg("--beam").arg(args.beam_size.to_string());
    }
    cmd.args(clips.iter().map(|c| librivox.join(format!("{}.wav", c.id))));
    let status = cmd.stdout(std::process::Stdio::null()).status().with_context(|| format!("running {}", python.display()))?;
    anyhow::ensure!(status.success(), "faster-whisper's reference failed: {status}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("reference.json"))?)?;
    let _ = std::fs::remove_dir_all(&out);
    let run = if args.beam_size > 1 { format!("beam{}", args.beam_size) } else { "greedy".to_string() };
    let texts = &json["transcripts"][&args.whisper_model][run.as_str()];
    let (mut errors, mut total) = (0, 0);
    for clip in short {
        let text = texts[&clip.id].as_str().with_context(|| format!("no transcript of {}", clip.id))?;
        let r = words(&clip.text);
        errors += word_errors(&r, &words(text));
        total += r.len();
    }
    Ok((100.0 * errors as f64 / total.max(1) as f64, json["faster_whisper"].as_str().unwrap_or("?").to_string()))
}

/// Sentences of about 15 tokens, varied so tokenisation is not trivially repeated.
fn sentence(i: usize) -> String {
    const SUBJECTS: [&str; 4] = ["The quiet engineer", "A small red fox", "Our weekly newsletter", "The old harbour crane"];
    const VERBS: [&str; 4] = ["quickly reviewed", "slowly crossed", "carefully described", "proudly repaired"];
    const OBJECTS: [&str; 4] = ["the long report on river pollution", "a frozen field near the village", "every change to the city budget", "the broken gate behind the station"];
    format!("{} {} {} number {i}.", SUBJECTS[i % 4], VERBS[(i / 4) % 4], OBJECTS[(i / 16) % 4])
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn embed(args: &Args, dir: &Path, device: &Device) -> Result<()> {
    let embedder = Embedder::load_in(&dir.join(&args.embed_model), device, args.precision).context("run scripts/models.sh --all")?;
    let texts: Vec<String> = (0..args.embed_texts).map(sentence).collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let tokens: usize = embedder.count_tokens(&refs)?.iter().sum();
    // The facts file's check: cosine of these two sentences is 0.755 (sentence-transformers).
    let pair = embedder.embed(&["A man is eating food.", "A man is eating a piece of bread."])?;
    let cosine = dot(&pair[0], &pair[1]);
    let batched = embedder.embed(&refs[..64.min(refs.len())])?;
    let mut worst = 0f32;
    for (text, b) in refs.iter().zip(&batched) {
        let single = embedder.embed(&[text])?.remove(0);
        // NaN must not vanish in the max.
        worst = single.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(worst, |m, d| if d.is_nan() || m.is_nan() { f32::NAN } else { m.max(d) });
    }
    anyhow::ensure!(cosine.is_finite() && worst.is_finite(), "non-finite embeddings (cosine {cosine}, difference {worst})");
    println!(
        "{}: {} texts ({:.1} tokens each on average); cosine check {cosine:.4} (reference 0.755); batched vs single, largest difference {worst:.2e}",
        args.embed_model,
        texts.len(),
        tokens as f64 / texts.len() as f64
    );
    println!("{:>12} {:>12}", "batch", "texts/s");
    for &batch in &args.embed_batches {
        let pb = progress(refs.len(), format!("batch {batch}"))?;
        let start = Instant::now();
        for chunk in refs.chunks(batch.max(1)) {
            embedder.embed(chunk)?;
            pb.inc(chunk.len() as u64);
        }
        let secs = start.elapsed().as_secs_f64();
        pb.finish_and_clear();
        println!("{:>12} {:>12.1}", batch, refs.len() as f64 / secs);
    }
    Ok(())
}

fn generate(args: &Args, dir: &Path, device: &Device) -> Result<()> {
    let path = dir.join(&args.llm_model);
    let llm = match args.llm_weights.as_str() {
        "auto" => Llm::load_gguf(&path, device),
        "quantized" => Llm::load_gguf_portable(&path, device, WeightLayout::Quantized),
        "dense" => Llm::load_gguf_portable(&path, device, WeightLayout::Dense),
        other => bail!("--llm-weights: {other:?} is not auto, quantized or dense"),
    }
    .context("run scripts/models.sh --all")?;
    eprintln!("{}: weights {} ({:.0} MB resident)", args.llm_model, args.llm_weights, llm.weights_bytes() as f64 / 1e6);
    llm.set_device_sampling(!args.host_sampling);
    llm.set_fused_step(!args.unfused_step);
    llm.set_precision(args.precision);
    println!(
        "{}: tokens picked on the {}; steps {}; precision {}",
        args.llm_model,
        if args.host_sampling { "host" } else { "logits' device" },
        if args.unfused_step { "as candle's ops" } else { "fused where they can be" },
        args.precision
    );
    let prompt = Prompt::Chat(vec![ChatMessage::new("user", "Write a long story about a lighthouse keeper who finds a message in a bottle.")]);
    let prompt_tokens = llm.count_tokens(&prompt)?;
    // A long prompt for the prefill figure.
    let long_prompt = Prompt::Text((0..args.prefill_sentences).map(sentence).collect::<Vec<_>>().join(" "));
    let long_tokens = llm.count_tokens(&long_prompt)?;
    let one = GenerateOptions { max_tokens: 1, temperature: 0.0, ..Default::default() };
    llm.generate(&prompt, &one, &mut |_, _| true)?; // warm-up
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for run in 0..args.gen_runs.max(1) {
        let start = Instant::now();
        llm.generate(&long_prompt, &one, &mut |_, _| true)?;
        prefill.push(long_tokens as f64 / start.elapsed().as_secs_f64());

        // Decode rate: time between the first and the last generated token.
        let opts = GenerateOptions { max_tokens: args.gen_tokens, temperature: 0.0, seed: run as u64, ..Default::default() };
        let mut first: Option<(Instant, usize)> = None;
        let mut last = (Instant::now(), 0);
        let g = llm.generate(&prompt, &opts, &mut |_, n| {
            let now = Instant::now();
            first.get_or_insert((now, n));
            last = (now, n);
            true
        })?;
        let (t0, n0) = first.context("no token generated")?;
        let secs = last.0.duration_since(t0).as_secs_f64();
        if last.1 > n0 && secs > 0.0 {
            decode.push((last.1 - n0) as f64 / secs);
        }
        eprintln!("run {run}: {} tokens generated", g.completion_tokens);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    println!(
        "{}: prefill {:.0} tokens/s ({long_tokens} prompt tokens), decode {:.1} tokens/s (prompt of {prompt_tokens} tokens, up to {} generated; median of {} runs)",
        args.llm_model,
        median(&mut prefill),
        median(&mut decode),
        args.gen_tokens,
        args.gen_runs
    );
    // Several requests at once: sampled (temperature 0.7), each with its own seed, so their
    // texts differ; all tokens generated over the wall time, prompts included.
    for &batch in args.gen_batches.iter().filter(|&&b| b > 1) {
        let opts: Vec<GenerateOptions> = (0..batch)
            .map(|i| GenerateOptions { max_tokens: args.gen_tokens, temperature: 0.7, seed: i as u64, ..Default::default() })
            .collect();
        let mut callbacks: Vec<Box<dyn FnMut(&str, usize) -> bool>> = (0..batch).map(|_| Box::new(|_: &str, _: usize| true) as Box<dyn FnMut(&str, usize) -> bool>).collect();
        let requests = opts
            .iter()
            .zip(callbacks.iter_mut())
            .map(|(options, on_text)| GenerationRequest { prompt: &prompt, options, on_text: on_text.as_mut() })
            .collect();
        let start = Instant::now();
        let results = llm.generate_batch(requests);
        let secs = start.elapsed().as_secs_f64();
        let mut tokens = 0;
        for r in results {
            tokens += r?.completion_tokens;
        }
        println!("{}: {batch} requests together: {:.1} tokens/s in all ({tokens} tokens in {secs:.2} s)", args.llm_model, tokens as f64 / secs);
        let s = llm.last_batch_stats();
        let per_step = |secs: f64| 1e3 * secs / s.steps.max(1) as f64;
        // On a GPU a step's kernels run asynchronously: their wait falls in picking, where
        // the tokens come back; the step's whole time is the sum.
        println!(
            "  {} prompts read in {:.2} s; {} steps of {:.1} rows on average, per step {:.2} ms: forward {:.2} ms, picking {:.2} ms, text {:.2} ms",
            s.prefills,
            s.prefill_secs,
            s.steps,
            s.rows as f64 / s.steps.max(1) as f64,
            per_step(s.forward_secs + s.sample_secs + s.text_secs),
            per_step(s.forward_secs),
            per_step(s.sample_secs),
            per_step(s.text_secs)
        );
    }
    // Continuous batching: a short request (16 tokens) arrives 10 steps into a long one
    // (`--gen-tokens`). Joined, it is answered after its own tokens; in a static batch it would
    // wait for the long one to end first.
    let long_opts = GenerateOptions { max_tokens: args.gen_tokens, temperature: 0.0, ..Default::default() };
    let short_opts = GenerateOptions { max_tokens: 16, temperature: 0.0, ..Default::default() };
    let (mut a, mut b) = (|_: &str, _: usize| true, |_: &str, _: usize| true);
    let mut first = Some(GenerationRequest { prompt: &prompt, options: &long_opts, on_text: &mut a });
    let mut second = Some(GenerationRequest { prompt: &prompt, options: &short_opts, on_text: &mut b });
    let (mut calls, mut arrived) = (0, None);
    let mut ended: Vec<(usize, Instant, usize)> = Vec::new();
    let start = Instant::now();
    llm.generate_continuous(
        &mut |_| {
            calls += 1;
            match calls {
                1 => first.take().into_iter().collect(),
                11 => {
                    arrived = Some(Instant::now());
                    second.take().into_iter().collect()
                }
                _ => Vec::new(),
            }
        },
        &mut |number, result| ended.push((number, Instant::now(), result.map(|g| g.completion_tokens).unwrap_or(0))),
    );
    let arrived = arrived.context("the long request ended before the short one arrived: raise --gen-tokens")?;
    let end_of = |n: usize| ended.iter().find(|e| e.0 == n).map(|e| e.1).context("a request never ended");
    let (short_end, long_end) = (end_of(1)?, end_of(0)?);
    println!(
        "{}: a 16-token request arriving 10 steps into a {}-token one: answered {:.0} ms after it arrived (joined); the long one ended {:.0} ms after it ({:.2} s in all)",
        args.llm_model,
        args.gen_tokens,
        short_end.duration_since(arrived).as_secs_f64() * 1e3,
        long_end.duration_since(arrived).as_secs_f64() * 1e3,
        long_end.duration_since(start).as_secs_f64(),
    );
    Ok(())
}

/// The fused decoding step against candle's ops, dense weights, on the same caches: greedy
/// steps of 1 to 64 requests (the matrix-vector kernels up to 8 rows, cuBLAS above), their
/// logits' largest difference, tokens that agree, and each way's time a step.
fn step_check(args: &Args, dir: &Path, device: &Device) -> Result<()> {
    let llm = Llm::load_gguf_portable(&dir.join(&args.llm_model), device, WeightLayout::Dense).context("run scripts/models.sh --all")?;
    llm.compare_fused_step(1, 2)?; // compiles and loads the kernels
    // F32 products (the default) must match candle's F32 ops to rounding; TF32 ones (more than
    // 8 rows, `tf32-products`) are reported beside them.
    let mut worst = 0f32;
    for (precision, requests) in [(Precision::F32, 1), (Precision::F32, 2), (Precision::F32, 8), (Precision::F32, 9), (Precision::F32, 64), (Precision::F32, 256), (Precision::Tf32Products, 9), (Precision::Tf32Products, 64), (Precision::Tf32Products, 256)] {
        llm.set_precision(precision);
        let Some(c) = llm.compare_fused_step(requests, 32)? else { bail!("{} is not served by the batched pass", args.llm_model) };
        let rows = c.requests * c.steps;
        println!(
            "step check: {requests} requests, products {}, {} steps: logits differ by at most {:.2e} (largest {:.1}); {} of {rows} greedy tokens agree; a step {:.3} ms fused, {:.3} ms as candle's ops",
            if precision == Precision::Tf32Products && requests > 8 { "TF32" } else { "F32" },
            c.steps,
            c.max_diff,
            c.max_logit,
            c.same_tokens,
            1e3 * c.fused_secs / c.steps as f64,
            1e3 * c.plain_secs / c.steps as f64
        );
        if precision != Precision::Tf32Products {
            worst = worst.max(c.max_diff / c.max_logit.max(1.0));
        }
    }
    if worst > 1e-3 {
        bail!("the fused step's logits differ from candle's by {worst:.2e} of the largest logit");
    }
    Ok(())
}

/// The device's token picks against the host's on the same random logits (rows the size of a
/// large step, SmolLM2's vocabulary, every kind of setting), and the time of each. Rows may
/// differ only where a draw falls within rounding of a boundary between two tokens (the
/// device's exp is not the host's).
fn sampling_check(device: &Device) -> Result<()> {
    use tern_models::generate::sampling::{pick_tokens, RowSettings};
    let (rows, vocab) = (256, 49_152);
    // Peaked like a language model's: a few tokens stand out.
    let logits = (Tensor::randn(0f32, 1.0, (rows, vocab), device)? * 3.0)?;
    let host = logits.to_device(&Device::Cpu)?;
    let settings: Vec<RowSettings> = (0..rows)
        .map(|r| {
            let u = ((r as f32 + 0.5) * 0.618_034).fract();
            match r % 5 {
                0 => RowSettings { temperature: 0.0, top_p: 1.0, top_k: 0, u },
                1 => RowSettings { temperature: 0.7, top_p: 1.0, top_k: 0, u },
                2 => RowSettings { temperature: 0.9, top_p: 0.9, top_k: 0, u },
                3 => RowSettings { temperature: 1.0, top_p: 1.0, top_k: 40, u },
                _ => RowSettings { temperature: 0.6, top_p: 0.95, top_k: 50, u },
            }
        })
        .collect();
    let on_device = pick_tokens(&logits, &settings)?; // compiles and loads the kernel
    let on_host = pick_tokens(&host, &settings)?;
    let agree = on_device.iter().zip(&on_host).filter(|(a, b)| a == b).count();
    let time = |f: &dyn Fn() -> Result<Vec<u32>>| -> Result<f64> {
        let start = Instant::now();
        for _ in 0..20 {
            f()?;
        }
        Ok(start.elapsed().as_secs_f64() * 1e3 / 20.0)
    };
    let device_ms = time(&|| Ok(pick_tokens(&logits, &settings)?))?;
    let host_ms = time(&|| Ok(pick_tokens(&logits.to_device(&Device::Cpu)?, &settings)?))?;
    println!(
        "sampling check: {agree} of {rows} rows pick the same token on the device as on the host; {rows} rows x {vocab} picked in {device_ms:.2} ms on the device, {host_ms:.2} ms copied to the host and picked there"
    );
    if agree + rows / 50 < rows {
        bail!("the device's picks differ from the host's on {} of {rows} rows", rows - agree);
    }
    Ok(())
}

