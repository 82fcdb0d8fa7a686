//! JSON Schemas of job inputs and outputs (`schemas/`), embedded at build time and compiled
//! once.

use crate::JobKind;
use jsonschema::Validator;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::LazyLock;

/// The schema documents, by kind: (input, output).
pub fn documents(kind: JobKind) -> (&'static str, &'static str) {
    match kind {
        JobKind::Echo => (
            include_str!("../../schemas/echo.input.json"),
            include_str!("../../schemas/echo.output.json"),
        ),
        JobKind::Transcribe => (
            include_str!("../../schemas/transcribe.input.json"),
            include_str!("../../schemas/transcribe.output.json"),
        ),
        JobKind::Embed => (include_str!("../../schemas/embed.input.json"), include_str!("../../schemas/embed.output.json")),
        JobKind::Generate => (
            include_str!("../../schemas/generate.input.json"),
            include_str!("../../schemas/generate.output.json"),
        ),
        JobKind::AudioEmbed => (
            include_str!("../../schemas/audio_embed.input.json"),
            include_str!("../../schemas/audio_embed.output.json"),
        ),
        JobKind::Image => (include_str!("../../schemas/image.input.json"), include_str!("../../schemas/image.output.json")),
    }
}

static VALIDATORS: LazyLock<HashMap<JobKind, (Validator, Validator)>> = LazyLock::new(|| {
    JobKind::ALL
        .iter()
        .map(|kind| {
            let (input, output) = documents(*kind);
            let compile = |doc: &str| {
                let schema: Value = serde_json::from_str(doc).expect("embedded schemas are JSON");
                jsonschema::validator_for(&schema).expect("embedded schemas compile")
            };
            (*kind, (compile(input), compile(output)))
        })
        .collect()
});

/// Most schema violations listed in one error message.
const ERRORS_SHOWN: usize = 5;

fn check(validator: &Validator, value: &Value) -> Result<(), String> {
    let errors: Vec<String> = validator
        .iter_errors(value)
        .take(ERRORS_SHOWN)
        .map(|e| {
            let path = e.instance_path().to_string();
            if path.is_empty() { e.to_string() } else { format!("{path}: {e}") }
        })
        .collect();
    if errors.is_empty() { Ok(()) } else { Err(errors.join("; ")) }
}

/// Checks a job's input against its kind's schema; the error lists what is wrong.
pub fn validate_input(kind: JobKind, input: &Value) -> Result<(), String> {
    check(&VALIDATORS[&kind].0, input)
}

/// Checks a job's output against its kind's schema.
pub fn validate_output(kind: JobKind, output: &Value) -> Result<(), String> {
    check(&VALIDATORS[&kind].1, output)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_embedded_schema_compiles() {
        for kind in JobKind::ALL {
            assert!(VALIDATORS.contains_key(kind));
        }
    }

    #[test]
    fn echo_input_accepts_its_fields_and_refuses_others() {
        assert!(validate_input(JobKind::Echo, &json!({"message": "hi", "sleep_ms": 10})).is_ok());
        assert!(validate_input(JobKind::Echo, &json!({"file": {"url": "https://x/y"}})).is_ok());
        let err = validate_input(JobKind::Echo, &json!({"sleep_ms": -1})).unwrap_err();
        assert!(err.contains("sleep_ms"), "{err}");
        assert!(validate_input(JobKind::Echo, &json!({"bogus": 1})).is_err());
        assert!(validate_input(JobKind::Echo, &json!("not an object")).is_err());
        assert!(validate_input(JobKind::Echo, &json!({"file": {"url": "ftp://x"}})).is_err());
    }

    #[test]
    fn echo_output_schema_describes_what_the_worker_writes() {
        let out = json!({"input": {"message": 1}, "attempt": 1, "worker_id": "w1",
                         "file": {"size": 3, "sha256": "a".repeat(64)}});
        assert!(validate_output(JobKind::Echo, &out).is_ok());
        assert!(validate_output(JobKind::Echo, &json!({"input": 1})).is_err());
    }

    #[test]
    fn image_output_schema_describes_what_the_worker_writes_and_the_api_shows() {
        let image = json!({"key": "outputs/0190f0f0-0000-7000-8000-000000000000.3.0.png", "width": 512, "height": 512, "seed": 42});
        let mut out = json!({"model": "sd-turbo", "images": [image], "scheduler": "euler_a", "steps": 4, "guidance": 0.0,
                             "timings": {"encode_ms": 12, "denoise_ms": 800, "decode_ms": 90}});
        assert!(validate_output(JobKind::Image, &out).is_ok());
        // As GET shows it inline: each image with its presigned URL.
        out["images"][0]["url"] = json!("https://s3.example/tern/outputs/x.0.png?X-Amz-Signature=abc");
        assert!(validate_output(JobKind::Image, &out).is_ok());
        out["scheduler"] = json!("lms");
        assert!(validate_output(JobKind::Image, &out).is_err());
    }
}
