//! `tern-bench-models`: throughput of the embedding and generation models as the worker runs
//! them (candle on this machine's CPU), without the service around them, so the figures compare
//! with the peers' model-level figures: sentence-transformers texts/s and llama.cpp tokens/s.
//!
//! - embeddings: texts of ~15 tokens at batch sizes `--embed-batches`, texts per second;
//! - generation: prompt tokens per second (prefill) and generated tokens per second (decode).

use anyhow::{Context, Result};
use candle_core::Device;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Instant;
use tern_models::embed::Embedder;
use tern_models::generate::{ChatMessage, GenerateOptions, Llm, Prompt};

// The allocator the worker uses, so the figures are the worker's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(name = "tern-bench-models", version, about = "Measure embedding and generation throughput of tern's model backends")]
struct Args {
    /// Embedding batch sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,32,128")]
    embed_batches: Vec<usize>,
    /// Texts embedded per batch size.
    #[arg(long, default_value_t = 1024)]
    embed_texts: usize,
    /// Tokens generated per generation run.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Generation runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    gen_runs: usize,
    /// Embedding model folder under the models directory.
    #[arg(long, default_value = "all-MiniLM-L6-v2")]
    embed_model: String,
    /// Language model folder under the models directory.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    llm_model: String,
}

/// Sentences of about 15 tokens, varied so tokenisation is not trivially repeated.
fn sentence(i: usize) -> String {
    const SUBJECTS: [&str; 4] = ["The quiet engineer", "A small red fox", "Our weekly newsletter", "The old harbour crane"];
    const VERBS: [&str; 4] = ["quickly reviewed", "slowly crossed", "carefully described", "proudly repaired"];
    const OBJECTS: [&str; 4] = ["the long report on river pollution", "a frozen field near the village", "every change to the city budget", "the broken gate behind the station"];
    format!("{} {} {} number {i}.", SUBJECTS[i % 4], VERBS[(i / 4) % 4], OBJECTS[(i / 16) % 4])
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dir = tern_e2e::models_dir();
    let device = Device::Cpu;

    let embedder = Embedder::load(&dir.join(&args.embed_model), &device).context("run scripts/models.sh --all")?;
    let texts: Vec<String> = (0..args.embed_texts).map(sentence).collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let tokens: usize = embedder.count_tokens(&refs)?.iter().sum();
    println!(
        "tern-bench-models: {} on {} texts ({:.1} tokens each on average)",
        args.embed_model,
        texts.len(),
        tokens as f64 / texts.len() as f64
    );
    embedder.embed(&refs[..8.min(refs.len())])?; // warm-up
    println!("{:>12} {:>12}", "batch", "texts/s");
    for &batch in &args.embed_batches {
        let pb = ProgressBar::new(refs.len() as u64);
        pb.set_style(ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len}")?.progress_chars("=> "));
        pb.set_message(format!("batch {batch}"));
        let start = Instant::now();
        for chunk in refs.chunks(batch.max(1)) {
            embedder.embed(chunk)?;
            pb.inc(chunk.len() as u64);
        }
        let secs = start.elapsed().as_secs_f64();
        pb.finish_and_clear();
        println!("{:>12} {:>12.1}", batch, refs.len() as f64 / secs);
    }
    drop(embedder);

    let llm = Llm::load_gguf(&dir.join(&args.llm_model), &device).context("run scripts/models.sh --all")?;
    let prompt = Prompt::Chat(vec![ChatMessage {
        role: "user".into(),
        content: "Write a long story about a lighthouse keeper who finds a message in a bottle.".into(),
    }]);
    let prompt_tokens = llm.count_tokens(&prompt)?;
    // A long prompt for the prefill figure.
    let long_prompt = Prompt::Text((0..60).map(sentence).collect::<Vec<_>>().join(" "));
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
    Ok(())
}
