//! Speech to text through the whole service: API, queue, worker (Whisper on candle), S3.

use base64::Engine;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;
use tern_e2e::Cluster;
use uuid::Uuid;

fn librivox() -> PathBuf {
    tern_e2e::models_dir().join("testdata/librivox")
}

/// (clip file, reference text) for every LibriVox clip.
fn clips() -> Vec<(PathBuf, String)> {
    let refs = std::fs::read_to_string(librivox().join("transcription"))
        .expect("test speech missing: run scripts/models.sh");
    refs.lines()
        .filter_map(|line| {
            let (text, id) = line.rsplit_once(" (")?;
            let id = id.trim_end_matches(')');
            let text = text.replace("<s>", "").replace("</s>", "");
            Some((librivox().join(format!("{id}.wav")), text.trim().to_string()))
        })
        .collect()
}

fn words(text: &str) -> Vec<String> {
    text.to_lowercase()
        .chars()
        .map(|c| if c.is_alphanumeric() || c == '\'' || c.is_whitespace() { c } else { ' ' })
        .collect::<String>()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Word-level edit distance.
fn word_errors(reference: &[String], hypothesis: &[String]) -> usize {
    let mut prev: Vec<usize> = (0..=hypothesis.len()).collect();
    for (i, r) in reference.iter().enumerate() {
        let mut cur = vec![i + 1];
        for (j, h) in hypothesis.iter().enumerate() {
            cur.push((prev[j] + usize::from(r != h)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[hypothesis.len()]
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

async fn output_json(cluster: &Cluster, id: Uuid) -> (Value, Value) {
    let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
    assert_eq!(job["state"], "succeeded", "{job}");
    let body: Value = reqwest::get(job["output"]["url"].as_str().unwrap()).await.unwrap().json().await.unwrap();
    (job, body)
}

#[tokio::test]
async fn librivox_clips_are_transcribed_through_the_service_within_ten_percent_word_error_rate() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let clips = clips();
    assert!(clips.len() >= 5, "expected the LibriVox clips");
    let jobs: Vec<Value> = clips
        .iter()
        .map(|(path, _)| json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&std::fs::read(path).unwrap())}}}))
        .collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(240)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&(ids.len() as i64)), "{counts:?}");
    let (mut errors, mut total) = (0, 0);
    for ((_, reference), id) in clips.iter().zip(&ids) {
        let (job, out) = output_json(&cluster, *id).await;
        tern_jobs::schemas::validate_output(tern_jobs::JobKind::Transcribe, &out).unwrap();
        let r = words(reference);
        let h = words(out["text"].as_str().unwrap());
        let e = word_errors(&r, &h);
        println!("ref: {reference}\nhyp: {}\nerrors: {e}/{}", out["text"], r.len());
        errors += e;
        total += r.len();
        assert_eq!(job["cost"], 1, "a clip under 30 s is one window");
        let srt = reqwest::get(job["output"]["formats"]["srt"]["url"].as_str().unwrap()).await.unwrap().text().await.unwrap();
        assert!(srt.starts_with("1\n00:00:"), "{srt}");
        let vtt = reqwest::get(job["output"]["formats"]["vtt"]["url"].as_str().unwrap()).await.unwrap().text().await.unwrap();
        assert!(vtt.starts_with("WEBVTT"), "{vtt}");
    }
    let wer = errors as f64 / total as f64;
    println!("word error rate: {wer:.3} ({errors}/{total})");
    assert!(wer <= 0.10, "word error rate {wer:.3} over 10%");
}

#[tokio::test]
async fn long_audio_costs_its_windows_and_is_stitched_in_order() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let clips = clips();
    let mut pcm = Vec::new();
    let mut expected = Vec::new();
    for (path, reference) in clips.iter().cycle().take(12) {
        pcm.extend(tern_models::audio::decode_mono_16k(&std::fs::read(path).unwrap()).unwrap());
        pcm.extend(std::iter::repeat_n(0.0f32, 16_000));
        expected.push(words(reference));
        if pcm.len() > 16_000 * 62 {
            break;
        }
    }
    let seconds = pcm.len() as f64 / 16_000.0;
    let (status, job) = cluster
        .post("/v1/jobs", &json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&tern_e2e::wav_16k_mono(&pcm))}}}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{job}");
    assert_eq!(job["cost"], (seconds / 30.0).ceil() as i64, "{seconds} s of audio");
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster.wait_terminal(&[id], Duration::from_secs(240)).await.unwrap();
    let (_, out) = output_json(&cluster, id).await;
    // Stitched in order: the whole transcript against the clips' references, in sequence.
    // (Fixed 30 s windows may cut a word at a join, hence a looser bound than for clips.)
    let heard = words(out["text"].as_str().unwrap());
    let reference: Vec<String> = expected.concat();
    let wer = word_errors(&reference, &heard) as f64 / reference.len() as f64;
    assert!(wer <= 0.15, "word error rate {wer:.3} over the stitched windows: {heard:?}");
    let segments = out["segments"].as_array().unwrap();
    assert!(segments.last().unwrap()["end"].as_f64().unwrap() > 30.0, "segments span the windows");
}

#[tokio::test]
async fn bad_audio_fails_with_stable_codes_and_the_worker_keeps_serving() {
    let mut cluster = Cluster::start(&[("TERN_MAX_AUDIO_SECONDS", "4")]).await.unwrap();
    let clip = std::fs::read(&clips()[1].0).unwrap(); // "he was not an ill disposed young man": under 4 s
    let long = std::fs::read(&clips()[0].0).unwrap(); // over 4 s
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("garbage", b"this is not audio at all, not even close".repeat(50), 422, "audio_unreadable"),
        ("empty", tern_e2e::wav_16k_mono(&[]), 422, "audio_empty"),
        ("over the limit", long.clone(), 413, "audio_too_long"),
    ];
    for (what, bytes, status, code) in &cases {
        let (got, body) = cluster
            .post("/v1/jobs", &json!({"kind": "transcribe", "input": {"audio": {"base64": b64(bytes)}}}))
            .await
            .unwrap();
        assert_eq!((got, body["error"]["code"].as_str()), (*status, Some(*code)), "{what}: {body}");
    }
    // Given by URL, the same audio reaches the worker unprobed: it fails there, permanently.
    let mut ids = Vec::new();
    for (name, bytes) in [("garbage", cases[0].1.clone()), ("truncated", clip[..clip.len().min(2000)].to_vec()), ("long", long)] {
        let key = format!("fixtures/{name}");
        cluster.objects.put(&key, bytes.into(), "application/octet-stream").await.unwrap();
        let url = cluster.objects.presign_get(&key).await.unwrap();
        let (status, job) =
            cluster.post("/v1/jobs", &json!({"kind": "transcribe", "input": {"audio": {"url": url}}})).await.unwrap();
        assert_eq!(status, 201, "{job}");
        ids.push(job["id"].as_str().unwrap().parse::<Uuid>().unwrap());
    }
    let (_, good) = cluster
        .post("/v1/jobs", &json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&clip)}}}))
        .await
        .unwrap();
    let good_id: Uuid = good["id"].as_str().unwrap().parse().unwrap();
    let _w = cluster.spawn_worker(&[("TERN_MAX_AUDIO_SECONDS", "4")]).unwrap();
    cluster.wait_terminal(&[ids.clone(), vec![good_id]].concat(), Duration::from_secs(120)).await.unwrap();
    let codes: Vec<Option<String>> = sqlx::query_scalar("SELECT error->>'code' FROM jobs WHERE id = ANY($1) ORDER BY id")
        .bind(&ids)
        .fetch_all(&cluster.pg)
        .await
        .unwrap();
    assert_eq!(codes[0].as_deref(), Some("audio_unreadable"));
    assert!(matches!(codes[1].as_deref(), Some("audio_unreadable") | Some("audio_empty")), "truncated: {codes:?}");
    assert_eq!(codes[2].as_deref(), Some("audio_too_long"));
    let attempts: Vec<i32> = sqlx::query_scalar("SELECT attempts FROM jobs WHERE id = ANY($1)").bind(&ids).fetch_all(&cluster.pg).await.unwrap();
    assert!(attempts.iter().all(|a| *a == 1), "bad audio is not retried: {attempts:?}");
    let (_, out) = output_json(&cluster, good_id).await;
    assert!(words(out["text"].as_str().unwrap()).contains(&"young".to_string()), "{out}");
}
