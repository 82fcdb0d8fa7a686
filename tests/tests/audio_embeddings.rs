//! Audio embeddings (`audio_embed`, `POST /v1/audio/embeddings`) through the whole service:
//! API, queue, worker (Whisper's encoder), S3.

use base64::Engine;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;
use tern_e2e::Cluster;

fn testdata() -> PathBuf {
    tern_e2e::models_dir().join("testdata")
}

/// The LibriVox clip ids, in the transcription file's order.
fn clip_ids() -> Vec<String> {
    let refs = std::fs::read_to_string(testdata().join("librivox/transcription")).expect("test speech missing: run scripts/models.sh");
    refs.lines().filter_map(|l| l.rsplit_once(" (")).map(|(_, id)| id.trim_end_matches(')').to_string()).collect()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The clip's samples at 8 kHz (pairs averaged) in an 8 kHz WAV, as a telephone system sends it.
fn at_8k(wav: &[u8]) -> Vec<u8> {
    let pcm: Vec<f32> = wav[44..].chunks_exact(2).map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) / 32768.0).collect();
    let halved: Vec<f32> = pcm.chunks(2).map(|c| c.iter().sum::<f32>() / c.len() as f32).collect();
    tern_e2e::wav_mono(&halved, 8_000)
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().expect("an array of numbers").iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Each LibriVox clip, as sent (WAV), as 32 kbit/s MP3 and resampled to 8 kHz, is embedded by
/// an `audio_embed` job beside a transcription on the same worker; every re-encoding lies
/// nearest its own original. The OpenAI-style route gives the same vectors, and bad input is
/// refused with the codes transcriptions use.
#[tokio::test]
async fn recordings_embed_nearest_their_own_other_encodings_through_the_service() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let ids = clip_ids();
    assert_eq!(ids.len(), 5, "the LibriVox clips");
    let wavs: Vec<Vec<u8>> = ids.iter().map(|id| std::fs::read(testdata().join(format!("librivox/{id}.wav"))).unwrap()).collect();
    let mp3s: Vec<Vec<u8>> = ids
        .iter()
        .map(|id| std::fs::read(testdata().join(format!("mp3/{id}.mp3"))).expect("the MP3 clips: run scripts/models.sh"))
        .collect();
    let embed = |bytes: &[u8], windows: bool| json!({"kind": "audio_embed", "input": {"audio": {"base64": b64(bytes)}, "windows": windows}});
    let mut jobs: Vec<Value> = Vec::new();
    for (i, wav) in wavs.iter().enumerate() {
        jobs.push(embed(wav, i == 0));
        jobs.push(embed(&mp3s[i], false));
        jobs.push(embed(&at_8k(wav), false));
    }
    // A transcription in the same queue run: its windows share the worker's Whisper batches.
    jobs.push(json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&wavs[1])}, "beam_size": 1}}));
    let job_ids = cluster.submit_all(&jobs).await.unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    let counts = cluster.wait_terminal(&job_ids, Duration::from_secs(240)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&(job_ids.len() as i64)), "{counts:?}");

    let mut vectors: Vec<Vec<f32>> = Vec::new();
    for (k, id) in job_ids[..15].iter().enumerate() {
        let (job, out) = cluster.succeeded_output(*id).await.unwrap();
        tern_jobs::schemas::validate_output(tern_jobs::JobKind::AudioEmbed, &out).unwrap();
        assert_eq!(job["kind"], "audio_embed");
        assert_eq!(job["output"]["inline"], out, "a small output is inlined, the same as the stored one");
        assert_eq!(job["cost"], 1, "a clip under 30 s is one window");
        assert_eq!(out["model"], "whisper-tiny.en");
        assert_eq!(out["dimensions"], 384, "tiny's width");
        let v = floats(&out["embedding"]);
        assert_eq!(v.len(), 384);
        assert!((cosine(&v, &v) - 1.0).abs() < 1e-3, "unit length: {}", cosine(&v, &v));
        let duration = out["duration"].as_f64().unwrap();
        assert!((2.0..10.0).contains(&duration), "{duration}");
        if k == 0 {
            let windows = out["windows"].as_array().expect("windows asked for");
            assert_eq!(windows.len(), 1, "{out}");
            assert_eq!(windows[0]["start"], 0.0);
            assert!((windows[0]["end"].as_f64().unwrap() - duration).abs() < 0.1, "{out}");
            assert!(cosine(&floats(&windows[0]["embedding"]), &v) > 0.999, "one window's vector is the recording's");
        } else {
            assert!(out.get("windows").is_none(), "windows only where asked for: {out}");
        }
        vectors.push(v);
    }
    let originals: Vec<&Vec<f32>> = vectors.iter().step_by(3).collect();
    for (k, v) in vectors.iter().enumerate().filter(|(k, _)| k % 3 != 0) {
        let own = k / 3;
        let scores: Vec<f32> = originals.iter().map(|o| cosine(v, o)).collect();
        let nearest = (0..5).max_by(|&a, &b| scores[a].total_cmp(&scores[b])).unwrap();
        let what = if k % 3 == 1 { "MP3" } else { "8 kHz" };
        println!("{} as {what}: cosine to its original {:.4}, to the others {:?}", ids[own], scores[own], scores);
        assert_eq!(nearest, own, "{} as {what} is nearest {}", ids[own], ids[nearest]);
    }
    let (_, transcript) = cluster.succeeded_output(job_ids[15]).await.unwrap();
    assert!(transcript["text"].as_str().unwrap().to_lowercase().contains("young man"), "{transcript}");

    // The OpenAI-style route: the MP3 of clip 2 as a form, float and base64.
    let form = |format: &str| {
        reqwest::multipart::Form::new()
            .text("model", "whisper-1")
            .text("encoding_format", format.to_string())
            .text("windows", "true")
            .part("file", reqwest::multipart::Part::bytes(mp3s[2].clone()).file_name("clip.mp3"))
    };
    let resp = cluster.http.post(cluster.url("/v1/audio/embeddings")).multipart(form("float")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("x-tern-job-id"));
    let listed: Value = resp.json().await.unwrap();
    assert_eq!(listed["object"], "list");
    assert_eq!(listed["model"], "whisper-tiny.en");
    assert!(listed["usage"]["seconds"].as_u64().unwrap() >= 1, "{}", listed["usage"]);
    let data = listed["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "the recording, then its one window");
    assert_eq!((data[0]["object"].as_str(), data[0]["index"].as_u64()), (Some("embedding"), Some(0)));
    let routed = floats(&data[0]["embedding"]);
    assert!(cosine(&routed, &vectors[7]) > 0.9999, "the route embeds as the job does");
    let resp = cluster.http.post(cluster.url("/v1/audio/embeddings")).multipart(form("base64")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let listed: Value = resp.json().await.unwrap();
    let bytes = base64::engine::general_purpose::STANDARD.decode(listed["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let decoded: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(decoded.len(), 384);
    assert!(cosine(&decoded, &routed) > 0.9999);

    // Bad input: the schema's and the audio's codes, as for transcriptions.
    let (status, body) = cluster.post("/v1/jobs", &json!({"kind": "audio_embed", "input": {"audio": {"base64": b64(&wavs[0])}, "windows": "yes"}})).await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (422, Some("invalid_input")), "{body}");
    let garbage = b"this is not audio at all, not even close".repeat(50);
    let (status, body) = cluster.post("/v1/jobs", &json!({"kind": "audio_embed", "input": {"audio": {"base64": b64(&garbage)}}})).await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (422, Some("audio_unreadable")), "{body}");
    let resp = cluster
        .http
        .post(cluster.url("/v1/audio/embeddings"))
        .multipart(reqwest::multipart::Form::new().text("encoding_format", "hex").part("file", reqwest::multipart::Part::bytes(mp3s[0].clone())))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_encoding_format", "{body}");
}
