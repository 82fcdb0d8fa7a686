//! What a generation request is: its prompt, its options and their limits, its result, and
//! why it may be refused.

use serde::{Deserialize, Serialize};

use super::tools::{ToolCall, ToolUse};

/// Default for [`GenerateOptions::max_tokens`].
pub const DEFAULT_MAX_TOKENS: usize = 256;
/// Default for [`GenerateOptions::temperature`].
pub const DEFAULT_TEMPERATURE: f64 = 0.7;
/// Most stop sequences [`GenerateOptions::stop`] may hold.
pub const MAX_STOP_SEQUENCES: usize = 4;
/// Sampling settings for one request. [`Default`] gives the documented defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Most tokens to generate, at least 1. Default [`DEFAULT_MAX_TOKENS`] (256). The prompt
    /// plus `max_tokens` must fit in [`Llm::context_length`].
    pub max_tokens: usize,
    /// Softmax temperature, finite and >= 0. Default [`DEFAULT_TEMPERATURE`] (0.7); 0 means
    /// greedy (argmax) decoding, which ignores `top_p` and `seed`.
    pub temperature: f64,
    /// Nucleus sampling: sample only from the most likely tokens whose probabilities add up
    /// to `top_p`, in (0, 1]. Default `None` (sample from the whole distribution).
    pub top_p: Option<f64>,
    /// Sample only from the `top_k` likeliest tokens (those tied with the k-th too), at least
    /// 1; applied before `top_p`. Default `None` (no cut).
    pub top_k: Option<usize>,
    /// Seed of the sampler: the same prompt, options and seed give the same text. Default 0.
    pub seed: u64,
    /// Stop sequences, at most [`MAX_STOP_SEQUENCES`], none empty. Default none. Matched on
    /// the decoded text (so across token boundaries); generation ends at the first match and
    /// the returned text stops just before it.
    pub stop: Vec<String>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: DEFAULT_MAX_TOKENS,
            temperature: DEFAULT_TEMPERATURE,
            top_p: None,
            top_k: None,
            seed: 0,
            stop: Vec::new(),
        }
    }
}

impl GenerateOptions {
    /// Checks the limits stated on each field.
    pub fn validate(&self) -> Result<(), GenerateError> {
        let invalid =
            |m: String| -> Result<(), GenerateError> { Err(GenerateError::InvalidOptions(m)) };
        if self.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return invalid(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if let Some(p) = self.top_p {
            // Written so that NaN fails too.
            if !(p > 0.0 && p <= 1.0) {
                return invalid(format!("top_p must be in (0, 1], got {p}"));
            }
        }
        if self.top_k == Some(0) {
            return invalid("top_k must be at least 1".into());
        }
        if self.stop.len() > MAX_STOP_SEQUENCES {
            return invalid(format!(
                "at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {}",
                self.stop.len()
            ));
        }
        if self.stop.iter().any(String::is_empty) {
            return invalid("stop sequences must not be empty".into());
        }
        Ok(())
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool` (not checked: the template takes any role).
    pub role: String,
    /// The message text; may be empty for an assistant's turn that only calls tools.
    #[serde(default)]
    pub content: String,
    /// The calls an assistant's turn made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// In a `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// In a `tool` message, the function's name (some templates show it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message of `role` with text `content`.
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
    }
}

/// What to continue.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Raw text, tokenised as is, after the BOS token where the model's metadata asks for one
    /// (`tokenizer.ggml.add_bos_token`: Gemma, Llama; not SmolLM2 or Qwen). Special tokens
    /// written in it, such as `<|im_start|>`, are recognised as such.
    Text(String),
    /// A conversation, rendered with the model's chat template (`tokenizer.chat_template`, or
    /// its architecture's published one) with the assistant's turn opened. Must not be empty.
    Chat(Vec<ChatMessage>),
    /// A conversation with tools the model may call: the template shows it the tools (it must
    /// use a `tools` variable, else [`GenerateError::ToolsUnsupported`]) and the calls it
    /// writes come back as [`Generation::tool_calls`].
    ChatWithTools(Vec<ChatMessage>, ToolUse),
}

impl Prompt {
    /// The conversation, for [`Prompt::Chat`] and [`Prompt::ChatWithTools`].
    pub fn messages(&self) -> Option<&[ChatMessage]> {
        match self {
            Prompt::Text(_) => None,
            Prompt::Chat(m) | Prompt::ChatWithTools(m, _) => Some(m),
        }
    }

    /// A cheap upper estimate of the prompt's tokens, for admission: a third of its characters
    /// plus the chat template's few tokens per message (BPE tokens of English text average
    /// about four characters).
    pub fn approximate_tokens(&self) -> usize {
        let message = |m: &ChatMessage| {
            let calls: usize = m.tool_calls.iter().map(|c| c.function.name.len() + c.function.arguments.len() + 20).sum();
            (m.role.len() + m.content.len() + calls) / 3 + 5
        };
        match self {
            Prompt::Text(t) => t.len() / 3 + 1,
            Prompt::Chat(messages) => messages.iter().map(message).sum::<usize>() + 20,
            Prompt::ChatWithTools(messages, tools) => {
                let definitions: usize = tools.tools.iter().map(|t| t.to_string().len()).sum();
                messages.iter().map(message).sum::<usize>() + definitions / 3 + 100
            }
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model ended its answer (an end-of-turn or end-of-sequence token) or a stop sequence
    /// matched.
    Stop,
    /// `max_tokens` tokens were generated.
    Length,
    /// The answer calls tools ([`Generation::tool_calls`]).
    ToolCalls,
}

/// The result of [`Llm::generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The generated text, without the end token and without a matched stop sequence; with
    /// tool calls, only the text before them.
    pub text: String,
    /// The tools the answer calls, read from its text (only with [`Prompt::ChatWithTools`]).
    pub tool_calls: Vec<ToolCall>,
    /// Tokens in the rendered prompt.
    pub prompt_tokens: usize,
    /// Tokens generated, not counting the end token (end of turn or sequence), which is not
    /// part of the text. A token that completed a stop sequence is counted.
    pub completion_tokens: usize,
    /// Why generation ended.
    pub finish_reason: FinishReason,
}

/// Why a request cannot be served. Each variant has a stable machine code, see
/// [`GenerateError::code`]. Returned inside `anyhow::Error`: find it with
/// `err.downcast_ref::<GenerateError>()`; any other error is an internal failure.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GenerateError {
    /// The prompt renders to no tokens, or the conversation has no messages. Code `prompt_empty`.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Prompt plus `max_tokens` do not fit in the context. Code `context_length_exceeded`.
    #[error(
        "the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the \
         model's context length of {context_length} tokens"
    )]
    ContextOverflow {
        /// Tokens in the rendered prompt.
        prompt_tokens: usize,
        /// The requested `max_tokens`.
        max_tokens: usize,
        /// [`Llm::context_length`].
        context_length: usize,
    },
    /// An option is out of its documented range. Code `invalid_options`.
    #[error("invalid generation options: {0}")]
    InvalidOptions(String),
    /// The progress callback asked to stop. Code `canceled`.
    #[error("generation was canceled")]
    Canceled,
    /// The model's chat template refuses the conversation (Gemma's, for roles that do not
    /// alternate user/assistant). Code `invalid_messages`.
    #[error("{0}")]
    InvalidMessages(String),
    /// Tools were offered but the model's chat template shows none (or cannot be made to
    /// call one, for `tool_choice` `required` or a named function). Code `tools_unsupported`.
    #[error("{0}")]
    ToolsUnsupported(String),
}

impl GenerateError {
    /// Stable machine-readable code: `prompt_empty`, `context_length_exceeded`,
    /// `invalid_options`, `canceled`, `invalid_messages` or `tools_unsupported`.
    pub fn code(&self) -> &'static str {
        match self {
            GenerateError::EmptyPrompt => "prompt_empty",
            GenerateError::ContextOverflow { .. } => "context_length_exceeded",
            GenerateError::InvalidOptions(_) => "invalid_options",
            GenerateError::Canceled => "canceled",
            GenerateError::InvalidMessages(_) => "invalid_messages",
            GenerateError::ToolsUnsupported(_) => "tools_unsupported",
        }
    }
}

/// One request of [`Llm::generate_batch`].
pub struct GenerationRequest<'a> {
    /// What to continue.
    pub prompt: &'a Prompt,
    /// Sampling settings.
    pub options: &'a GenerateOptions,
    /// Called after each token, as in [`Llm::generate`]; `false` cancels this request.
    pub on_text: &'a mut dyn FnMut(&str, usize) -> bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_are_checked() {
        assert!(GenerateOptions::default().validate().is_ok());
        let with = |change: fn(&mut GenerateOptions)| {
            let mut o = GenerateOptions::default();
            change(&mut o);
            o
        };
        let bad = [
            with(|o| o.max_tokens = 0),
            with(|o| o.temperature = -0.1),
            with(|o| o.temperature = f64::NAN),
            with(|o| o.top_p = Some(0.0)),
            with(|o| o.top_p = Some(1.5)),
            with(|o| o.stop = stops(&["a", "b", "c", "d", "e"])),
            with(|o| o.stop = stops(&[""])),
        ];
        for o in bad {
            assert_eq!(o.validate().unwrap_err().code(), "invalid_options", "{o:?}");
        }
    }

    #[test]
    fn finish_reason_serialises_lowercase() {
        assert_eq!(
            serde_json::to_string(&FinishReason::Stop).unwrap(),
            "\"stop\""
        );
        assert_eq!(
            serde_json::to_string(&FinishReason::Length).unwrap(),
            "\"length\""
        );
        assert_eq!(serde_json::to_string(&FinishReason::ToolCalls).unwrap(), "\"tool_calls\"");
    }
}
