//! A batch's input file: JSONL, one request a line,
//! `{"custom_id": ..., "method": "POST", "url": "/v1/...", "body": {...}}`.

use crate::openai::route::Route;
use serde_json::{json, Value};
use std::collections::HashSet;

/// Most requests in one batch, as OpenAI allows.
pub const MAX_LINES: usize = 50_000;
/// Longest `custom_id`, in bytes: with the batch's id it makes the job's idempotency key,
/// which holds at most 255.
pub const CUSTOM_ID_MAX: usize = 200;
/// Format errors listed for a file that fails validation; the count says how many there were.
const ERRORS_LISTED: usize = 100;

/// One request of the file.
#[derive(Debug)]
pub struct Line {
    pub custom_id: String,
    pub route: Route,
    pub body: Value,
}

/// Why a line is not a request, in OpenAI's `errors.data` shape.
#[derive(Debug, Clone, PartialEq)]
pub struct FormatError {
    pub code: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    /// 1-based line of the file; none for the file as a whole.
    pub line: Option<usize>,
}

impl FormatError {
    pub fn to_json(&self) -> Value {
        json!({ "code": self.code, "message": self.message, "param": self.param, "line": self.line })
    }
}

/// The requests of `file` in order, with their 1-based line numbers, blank lines skipped.
pub fn requests(file: &str) -> impl Iterator<Item = (usize, &str)> {
    file.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty())
}

/// Reads the line at 1-based `number`.
pub fn parse(number: usize, text: &str) -> Result<Line, FormatError> {
    let error = |code, message: String, param| FormatError { code, message, param, line: Some(number) };
    let value: Value = serde_json::from_str(text).map_err(|e| error("invalid_json_line", format!("line {number} is not JSON: {e}"), None))?;
    let custom_id = match value.get("custom_id") {
        // Postgres cannot store a NUL, and the id is recorded with the line's answer.
        Some(Value::String(id)) if id.contains('\0') => {
            return Err(error("invalid_custom_id", "custom_id contains a NUL character (\\u0000)".into(), Some("custom_id")))
        }
        Some(Value::String(id)) if !id.is_empty() && id.len() <= CUSTOM_ID_MAX => id.clone(),
        Some(Value::String(id)) if !id.is_empty() => {
            return Err(error("invalid_custom_id", format!("custom_id is {} bytes; at most {CUSTOM_ID_MAX}", id.len()), Some("custom_id")))
        }
        _ => return Err(error("missing_required_parameter", "each line needs a non-empty string custom_id".into(), Some("custom_id"))),
    };
    if value.get("method").and_then(Value::as_str) != Some("POST") {
        return Err(error("invalid_method", "method must be \"POST\"".into(), Some("method")));
    }
    let url = value.get("url").and_then(Value::as_str).unwrap_or_default();
    let route = Route::parse(url)
        .ok_or_else(|| error("invalid_url", format!("url {url:?}: a batch line names one of {}", Route::listed()), Some("url")))?;
    let body = match value.get("body") {
        Some(body @ Value::Object(_)) => body.clone(),
        _ => return Err(error("missing_required_parameter", "each line needs a JSON object body".into(), Some("body"))),
    };
    Ok(Line { custom_id, route, body })
}

/// Checks every line of `file`: its format, and that custom ids are unique. The number of
/// requests, or the errors (the first 100, then one that counts the rest).
pub fn validate(file: &[u8]) -> Result<usize, Vec<FormatError>> {
    let whole = |code, message: String| vec![FormatError { code, message, param: None, line: None }];
    let text = std::str::from_utf8(file).map_err(|e| whole("invalid_file", format!("the file is not UTF-8: {e}")))?;
    let (mut errors, mut seen, mut count) = (Vec::new(), HashSet::new(), 0usize);
    let mut more = 0usize;
    for (number, line) in requests(text) {
        count += 1;
        let problem = match parse(number, line) {
            Ok(line) if !seen.insert(line.custom_id.clone()) => Some(FormatError {
                code: "duplicate_custom_id",
                message: format!("custom_id {:?} is used by an earlier line; each line needs its own", line.custom_id),
                param: Some("custom_id"),
                line: Some(number),
            }),
            Ok(_) => None,
            Err(e) => Some(e),
        };
        match problem {
            Some(e) if errors.len() < ERRORS_LISTED => errors.push(e),
            Some(_) => more += 1,
            None => {}
        }
    }
    if count == 0 {
        return Err(whole("empty_file", "the file holds no requests".into()));
    }
    if count > MAX_LINES {
        return Err(whole("too_many_requests", format!("the file holds {count} requests; a batch holds at most {MAX_LINES}")));
    }
    if more > 0 {
        errors.push(FormatError { code: "more_errors", message: format!("{more} more lines have errors"), param: None, line: None });
    }
    if errors.is_empty() {
        Ok(count)
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(custom_id: &str) -> String {
        json!({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}}).to_string()
    }

    #[test]
    fn a_good_file_counts_its_requests_and_skips_blank_lines() {
        let file = format!("{}\n\n{}\n", line("a"), line("b"));
        assert_eq!(validate(file.as_bytes()), Ok(2));
        let numbers: Vec<usize> = requests(&file).map(|(n, _)| n).collect();
        assert_eq!(numbers, vec![1, 3]);
    }

    #[test]
    fn each_bad_line_is_named_with_its_number() {
        let file = [
            line("a"),
            "not json".into(),
            line("a"),
            json!({"custom_id": "c", "method": "GET", "url": "/v1/embeddings", "body": {}}).to_string(),
            json!({"custom_id": "d", "method": "POST", "url": "/v1/moderations", "body": {}}).to_string(),
            json!({"custom_id": "e", "method": "POST", "url": "/v1/embeddings"}).to_string(),
            json!({"custom_id": "x".repeat(CUSTOM_ID_MAX + 1), "method": "POST", "url": "/v1/embeddings", "body": {}}).to_string(),
            json!({"custom_id": "f\u{0}", "method": "POST", "url": "/v1/embeddings", "body": {}}).to_string(),
        ]
        .join("\n");
        let errors = validate(file.as_bytes()).unwrap_err();
        let found: Vec<(&str, Option<usize>)> = errors.iter().map(|e| (e.code, e.line)).collect();
        assert_eq!(
            found,
            vec![
                ("invalid_json_line", Some(2)),
                ("duplicate_custom_id", Some(3)),
                ("invalid_method", Some(4)),
                ("invalid_url", Some(5)),
                ("missing_required_parameter", Some(6)),
                ("invalid_custom_id", Some(7)),
                ("invalid_custom_id", Some(8)),
            ]
        );
    }

    #[test]
    fn whole_file_errors() {
        assert_eq!(validate(b"\n \n").unwrap_err()[0].code, "empty_file");
        assert_eq!(validate(b"\xff").unwrap_err()[0].code, "invalid_file");
        let big: String = (0..=MAX_LINES).map(|i| line(&i.to_string()) + "\n").collect();
        assert_eq!(validate(big.as_bytes()).unwrap_err()[0].code, "too_many_requests");
    }
}
