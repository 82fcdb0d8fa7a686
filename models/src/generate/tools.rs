//! Tools a model may call: the definitions offered (OpenAI's `tools`), the choice
//! (`tool_choice`), and the calls read back out of the generated text into OpenAI's
//! `tool_calls`.
//!
//! Models write calls in their template's format; three are read, whichever the model uses:
//! - Hermes (Qwen2.5, Qwen3, SmolLM3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//!   possibly after some text, possibly several;
//! - Llama 3.1/3.2: the answer is a JSON object `{"name": ..., "parameters": {...}}` (several
//!   separated by `;`), after `<|python_tag|>` (a control token, left out of the text);
//! - Mistral: `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`.
//!
//! Text that looks like a call but does not parse as one stays the answer's text, as vLLM's
//! parsers leave it.

use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

/// Most tools a request may offer.
pub const MAX_TOOLS: usize = 128;

/// A call the model made (or, in a conversation, made earlier), in OpenAI's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, which the tool's answer names (`tool_call_id`): `call_` and 24 letters
    /// and digits, or 9 for Mistral's templates, which require that length.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".into()
}

/// The function a [`ToolCall`] calls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as JSON text (an object), as OpenAI gives them.
    pub arguments: String,
}

/// Whether and how the model may call tools (OpenAI's `tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// It decides (the default).
    #[default]
    Auto,
    /// It answers in text: the tools are not shown to it.
    None,
    /// It calls at least one tool: its answer is begun with the opening of a call.
    Required,
    /// It calls this function: its answer is begun with the opening of a call to it.
    Function(String),
}

/// Tools offered with a conversation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolUse {
    /// Tool definitions as OpenAI takes them (`{"type": "function", "function": {"name",
    /// "description", "parameters"}}`), shown to the model through its chat template. At most
    /// [`MAX_TOOLS`].
    pub tools: Vec<Value>,
    pub choice: ToolChoice,
    /// Whether the answer may hold several calls (OpenAI's `parallel_tool_calls`, default
    /// true); when false only the first is kept.
    pub parallel: bool,
}

/// How a model's chat template asks for calls to be written, read from its source; decides
/// how an answer is begun when a call is required.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// The template shows no tools.
    Unsupported,
    /// `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
    Hermes,
    /// `[TOOL_CALLS][{"name": ..., "arguments": ...}]`.
    Mistral,
    /// A bare JSON object; `parameters` names the arguments' key (Llama 3's templates ask
    /// for `parameters`, others for `arguments`).
    Json { parameters: bool },
}

impl CallFormat {
    /// The format a template's source asks for.
    pub fn of_template(source: &str) -> CallFormat {
        if !source.contains("tools") {
            CallFormat::Unsupported
        } else if source.contains("<tool_call>") {
            CallFormat::Hermes
        } else if source.contains("[TOOL_CALLS]") {
            CallFormat::Mistral
        } else {
            CallFormat::Json { parameters: source.contains(r#"\"parameters\""#) || source.contains(r#""parameters""#) }
        }
    }

    /// The text the answer begins with for `choice`: the opening of a call (with the
    /// function's name for [`ToolChoice::Function`]); empty for `auto` and `none`. `None`
    /// where the format is [`CallFormat::Unsupported`] and a call is required.
    pub fn forced_opening(self, choice: &ToolChoice) -> Option<String> {
        let name = match choice {
            ToolChoice::Auto | ToolChoice::None => return Some(String::new()),
            ToolChoice::Required => None,
            ToolChoice::Function(name) => Some(name.as_str()),
        };
        let (open, key) = match self {
            CallFormat::Unsupported => return None,
            CallFormat::Hermes => ("<tool_call>\n{\"name\": \"", "arguments"),
            CallFormat::Mistral => ("[TOOL_CALLS][{\"name\": \"", "arguments"),
            CallFormat::Json { parameters } => ("{\"name\": \"", if parameters { "parameters" } else { "arguments" }),
        };
        // The name is a JSON string: escape it as one (names are [A-Za-z0-9_-] in the schema).
        Some(match name {
            None => open.to_string(),
            Some(name) => format!("{open}{}\", \"{key}\": ", json_string_body(name)),
        })
    }

    fn id(self) -> String {
        let letters = |n: usize| -> String { rand::rng().sample_iter(rand::distr::Alphanumeric).take(n).map(char::from).collect() };
        match self {
            CallFormat::Mistral => letters(9),
            _ => format!("call_{}", letters(24)),
        }
    }
}

fn json_string_body(s: &str) -> String {
    let quoted = Value::String(s.to_string()).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";

/// The part of a growing answer that is surely text, not a call: what comes before the
/// first `<tool_call>` (and before a tail that may be its beginning), trailing white space
/// held back; nothing while the answer (after white space) begins as JSON or `[TOOL_CALLS]`
/// does. Always a prefix of [`read_calls`]'s text for the finished answer.
pub fn settled_text(text: &str) -> &str {
    let start = text.trim_start();
    if start.is_empty() || start.starts_with('{') || start.starts_with('[') {
        return "";
    }
    let mut end = text.find(HERMES_OPEN).unwrap_or(text.len());
    // A tail that may grow into the opening.
    for (i, _) in text[..end].char_indices().rev().take(HERMES_OPEN.len()) {
        if HERMES_OPEN.starts_with(&text[i..end]) {
            end = i;
            break;
        }
    }
    text[..end].trim_end()
}

/// The calls in a finished answer, and its text outside them: with calls, the text before
/// the first (trailing white space trimmed); without, the whole answer. Calls are read only
/// where every one parses; ids are new. With `parallel` false, only the first call is kept.
pub fn read_calls(answer: &str, format: CallFormat, parallel: bool) -> (String, Vec<ToolCall>) {
    let start = answer.trim_start();
    let parsed = if let Some(at) = answer.find(HERMES_OPEN) {
        hermes_calls(&answer[at..]).map(|calls| (answer[..at].trim_end().to_string(), calls))
    } else if start.starts_with('{') || start.starts_with('[') {
        let json = start.strip_prefix(MISTRAL_OPEN).unwrap_or(start);
        json_calls(json).map(|calls| (String::new(), calls))
    } else if let Some(json) = start.strip_prefix(MISTRAL_OPEN) {
        json_calls(json).map(|calls| (String::new(), calls))
    } else {
        None
    };
    match parsed {
        Some((text, mut calls)) if !calls.is_empty() => {
            if !parallel {
                calls.truncate(1);
            }
            let calls = calls.into_iter().map(|(name, arguments)| ToolCall { id: format.id(), kind: function_type(), function: FunctionCall { name, arguments } }).collect();
            (text, calls)
        }
        _ => (answer.to_string(), Vec::new()),
    }
}

/// The call of function `name` whose arguments are `arguments`: one JSON object, white space
/// around it; `None` for anything else.
pub fn named_call(name: &str, arguments: &str, format: CallFormat) -> Option<ToolCall> {
    let value: &RawValue = serde_json::from_str(arguments.trim()).ok()?;
    value.get().starts_with('{').then(|| ToolCall { id: format.id(), kind: function_type(), function: FunctionCall { name: name.to_string(), arguments: value.get().to_string() } })
}

/// Where the JSON object a growing text begins with (after white space) closes, found as the
/// text grows, each byte read once: braces and brackets counted outside strings. Gives up
/// for good where the text begins otherwise.
#[derive(Debug, Default)]
pub struct ObjectEnd {
    scanned: usize,
    depth: usize,
    started: bool,
    in_string: bool,
    escaped: bool,
    gave_up: bool,
}

impl ObjectEnd {
    /// The end (exclusive) of the object in `text`, once written; `text` must extend the
    /// text of the previous call.
    pub fn find(&mut self, text: &str) -> Option<usize> {
        let bytes = text.as_bytes();
        while self.scanned < bytes.len() && !self.gave_up {
            let b = bytes[self.scanned];
            self.scanned += 1;
            if !self.started {
                match b {
                    b'{' => (self.started, self.depth) = (true, 1),
                    b if b.is_ascii_whitespace() => {}
                    _ => self.gave_up = true,
                }
            } else if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
            } else {
                match b {
                    b'"' => self.in_string = true,
                    b'{' | b'[' => self.depth += 1,
                    b'}' | b']' => {
                        self.depth -= 1;
                        if self.depth == 0 {
                            return Some(self.scanned);
                        }
                    }
                    _ => {}
                }
            }
        }
        None
    }
}

/// `<tool_call>...</tool_call>` blocks, white space between them, the last one's closing
/// optional (the model may end its turn instead). Text after the last closed block is
/// dropped, as vLLM's Hermes parser drops it (small models ramble on after a call).
fn hermes_calls(mut rest: &str) -> Option<Vec<(String, String)>> {
    let mut calls = Vec::new();
    while let Some(body) = rest.strip_prefix(HERMES_OPEN) {
        let (inside, after) = match body.find(HERMES_CLOSE) {
            Some(end) => (&body[..end], &body[end + HERMES_CLOSE.len()..]),
            None => (body, ""),
        };
        calls.push(call(inside.trim())?);
        rest = after.trim_start();
    }
    Some(calls)
}

/// One JSON object, an array of them, or objects separated by `;` (Llama 3.1's parallel
/// calls), nothing after them.
fn json_calls(mut text: &str) -> Option<Vec<(String, String)>> {
    let mut calls = Vec::new();
    loop {
        let mut values = serde_json::Deserializer::from_str(text).into_iter::<&RawValue>();
        let value = values.next()?.ok()?.get();
        if value.starts_with('[') {
            for item in serde_json::from_str::<Vec<&RawValue>>(value).ok()? {
                calls.push(call(item.get())?);
            }
        } else {
            calls.push(call(value)?);
        }
        let rest = text[values.byte_offset()..].trim_start();
        match rest.strip_prefix(';') {
            Some(more) if !more.trim().is_empty() => text = more,
            Some(_) => return Some(calls),
            None if rest.is_empty() => return Some(calls),
            None => return None,
        }
    }
}

/// A call as models write one.
#[derive(Deserialize)]
struct WrittenCall<'a> {
    name: String,
    #[serde(borrow)]
    arguments: Option<&'a RawValue>,
    #[serde(borrow)]
    parameters: Option<&'a RawValue>,
}

/// A call object's `name` and its `arguments` (or `parameters`): an object, kept as the model
/// wrote it, or JSON text of one.
fn call(json: &str) -> Option<(String, String)> {
    let written: WrittenCall = serde_json::from_str(json).ok()?;
    let arguments = match written.arguments.or(written.parameters).map(RawValue::get) {
        None | Some("null") => "{}".to_string(),
        Some(object) if object.starts_with('{') => object.to_string(),
        Some(text) if text.starts_with('"') => serde_json::from_str::<String>(text).ok()?,
        Some(_) => return None,
    };
    Some((written.name, arguments))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(calls: &[ToolCall]) -> Vec<(&str, &str)> {
        calls.iter().map(|c| (c.function.name.as_str(), c.function.arguments.as_str())).collect()
    }

    #[test]
    fn hermes_calls_are_read_with_the_text_before_them() {
        let answer = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (text, calls) = read_calls(answer, CallFormat::Hermes, true);
        assert_eq!(text, "Let me look.");
        assert_eq!(names(&calls), [("get_weather", r#"{"city": "Paris"}"#), ("now", "{}")]);
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 29 && calls[0].id != calls[1].id);
        assert_eq!(calls[0].kind, "function");
        // The model may end its turn without the closing tag.
        let (_, calls) = read_calls("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}", CallFormat::Hermes, true);
        assert_eq!(names(&calls), [("now", "{}")]);
        let (_, calls) = read_calls(answer, CallFormat::Hermes, false);
        assert_eq!(calls.len(), 1);
        let (text, calls) = read_calls("<tool_call>{\"name\": \"f\"}</tool_call>\n\nThe weather is", CallFormat::Hermes, true);
        assert_eq!((text.as_str(), names(&calls)), ("", vec![("f", "{}")]));
    }

    #[test]
    fn llama_and_mistral_calls_are_read() {
        let (text, calls) = read_calls(" {\"name\": \"f\", \"parameters\": {\"x\": 1}}; {\"name\": \"g\", \"parameters\": {}}", CallFormat::Json { parameters: true }, true);
        assert_eq!((text.as_str(), names(&calls)), ("", vec![("f", r#"{"x": 1}"#), ("g", "{}")]));
        let (text, calls) = read_calls("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": \"y\"}}]", CallFormat::Mistral, true);
        assert_eq!((text.as_str(), names(&calls)), ("", vec![("f", r#"{"x": "y"}"#)]));
        assert_eq!(calls[0].id.len(), 9);
        // The control token is left out of decoded text: the array alone.
        let (_, calls) = read_calls("[{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 2}\"}]", CallFormat::Mistral, true);
        assert_eq!(names(&calls), [("f", r#"{"x": 2}"#)]);
    }

    #[test]
    fn a_named_calls_arguments_end_where_their_object_closes() {
        let text = " {\"city\": \"Pa}ris \\\" {\", \"days\": [1, {\"x\": 2}]}}\n</tool_call>";
        let mut end = ObjectEnd::default();
        // Fed as it grows, a few bytes at a time.
        let found = (1..=text.len()).find_map(|n| end.find(&text[..n])).unwrap();
        assert_eq!(&text[..found], " {\"city\": \"Pa}ris \\\" {\", \"days\": [1, {\"x\": 2}]}");
        let call = named_call("get_weather", &text[..found], CallFormat::Hermes).unwrap();
        assert_eq!((call.function.name.as_str(), call.function.arguments.as_str()), ("get_weather", "{\"city\": \"Pa}ris \\\" {\", \"days\": [1, {\"x\": 2}]}"));
        let mut end = ObjectEnd::default();
        assert_eq!(end.find("\"Paris\" {}"), None);
        assert_eq!(end.find("\"Paris\" {} {}"), None, "gave up: the text began otherwise");
        assert!(named_call("f", "{\"a\": }", CallFormat::Hermes).is_none());
        assert!(named_call("f", "[1]", CallFormat::Hermes).is_none());
    }

    #[test]
    fn what_does_not_parse_stays_text() {
        for answer in [
            "Paris is sunny.",
            "{\"name\": \"f\", \"parameters\": {\"x\": 1}",
            "{\"city\": \"Paris\"}",
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\n</tool_call>",
            "[1, 2, 3]",
            "{\"name\": \"f\"} trailing",
        ] {
            let (text, calls) = read_calls(answer, CallFormat::Hermes, true);
            assert_eq!((text.as_str(), calls.len()), (answer, 0), "{answer}");
        }
    }

    #[test]
    fn settled_text_holds_back_what_may_become_a_call() {
        assert_eq!(settled_text("Hello there "), "Hello there");
        assert_eq!(settled_text("Let me look.\n<tool_"), "Let me look.");
        assert_eq!(settled_text("Let me look.\n<tool_call>\n{\"na"), "Let me look.");
        assert_eq!(settled_text("a <b> c"), "a <b> c");
        assert_eq!(settled_text("  {\"name\""), "");
        assert_eq!(settled_text("[TOOL"), "");
        assert_eq!(settled_text("   "), "");
        for answer in ["Let me look.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "Paris.  "] {
            let (text, _) = read_calls(answer, CallFormat::Hermes, true);
            for end in 0..=answer.len() {
                assert!(text.starts_with(settled_text(&answer[..end])), "{answer:?} at {end}");
            }
        }
    }

    #[test]
    fn formats_and_forced_openings_follow_the_template() {
        assert_eq!(CallFormat::of_template("{{ messages }}"), CallFormat::Unsupported);
        assert_eq!(CallFormat::of_template("{% if tools %}<tool_call>{% endif %}"), CallFormat::Hermes);
        assert_eq!(CallFormat::of_template("{% if tools %}[TOOL_CALLS]{% endif %}"), CallFormat::Mistral);
        let llama = r#"{% if tools %}{{ 'Respond in the format {\"name\": function name, \"parameters\": dictionary}' }}{% endif %}"#;
        assert_eq!(CallFormat::of_template(llama), CallFormat::Json { parameters: true });
        let f = ToolChoice::Function("get_weather".into());
        assert_eq!(CallFormat::Hermes.forced_opening(&f).unwrap(), "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ");
        assert_eq!(CallFormat::Json { parameters: true }.forced_opening(&f).unwrap(), "{\"name\": \"get_weather\", \"parameters\": ");
        assert_eq!(CallFormat::Hermes.forced_opening(&ToolChoice::Required).unwrap(), "<tool_call>\n{\"name\": \"");
        assert_eq!(CallFormat::Hermes.forced_opening(&ToolChoice::Auto).unwrap(), "");
        assert_eq!(CallFormat::Unsupported.forced_opening(&ToolChoice::Required), None);
    }
}
