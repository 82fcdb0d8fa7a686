//! Text generation with GGUF language models: SmolLM2 and Llama (2, 3), Qwen2/2.5, Qwen3, Phi-3
//! and Gemma 3 ([`architecture`]).
//!
//! Everything needed comes from the one `.gguf` file: the weights, the tokenizer (rebuilt from
//! the `tokenizer.ggml.*` metadata, [`vocabulary`]) and the chat template ([`chat_template`]).
//! No network access is needed at run time.
//!
//! [`Llm::generate`] runs one request at a time on a private copy of the model state, so an
//! [`Llm`] can be shared between threads and each request starts from an empty KV cache.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::{ModelWeights, MAX_SEQ_LEN};

mod architecture;
mod batched;
pub mod chat_template;
mod cpu_pass;
mod decoding;
pub mod family;
mod gguf;
mod python_json;
mod request;
pub mod sampling;
pub mod tools;
mod vocabulary;
use decoding::{CallReading, Decoding, IncrementalText, Step};
use gguf::{metadata_array, metadata_int, metadata_str, requantize, resident_bytes, value_int, WITHOUT_CPU_KERNEL};
pub use request::{
    ChatMessage, FinishReason, GenerateError, GenerateOptions, Generation, GenerationRequest, Prompt, DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, MAX_STOP_SEQUENCES,
};
use architecture::{Architecture, Config};
use batched::BatchedLlama;
pub use chat_template::ChatTemplate;
use cpu_pass::{CpuPass, Segment};
use sampling::{pick_tokens, RowSettings, Sampler};
use vocabulary::Vocabulary;

/// How the forward pass made of candle's ops (a GPU's) keeps the weight matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// As the GGUF stores them. candle multiplies a few rows on the quantized blocks, but
    /// more rows dequantize the whole matrix on every product: on an H100, 64 requests made a
    /// SmolLM2 step 4.6 times as long as one request's.
    Quantized,
    /// Dequantized once, at load, to F32 (4 bytes a parameter: 540 MB for SmolLM2-135M):
    /// each product is one GEMM for every row of every request. The default on GPUs.
    Dense,
}

/// Context length assumed when the GGUF metadata does not state `{architecture}.context_length`.
pub const DEFAULT_CONTEXT_LENGTH: usize = 2048;
/// Most positions tern's forward pass offers: 32,768 (its rotary tables take 4 bytes per
/// position and head dimension, 8 MB at this length for 64-wide heads).
pub const MAX_CONTEXT_LENGTH: usize = 32_768;

/// Prompt tokens fed to the model per forward pass while reading the prompt. Attention scores
/// take `heads x chunk x context` floats per layer, so chunking bounds memory for long prompts
/// (9 heads x 512 x 4096 x 4 bytes = 75 MB) without costing speed at this model size.
const PREFILL_CHUNK: usize = 512;

/// Most tokens, padding included (rows x the longest prompt), read in one pass when requests
/// admitted together have their prompts read together: about what one request of
/// [`PREFILL_CHUNK`] tokens reads at once, times 8.
const PREFILL_GROUP_TOKENS: usize = 8 * PREFILL_CHUNK;

/// A loaded model with its tokenizer and chat template.
pub struct Llm {
    weights: Weights,
    vocabulary: Vocabulary,
    template: ChatTemplate,
    device: Device,
    /// Tokens that end the answer: the metadata's EOS and end-of-turn tokens
    /// ([`Vocabulary::end_ids`]).
    end_ids: Vec<u32>,
    context_length: usize,
    weights_bytes: u64,
    /// Where the time of the last [`Llm::generate_continuous`] call went.
    last_stats: std::sync::Mutex<BatchStats>,
    /// Tokens picked where a step's logits are (a GPU's); false copies them to the host first.
    /// Default true ([`Llm::set_device_sampling`]).
    device_sampling: AtomicBool,
}

/// Where the time of a call that decodes requests together went ([`Llm::last_batch_stats`]):
/// reading prompts, the steps' forward passes, picking tokens, and the per-token text work
/// (detokenising, stop sequences, callbacks). For benchmarks. On a GPU a step's kernels run
/// asynchronously: the wait for them falls in picking, where its tokens come back.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchStats {
    /// Decoding steps, and rows over all of them (a step runs one token of each request).
    pub steps: usize,
    pub rows: usize,
    /// Prompts read, and seconds spent reading them (those admitted together, in groups).
    pub prefills: usize,
    pub prefill_secs: f64,
    pub forward_secs: f64,
    pub sample_secs: f64,
    pub text_secs: f64,
}

/// The PTX of a kernel source, compiled by NVRTC at its first use in the process and kept in
/// `cell` (or the compiler's error, reported for `what` at every use).
#[cfg(feature = "cuda")]
pub(crate) fn nvrtc_once(cell: &'static std::sync::OnceLock<std::result::Result<String, String>>, source: &str, what: &str) -> candle_core::Result<&'static str> {
    cell.get_or_init(|| candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(source).map(|p| p.to_src()).map_err(|e| format!("{e:?}")))
        .as_ref()
        .map(String::as_str)
        .map_err(|e| candle_core::Error::Msg(format!("compiling {what}: {e}")))
}

/// The fused decoding step against candle's ops over the same steps ([`Llm::compare_fused_step`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FusedStepCheck {
    pub requests: usize,
    pub steps: usize,
    /// The largest difference between the two's logits, and the largest logit.
    pub max_diff: f32,
    pub max_logit: f32,
    /// Rows whose greedy token is the same, of `requests x steps`.
    pub same_tokens: usize,
    /// Seconds the steps took each way, a step's tokens back on the host included.
    pub fused_secs: f64,
    pub plain_secs: f64,
}

/// The forward pass that serves a model.
enum Weights {
    /// tern's own, on the CPU over the file's quantized blocks (see [`cpu_pass`]).
    Tern(CpuPass),
    /// candle's ops, on GPUs and for the quantizations tern's own pass lacks; requests decode
    /// together as with [`Weights::Tern`] (see [`batched`]).
    Batched(BatchedLlama),
    /// candle's `quantized_llama`, for the llama variants neither of the above implements
    /// (scaled or partial rotary embeddings, mixtures of experts). Weights with an empty KV
    /// cache: each request works on a clone, so the tensors are shared (reference
    /// counted) while the KV cache and the attention-mask cache (which `quantized_llama` keeps
    /// per prompt length and never clears) die with the request.
    Candle(ModelWeights),
}

impl Llm {
    /// Loads `model.gguf` from the folder `dir_or_file`, or the `.gguf` file it names, onto
    /// `device`. A `chat_template.jinja` in the folder (as transformers saves one) replaces
    /// the file's chat template: for files whose template is missing, wrong or shows no tools.
    ///
    /// Supports the architectures `llama`, `qwen2`, `qwen3`, `phi3` and `gemma3`
    /// ([`architecture`]) with byte-level BPE (`gpt2`) or SentencePiece (`llama`) vocabularies
    /// ([`vocabulary`]).
    ///
    /// On the CPU every model runs on tern's own forward pass, its matrices as stored where
    /// they are Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K and re-quantized to Q8_0 at
    /// load otherwise (Q2_K, Q3_K, the IQ types, F16 matrices). On other devices models run on a forward pass
    /// made of candle's ops, their matrices dequantized once at load
    /// ([`WeightLayout::Dense`]). Both passes decode requests together
    /// ([`Llm::generate_batch`]). The llama variants neither implements (mixtures of experts)
    /// run on candle's `quantized_llama`, one request at a time.
    pub fn load_gguf(dir_or_file: &Path, device: &Device) -> Result<Llm> {
        let layout = if device.is_cpu() { WeightLayout::Quantized } else { WeightLayout::Dense };
        Self::load_gguf_on(dir_or_file, device, device.is_cpu(), layout)
    }

    /// [`Self::load_gguf`] with candle's ops even on the CPU, the matrices kept as `layout`
    /// says: how the forward pass GPUs run is tested and measured without one.
    pub fn load_gguf_portable(dir_or_file: &Path, device: &Device, layout: WeightLayout) -> Result<Llm> {
        Self::load_gguf_on(dir_or_file, device, false, layout)
    }

    fn load_gguf_on(dir_or_file: &Path, device: &Device, own_cpu_pass: bool, layout: WeightLayout) -> Result<Llm> {
        let (path, template_file) = if dir_or_file.is_dir() {
            (dir_or_file.join("model.gguf"), Some(dir_or_file.join("chat_template.jinja")).filter(|f| f.is_file()))
        } else {
            (dir_or_file.to_path_buf(), None)
        };
        let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        // The header holds ~100k small strings (vocabulary and merges): buffer the reads.
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader)
            .with_context(|| format!("reading the GGUF header of {}", path.display()))?;

        let arch = Architecture::from_gguf(&content).with_context(|| format!("{}", path.display()))?;
        // A llama variant neither of tern's passes implements (a mixture of experts) goes to
        // candle's quantized_llama.
        let cfg = match Config::from_gguf(&content) {
            Ok(cfg) => Some(cfg),
            Err(_) if arch == Architecture::Llama => None,
            Err(e) => return Err(e.context(format!("reading the model's shape from {}", path.display()))),
        };
        let vocabulary = Vocabulary::from_gguf(&content).with_context(|| format!("building the tokenizer from {}", path.display()))?;
        let template_source = match &template_file {
            Some(f) => Some(std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?),
            None => None,
        };
        let template = ChatTemplate::from_gguf(&content, &vocabulary, arch, template_source).with_context(|| format!("{}", template_file.as_deref().unwrap_or(&path).display()))?;
        let end_ids = vocabulary.end_ids(&content);
        if end_ids.is_empty() {
            bail!("{}: the metadata names no end-of-sequence token, generation could not end before max_tokens", path.display());
        }
        let stated_context = metadata_int(&content, &format!("{}.context_length", arch.key())).and_then(|v| usize::try_from(v).ok()).unwrap_or(DEFAULT_CONTEXT_LENGTH);
        let own_cpu_pass = own_cpu_pass && device.is_cpu();
        if let Some(cfg) = cfg.as_ref().filter(|_| own_cpu_pass) {
            let context_length = stated_context.min(MAX_CONTEXT_LENGTH);
            let convert = cpu_pass::convertible_to_q8_0(&content);
            let pass = if convert.is_empty() {
                CpuPass::from_gguf(cfg, &content, &mut reader, context_length)
            } else {
                let names: Vec<&str> = convert.iter().map(String::as_str).collect();
                let gguf = requantize(&content, &mut reader, &names, GgmlDType::Q8_0).with_context(|| format!("re-quantizing {} to Q8_0", path.display()))?;
                let mut cursor = std::io::Cursor::new(gguf);
                let content = Content::read(&mut cursor)?;
                CpuPass::from_gguf(cfg, &content, &mut cursor, context_length)
            }
            .with_context(|| format!("loading the weights of {}", path.display()))?;
            match pass {
                Some(pass) => {
                    return Ok(Llm {
                        weights_bytes: pass.bytes(),
                        weights: Weights::Tern(pass),
                        vocabulary,
                        template,
                        device: device.clone(),
                        end_ids,
                        context_length,
                        last_stats: Default::default(),
                        device_sampling: AtomicBool::new(true),
                    })
                }
                // Rows that are not whole blocks of 32: candle's ops serve the model.
                None => {}
            }
        }
        // The RoPE tables of quantized_llama stop at MAX_SEQ_LEN (4096) positions, below
        // SmolLM2's stated 8192: positions past them would fail, so they are not offered.
        let context_length = stated_context.min(MAX_SEQ_LEN);
        let slow: Vec<&str> = content
            .tensor_infos
            .iter()
            .filter(|(_, info)| device.is_cpu() && WITHOUT_CPU_KERNEL.contains(&info.ggml_dtype))
            .map(|(name, _)| name.as_str())
            .collect();
        let load = |content: Content, mut reader: &mut dyn ReadSeek| -> Result<(Weights, u64)> {
            let weights = match &cfg {
                Some(cfg) => (Weights::Batched(BatchedLlama::from_gguf(cfg, &content, &mut reader, device, context_length, layout)?), resident_bytes(&content, layout)),
                // Only a llama variant has no Config (see above).
                None => {
                    let bytes = resident_bytes(&content, WeightLayout::Quantized);
                    (Weights::Candle(ModelWeights::from_gguf(content, &mut reader, device)?), bytes)
                }
            };
            Ok(weights)
        };
        let (weights, weights_bytes) = if slow.is_empty() {
            load(content, &mut reader)
        } else {
            let gguf = requantize(&content, &mut reader, &slow, GgmlDType::Q8_0)
                .with_context(|| format!("re-quantizing {} to Q8_0", path.display()))?;
            let mut cursor = std::io::Cursor::new(gguf);
            let content = Content::read(&mut cursor)?;
            load(content, &mut cursor)
        }
        .with_context(|| format!("loading the weights of {}", path.display()))?;
        Ok(Llm {
            weights,
            vocabulary,
            template,
            device: device.clone(),
            end_ids,
            context_length,
            weights_bytes,
            last_stats: Default::default(),
            device_sampling: AtomicBool::new(true),
        })
    }

    /// Where the time of the last [`Llm::generate_batch`] or [`Llm::generate_continuous`] call
    /// went, where its requests decoded together (zeros for candle's `quantized_llama`).
    pub fn last_batch_stats(&self) -> BatchStats {
        *self.last_stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a step's tokens are picked on the device its logits are on (default true), or
    /// its logits are copied to the host and picked there, by the same rules: for benchmarks
    /// comparing the two.
    pub fn set_device_sampling(&self, on: bool) {
        self.device_sampling.store(on, Ordering::Relaxed);
    }

    /// Whether decoding steps on a GPU run as tern's fused kernels (default true where they
    /// serve the model: dense weights, `batched::fused_step`) or as candle's ops: for
    /// benchmarks comparing the two.
    pub fn set_fused_step(&self, on: bool) {
        if let Weights::Batched(b) = &self.weights {
            b.set_fused_step(on);
        }
    }

    /// The precision of a GPU's larger decoding steps (more than 8 requests, the fused step's
    /// cuBLAS products): F32 (the default, what the reference computes) but for
    /// [`Precision::Tf32Products`], which takes TF32 tensor cores (inputs rounded to 10 bits of
    /// mantissa, F32 sums). Weights stay F32 either way; no effect on the CPU.
    pub fn set_precision(&self, precision: crate::precision::Precision) {
        use crate::precision::Precision;
        if let Weights::Batched(b) = &self.weights {
            b.set_tf32_products(precision == Precision::Tf32Products);
        }
    }

    /// The fused step against candle's ops on the same caches ([`FusedStepCheck`]); `None`
    /// where the model is not served by the batched pass.
    #[cfg(feature = "bench")]
    pub fn compare_fused_step(&self, requests: usize, steps: usize) -> Result<Option<FusedStepCheck>> {
        match &self.weights {
            Weights::Batched(b) => b.compare_fused_step(requests, steps).map(Some),
            _ => Ok(None),
        }
    }

    fn device_sampling(&self) -> bool {
        self.device_sampling.load(Ordering::Relaxed)
    }

    /// Tokens of `prompt` once rendered (template included for [`Prompt::Chat`]), the figure
    /// [`Generation::prompt_tokens`] reports and the context check uses.
    pub fn count_tokens(&self, prompt: &Prompt) -> Result<usize> {
        Ok(self.prompt_ids(prompt)?.len())
    }

    /// Most tokens a request may span, prompt plus `max_tokens`: the metadata's
    /// `{architecture}.context_length` (default [`DEFAULT_CONTEXT_LENGTH`], 2048), capped at
    /// [`MAX_CONTEXT_LENGTH`] (32,768) on tern's forward pass and at 4096, the longest it
    /// supports, on candle's.
    pub fn context_length(&self) -> usize {
        self.context_length
    }

    /// Approximate memory the weights take once loaded, in bytes: the tensors as stored in
    /// the file, plus, with candle's forward pass, the f32 copy of the token embeddings that
    /// candle makes for the lookup (tern's looks rows up in the quantized matrix).
    /// The per-request KV cache is not included (about 46 KB per token for SmolLM2-135M:
    /// 30 layers x keys and values x 3 heads x 64 floats).
    pub fn weights_bytes(&self) -> u64 {
        self.weights_bytes
    }

    /// Token ids of `text`, without a template. Special tokens written in the text (such as
    /// `<|im_end|>`) become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.vocabulary.encode(text)
    }

    /// Text of `ids`; special tokens are left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.vocabulary.decode(ids)
    }

    /// Generates a continuation of `prompt`.
    ///
    /// `on_text` is called after each generated token with the text so far and the number of
    /// tokens generated so far; returning `false` cancels the request, which then fails with
    /// [`GenerateError::Canceled`]. The text it is given never shrinks and is always a prefix
    /// of the final [`Generation::text`]: an unfinished UTF-8 character, or a tail that could
    /// be the beginning of a stop sequence, is held back until it is settled, so some calls
    /// may repeat the previous text.
    ///
    /// Errors: [`GenerateError`] for a request that cannot be served (empty prompt, prompt
    /// plus `max_tokens` over [`Llm::context_length`], options out of range, canceled);
    /// anything else is an internal failure of the model.
    pub fn generate(
        &self,
        prompt: &Prompt,
        opts: &GenerateOptions,
        on_text: &mut dyn FnMut(&str, usize) -> bool,
    ) -> Result<Generation> {
        let request = GenerationRequest { prompt, options: opts, on_text };
        self.generate_batch(vec![request]).pop().expect("one result per request")
    }

    /// Serves several requests at once and returns their results in order, each as
    /// [`Llm::generate`] would give it alone: the same text for the same seed, and a request
    /// that fails or is canceled leaves the others running.
    ///
    /// Each prompt is read on its own, then the requests decode together: one pass through the
    /// weights per step serves every request still running, which is where batching pays,
    /// since a step of one request is bound by reading the weights. So on tern's own CPU pass
    /// and on candle's ops (GPUs, see [`Llm::load_gguf`]); with candle's `quantized_llama` (llama
    /// variants neither implements) they run one after another.
    pub fn generate_batch(&self, requests: Vec<GenerationRequest<'_>>) -> Vec<Result<Generation>> {
        let mut results: Vec<Option<Result<Generation>>> = (0..requests.len()).map(|_| None).collect();
        let mut pending = Some(requests);
        self.generate_continuous(&mut |_| pending.take().unwrap_or_default(), &mut |i, r| results[i] = Some(r));
        results.into_iter().map(|r| r.expect("every request settled")).collect()
    }

    /// Continuous batching: serves the requests `admit` hands over, as [`Llm::generate_batch`]
    /// does, and asks `admit` for more before every decoding step (its argument: how many
    /// requests are decoding), so a request that arrives while others run joins them at the
    /// next step instead of waiting for them all to finish. A newcomer's prompt is read before
    /// it joins (the others wait for that read). Requests are numbered in the order `admit`
    /// gives them, from 0; `done(number, result)` is called as soon as each one finishes. Ends
    /// when no request is running and `admit` gives none.
    ///
    /// With candle's forward pass (GPUs, other quantizations) the requests run one after
    /// another, asking `admit` between them.
    pub fn generate_continuous<'a>(
        &self,
        admit: &mut dyn FnMut(usize) -> Vec<GenerationRequest<'a>>,
        done: &mut dyn FnMut(usize, Result<Generation>),
    ) {
        match &self.weights {
            Weights::Tern(llama) => self.decode_together(llama, admit, done),
            Weights::Batched(batched) => self.decode_together(batched, admit, done),
            Weights::Candle(weights) => {
                let mut next_number = 0;
                loop {
                    let requests = admit(0);
                    if requests.is_empty() {
                        return;
                    }
                    for request in requests {
                        let number = next_number;
                        next_number += 1;
                        done(number, self.start(request).and_then(|(seq, ids)| self.run_with_candle(weights, seq, &ids)));
                    }
                }
            }
        }
    }

    /// [`Llm::generate_continuous`] on a forward pass that decodes requests together.
    fn decode_together<'a, P: BatchedPass>(
        &self,
        pass: &P,
        admit: &mut dyn FnMut(usize) -> Vec<GenerationRequest<'a>>,
        done: &mut dyn FnMut(usize, Result<Generation>),
    ) {
        let mut next_number = 0;
        // (request number, its state, its cache, the token to feed next)
        let mut live = Vec::new();
        let mut stats = BatchStats::default();
        let record = |stats: &BatchStats| *self.last_stats.lock().unwrap_or_else(|e| e.into_inner()) = *stats;
        loop {
            let reading = Instant::now();
            let mut read = 0;
            // Requests admitted together whose prompts fit one chunk are read together, in
            // groups of at most PREFILL_GROUP_TOKENS padded tokens; longer prompts alone, a
            // chunk at a time.
            let mut short = Vec::new();
            for request in admit(live.len()) {
                read += 1;
                let number = next_number;
                next_number += 1;
                let started = self.start(request).and_then(|(seq, ids)| {
                    let cache = pass.new_cache(ids.len() + seq.opts.max_tokens)?;
                    Ok((seq, ids, cache))
                });
                match started {
                    Ok((seq, ids, cache)) if ids.len() <= PREFILL_CHUNK => short.push((number, seq, ids, cache)),
                    Ok((mut seq, ids, mut cache)) => {
                        let first = ids.chunks(PREFILL_CHUNK).try_fold(Vec::new(), |_, chunk| pass.prefill(chunk, &mut cache));
                        let step = first.and_then(|logits| seq.step(self, &logits_tensor(logits)?));
                        self.started(number, seq, cache, step, &mut live, done);
                    }
                    Err(e) => done(number, Err(e)),
                }
            }
            while !short.is_empty() {
                let (mut take, mut longest) = (0, 0);
                while take < short.len() {
                    let longest_then = longest.max(short[take].2.len());
                    if take > 0 && longest_then * (take + 1) > PREFILL_GROUP_TOKENS {
                        break;
                    }
                    longest = longest_then;
                    take += 1;
                }
                let mut group: Vec<_> = short.drain(..take).collect();
                let mut prompts: Vec<(&[u32], &mut P::Cache)> = group.iter_mut().map(|g| (&g.2[..], &mut g.3)).collect();
                let firsts = pass.prefill_many(&mut prompts);
                drop(prompts);
                match firsts {
                    Ok(firsts) => {
                        for ((number, mut seq, _, cache), logits) in group.into_iter().zip(firsts) {
                            let step = logits_tensor(logits).and_then(|logits| seq.step(self, &logits));
                            self.started(number, seq, cache, step, &mut live, done);
                        }
                    }
                    // Read alone, so that one request's failure is its own.
                    Err(_) => {
                        for (number, mut seq, ids, mut cache) in group {
                            let step = pass.prefill(&ids, &mut cache).and_then(|logits| seq.step(self, &logits_tensor(logits)?));
                            self.started(number, seq, cache, step, &mut live, done);
                        }
                    }
                }
            }
            if read > 0 {
                stats.prefills += read;
                stats.prefill_secs += reading.elapsed().as_secs_f64();
            }
            if live.is_empty() {
                record(&stats);
                return;
            }
            let forward = Instant::now();
            let mut rows: Vec<(u32, &mut P::Cache)> = live.iter_mut().map(|l| (l.3, &mut l.2)).collect();
            let logits = pass.step(&mut rows);
            drop(rows);
            stats.steps += 1;
            stats.rows += live.len();
            stats.forward_secs += forward.elapsed().as_secs_f64();
            let sampling = Instant::now();
            let settings: Vec<RowSettings> = live.iter_mut().map(|l| l.1.sampler.next_row()).collect();
            let tokens = match logits.and_then(|logits| logits.pick(&settings, self.device_sampling())) {
                Ok(tokens) => tokens,
                Err(e) => {
                    for (number, ..) in live.drain(..) {
                        done(number, Err(anyhow!("{e:#}")));
                    }
                    continue;
                }
            };
            stats.sample_secs += sampling.elapsed().as_secs_f64();
            let text = Instant::now();
            let mut still = Vec::with_capacity(live.len());
            for ((number, mut seq, cache, _), token) in live.into_iter().zip(tokens) {
                match seq.accept(self, token) {
                    Ok(Step::Next(token)) => still.push((number, seq, cache, token)),
                    Ok(Step::Done(generation)) => done(number, Ok(generation)),
                    Err(e) => done(number, Err(e)),
                }
            }
            live = still;
            stats.text_secs += text.elapsed().as_secs_f64();
        }
    }

    /// A request whose prompt was read: decoding if its first token goes on, answered if not.
    fn started<'a, C>(
        &self,
        number: usize,
        seq: Decoding<'a>,
        cache: C,
        step: Result<Step>,
        live: &mut Vec<(usize, Decoding<'a>, C, u32)>,
        done: &mut dyn FnMut(usize, Result<Generation>),
    ) {
        match step {
            Ok(Step::Next(token)) => live.push((number, seq, cache, token)),
            Ok(Step::Done(generation)) => done(number, Ok(generation)),
            Err(e) => done(number, Err(e)),
        }
    }

    /// One request through candle's `quantized_llama`.
    fn run_with_candle(&self, weights: &ModelWeights, mut seq: Decoding<'_>, ids: &[u32]) -> Result<Generation> {
        // A fresh KV cache per request. (quantized_llama also drops its cache when a forward
        // starts at index_pos 0, but the mask cache would keep growing across requests.)
        let mut model = weights.clone();
        let forward = |model: &mut ModelWeights, ids: &[u32], pos: usize| -> Result<Tensor> {
            let input = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
            // (batch, vocab) logits for the last position.
            Ok(model.forward(&input, pos)?.squeeze(0)?)
        };
        let mut logits = None;
        for (i, chunk) in ids.chunks(PREFILL_CHUNK).enumerate() {
            logits = Some(forward(&mut model, chunk, i * PREFILL_CHUNK)?);
        }
        let mut logits = logits.context("no prompt tokens")?;
        loop {
            match seq.step(self, &logits)? {
                Step::Done(generation) => return Ok(generation),
                // Prompt positions are 0..prompt_tokens; generated[k] sits at prompt_tokens + k.
                Step::Next(token) => logits = forward(&mut model, &[token], seq.prompt_tokens + seq.generated.len() - 1)?,
            }
        }
    }

    /// Checks a request and renders its prompt.
    fn start<'a>(&self, request: GenerationRequest<'a>) -> Result<(Decoding<'a>, Vec<u32>)> {
        let GenerationRequest { prompt, options: opts, on_text } = request;
        opts.validate()?;
        if prompt.messages().is_some_and(<[ChatMessage]>::is_empty) {
            return Err(GenerateError::EmptyPrompt.into());
        }
        let prompt_ids = self.prompt_ids(prompt)?;
        let prompt_tokens = prompt_ids.len();
        if prompt_tokens == 0 {
            return Err(GenerateError::EmptyPrompt.into());
        }
        if prompt_tokens + opts.max_tokens > self.context_length {
            return Err(GenerateError::ContextOverflow {
                prompt_tokens,
                max_tokens: opts.max_tokens,
                context_length: self.context_length,
            }
            .into());
        }
        let seq = Decoding {
            opts,
            on_text,
            sampler: Sampler::new(opts),
            prompt_tokens,
            generated: Vec::with_capacity(opts.max_tokens),
            text: IncrementalText::default(),
            searched: 0,
            max_stop: opts.stop.iter().map(String::len).max().unwrap_or(0),
            tools: match prompt {
                Prompt::ChatWithTools(_, tools) if offered(tools) => Some(CallReading {
                    format: self.template.call_format(),
                    opening: self.call_opening(tools)?,
                    parallel: tools.parallel,
                    named: match &tools.choice {
                        tools::ToolChoice::Function(name) => Some(name.clone()),
                        _ => None,
                    },
                    arguments_end: Default::default(),
                }),
                _ => None,
            },
        };
        Ok((seq, prompt_ids))
    }

    /// The logits after each token of each sequence (per sequence, a row of the vocabulary's
    /// width per token), the sequences decoded together as requests are: each one's first
    /// token read alone, then one decoding step per position for every sequence that long.
    /// For comparing the forward passes with a reference. Not on candle's `quantized_llama`.
    pub fn logits_at_each_position(&self, sequences: &[&[u32]]) -> Result<Vec<Vec<Vec<f32>>>> {
        fn each<P: BatchedPass>(pass: &P, sequences: &[&[u32]]) -> Result<Vec<Vec<Vec<f32>>>> {
            ensure!(sequences.iter().all(|s| !s.is_empty()), "an empty sequence");
            let mut caches = sequences.iter().map(|s| pass.new_cache(s.len())).collect::<Result<Vec<_>>>()?;
            let mut out: Vec<Vec<Vec<f32>>> = sequences.iter().zip(&mut caches).map(|(s, c)| Ok(vec![pass.prefill(&s[..1], c)?])).collect::<Result<_>>()?;
            let longest = sequences.iter().map(|s| s.len()).max().unwrap_or(0);
            for i in 1..longest {
                let live: Vec<usize> = (0..sequences.len()).filter(|&r| sequences[r].len() > i).collect();
                let mut rows: Vec<(u32, &mut P::Cache)> = caches.iter_mut().enumerate().filter(|(r, _)| live.contains(r)).map(|(r, c)| (sequences[r][i], c)).collect();
                let logits = match pass.step(&mut rows)? {
                    StepLogits::Host(rows) => rows,
                    StepLogits::Device(t) => t.to_device(&Device::Cpu)?.to_dtype(candle_core::DType::F32)?.to_vec2()?,
                };
                for (r, row) in live.into_iter().zip(logits) {
                    out[r].push(row);
                }
            }
            Ok(out)
        }
        match &self.weights {
            Weights::Tern(pass) => each(pass, sequences),
            Weights::Batched(pass) => each(pass, sequences),
            Weights::Candle(_) => bail!("candle's quantized_llama serves this model: its logits are not offered"),
        }
    }

    /// The logits after the last of `tokens`, all read in one pass (as a prompt is read).
    pub fn logits_after(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        match &self.weights {
            Weights::Tern(pass) => BatchedPass::prefill(pass, tokens, &mut BatchedPass::new_cache(pass, tokens.len())?),
            Weights::Batched(pass) => BatchedPass::prefill(pass, tokens, &mut BatchedPass::new_cache(pass, tokens.len())?),
            Weights::Candle(_) => bail!("candle's quantized_llama serves this model: its logits are not offered"),
        }
    }

    /// The prompt text `messages` render to with the model's chat template, the assistant's
    /// turn opened. Errors: [`GenerateError::InvalidMessages`] where the template refuses them.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        self.template.render(messages, None)
    }

    /// The text a prompt becomes: the text itself, or the conversation rendered with the
    /// model's chat template, the assistant's turn opened (and begun with the opening of a
    /// call, where `tool_choice` requires one). Errors: [`GenerateError::InvalidMessages`]
    /// where the template refuses the conversation, [`GenerateError::ToolsUnsupported`] where
    /// tools are offered to a template that shows none.
    pub fn render_prompt<'p>(&self, prompt: &'p Prompt) -> Result<std::borrow::Cow<'p, str>> {
        Ok(match prompt {
            Prompt::Text(text) => text.as_str().into(),
            Prompt::Chat(messages) => self.template.render(messages, None)?.into(),
            Prompt::ChatWithTools(messages, tools) if offered(tools) => {
                let opening = self.call_opening(tools)?;
                (self.template.render(messages, Some(&tools.tools))? + &opening).into()
            }
            Prompt::ChatWithTools(messages, _) => self.template.render(messages, None)?.into(),
        })
    }

    /// What the answer is begun with for the request's `tool_choice` (see
    /// [`tools::CallFormat::forced_opening`]).
    fn call_opening(&self, tools: &tools::ToolUse) -> Result<String> {
        let format = self.template.call_format();
        if format == tools::CallFormat::Unsupported {
            return Err(GenerateError::ToolsUnsupported("this model's chat template shows no tools: it cannot call them".into()).into());
        }
        format.forced_opening(&tools.choice).ok_or_else(|| GenerateError::ToolsUnsupported("this model's chat template writes calls in a form tern cannot begin".into()).into())
    }

    /// Token ids of the rendered prompt, after the BOS token where the model asks for one
    /// (and the rendered text does not begin with it already, as chat templates often do).
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let mut ids = self.encode(&self.render_prompt(prompt)?)?;
        if let Some(bos) = self.vocabulary.bos {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }
}

/// Whether tools are shown to the model: some are offered and `tool_choice` is not `none`.
fn offered(tools: &tools::ToolUse) -> bool {
    !tools.tools.is_empty() && tools.choice != tools::ToolChoice::None
}

/// A forward pass whose requests decode together: each request's prompt is read on its own,
/// then one step runs a token of every running request, reading the weights once for all.
trait BatchedPass {
    /// One request's keys and values.
    type Cache;
    /// An empty cache for a request of `capacity` positions.
    fn new_cache(&self, capacity: usize) -> Result<Self::Cache>;
    /// Runs `tokens` at the positions after those in `cache`; the logits of the last one.
    fn prefill(&self, tokens: &[u32], cache: &mut Self::Cache) -> Result<Vec<f32>>;
    /// Reads several requests' prompts (each at most [`PREFILL_CHUNK`] tokens, into an empty
    /// cache); the logits of each one's last token, in order. By default one after another:
    /// on the CPU a prompt is already read at the products' full speed, and 64 prompts read
    /// together were no faster (docs/benchmarks.md).
    fn prefill_many(&self, prompts: &mut [(&[u32], &mut Self::Cache)]) -> Result<Vec<Vec<f32>>> {
        prompts.iter_mut().map(|(tokens, cache)| self.prefill(tokens, cache)).collect()
    }
    /// One token of each row at the position after its cache's; the logits of each.
    fn step(&self, rows: &mut [(u32, &mut Self::Cache)]) -> Result<StepLogits>;
}

/// A step's logits, `rows x vocabulary`, where the forward pass left them.
enum StepLogits {
    Host(Vec<Vec<f32>>),
    /// On the pass's device, where the tokens are picked (only they come back).
    Device(Tensor),
}

impl StepLogits {
    /// Each row's next token by its settings ([`sampling`]), picked where the logits are, or
    /// on the host when `on_device` is false (to compare the two).
    fn pick(self, settings: &[RowSettings], on_device: bool) -> Result<Vec<u32>> {
        let logits = match self {
            StepLogits::Host(rows) => {
                let (n, vocab) = (rows.len(), rows.first().map_or(0, Vec::len));
                Tensor::from_vec(rows.concat(), (n, vocab), &Device::Cpu)?
            }
            StepLogits::Device(logits) if on_device => logits,
            StepLogits::Device(logits) => logits.to_device(&Device::Cpu)?,
        };
        Ok(pick_tokens(&logits, settings)?)
    }
}

impl BatchedPass for CpuPass {
    type Cache = cpu_pass::KvCache;

    fn new_cache(&self, capacity: usize) -> Result<Self::Cache> {
        Ok(CpuPass::new_cache(self, capacity))
    }

    fn prefill(&self, tokens: &[u32], cache: &mut Self::Cache) -> Result<Vec<f32>> {
        self.forward(tokens, cache)
    }

    fn step(&self, rows: &mut [(u32, &mut Self::Cache)]) -> Result<StepLogits> {
        let tokens: Vec<[u32; 1]> = rows.iter().map(|r| [r.0]).collect();
        let mut segments: Vec<Segment<'_>> = rows.iter_mut().zip(&tokens).map(|(r, t)| Segment { tokens: t, cache: &mut *r.1 }).collect();
        Ok(StepLogits::Host(self.forward_batch(&mut segments)?))
    }
}

impl BatchedPass for BatchedLlama {
    type Cache = batched::RowCache;

    fn new_cache(&self, capacity: usize) -> Result<Self::Cache> {
        BatchedLlama::new_cache(self, capacity)
    }

    fn prefill(&self, tokens: &[u32], cache: &mut Self::Cache) -> Result<Vec<f32>> {
        BatchedLlama::prefill(self, tokens, cache)
    }

    fn prefill_many(&self, prompts: &mut [(&[u32], &mut Self::Cache)]) -> Result<Vec<Vec<f32>>> {
        BatchedLlama::prefill_many(self, prompts)
    }

    fn step(&self, rows: &mut [(u32, &mut Self::Cache)]) -> Result<StepLogits> {
        Ok(StepLogits::Device(BatchedLlama::step(self, rows)?))
    }
}

/// What loading reads the weights from: the file, or a re-quantized copy in memory.
trait ReadSeek: std::io::Read + std::io::Seek {}
impl<T: std::io::Read + std::io::Seek> ReadSeek for T {}

/// A row of logits as a host tensor `(1, vocabulary)`.
fn logits_tensor(logits: Vec<f32>) -> Result<Tensor> {
    let n = logits.len();
    Ok(Tensor::from_vec(logits, (1, n), &Device::Cpu)?)
}
