//! A conversation rendered into a prompt by the model's own chat template: the Jinja template
//! in the GGUF's `tokenizer.chat_template`, run by minijinja set up as transformers runs
//! templates (`trim_blocks`, `lstrip_blocks`, Python's string methods, `raise_exception`).
//! Files without a template get their architecture's published one (Gemma's), or ChatML.
//!
//! Templates see what transformers' `apply_chat_template` gives them: `messages` (a tool
//! call's `arguments` as an object, as vLLM hands them over), `tools` where offered, and
//! `tojson` as `json.dumps` ([`super::python_json`]). Tool definitions come from the job's
//! input, stored in Postgres as `jsonb`, which keeps no key order, so they are shown in one
//! fixed order: `type`, `function`, `name`, `description`, `parameters`, `properties`,
//! `required`, then the rest by name (a schema's property names by name).

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::Content;
use minijinja::{context, Environment, Error, ErrorKind, Value};

use super::architecture::Architecture;
use super::tools::CallFormat;
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
    call_format: CallFormat,
}

impl ChatTemplate {
    /// `source` where given (a `chat_template.jinja` beside the file), else the file's
    /// template, or its architecture's default.
    pub(crate) fn from_gguf(content: &Content, vocabulary: &Vocabulary, arch: Architecture, source: Option<String>) -> Result<ChatTemplate> {
        let source = match (source, metadata_str(content, "tokenizer.chat_template")) {
            (Some(s), _) => s,
            (None, Some(s)) => s.to_string(),
            (None, None) if arch == Architecture::Gemma3 => GEMMA.to_string(),
            (None, None) => CHATML.to_string(),
        };
        let special = |key: &str| {
            let id = super::metadata_int(content, key).and_then(|v| u32::try_from(v).ok());
            id.and_then(|id| vocabulary.token_text(id)).unwrap_or_default().to_string()
        };
        ChatTemplate::new(source, special("tokenizer.ggml.bos_token_id"), special("tokenizer.ggml.eos_token_id"), None).context("the chat template does not compile")
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
        env.add_filter("tojson", super::python_json::tojson);
        let call_format = CallFormat::of_template(&source);
        env.add_template_owned("chat", source)?;
        Ok(ChatTemplate { env, bos, eos, call_format })
    }

    /// How the template asks for tool calls to be written.
    pub fn call_format(&self) -> CallFormat {
        self.call_format
    }

    /// The prompt for `messages`, the assistant's turn opened, with `tools` (OpenAI's tool
    /// definitions) where given. A conversation the template refuses (`raise_exception`, such
    /// as Gemma's for roles that do not alternate) is [`GenerateError::InvalidMessages`].
    pub fn render(&self, messages: &[ChatMessage], tools: Option<&[serde_json::Value]>) -> Result<String> {
        let template = self.env.get_template("chat")?;
        let tools = tools.map(|tools| Value::from_iter(tools.iter().map(|t| ordered(t, false))));
        let rendered = template.render(context! {
            messages => Value::from_iter(messages.iter().map(message_value)),
            tools => tools,
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

/// A message as transformers' templates read one: only the keys it has (`content` always,
/// empty in an assistant's turn that only calls tools, as vLLM gives it: Qwen3's and
/// Phi-3.5's templates fail on none); each call's `arguments` as the object its JSON text
/// holds (keys in the text's order), or the text where it is not JSON.
fn message_value(m: &ChatMessage) -> Value {
    let mut fields: Vec<(&str, Value)> = vec![("role", Value::from(m.role.as_str())), ("content", Value::from(m.content.as_str()))];
    if !m.tool_calls.is_empty() {
        let calls = m.tool_calls.iter().map(|c| {
            let arguments = serde_json::from_str::<Value>(&c.function.arguments).unwrap_or_else(|_| Value::from(c.function.arguments.as_str()));
            let function = Value::from_iter([("name", Value::from(c.function.name.as_str())), ("arguments", arguments)]);
            Value::from_iter([("id", Value::from(c.id.as_str())), ("type", Value::from(c.kind.as_str())), ("function", function)])
        });
        fields.push(("tool_calls", Value::from_iter(calls)));
    }
    if let Some(id) = &m.tool_call_id {
        fields.push(("tool_call_id", Value::from(id.as_str())));
    }
    if let Some(name) = &m.name {
        fields.push(("name", Value::from(name.as_str())));
    }
    Value::from_iter(fields)
}

/// Keys shown first, in this order, in tool definitions and their schemas.
const KEY_ORDER: [&str; 7] = ["type", "function", "name", "description", "parameters", "properties", "required"];

/// `v` with its objects' keys in the documented order (see the module's doc); inside a
/// schema's `properties` (`names_are_properties`) the keys are the user's and go by name.
fn ordered(v: &serde_json::Value, names_are_properties: bool) -> Value {
    match v {
        serde_json::Value::Object(map) => {
            let rank = |k: &str| if names_are_properties { KEY_ORDER.len() } else { KEY_ORDER.iter().position(|o| *o == k).unwrap_or(KEY_ORDER.len()) };
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_by(|a, b| rank(a).cmp(&rank(b)).then(a.cmp(b)));
            Value::from_iter(keys.into_iter().map(|k| (k.as_str(), ordered(&map[k], !names_are_properties && k == "properties"))))
        }
        serde_json::Value::Array(items) => Value::from_iter(items.iter().map(|i| ordered(i, false))),
        other => Value::from_serialize(other),
    }
}
