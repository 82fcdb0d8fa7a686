//! Image generation (`image` jobs, `POST /v1/images/generations`) through the whole service:
//! API, queue, worker (a Stable Diffusion pipeline on candle), S3.

use base64::Engine;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tern_e2e::Cluster;
use uuid::Uuid;

/// The tiny random-weight SD pipeline (diffusers layout) of the diffusion family's tests.
fn sd_tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/diffusion/sd-tiny")
}

/// A PNG's width, height, color type and bit depth, its pixels decoded in full.
fn decoded(png_bytes: &[u8]) -> (u32, u32, png::ColorType, png::BitDepth) {
    let mut reader = png::Decoder::new(std::io::Cursor::new(png_bytes)).read_info().expect("a PNG");
    let mut pixels = vec![0; reader.output_buffer_size().expect("a PNG's size")];
    let info = reader.next_frame(&mut pixels).expect("a PNG's pixels");
    (info.width, info.height, info.color_type, info.bit_depth)
}

/// OpenAI's error shape with `code` (and `param`, where one is named).
fn assert_openai_error(status: u16, body: &Value, expected: (u16, &str, Option<&str>)) {
    let (expected_status, code, param) = expected;
    assert_eq!((status, body["error"]["code"].as_str(), body["error"]["param"].as_str()), (expected_status, Some(code), param), "{body}");
    assert!(body["error"]["message"].is_string() && body["error"]["type"].is_string(), "{body}");
}

#[tokio::test]
async fn bad_image_requests_get_their_error_codes_through_both_routes() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let prompt = "a lighthouse at dusk";
    // The native route: the kind's schema, 422 `invalid_input`.
    for input in [
        json!({}),
        json!({ "prompt": "" }),
        json!({ "prompt": 5 }),
        json!({ "prompt": prompt, "width": 500 }),
        json!({ "prompt": prompt, "height": 4096 }),
        json!({ "prompt": prompt, "steps": 0 }),
        json!({ "prompt": prompt, "steps": 151 }),
        json!({ "prompt": prompt, "guidance": 31 }),
        json!({ "prompt": prompt, "seed": -1 }),
        json!({ "prompt": prompt, "n": 9 }),
        json!({ "prompt": prompt, "scheduler": "lms" }),
        json!({ "prompt": prompt, "model": "sd-turbo" }),
    ] {
        let (status, body) = cluster.post("/v1/jobs", &json!({ "kind": "image", "input": input })).await.unwrap();
        assert_eq!((status, body["error"]["code"].as_str()), (422, Some("invalid_input")), "{input}: {body}");
    }
    // A good one is queued, costing its UNet rows: 3 unguided images of twice 512 x 512's pixels.
    let (status, job) = cluster
        .post("/v1/jobs", &json!({ "kind": "image", "input": { "prompt": prompt, "n": 3, "width": 512, "height": 1024, "steps": 4, "guidance": 0, "seed": 1, "scheduler": "euler_a" } }))
        .await
        .unwrap();
    assert_eq!((status, job["cost"].as_i64()), (201, Some(6)), "{job}");
    let id = job["id"].as_str().unwrap();
    let (status, _) = cluster.post(&format!("/v1/jobs/{id}/cancel"), &json!({})).await.unwrap();
    assert_eq!(status, 200);

    // The OpenAI route: its own fields by name, the kind's limits as the native route.
    let images = "/v1/images/generations";
    for (body, expected) in [
        (json!({ "n": 1 }), (400, "invalid_request", Some("prompt"))),
        (json!({ "prompt": prompt, "size": "big" }), (400, "invalid_size", Some("size"))),
        (json!({ "prompt": prompt, "size": "500x500" }), (400, "invalid_size", Some("size"))),
        (json!({ "prompt": prompt, "size": "4096x4096" }), (400, "invalid_size", Some("size"))),
        (json!({ "prompt": prompt, "response_format": "jpeg" }), (400, "invalid_response_format", Some("response_format"))),
        (json!({ "prompt": prompt, "style": "vivid" }), (400, "unsupported_parameter", Some("style"))),
        (json!({ "prompt": prompt, "quality": "hd" }), (400, "unsupported_parameter", Some("quality"))),
        (json!({ "prompt": prompt, "output_format": "webp" }), (400, "unsupported_parameter", Some("output_format"))),
        (json!({ "prompt": prompt, "stream": true }), (400, "unsupported_parameter", Some("stream"))),
        (json!({ "prompt": "" }), (422, "invalid_input", None)),
        (json!({ "prompt": prompt, "n": 9 }), (422, "invalid_input", None)),
        (json!({ "prompt": prompt, "steps": 500 }), (422, "invalid_input", None)),
    ] {
        let (status, answer) = cluster.post(images, &body).await.unwrap();
        assert_openai_error(status, &answer, expected);
    }
    // Without a key, and with a key that may not write: OpenAI's shape too.
    let response = reqwest::Client::new().post(cluster.url(images)).json(&json!({ "prompt": prompt })).send().await.unwrap();
    let status = response.status().as_u16();
    assert_openai_error(status, &response.json().await.unwrap(), (401, "unauthenticated", None));
    let reader = cluster.client_for(&cluster.create_key("default", "jobs:read").unwrap()).unwrap();
    let response = reader.post(cluster.url(images)).json(&json!({ "prompt": prompt })).send().await.unwrap();
    let status = response.status().as_u16();
    assert_openai_error(status, &response.json().await.unwrap(), (403, "insufficient_scope", None));
    // None of the refused requests made a job.
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(&cluster.pg).await.unwrap();
    assert_eq!(jobs, 1);
}

#[tokio::test]
async fn a_worker_without_the_model_fails_image_jobs_as_model_unavailable() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _w = cluster
        .spawn_worker(&[
            ("TERN_WORKER_KINDS", "image"),
            ("TERN_IMAGE_MODEL", "no-such-pipeline"),
            // Attempts follow each other at once: the OpenAI route answers after the last.
            ("TERN_RETRY_BASE_MS", "10"),
            ("TERN_RETRY_CAP_MS", "20"),
        ])
        .unwrap();
    let (status, job) = cluster.post("/v1/jobs", &json!({ "kind": "image", "input": { "prompt": "a lighthouse" }, "max_attempts": 1 })).await.unwrap();
    assert_eq!(status, 201, "{job}");
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    cluster.wait_terminal(&[id], Duration::from_secs(60)).await.unwrap();
    let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
    assert_eq!((job["state"].as_str(), job["error"]["code"].as_str()), (Some("failed"), Some("model_unavailable")), "{job}");

    let response = cluster.http.post(cluster.url("/v1/images/generations")).json(&json!({ "prompt": "a lighthouse", "size": "64x64" })).send().await.unwrap();
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    assert_openai_error(status, &body, (500, "model_unavailable", None));
    assert_eq!(body["error"]["type"], "server_error");
    // The message names the job, which ran every attempt.
    let id = body["error"]["message"].as_str().unwrap().strip_prefix("job ").unwrap().split(':').next().unwrap().to_string();
    let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
    assert_eq!((job["kind"].as_str(), job["state"].as_str(), job["attempts"].as_i64()), (Some("image"), Some("failed"), Some(5)), "{job}");
}

/// The progress the worker records for job `id` in Redis, polled every 2 ms until `done` is
/// raised: every `(done, total)` seen, in order. The last step's progress is recorded before
/// the images are encoded and stored, so it is there to be seen for a while.
fn watch_progress(cluster: &Cluster, id: Uuid, done: Arc<std::sync::atomic::AtomicBool>) -> tokio::task::JoinHandle<Vec<(u64, u64)>> {
    let key = format!("{}:{{image}}:progress", cluster.redis_prefix);
    let redis = tern_e2e::redis_url();
    tokio::spawn(async move {
        let mut c = redis::Client::open(redis).unwrap().get_multiplexed_async_connection().await.unwrap();
        let mut seen: Vec<(u64, u64)> = Vec::new();
        while !done.load(std::sync::atomic::Ordering::Relaxed) {
            let v: Option<String> = redis::cmd("HGET").arg(&key).arg(id.to_string()).query_async(&mut c).await.unwrap();
            if let Some(p) = v.and_then(|v| serde_json::from_str::<Value>(&v).ok()) {
                let now = (p["done"].as_u64().unwrap(), p["total"].as_u64().unwrap());
                if seen.last() != Some(&now) {
                    seen.push(now);
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        seen
    })
}

/// On the sd-tiny fixture (random weights, so the images are noise: their pixels are checked
/// against diffusers' by `models/tests/diffusion_parity.rs`, this checks what the service does
/// with them).
#[tokio::test]
async fn images_are_generated_stored_as_pngs_and_served_through_both_routes() {
    let fixture = sd_tiny();
    assert!(fixture.join("model_index.json").exists(), "{} is missing", fixture.display());
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let models = fixture.parent().unwrap().display().to_string();
    let _w = cluster
        .spawn_worker(&[
            ("TERN_WORKER_KINDS", "image"),
            ("TERN_MODELS_DIR", models.as_str()),
            ("TERN_IMAGE_MODEL", "sd-tiny"),
            // Its jobs show `running` (and their progress) from their first step.
            ("TERN_RECORD_START_AFTER_MS", "0"),
        ])
        .unwrap();
    let (width, height, steps, n) = (64, 128, 12, 2);
    let input = json!({ "prompt": "a lighthouse at dusk", "negative_prompt": "fog", "width": width, "height": height, "steps": steps, "n": n, "seed": 42, "scheduler": "euler" });
    let (status, job) = cluster.post("/v1/jobs", &json!({ "kind": "image", "input": input })).await.unwrap();
    // Two guided rows an image.
    assert_eq!((status, job["cost"].as_i64()), (201, Some(2 * n)), "{job}");
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let progress = watch_progress(&cluster, id, finished.clone());
    let counts = cluster.wait_terminal(&[id], Duration::from_secs(300)).await.unwrap();
    finished.store(true, std::sync::atomic::Ordering::Relaxed);
    let progress = progress.await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&1), "{counts:?}");

    // The progress counted the denoising steps up to the last.
    assert!(progress.iter().all(|&(_, total)| total == steps), "{progress:?}");
    assert!(progress.windows(2).all(|w| w[0].0 < w[1].0), "{progress:?}");
    assert_eq!(progress.last(), Some(&(steps, steps)), "{progress:?}");

    let (job, stored) = cluster.succeeded_output(id).await.unwrap();
    tern_jobs::schemas::validate_output(tern_jobs::JobKind::Image, &stored).unwrap();
    assert_eq!((stored["model"].as_str(), stored["steps"].as_u64(), stored["scheduler"].as_str()), (Some("sd-tiny"), Some(steps), Some("euler")), "{stored}");
    // A worker on the CPU keeps its encoders and VAE resident and decodes 64x128 whole.
    assert_eq!(stored["memory"], json!({ "state": "resident", "tiled_decode": false }), "{stored}");
    for timing in ["encode_ms", "denoise_ms", "decode_ms"] {
        assert!(stored["timings"][timing].is_u64(), "{stored}");
    }
    let inline = &job["output"]["inline"];
    let images = inline["images"].as_array().unwrap();
    assert_eq!(images.len(), n as usize, "{inline}");
    // The inline output is the stored one, with each image's URL added.
    let mut without_urls = inline.clone();
    for image in without_urls["images"].as_array_mut().unwrap() {
        assert!(image.as_object_mut().unwrap().remove("url").is_some_and(|u| u.is_string()), "{inline}");
    }
    assert_eq!(without_urls, stored);
    for (i, image) in images.iter().enumerate() {
        assert_eq!((image["width"].as_u64(), image["height"].as_u64(), image["seed"].as_u64()), (Some(width), Some(height), Some(42 + i as u64)), "{image}");
        let png_bytes = reqwest::get(image["url"].as_str().unwrap()).await.unwrap().bytes().await.unwrap();
        assert_eq!(decoded(&png_bytes), (width as u32, height as u32, png::ColorType::Rgb, png::BitDepth::Eight));
        // The same PNG is the job's rendering `{i}.png`, described by size and digest.
        let rendering = &job["output"]["formats"][format!("{i}.png")];
        assert_eq!(rendering["key"], image["key"], "{rendering}");
        assert_eq!(rendering["content_type"], "image/png");
        assert_eq!(rendering["size"].as_u64(), Some(png_bytes.len() as u64));
        assert_eq!(rendering["sha256"].as_str(), Some(hex::encode(Sha256::digest(&png_bytes)).as_str()));
    }

    // The OpenAI route: URLs by default, the PNGs themselves as base64 when asked.
    let request = json!({ "prompt": "a lighthouse at dusk", "model": "dall-e-2", "size": format!("{width}x{height}"), "n": 2, "steps": 4, "seed": 7, "user": "u1" });
    let response = cluster.http.post(cluster.url("/v1/images/generations")).json(&request).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers().contains_key("x-tern-job-id"));
    let answer: Value = response.json().await.unwrap();
    assert!(answer["created"].is_i64(), "{answer}");
    let data = answer["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{answer}");
    let mut by_url = Vec::new();
    for image in data {
        let png_bytes = reqwest::get(image["url"].as_str().unwrap()).await.unwrap().bytes().await.unwrap();
        assert_eq!(decoded(&png_bytes).0, width as u32);
        by_url.push(png_bytes);
    }
    let mut b64_request = request.clone();
    b64_request["response_format"] = json!("b64_json");
    let response = cluster.http.post(cluster.url("/v1/images/generations")).json(&b64_request).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let answer: Value = response.json().await.unwrap();
    let data = answer["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{answer}");
    for (i, image) in data.iter().enumerate() {
        let png_bytes = base64::engine::general_purpose::STANDARD.decode(image["b64_json"].as_str().unwrap()).unwrap();
        assert_eq!(decoded(&png_bytes), (width as u32, height as u32, png::ColorType::Rgb, png::BitDepth::Eight));
        // The same request and seed, the same images.
        assert_eq!(png_bytes, by_url[i], "image {i}");
    }
}

/// Image lines in a batch (OpenAI's Batch API) become image jobs and are answered by URL;
/// `b64_json`, which would put each PNG in the output file, is refused by name on its line.
#[tokio::test]
async fn a_batch_of_image_lines_is_answered_with_urls_of_its_pngs() {
    use tern_e2e::batch::{create_batch, line, lines_of, upload, wait_for};
    let fixture = sd_tiny();
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let models = fixture.parent().unwrap().display().to_string();
    let _w = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "image"), ("TERN_MODELS_DIR", models.as_str()), ("TERN_IMAGE_MODEL", "sd-tiny")]).unwrap();
    let url = "/v1/images/generations";
    let lines = [
        line("one", url, json!({ "prompt": "a lighthouse at dusk", "size": "64x64", "steps": 2, "seed": 1 })),
        line("two", url, json!({ "prompt": "a harbour at dawn", "size": "64x128", "n": 2, "steps": 2, "seed": 2, "response_format": "url" })),
        line("base64", url, json!({ "prompt": "p", "size": "64x64", "steps": 2, "response_format": "b64_json" })),
    ];
    let file = upload(&cluster, &lines).await.unwrap();
    let batch = create_batch(&cluster, &file, url).await.unwrap();
    let batch = wait_for(&cluster, batch["id"].as_str().unwrap(), "completed", Duration::from_secs(300)).await.unwrap();
    assert_eq!(batch["request_counts"], json!({ "total": 3, "completed": 2, "failed": 1 }), "{batch}");
    let answers = lines_of(&cluster, &batch["output_file_id"]).await.unwrap();
    for (custom_id, n, height) in [("one", 1, 64), ("two", 2, 128)] {
        let answer = &answers[custom_id];
        assert_eq!(answer["response"]["status_code"], 200, "{answer}");
        let data = answer["response"]["body"]["data"].as_array().unwrap();
        assert_eq!(data.len(), n, "{answer}");
        for image in data {
            let png_bytes = reqwest::get(image["url"].as_str().unwrap()).await.unwrap().bytes().await.unwrap();
            assert_eq!(decoded(&png_bytes), (64, height, png::ColorType::Rgb, png::BitDepth::Eight), "{custom_id}");
        }
    }
    let errors = lines_of(&cluster, &batch["error_file_id"]).await.unwrap();
    let refused = &errors["base64"]["response"];
    assert_eq!((refused["status_code"].as_u64(), refused["body"]["error"]["code"].as_str()), (Some(400), Some("unsupported_parameter")), "{refused}");
}
