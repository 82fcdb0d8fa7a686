//! Speech to text through the whole service: API, queue, worker (Whisper on candle), S3.

use tern_models::wer::{word_errors, words};
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

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[tokio::test]
async fn librivox_clips_are_transcribed_through_the_service_within_ten_percent_word_error_rate() {
    librivox_word_error_rate("whisper-tiny.en", 0.10).await;
}

#[tokio::test]
async fn the_multilingual_base_model_transcribes_within_five_percent_word_error_rate() {
    librivox_word_error_rate("whisper-base", 0.05).await;
}

/// Transcribes every LibriVox clip with `model` (auto language for multilingual ones) and
/// checks the word error rate over all of them.
async fn librivox_word_error_rate(model: &str, limit: f64) {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let clips = clips();
    assert!(clips.len() >= 5, "expected the LibriVox clips");
    let jobs: Vec<Value> = clips
        .iter()
        .map(|(path, _)| json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&std::fs::read(path).unwrap())}}}))
        .collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let _w = cluster.spawn_worker(&[("TERN_WHISPER_MODEL", model)]).unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(240)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&(ids.len() as i64)), "{counts:?}");
    let (mut errors, mut total) = (0, 0);
    for ((_, reference), id) in clips.iter().zip(&ids) {
        let (job, out) = cluster.succeeded_output(*id).await.unwrap();
        tern_jobs::schemas::validate_output(tern_jobs::JobKind::Transcribe, &out).unwrap();
        let r = words(reference);
        let h = words(out["text"].as_str().unwrap());
        let e = word_errors(&r, &h);
        println!("ref: {reference}\nhyp: {}\nerrors: {e}/{}", out["text"], r.len());
        errors += e;
        total += r.len();
        assert_eq!(job["cost"], 1, "a clip under 30 s is one window");
        assert_eq!(out["model"], model);
        assert_eq!(out["language"], "en", "English, given or detected");
        let srt = reqwest::get(job["output"]["formats"]["srt"]["url"].as_str().unwrap()).await.unwrap().text().await.unwrap();
        assert!(srt.starts_with("1\n00:00:"), "{srt}");
        let vtt = reqwest::get(job["output"]["formats"]["vtt"]["url"].as_str().unwrap()).await.unwrap().text().await.unwrap();
        assert!(vtt.starts_with("WEBVTT"), "{vtt}");
    }
    let wer = errors as f64 / total as f64;
    println!("{model}: word error rate {wer:.3} ({errors}/{total})");
    assert!(wer <= limit, "{model}: word error rate {wer:.3} over {limit}");
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
    let (_, out) = cluster.succeeded_output(id).await.unwrap();
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
    let (_, out) = cluster.succeeded_output(good_id).await.unwrap();
    assert!(words(out["text"].as_str().unwrap()).contains(&"young".to_string()), "{out}");
}

/// Largest `recordings=N` a worker logged for one model batch.
fn largest_batch(log: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("transcription batch done"))
        .filter_map(|l| l.split("recordings=").nth(1)?.split_whitespace().next()?.parse().ok())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn windows_of_several_jobs_batched_together_give_the_same_text_as_each_alone() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let clips = clips();
    let jobs: Vec<Value> = clips
        .iter()
        .map(|(path, _)| json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&std::fs::read(path).unwrap())}}}))
        .collect();

    let alone_ids = cluster.submit_all(&jobs).await.unwrap();
    let mut alone = cluster
        .spawn_worker(&[("TERN_TRANSCRIBE_BATCH_WINDOWS", "1"), ("TERN_CONCURRENCY", "1"), ("TERN_WORKER_KINDS", "transcribe")])
        .unwrap();
    cluster.wait_terminal(&alone_ids, Duration::from_secs(240)).await.unwrap();
    assert_eq!(largest_batch(&alone.log_text()), 1, "one recording per model batch");
    alone.terminate(Duration::from_secs(10)).unwrap();

    let batched_ids = cluster.submit_all(&jobs).await.unwrap();
    let batched = cluster
        .spawn_worker(&[("TERN_TRANSCRIBE_BATCH_WINDOWS", "16"), ("TERN_WORKER_KINDS", "transcribe")])
        .unwrap();
    cluster.wait_terminal(&batched_ids, Duration::from_secs(240)).await.unwrap();
    let largest = largest_batch(&batched.log_text());
    assert!(largest >= 4, "several recordings shared a model batch (largest {largest})");

    for (a, b) in alone_ids.iter().zip(&batched_ids) {
        let (_, one) = cluster.succeeded_output(*a).await.unwrap();
        let (_, many) = cluster.succeeded_output(*b).await.unwrap();
        assert_eq!(one["text"], many["text"]);
        assert_eq!(one["segments"], many["segments"]);
    }
}

#[tokio::test]
async fn canceling_a_long_transcription_stops_it_between_windows() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let clip = tern_models::audio::decode_mono_16k(&std::fs::read(&clips()[0].0).unwrap()).unwrap();
    let pcm: Vec<f32> = clip.iter().copied().cycle().take(16_000 * 300).collect(); // 5 min: 10 windows
    let (status, job) = cluster
        .post("/v1/jobs", &json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&tern_e2e::wav_16k_mono(&pcm))}}}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{job}");
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    let _w = cluster.spawn_worker(&[("TERN_TRANSCRIBE_BATCH_WINDOWS", "1")]).unwrap();
    cluster
        .wait_until("the first window is done", Duration::from_secs(120), || async {
            let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await?;
            Ok(job["progress"]["done"].as_u64().is_some_and(|d| d >= 1))
        })
        .await
        .unwrap();
    let (status, _) = cluster.post(&format!("/v1/jobs/{id}/cancel"), &json!({})).await.unwrap();
    assert_eq!(status, 202);
    // Ended between windows: the progress seen never reaches the tenth window.
    let mut most = 0;
    let job = loop {
        let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
        most = most.max(job["progress"]["done"].as_u64().unwrap_or(0));
        if job["state"] != "running" {
            break job;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(job["state"], "canceled", "{job}");
    assert!(most < 10, "all {most} windows ran before the cancel took effect");
}

/// A long recording given by URL (two hours of 8 kHz 8-bit silence, 58 MB, over a one-hour
/// limit) fails `audio_too_long` from its header: the worker never holds its samples (which
/// decoded whole took ~700 MB, at 16 kHz f32 and the copies on the way), so one file cannot
/// take workers down. The worker's peak resident set is the check.
#[tokio::test]
async fn a_long_recording_by_url_is_refused_without_decoding_it() {
    let limit = [("TERN_MAX_AUDIO_SECONDS", "3600")];
    let mut cluster = Cluster::start(&limit).await.unwrap();
    let seconds = 2 * 3600u32;
    let data_len = seconds * 8_000;
    let mut wav = Vec::with_capacity(44 + data_len as usize);
    wav.extend_from_slice(b"RIFF");
    wav.extend_from_slice(&(36 + data_len).to_le_bytes());
    wav.extend_from_slice(b"WAVEfmt ");
    // PCM, mono, 8 kHz, 8 kB/s, 1-byte frames, 8 bits.
    for field in [16u32.to_le_bytes().to_vec(), 1u16.to_le_bytes().to_vec(), 1u16.to_le_bytes().to_vec(), 8_000u32.to_le_bytes().to_vec(), 8_000u32.to_le_bytes().to_vec(), 1u16.to_le_bytes().to_vec(), 8u16.to_le_bytes().to_vec()] {
        wav.extend_from_slice(&field);
    }
    wav.extend_from_slice(b"data");
    wav.extend_from_slice(&data_len.to_le_bytes());
    wav.resize(44 + data_len as usize, 128);
    let wav = axum::body::Bytes::from(wav);
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().unwrap().port();
    let app = axum::Router::new().route("/long.wav", axum::routing::get(move || async move { wav.clone() }));
    tokio::spawn(async move { axum::serve(server, app).await.unwrap() });

    let worker = cluster.spawn_worker(&[("TERN_MAX_AUDIO_SECONDS", "3600"), ("TERN_WORKER_KINDS", "transcribe")]).unwrap();
    let job = json!({"kind": "transcribe", "input": {"audio": {"url": format!("http://127.0.0.1:{port}/long.wav")}}});
    let ids = cluster.submit_all(&[job]).await.unwrap();
    let states = cluster.wait_terminal(&ids, Duration::from_secs(60)).await.unwrap();
    assert_eq!(states.get("failed"), Some(&1), "{states:?}");
    let (code,): (String,) = sqlx::query_as("SELECT error->>'code' FROM jobs WHERE id = $1").bind(ids[0]).fetch_one(&cluster.pg).await.unwrap();
    assert_eq!(code, "audio_too_long");
    let status = std::fs::read_to_string(format!("/proc/{}/status", worker.pid())).unwrap();
    let peak_kb: u64 = status.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)).unwrap().parse().unwrap();
    assert!(peak_kb < 400 * 1024, "the worker's peak resident set was {} MB", peak_kb / 1024);
}
