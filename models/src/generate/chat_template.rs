//! A conversation rendered into a prompt by the model's own chat template: the Jinja template
//! in the GGUF's `tokenizer.chat_template`, run by minijinja set up as transformers runs
//! templates (`trim_blocks`, `lstrip_blocks`, Python's string methods, `raise_exception`).
//! Files without a template get their architecture's published one (Gemma's), or ChatML.

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::Content;
use minijinja::{context, Environment, Error, ErrorKind};

use super::architecture::Architecture;
use super::vocabulary::Vocabulary;
use super::{metadata_str, ChatMessage, GenerateError};

/// Gemma's template (google/gemma-3-270m's `tokenizer_config.json`) for text contents, its
/// branches for image parts left out (messages here are text), for files converted without
/// one: a system message is put before the first user turn; roles must alternate.
const GEMMA: &str = "{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = \"\" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = \"model\" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
";

/// ChatML, the template of files that state none and are not Gemma (llama.cpp's default too).
const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A model's chat template, compiled once.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// The file's template, or its architecture's default.
    pub(crate) fn from_gguf(content: &Content, vocabulary: &Vocabulary, arch: Architecture) -> Result<ChatTemplate> {
        let source = match metadata_str(content, "tokenizer.chat_template") {
            Some(s) => s.to_string(),
            None if arch == Architecture::Gemma3 => GEMMA.to_string(),
            None => CHATML.to_string(),
        };
        let special = |key: &str| {
            let id = super::metadata_int(content, key).and_then(|v| u32::try_from(v).ok());
            id.and_then(|id| vocabulary.token_text(id)).unwrap_or_default().to_string()
        };
        ChatTemplate::new(source, special("tokenizer.ggml.bos_token_id"), special("tokenizer.ggml.eos_token_id"), None).context("the GGUF's chat template does not compile")
    }

    /// A template from its Jinja `source`, with the texts of the BOS and EOS tokens it may
    /// write; `strftime_now` gives `today` (default: the current UTC date and time), as
    /// transformers gives templates the current time.
    pub fn new(source: String, bos: String, eos: String, today: Option<chrono::NaiveDateTime>) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, message)) });
        env.add_function("strftime_now", move |format: String| -> String {
            let now = today.unwrap_or_else(|| chrono::Utc::now().naive_utc());
            now.format(&format).to_string()
        });
        env.add_template_owned("chat", source)?;
        Ok(ChatTemplate { env, bos, eos })
    }

    /// The prompt for `messages`, the assistant's turn opened. A conversation the template
    /// refuses (`raise_exception`, such as Gemma's for roles that do not alternate) is
    /// [`GenerateError::InvalidMessages`].
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self.env.get_template("chat")?;
        let rendered = template.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        });
        rendered.map_err(|e| {
            let message = match e.kind() {
                ErrorKind::InvalidOperation => e.detail().unwrap_or("the chat template refused the conversation").to_string(),
                _ => format!("the model's chat template failed on this conversation: {e}"),
            };
            GenerateError::InvalidMessages(message).into()
        })
    }
}
