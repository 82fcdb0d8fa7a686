//! The architectures of the generation family against llama.cpp (llama-cpp-python 0.3.36):
//! - tiny GGUFs with random weights, one per architecture (`fixtures/llm/*.gguf`, written with
//!   the reference's logits by `scripts/peers/llama_cpp_reference.py`): the same tokens for the
//!   same texts, and the same logits at every position;
//! - the real Gemma 3 270M (`gemma-3-270m/model.gguf` under `TERN_MODELS_DIR`, from
//!   `scripts/models.sh --all`): llama.cpp's greedy tokens, and a known answer.
//! Tests on real weights print SKIPPED when the file is missing, except under `CI=true`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::Device;
use serde_json::Value;
use tern_models::generate::{ChatMessage, ChatTemplate, GenerateError, GenerateOptions, Llm, Prompt, WeightLayout};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm")
}

fn reference() -> &'static Value {
    static REFERENCE: OnceLock<Value> = OnceLock::new();
    REFERENCE.get_or_init(|| serde_json::from_slice(&std::fs::read(fixtures().join("reference.json")).unwrap()).unwrap())
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

const ARCHITECTURES: [&str; 5] = ["llama", "qwen2", "qwen3", "phi3", "gemma3"];

#[test]
fn each_architecture_tokenises_texts_as_llama_cpp() {
    for arch in ARCHITECTURES {
        let llm = Llm::load_gguf(&fixtures().join(format!("{arch}.gguf")), &Device::Cpu).unwrap();
        let r = &reference()["architectures"][arch];
        for (text, want) in r["texts"].as_array().unwrap().iter().zip(r["tokens"].as_array().unwrap()) {
            let text = text.as_str().unwrap();
            let got = llm.prompt_ids(&Prompt::Text(text.into())).unwrap();
            assert_eq!(got, ids(want), "{arch}: {text:?}");
            // Decoding gives the text back (after the BOS, which decoding leaves out; a
            // SentencePiece vocabulary's prefix space aside).
            let back = llm.decode(&got).unwrap();
            assert_eq!(back.strip_prefix(' ').filter(|_| arch == "phi3").unwrap_or(&back), text, "{arch}");
        }
    }
}

/// Logits at every position of a 12-token sequence (past Gemma's window of 4), decoded beside a
/// shorter one, equal to llama.cpp's to a ten-thousandth of the largest logit, and the same
/// next token; the last one's again with the sequence read at once. tern rounds activations
/// for the Q8_0 products as GGML does (f16 scales), so the products agree to ~1e-6. Gemma 3's
/// differ by ~1% of the largest logit (logits up to 30 with random weights): llama.cpp reads
/// GELU from a table of f16 inputs and outputs; tern computes it in f32, as the model defines
/// it (with llama.cpp's table tern's agree to 3e-7). A wrong rotary layout or window moves
/// logits by 10% and more.
#[test]
fn each_architecture_computes_llama_cpps_logits() {
    for arch in ARCHITECTURES {
        let llm = Llm::load_gguf(&fixtures().join(format!("{arch}.gguf")), &Device::Cpu).unwrap();
        compare_with_llama_cpp(&llm, arch, "tern's CPU pass", if arch == "gemma3" { 2e-2 } else { 1e-4 });
    }
}

/// The same through the pass GPUs run (candle's ops), on the CPU: with the weights as stored
/// (candle's products are GGML's), and dequantized as on a GPU, where activations are not
/// rounded, which moves logits ~1% of the largest from llama.cpp's (as far as llama.cpp's own
/// are from exact arithmetic, measured on the llama file).
#[test]
fn each_architecture_on_the_portable_pass_computes_llama_cpps_logits() {
    for layout in [WeightLayout::Dense, WeightLayout::Quantized] {
        for arch in ARCHITECTURES {
            let llm = Llm::load_gguf_portable(&fixtures().join(format!("{arch}.gguf")), &Device::Cpu, layout).unwrap();
            let tolerance = if arch == "gemma3" || layout == WeightLayout::Dense { 2e-2 } else { 1e-4 };
            compare_with_llama_cpp(&llm, arch, &format!("the portable pass, {layout:?}"), tolerance);
        }
    }
}

/// Files quantized by llama.cpp itself as Q4_K_M and Q5_K_M (Q4_K, Q5_K and Q6_K matrices, and
/// Q5_0, Q5_1 and Q8_0 where rows are no whole 256-value blocks, q/k/v stacks mixing them),
/// multiplied as stored. llama.cpp rounds activations for the K types per 256 values with an
/// f32 scale (Q8_K), tern per 32 with an f16 scale as for every type, so the logits are not
/// llama.cpp's to the digit. Against exact arithmetic on the file's weights (the portable pass
/// with the weights dequantized, activations unrounded) they are closer than llama.cpp's in the
/// mean square and within a fifth of its largest difference; where tern's next token is not
/// exact arithmetic's, the two are closer than llama.cpp's own largest difference (a close call
/// either's rounding may tip). Random weights make the differences large: a few percent of the
/// largest logit for both, as for the Q8_0 files above.
#[test]
fn k_quant_files_compute_logits_as_close_to_exact_as_llama_cpps() {
    for name in ["llama-q4_k_m", "llama-q5_k_m"] {
        let r = &reference()["quantized"][name];
        let types = r["types"].as_object().unwrap();
        let k_type = if name == "llama-q4_k_m" { "Q4_K" } else { "Q5_K" };
        assert!(types.contains_key(k_type) && types.contains_key("Q6_K"), "{name}: {types:?}");
        let path = fixtures().join(format!("{name}.gguf"));
        let tern = Llm::load_gguf(&path, &Device::Cpu).unwrap();
        let exact = Llm::load_gguf_portable(&path, &Device::Cpu, WeightLayout::Dense).unwrap();
        let sequence = ids(&r["sequence"]);
        let llama: Vec<Vec<f32>> = r["logits"].as_array().unwrap().iter().map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect();
        let got = tern.logits_at_each_position(&[&sequence]).unwrap().remove(0);
        let exact = exact.logits_at_each_position(&[&sequence]).unwrap().remove(0);
        assert_eq!((got.len(), exact.len()), (llama.len(), llama.len()));
        let largest: Vec<f32> = exact.iter().map(|e| e.iter().fold(0f32, |m, v| m.max(v.abs()))).collect();
        // The largest difference over all positions, in units of each position's largest
        // exact logit, and the root mean square difference.
        let worst = |a: &[Vec<f32>]| a.iter().zip(&exact).zip(&largest).fold(0f32, |m, ((x, e), l)| m.max(x.iter().zip(e).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / l));
        let rms = |a: &[Vec<f32>]| (a.iter().zip(&exact).flat_map(|(x, e)| x.iter().zip(e).map(|(p, q)| ((p - q) as f64).powi(2))).sum::<f64>() / (a.len() * a[0].len()) as f64).sqrt();
        let (tern_worst, llama_worst) = (worst(&got), worst(&llama));
        let (tern_rms, llama_rms) = (rms(&got), rms(&llama));
        eprintln!("{name}: from exact, tern {tern_worst:.2e} at worst and {tern_rms:.2e} rms, llama.cpp {llama_worst:.2e} and {llama_rms:.2e}");
        assert!(tern_rms <= llama_rms, "{name}: tern's logits {tern_rms:.2e} from exact (rms), llama.cpp's {llama_rms:.2e}");
        assert!(tern_worst <= 1.2 * llama_worst, "{name}: tern's logits {tern_worst:.2e} from exact at worst, llama.cpp's {llama_worst:.2e}");
        for (p, (g, e)) in got.iter().zip(&exact).enumerate() {
            let (mine, best) = (argmax(g), argmax(e));
            let gap = e[best] - e[mine];
            assert!(gap <= llama_worst * largest[p], "{name}, position {p}: next token {mine}, exact arithmetic's {best} by {gap}");
            if mine != best {
                eprintln!("{name}, position {p}: a close call, {mine} for {best} ({gap:.3} apart)");
            }
        }
    }
}

/// The reference's sequence decoded beside a shorter one (its last 7 tokens, at other
/// positions), so steps hold rows at different positions.
fn compare_with_llama_cpp(llm: &Llm, arch: &str, pass: &str, tolerance: f32) {
    let r = &reference()["architectures"][arch];
    let sequence = ids(&r["sequence"]);
    let want: Vec<Vec<f32>> = r["logits"].as_array().unwrap().iter().map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect();
    let other = &sequence[sequence.len() - 7..];
    let together = llm.logits_at_each_position(&[&sequence, other]).unwrap();
    let got = &together[0];
    let alone = llm.logits_at_each_position(&[other]).unwrap();
    let at_once = llm.logits_after(&sequence).unwrap();
    assert_eq!(got.len(), want.len());
    let mut worst = 0f32;
    for (p, (g, w)) in got.iter().zip(&want).enumerate() {
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(diff / scale);
        assert!(diff <= tolerance * scale, "{arch}, {pass}, position {p}: logits differ by {diff} (largest {scale})");
        assert_eq!(argmax(g), argmax(w), "{arch}, {pass}, position {p}: next token");
    }
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) <= 1e-4 * a.iter().fold(1f32, |m, x| m.max(x.abs()));
    assert!(close(got.last().unwrap(), &at_once), "{arch}, {pass}: the sequence read at once differs");
    for (p, (a, b)) in alone[0].iter().zip(&together[1]).enumerate() {
        assert!(close(a, b), "{arch}, {pass}: the shorter sequence at {p} differs beside the other");
    }
    eprintln!("{arch}, {pass}: largest difference {worst:.2e} of the largest logit");
}

fn argmax(xs: &[f32]) -> usize {
    xs.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap()
}

fn gemma() -> Option<&'static Llm> {
    static LLM: OnceLock<Option<Llm>> = OnceLock::new();
    LLM.get_or_init(|| {
        let dir = std::env::var_os("TERN_MODELS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tern/models"))
            .join("gemma-3-270m");
        if !dir.join("model.gguf").is_file() {
            assert!(std::env::var("CI").map_or(true, |v| v != "true"), "{} missing", dir.display());
            eprintln!("SKIPPED: {} missing (scripts/models.sh --all)", dir.display());
            return None;
        }
        Some(Llm::load_gguf(&dir, &Device::Cpu).unwrap())
    })
    .as_ref()
}

/// The real model's greedy tokens are llama.cpp's, prompt tokens included, and so is the text.
#[test]
fn gemma3_270m_generates_llama_cpps_greedy_tokens() {
    let Some(llm) = gemma() else { return };
    for run in reference()["gemma3_270m"].as_array().unwrap() {
        let prompt = Prompt::Text(run["prompt"].as_str().unwrap().into());
        let mut tokens = llm.prompt_ids(&prompt).unwrap();
        assert_eq!(tokens, ids(&run["prompt_tokens"]), "{prompt:?}");
        let want = ids(&run["greedy"]);
        let mut got = Vec::new();
        while got.len() < want.len() {
            let next = argmax(&llm.logits_after(&tokens).unwrap()) as u32;
            got.push(next);
            tokens.push(next);
        }
        assert_eq!(got, want, "{prompt:?}");
        let opts = GenerateOptions { max_tokens: want.len(), temperature: 0.0, ..Default::default() };
        let g = llm.generate(&prompt, &opts, &mut |_, _| true).unwrap();
        assert_eq!(g.text, run["text"].as_str().unwrap(), "{prompt:?}: llama.cpp's text");
    }
}

#[test]
fn gemma3_270m_completes_a_question_with_paris() {
    let Some(llm) = gemma() else { return };
    let prompt = Prompt::Text("Question: What is the capital of France?\nAnswer:".into());
    let g = llm.generate(&prompt, &GenerateOptions { max_tokens: 4, temperature: 0.0, ..Default::default() }, &mut |_, _| true).unwrap();
    assert!(g.text.contains("Paris"), "{g:?}");
}

fn user(text: &str) -> ChatMessage {
    ChatMessage::new("user", text)
}

/// Gemma's file names no template: its published one is used, with its BOS, turn markers,
/// the system message folded into the first user turn, and its refusal of roles that do not
/// alternate.
#[test]
fn gemma_conversations_render_with_gemmas_template() {
    let Some(llm) = gemma() else { return };
    let messages = vec![ChatMessage::new("system", "Be brief."), user("Hi "), ChatMessage::new("assistant", "Hello."), user("Capital of France?")];
    assert_eq!(
        llm.render_chat(&messages).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = llm.prompt_ids(&Prompt::Chat(vec![user("Hi")])).unwrap();
    assert_eq!(ids.iter().filter(|&&t| t == ids[0]).count(), 1, "one BOS: {ids:?}");
    let err = llm.render_chat(&[user("a"), user("b")]).unwrap_err();
    let err = err.downcast_ref::<GenerateError>().expect("a GenerateError");
    assert_eq!(err.code(), "invalid_messages");
    assert!(err.to_string().contains("alternate"), "{err}");
}

/// A file's own template (ChatML in the llama fixture is the default; Qwen's files name
/// theirs): the fixtures hold none, so the default ChatML applies.
#[test]
fn files_without_a_template_get_chatml() {
    let llm = Llm::load_gguf(&fixtures().join("qwen2.gguf"), &Device::Cpu).unwrap();
    assert_eq!(llm.render_chat(&[user("Hi")]).unwrap(), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

/// Published templates of real models (llama.cpp's copies: Qwen2.5, Qwen3, Llama 3.1 and 3.2,
/// Phi-3.5, Gemma 2, SmolLM3) render five conversations, two with tools (offered; a call made
/// and answered), exactly as transformers' `render_jinja_template` renders them
/// (`scripts/peers/chat_template_reference.py`); refusals give their message, and a template
/// that fails on a conversation fails in tern too.
#[test]
fn published_templates_render_as_transformers_renders_them() {
    let dir = fixtures().join("templates");
    let expected: Value = serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let today = chrono::NaiveDate::parse_from_str(expected["date"].as_str().unwrap(), "%Y-%m-%d").unwrap().and_hms_opt(0, 0, 0).unwrap();
    let conversations: Vec<(Vec<ChatMessage>, Option<Vec<Value>>)> = expected["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (serde_json::from_value(c["messages"].clone()).unwrap(), c.get("tools").map(|t| t.as_array().unwrap().clone())))
        .collect();
    for (name, t) in expected["templates"].as_object().unwrap() {
        let source = std::fs::read_to_string(dir.join(format!("{name}.jinja"))).unwrap();
        let template = ChatTemplate::new(source, t["bos"].as_str().unwrap().into(), t["eos"].as_str().unwrap().into(), Some(today)).unwrap();
        for ((messages, tools), want) in conversations.iter().zip(t["rendered"].as_array().unwrap()) {
            let got = template.render(messages, tools.as_deref());
            match want.as_str() {
                Some(want) => assert_eq!(got.unwrap(), want, "{name}: {messages:?}"),
                None => {
                    let err = got.unwrap_err();
                    let err = err.downcast_ref::<GenerateError>().expect("a GenerateError");
                    assert_eq!(err.code(), "invalid_messages", "{name}");
                    if want["raised"] == true {
                        assert_eq!(err.to_string(), want["error"].as_str().unwrap(), "{name}");
                    }
                }
            }
        }
    }
}
