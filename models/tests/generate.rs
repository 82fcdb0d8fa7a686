//! Text generation with the real SmolLM2-135M-Instruct Q4_1 weights.
//!
//! Models dir: `TERN_MODELS_DIR`, default `$HOME/.cache/tern/models`, holding
//! `smollm2-135m-instruct/model.gguf`. Tests print SKIPPED and return when it is missing, except
//! under `CI=true`, where a missing file fails them so CI cannot pass vacuously.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use candle_core::Device;
use tern_models::generate::{
    ChatMessage, FinishReason, GenerateError, GenerateOptions, Generation, GenerationRequest, Llm, Prompt,
    WeightLayout,
};
use tern_models::generate::tools::{ToolChoice, ToolUse};

fn model_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("TERN_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tern/models")
        })
        .join("smollm2-135m-instruct");
    if dir.join("model.gguf").is_file() {
        return Some(dir);
    }
    let msg = format!(
        "{} missing (set TERN_MODELS_DIR)",
        dir.join("model.gguf").display()
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{msg}");
    }
    eprintln!("SKIPPED: {msg}");
    None
}

/// One model for all tests: `generate` takes `&self`, so the tests share it.
fn llm() -> Option<&'static Llm> {
    static LLM: OnceLock<Option<Llm>> = OnceLock::new();
    LLM.get_or_init(|| {
        let dir = model_dir()?;
        let t = Instant::now();
        let llm = Llm::load_gguf(&dir, &Device::Cpu).expect("load SmolLM2");
        eprintln!(
            "loaded SmolLM2 in {:.2?}, ~{} MB, context {}",
            t.elapsed(),
            llm.weights_bytes() / 1_000_000,
            llm.context_length()
        );
        Some(llm)
    })
    .as_ref()
}

fn capital_question() -> Prompt {
    Prompt::Chat(vec![ChatMessage::new("user", "What is the capital of France? Answer with one word.")])
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        temperature: 0.0,
        ..Default::default()
    }
}

/// Runs a request, checking on the way that every text the callback sees is a prefix of the
/// final text and that the token counts it gets go up one by one.
fn run(llm: &Llm, prompt: &Prompt, opts: &GenerateOptions) -> Generation {
    let mut seen: Vec<(String, usize)> = Vec::new();
    let t = Instant::now();
    let g = llm
        .generate(prompt, opts, &mut |text, n| {
            seen.push((text.to_string(), n));
            true
        })
        .unwrap();
    println!(
        "{:?} in {:.2?} ({} + {} tokens): {:?}",
        g.finish_reason,
        t.elapsed(),
        g.prompt_tokens,
        g.completion_tokens,
        g.text
    );
    for (i, (text, n)) in seen.iter().enumerate() {
        assert_eq!(*n, i + 1, "token counts given to the callback");
        assert!(
            g.text.starts_with(text.as_str()),
            "callback text {text:?} is not a prefix of {:?}",
            g.text
        );
        for stop in &opts.stop {
            assert!(
                !text.contains(stop.as_str()),
                "{text:?} shows stop {stop:?}"
            );
        }
    }
    assert_eq!(g.prompt_tokens, llm.count_tokens(prompt).unwrap());
    g
}

#[test]
fn tokenisation_round_trips_and_splits_digits() {
    let Some(llm) = llm() else { return };
    let text = "Hello, world! 12345";
    let ids = llm.encode(text).unwrap();
    println!("{ids:?}");
    assert_eq!(llm.decode(&ids).unwrap(), text);
    // Digits are pre-tokenised one by one, so the number is five single-digit tokens.
    let last5: Vec<String> = ids[ids.len() - 5..]
        .iter()
        .map(|&id| llm.decode(&[id]).unwrap())
        .collect();
    assert_eq!(last5, ["1", "2", "3", "4", "5"]);
    // Special tokens are single ids: <|im_end|> is 2 in SmolLM2's vocabulary.
    assert_eq!(llm.encode("<|im_end|>").unwrap(), [2u32]);
    assert_eq!(
        llm.count_tokens(&Prompt::Text(text.into())).unwrap(),
        ids.len()
    );
}

#[test]
fn same_seed_same_text() {
    let Some(llm) = llm() else { return };
    let opts = GenerateOptions {
        max_tokens: 24,
        temperature: 0.8,
        seed: 42,
        ..Default::default()
    };
    let prompt = Prompt::Text("Once upon a time".into());
    let a = run(llm, &prompt, &opts);
    let b = run(llm, &prompt, &opts);
    assert_eq!(a, b);
    assert!(!a.text.is_empty());
}

#[test]
fn greedy_answer_names_paris() {
    let Some(llm) = llm() else { return };
    let g = run(llm, &capital_question(), &greedy(64));
    assert!(g.text.contains("Paris"), "{:?}", g.text);
    assert_eq!(g.finish_reason, FinishReason::Stop);
    assert!(g.completion_tokens > 0 && g.completion_tokens < 64);
}

#[test]
fn max_tokens_ends_with_length() {
    let Some(llm) = llm() else { return };
    let g = run(llm, &capital_question(), &greedy(5));
    assert_eq!(g.completion_tokens, 5);
    assert_eq!(g.finish_reason, FinishReason::Length);
    // Greedy decoding is deterministic, so the short answer starts the long one.
    let full = run(llm, &capital_question(), &greedy(64));
    assert!(
        full.text.starts_with(&g.text),
        "{:?} vs {:?}",
        g.text,
        full.text
    );
}

#[test]
fn stop_sequences_cut_the_text_before_them() {
    let Some(llm) = llm() else { return };
    let full = run(llm, &capital_question(), &greedy(64));
    // "Paris" is most likely inside a token (" Paris"); the two-word phrase spans tokens and
    // holds a space.
    let words: Vec<&str> = full.text.split_whitespace().collect();
    let mut stops = vec!["Paris".to_string()];
    if words.len() >= 3 {
        stops.push(format!("{} {}", words[1], words[2]));
    }
    for stop in stops {
        let Some(at) = full.text.find(&stop) else {
            panic!("{stop:?} not in {:?}", full.text)
        };
        let opts = GenerateOptions {
            stop: vec![stop.clone()],
            ..greedy(64)
        };
        let g = run(llm, &capital_question(), &opts);
        assert_eq!(g.text, full.text[..at], "stop {stop:?}");
        assert_eq!(g.finish_reason, FinishReason::Stop);
        assert!(g.completion_tokens <= full.completion_tokens);
    }
}

#[test]
fn cancel_and_context_errors_have_codes() {
    let Some(llm) = llm() else { return };
    let mut calls = 0;
    let err = llm
        .generate(&capital_question(), &greedy(64), &mut |_, n| {
            calls = n;
            n < 3
        })
        .unwrap_err();
    assert_eq!(calls, 3);
    let e = err
        .downcast_ref::<GenerateError>()
        .expect("a GenerateError");
    assert_eq!(e.code(), "canceled");

    let too_long = greedy(llm.context_length());
    let err = llm
        .generate(&capital_question(), &too_long, &mut |_, _| true)
        .unwrap_err();
    let e = err
        .downcast_ref::<GenerateError>()
        .expect("a GenerateError");
    assert_eq!(e.code(), "context_length_exceeded", "{e}");
    assert!(matches!(e, GenerateError::ContextOverflow { .. }));

    let err = llm
        .generate(&Prompt::Chat(vec![]), &greedy(4), &mut |_, _| true)
        .unwrap_err();
    assert_eq!(
        err.downcast_ref::<GenerateError>().map(GenerateError::code),
        Some("prompt_empty")
    );
}

/// Requests served together each come out as alone: a sampled one with its seed, a greedy one;
/// one canceled and one refused (context) fail with their codes and leave the others running.
#[test]
fn a_batch_serves_each_request_as_alone_and_isolates_failures() {
    let Some(llm) = llm() else { return };
    let story = Prompt::Chat(vec![ChatMessage::new("user", "Tell me a story about a fox.")]);
    let sampled = GenerateOptions { max_tokens: 24, temperature: 0.8, seed: 11, ..Default::default() };
    let greedy_opts = greedy(16);
    let too_long = greedy(llm.context_length());
    let alone_sampled = llm.generate(&story, &sampled, &mut |_, _| true).unwrap();
    let alone_greedy = llm.generate(&capital_question(), &greedy_opts, &mut |_, _| true).unwrap();

    let (mut a, mut b, mut d) = (|_: &str, _: usize| true, |_: &str, _: usize| true, |_: &str, _: usize| true);
    let mut cancel_at_2 = |_: &str, n: usize| n < 2;
    let question = capital_question();
    let requests = vec![
        GenerationRequest { prompt: &story, options: &sampled, on_text: &mut a },
        GenerationRequest { prompt: &story, options: &greedy_opts, on_text: &mut cancel_at_2 },
        GenerationRequest { prompt: &question, options: &too_long, on_text: &mut d },
        GenerationRequest { prompt: &question, options: &greedy_opts, on_text: &mut b },
    ];
    let results = llm.generate_batch(requests);
    assert_eq!(results.len(), 4);
    let code = |r: &anyhow::Result<Generation>| r.as_ref().unwrap_err().downcast_ref::<GenerateError>().map(GenerateError::code);
    assert_eq!(results[0].as_ref().unwrap(), &alone_sampled, "sampled, same seed, batched");
    assert_eq!(code(&results[1]), Some("canceled"));
    assert_eq!(code(&results[2]), Some("context_length_exceeded"));
    assert_eq!(results[3].as_ref().unwrap(), &alone_greedy, "greedy, batched");
}

/// One request of `prompt` for each of `opts`, served together.
fn one_batch(llm: &Llm, prompt: &Prompt, opts: &[GenerateOptions]) -> Vec<anyhow::Result<Generation>> {
    let mut callbacks: Vec<_> = (0..opts.len()).map(|_| |_: &str, _: usize| true).collect();
    let requests = opts
        .iter()
        .zip(callbacks.iter_mut())
        .map(|(options, on_text)| GenerationRequest { prompt, options, on_text: on_text as &mut dyn FnMut(&str, usize) -> bool })
        .collect();
    llm.generate_batch(requests)
}

/// Enough sampled requests that a step samples its rows on several threads: each, with its
/// own seed, comes out as it does alone.
#[test]
fn many_sampled_requests_sampled_side_by_side_each_come_out_as_alone() {
    let Some(llm) = llm() else { return };
    let story = Prompt::Chat(vec![ChatMessage::new("user", "Tell me a story about a fox.")]);
    let opts: Vec<GenerateOptions> =
        (0..10).map(|seed| GenerateOptions { max_tokens: 12, temperature: 0.9, seed, ..Default::default() }).collect();
    let alone: Vec<Generation> = opts.iter().map(|o| llm.generate(&story, o, &mut |_, _| true).unwrap()).collect();
    let distinct: std::collections::HashSet<&str> = alone.iter().map(|g| g.text.as_str()).collect();
    assert!(distinct.len() > 1, "the seeds should give different texts: {alone:?}");
    let together = one_batch(llm, &story, &opts);
    for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(t.as_ref().unwrap(), a, "request {i}: batched as alone");
    }
}

/// Continuous batching: a request admitted while another decodes joins it at the next step,
/// comes out as alone, and each result is delivered as soon as its request ends (the short
/// late one before the long first one).
#[test]
fn a_request_admitted_mid_batch_joins_the_running_one_and_each_comes_out_as_alone() {
    let Some(llm) = llm() else { return };
    let story = Prompt::Chat(vec![ChatMessage::new("user", "Tell me a story about a fox.")]);
    let long = GenerateOptions { max_tokens: 48, temperature: 0.8, seed: 5, ..Default::default() };
    let short = greedy(6);
    let question = capital_question();
    let alone_long = llm.generate(&story, &long, &mut |_, _| true).unwrap();
    let alone_short = llm.generate(&question, &short, &mut |_, _| true).unwrap();
    assert!(alone_long.completion_tokens > 20, "the first request must outlast the second: {alone_long:?}");

    let (mut a, mut b) = (|_: &str, _: usize| true, |_: &str, _: usize| true);
    let mut first = Some(GenerationRequest { prompt: &story, options: &long, on_text: &mut a });
    let mut second = Some(GenerationRequest { prompt: &question, options: &short, on_text: &mut b });
    let (mut calls, mut running_when_joined) = (0, None);
    let mut admit = |running: usize| {
        calls += 1;
        match calls {
            1 => first.take().into_iter().collect(),
            // Ten steps in, the second arrives.
            11 => {
                running_when_joined = Some(running);
                second.take().into_iter().collect()
            }
            _ => Vec::new(),
        }
    };
    let mut finished: Vec<(usize, Generation)> = Vec::new();
    llm.generate_continuous(&mut admit, &mut |number, result| finished.push((number, result.unwrap())));
    assert_eq!(running_when_joined, Some(1), "the first request was decoding when the second joined");
    let order: Vec<usize> = finished.iter().map(|(n, _)| *n).collect();
    assert_eq!(order, vec![1, 0], "the short late request ends first and is delivered at once");
    assert_eq!(finished[0].1, alone_short, "joined mid-batch, greedy");
    assert_eq!(finished[1].1, alone_long, "sampled, joined by another mid-batch");
}

/// The forward pass GPUs run (candle's ops, [`Llm::load_gguf_portable`]), here on the CPU,
/// with the matrices as the GGUF stores them and dequantized (a GPU's default): it answers as
/// the model should, and requests of different prompt lengths decoded together, one joining
/// mid-batch, each come out as they do alone (each keeps its own cache and position). The two
/// admitted together have their prompts read in one padded pass, and every token, greedy or
/// sampled, is picked where the logits are (the device's path, on the CPU here).
#[test]
fn the_portable_pass_decodes_requests_together_each_as_alone() {
    the_portable_pass_decodes_each_as_alone(WeightLayout::Quantized);
}

#[test]
fn the_portable_pass_on_dense_weights_decodes_requests_together_each_as_alone() {
    the_portable_pass_decodes_each_as_alone(WeightLayout::Dense);
}

fn the_portable_pass_decodes_each_as_alone(layout: WeightLayout) {
    let Some(dir) = model_dir() else { return };
    let llm = Llm::load_gguf_portable(&dir, &Device::Cpu, layout).expect("load SmolLM2 on candle's ops");
    let question = capital_question();
    let paris = llm.generate(&question, &greedy(16), &mut |_, _| true).unwrap();
    assert!(paris.text.contains("Paris"), "{paris:?}");

    let story = Prompt::Chat(vec![ChatMessage::new("user", "Tell me a story about a fox who lived by a river.")]);
    let count = Prompt::Text("1, 2, 3, 4,".into());
    let sampled = GenerateOptions { max_tokens: 20, temperature: 0.8, seed: 3, ..Default::default() };
    let alone = [
        llm.generate(&story, &sampled, &mut |_, _| true).unwrap(),
        llm.generate(&count, &greedy(12), &mut |_, _| true).unwrap(),
        llm.generate(&question, &greedy(8), &mut |_, _| true).unwrap(),
    ];
    let (short, long) = (greedy(12), greedy(8));
    let (mut a, mut b, mut c) = (|_: &str, _: usize| true, |_: &str, _: usize| true, |_: &str, _: usize| true);
    let mut together = Some(vec![
        GenerationRequest { prompt: &story, options: &sampled, on_text: &mut a },
        GenerationRequest { prompt: &count, options: &short, on_text: &mut b },
    ]);
    let mut late = Some(GenerationRequest { prompt: &question, options: &long, on_text: &mut c });
    let mut calls = 0;
    let mut admit = |_running: usize| {
        calls += 1;
        match calls {
            1 => together.take().unwrap_or_default(),
            4 => late.take().into_iter().collect(),
            _ => Vec::new(),
        }
    };
    let mut results: Vec<Option<Generation>> = vec![None, None, None];
    llm.generate_continuous(&mut admit, &mut |number, result| results[number] = Some(result.unwrap()));
    for (i, (r, a)) in results.iter().zip(&alone).enumerate() {
        assert_eq!(r.as_ref().expect("answered"), a, "request {i}: batched as alone");
    }
}

/// top_k 1 and a top_p that only the likeliest token reaches leave one token to draw: a sampled
/// request then writes the greedy text, on tern's CPU pass and on the pass GPUs run.
#[test]
fn top_k_of_one_and_a_tiny_top_p_sample_the_greedy_text() {
    let Some(dir) = model_dir() else { return };
    let portable = Llm::load_gguf_portable(&dir, &Device::Cpu, WeightLayout::Dense).expect("load SmolLM2 on candle's ops");
    for llm in [llm().expect("the model"), &portable] {
        let greedy_text = llm.generate(&capital_question(), &greedy(12), &mut |_, _| true).unwrap();
        for (top_k, top_p) in [(Some(1), None), (None, Some(1e-6))] {
            let opts = GenerateOptions { max_tokens: 12, temperature: 0.9, top_k, top_p, seed: 9, ..Default::default() };
            let g = llm.generate(&capital_question(), &opts, &mut |_, _| true).unwrap();
            assert_eq!(g, greedy_text, "top_k {top_k:?}, top_p {top_p:?}");
        }
    }
    let zero = GenerateOptions { top_k: Some(0), ..Default::default() };
    let err = portable.generate(&capital_question(), &zero, &mut |_, _| true).unwrap_err();
    assert_eq!(err.downcast_ref::<GenerateError>().map(GenerateError::code), Some("invalid_options"));
}

/// Tokens picked where a step's logits are and picked from logits copied to the host are the
/// same tokens (`Llm::set_device_sampling`), for requests decoded together with every kind of
/// setting: temperature alone, top_k, top_p, both, and greedy, each with its own seed. On a GPU
/// the same comparison is `tern-bench-models --only sampling-check`.
#[test]
fn tokens_picked_with_the_logits_are_those_picked_on_the_host() {
    let Some(dir) = model_dir() else { return };
    let llm = Llm::load_gguf_portable(&dir, &Device::Cpu, WeightLayout::Dense).expect("load SmolLM2 on candle's ops");
    let story = Prompt::Chat(vec![ChatMessage::new("user", "Tell me a story about a fox.")]);
    let opts = [
        GenerateOptions { max_tokens: 16, temperature: 0.8, seed: 1, ..Default::default() },
        GenerateOptions { max_tokens: 16, temperature: 1.0, top_k: Some(20), seed: 2, ..Default::default() },
        GenerateOptions { max_tokens: 16, temperature: 0.9, top_p: Some(0.9), seed: 3, ..Default::default() },
        GenerateOptions { max_tokens: 16, temperature: 0.7, top_k: Some(40), top_p: Some(0.95), seed: 4, ..Default::default() },
        greedy(16),
    ];
    let run = |device_sampling: bool| -> Vec<Generation> {
        llm.set_device_sampling(device_sampling);
        one_batch(&llm, &story, &opts).into_iter().map(Result::unwrap).collect()
    };
    let (with_logits, on_host) = (run(true), run(false));
    assert_eq!(with_logits, on_host);
    let distinct: std::collections::HashSet<&str> = with_logits.iter().map(|g| g.text.as_str()).collect();
    assert!(distinct.len() > 2, "the settings and seeds should give different texts: {with_logits:?}");
}


fn weather_tool() -> serde_json::Value {
    serde_json::json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": { "type": "object", "properties": { "city": { "type": "string" } }, "required": ["city"] }
        }
    })
}

fn with_tools(text: &str, choice: ToolChoice) -> Prompt {
    Prompt::ChatWithTools(vec![ChatMessage::new("user", text)], ToolUse { tools: vec![weather_tool()], choice, parallel: true })
}

/// SmolLM2's own template shows no tools: offering them is refused (`tools_unsupported`), and
/// with `tool_choice` `none` the conversation renders as without them.
#[test]
fn tools_need_a_template_that_shows_them() {
    let Some(llm) = llm() else { return };
    let err = llm.generate(&with_tools("Weather in Paris?", ToolChoice::Auto), &greedy(8), &mut |_, _| true).unwrap_err();
    assert_eq!(err.downcast_ref::<GenerateError>().map(GenerateError::code), Some("tools_unsupported"), "{err:#}");
    let none = with_tools("Weather in Paris?", ToolChoice::None);
    assert_eq!(llm.render_prompt(&none).unwrap(), llm.render_chat(&[ChatMessage::new("user", "Weather in Paris?")]).unwrap());
}

/// SmolLM2 speaks ChatML, as Qwen2.5 does: with Qwen2.5's published template beside the file
/// (`chat_template.jinja`) it is shown the tools as Qwen is, and a call to a named function
/// is begun for it and read back as OpenAI's `tool_calls`, its text never shown as it comes.
#[test]
fn a_named_function_is_called_and_read_back() {
    let Some(dir) = model_dir() else { return };
    let folder = std::env::temp_dir().join(format!("tern-tools-{}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    let _ = std::fs::remove_file(folder.join("model.gguf"));
    std::os::unix::fs::symlink(dir.join("model.gguf"), folder.join("model.gguf")).unwrap();
    let qwen = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm/templates/qwen2.5.jinja");
    std::fs::copy(qwen, folder.join("chat_template.jinja")).unwrap();
    let llm = Llm::load_gguf(&folder, &Device::Cpu).unwrap();
    std::fs::remove_dir_all(&folder).unwrap();

    let prompt = with_tools("What is the weather like in Paris?", ToolChoice::Function("get_weather".into()));
    let rendered = llm.render_prompt(&prompt).unwrap();
    assert!(rendered.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""), "{rendered}");
    assert!(rendered.ends_with("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "), "{rendered}");
    let g = run(&llm, &prompt, &greedy(48));
    assert_eq!(g.finish_reason, FinishReason::ToolCalls, "{g:?}");
    assert_eq!(g.text, "");
    assert_eq!(g.tool_calls.len(), 1, "{g:?}");
    let call = &g.tool_calls[0];
    assert_eq!((call.kind.as_str(), call.function.name.as_str()), ("function", "get_weather"));
    let arguments: serde_json::Value = serde_json::from_str(&call.function.arguments).unwrap();
    assert!(arguments.is_object(), "{arguments}");
    println!("{call:?}");

    // The same conversation, the call made and answered: the model answers in text.
    let messages = vec![
        ChatMessage::new("user", "What is the weather like in Paris?"),
        ChatMessage { role: "assistant".into(), tool_calls: g.tool_calls.clone(), ..Default::default() },
        ChatMessage { role: "tool".into(), content: "{\"sky\": \"sunny\", \"celsius\": 21}".into(), tool_call_id: Some(call.id.clone()), ..Default::default() },
    ];
    let answered = Prompt::ChatWithTools(messages, ToolUse { tools: vec![weather_tool()], choice: ToolChoice::Auto, parallel: true });
    assert!(llm.render_prompt(&answered).unwrap().contains("<tool_response>\n{\"sky\": \"sunny\", \"celsius\": 21}\n</tool_response>"));
    let g = run(&llm, &answered, &greedy(32));
    println!("{g:?}");
    assert!(g.tool_calls.is_empty() || g.finish_reason == FinishReason::ToolCalls);
}
