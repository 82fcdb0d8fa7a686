//! The language model as a [`Family`]: GGUF files (`model.gguf`), costed in tokens (prompt and
//! generated).

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Result};

use super::{ChatMessage, GenerateError, GenerateOptions, Generation, GenerationRequest, Llm, Prompt};
use crate::family::{downcast_all, file_len, BatchRun, BudgetRule, Family, FamilyModel, LoadSettings, Setting, Work, WorkError};

/// A generation request, with its reply.
pub struct GenerateWork {
    pub prompt: Prompt,
    pub options: GenerateOptions,
    /// After each token: the text so far and its tokens; false stops the generation (the reply
    /// then holds what was generated).
    pub on_text: Box<dyn FnMut(&str, usize) -> bool + Send>,
    /// The generation or why not, and the model that served it.
    pub reply: Box<dyn FnOnce(Result<Generation, WorkError>, &str) + Send>,
}

/// Tokens in flight of a generation batch until configured (`TERN_GENERATE_BATCH_TOKENS`).
pub const DEFAULT_BATCH_TOKENS: usize = 4096;

pub struct LlmFamily;
pub static FAMILY: LlmFamily = LlmFamily;

/// Tokens generated in the warmup after a short prompt.
const WARMUP_TOKENS: usize = 8;

impl Family for LlmFamily {
    fn name(&self) -> &'static str {
        "llm"
    }

    fn kinds(&self) -> &'static [&'static str] {
        &["generate"]
    }

    fn unit(&self) -> &'static str {
        "tokens"
    }

    fn model_setting(&self) -> Setting {
        Setting {
            flag: "llm-model",
            env: "TERN_LLM_MODEL",
            default: Some("smollm2-135m-instruct"),
            help: "Language model for `generate` jobs: a folder holding `model.gguf` (llama, qwen2, qwen3, phi3 or gemma3 architecture) under the models directory, or a hub id `hf:OWNER/NAME/FILE.gguf`",
        }
    }

    fn budget_setting(&self) -> Setting {
        Setting {
            flag: "generate-batch-tokens",
            env: "TERN_GENERATE_BATCH_TOKENS",
            default: Some("4096"),
            help: "Most tokens (prompt + max_tokens) of generation jobs pulled in one batch, and in flight in the running generation batch, which jobs pulled later join between decoding steps",
        }
    }

    /// One GGUF file of the repository, named in the hub id (`hf:OWNER/NAME/FILE.gguf`).
    fn hub_files(&self, repo: &str, file: Option<&str>) -> Result<Vec<(String, &'static str)>> {
        match file {
            Some(f) => Ok(vec![(f.to_string(), "model.gguf")]),
            None => bail!("name the GGUF file to load: hf:{repo}/FILE.gguf"),
        }
    }

    /// GGUF loads as stored on the CPU (a GPU dequantizes it at load: more, measured then).
    fn estimate_bytes(&self, dir: &Path, _settings: &LoadSettings) -> Result<u64> {
        file_len(dir, "model.gguf")
    }

    fn load(&self, dir: &Path, settings: &LoadSettings) -> Result<Box<dyn FamilyModel>> {
        let llm = Llm::load_gguf(dir, &settings.device)?;
        llm.set_precision(settings.precision);
        Ok(Box::new(llm))
    }

    /// Tokens (prompt + max_tokens) of the requests in flight: fixed, not calibrated (default
    /// [`DEFAULT_BATCH_TOKENS`], or the worker's setting).
    fn budget(&self) -> BudgetRule {
        BudgetRule { initial: DEFAULT_BATCH_TOKENS, calibrated: false, cpu_ceiling: usize::MAX, device_ceiling: usize::MAX }
    }

    fn refuse(&self, work: Work, error: WorkError, model: &str) {
        if let Ok(w) = work.downcast::<GenerateWork>() {
            (w.reply)(Err(error), model);
        }
    }
}

impl FamilyModel for Llm {
    fn resident_bytes(&self) -> u64 {
        self.weights_bytes()
    }

    fn warm_up(&mut self, _settings: &LoadSettings) -> Result<u64> {
        let prompt = Prompt::Text("tern warmup".into());
        let opts = GenerateOptions { max_tokens: WARMUP_TOKENS, temperature: 0.0, ..Default::default() };
        let g = self.generate(&prompt, &opts, &mut |_, _| true)?;
        Ok((g.prompt_tokens + g.completion_tokens) as u64)
    }

    /// Asks for the capital of France as a conversation, and, where the answer does not name
    /// Paris, as a text to complete: base models (Gemma 3 270M) do not chat.
    fn check_health(&mut self) -> Result<()> {
        let opts = GenerateOptions { max_tokens: 16, temperature: 0.0, ..Default::default() };
        let chat = Prompt::Chat(vec![ChatMessage::new("user", "What is the capital of France? Answer with one word.")]);
        let answer = self.generate(&chat, &opts, &mut |_, _| true)?.text;
        if answer.to_lowercase().contains("paris") {
            return Ok(());
        }
        let completion = Prompt::Text("Question: What is the capital of France?\nAnswer:".into());
        let completed = self.generate(&completion, &opts, &mut |_, _| true)?.text;
        ensure!(completed.to_lowercase().contains("paris"), "asked for the capital of France, answered {answer:?} in a chat and {completed:?} as a completion");
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    /// Continuous batching: between decoding steps, requests that arrived join as long as the
    /// tokens in flight (prompt + max_tokens of each running request; a prompt's tokens are not
    /// known before it is rendered, so its characters / 4) stay within the budget; the first
    /// always runs, however costly. Once a request of another family waits, none join, so the
    /// batch drains and that request runs next. Each reply goes out as soon as its request
    /// finishes; requests that did not fit are returned to run in the next batch.
    fn run(&mut self, work: Vec<Work>, batch: &mut dyn BatchRun) -> Vec<Work> {
        let name = batch.model_name().to_string();
        let budget = batch.units().max(1);
        struct Job {
            prompt: Prompt,
            options: GenerateOptions,
            on_text: Box<dyn FnMut(&str, usize) -> bool + Send>,
        }
        type Reply = Box<dyn FnOnce(Result<Generation, WorkError>, &str) + Send>;
        // Jobs live until the batch ends; the requests borrow them while newcomers are added.
        let jobs: typed_arena::Arena<Job> = typed_arena::Arena::new();
        // Per request number: its reply and its cost.
        let replies: RefCell<Vec<Option<(Reply, usize)>>> = Default::default();
        let in_flight = Cell::new(0usize);
        let mut waiting: VecDeque<GenerateWork> = downcast_all(work).into();
        let started = Instant::now();
        let (mut served, mut joined_late) = (0usize, 0usize);
        let mut first_call = true;
        let mut admit = |_running: usize| -> Vec<GenerationRequest<'_>> {
            if !first_call {
                waiting.extend(downcast_all::<GenerateWork>(batch.arrivals()));
            }
            let mut out = Vec::new();
            while let Some(w) = waiting.pop_front() {
                let cost = w.options.max_tokens + w.prompt.approximate_tokens();
                if in_flight.get() > 0 && in_flight.get() + cost > budget {
                    waiting.push_front(w);
                    break;
                }
                in_flight.set(in_flight.get() + cost);
                replies.borrow_mut().push(Some((w.reply, cost)));
                if !first_call {
                    joined_late += 1;
                }
                let job = jobs.alloc(Job { prompt: w.prompt, options: w.options, on_text: w.on_text });
                out.push(GenerationRequest { prompt: &job.prompt, options: &job.options, on_text: job.on_text.as_mut() });
            }
            first_call = false;
            out
        };
        let mut done = |number: usize, result: Result<Generation>| {
            let Some((reply, cost)) = replies.borrow_mut().get_mut(number).and_then(Option::take) else { return };
            in_flight.set(in_flight.get().saturating_sub(cost));
            served += 1;
            let result = result.map_err(|e| match e.downcast_ref::<GenerateError>() {
                // A stop is seen by the job itself; the rest are the input's fault.
                Some(g) if *g != GenerateError::Canceled => WorkError::Rejected { code: g.code(), message: g.to_string() },
                _ => WorkError::inference(format!("{e:#}")),
            });
            reply(result, &name);
        };
        self.generate_continuous(&mut admit, &mut done);
        drop(admit);
        drop(done);
        batch.busy(started);
        tracing::info!(requests = served, joined_late, model_ms = started.elapsed().as_millis() as u64, "generation batch done");
        waiting.into_iter().map(|w| Box::new(w) as Work).collect()
    }
}
