//! Generates text with a GGUF llama model and prints the tokens of the prompt and the answer.
//! Usage: cargo run --release --example generate -- MODEL_DIR [--chat] PROMPT

use std::time::Instant;

// The worker's allocator, so timings match the service.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use candle_core::Device;
use tern_models::generate::{ChatMessage, GenerateOptions, Llm, Prompt};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, rest) = args.split_first().ok_or_else(|| anyhow::anyhow!("usage: generate MODEL_DIR [--chat] PROMPT"))?;
    let chat = rest.first().is_some_and(|a| a == "--chat");
    let text = rest[usize::from(chat)..].join(" ");
    let llm = Llm::load_gguf(std::path::Path::new(dir), &Device::Cpu)?;
    let prompt = if chat {
        Prompt::Chat(vec![ChatMessage::new("user", &text)])
    } else {
        Prompt::Text(text.clone())
    };
    println!("prompt tokens: {:?}", llm.encode(&text)?);
    let t = Instant::now();
    let opts = GenerateOptions { max_tokens: 48, temperature: 0.0, ..Default::default() };
    let g = llm.generate(&prompt, &opts, &mut |_, _| true)?;
    let secs = t.elapsed().as_secs_f64();
    println!("{:?} ({} + {} tokens in {secs:.2} s): {}", g.finish_reason, g.prompt_tokens, g.completion_tokens, g.text);
    Ok(())
}
