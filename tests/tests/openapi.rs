//! `/openapi.json` describes the routes the API serves (the router and the document are built
//! from the same registrations; this checks each documented operation is really routed), and
//! schemathesis (PyPI), fuzzing every operation from the document with every check, finds no
//! 5xx, no response that breaks its schema, no request the document allows that is refused and
//! none it forbids that is accepted.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use tern_e2e::{bin_dir, Cluster};

async fn document(cluster: &Cluster) -> Value {
    // No key: the document is public.
    let response = reqwest::get(cluster.url("/openapi.json")).await.unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

#[tokio::test]
async fn every_documented_operation_is_routed_and_every_v1_operation_needs_a_key() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let doc = document(&cluster).await;
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"), "{}", doc["openapi"]);
    for kind in ["Echo", "Transcribe", "Embed", "Generate", "Image"] {
        for side in ["Input", "Output"] {
            assert!(doc["components"]["schemas"][format!("{kind}{side}")].is_object(), "{kind}{side} schema missing");
        }
    }
    let mut operations = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let Ok(method) = method.to_uppercase().parse::<reqwest::Method>() else { continue };
            if !["GET", "POST", "PUT", "PATCH", "DELETE"].contains(&method.as_str()) {
                continue;
            }
            operations += 1;
            if path.starts_with("/v1/") {
                assert!(op["security"].as_array().is_some_and(|s| !s.is_empty()), "{method} {path} has no security");
            }
            // Any id or kind: the route must answer as itself, not as the router's fallback.
            let url = path.replace("{kind}", "embed").replace("{id}", "0190f0f0-0000-7000-8000-000000000000");
            let response = cluster.http.request(method.clone(), cluster.url(&url)).send().await.unwrap();
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            assert_ne!(status, 405, "{method} {path} is documented but not routed");
            assert!(
                !(status == 404 && body["error"]["message"] == "no such route"),
                "{method} {path} is documented but not routed: {body}"
            );
            assert!(status < 500, "{method} {path} answered {status}: {body}");
        }
    }
    assert!(operations >= 35, "only {operations} operations documented");
}

/// The schemathesis CLI: `TERN_SCHEMATHESIS`, else where `scripts/services.sh schemathesis`
/// installs it.
fn schemathesis() -> PathBuf {
    if let Some(path) = std::env::var_os("TERN_SCHEMATHESIS") {
        return path.into();
    }
    tern_e2e::state_dir().join("schemathesis/venv/bin/st")
}

#[tokio::test]
async fn schemathesis_with_every_check_finds_nothing() {
    let st = schemathesis();
    assert!(st.exists(), "{} is missing: run scripts/services.sh schemathesis", st.display());
    // With a webhook secret: jobs naming a webhook are then valid requests.
    let cluster = Cluster::start(&[("TERN_WEBHOOK_SECRETS", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")]).await.unwrap();
    let report = bin_dir().join("tern-test-logs").join(format!("schemathesis-{}", cluster.name));
    // The settings and hooks for what the document cannot state (each file says what).
    let settings = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schemathesis");
    let config = settings.join("schemathesis.toml");
    let output = Command::new(&st)
        .env("PYTHONPATH", &settings)
        .env("SCHEMATHESIS_HOOKS", "tern_hooks")
        .arg("--config-file")
        .arg(&config)
        .arg("run")
        .arg(cluster.url("/openapi.json"))
        .args(["--header", &format!("Authorization: Bearer {}", cluster.api_key)])
        .args(["--checks", "all"])
        // One worker: with two, hypothesis ran `ast.parse` from two threads at once and a CI run
        // crashed inside CPython 3.11's ast module ("AST constructor recursion depth mismatch",
        // a runtime error of the tool, not a finding). The cases and checks are the same.
        .args(["--max-examples", "30", "--seed", "7", "--workers", "1"])
        .args(["--phases", "examples,coverage,fuzzing"])
        // Revoking keys is fuzzed too, and the run's own key can be among those it finds.
        .args(["--exclude-operation-id", "admin_revoke_key"])
        .args(["--generation-database", "none", "--request-timeout", "30", "--no-color", "--report", "junit", "--report-dir"])
        .arg(&report)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    println!("{text}");
    assert!(output.status.success(), "schemathesis found problems (report in {}):\n{text}", report.display());
}
