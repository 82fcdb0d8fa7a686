//! The `tern` CLI against a real deployment, a test per command: transcribing a directory of
//! recordings (progress shown, then again with nothing left to do, then resumed), embed,
//! generate, image, submit, jobs list/get/watch/cancel/retry, batch create, queues, keys,
//! profiles, and the exit codes that say what failed.

use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Output};
use tern_e2e::Cluster;

/// Runs `tern ARGS` against the cluster (its URL and key through the environment, a config
/// file of the test's own); stdout is a pipe, so the CLI answers in JSON.
fn tern(cluster: &Cluster, config: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(tern_e2e::bin_dir().join("tern"));
    for (k, _) in std::env::vars() {
        if k.starts_with("TERN_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("TERN_URL", cluster.url("")).env("TERN_API_KEY", &cluster.api_key).env("TERN_CONFIG", config).args(args);
    let output = cmd.output().unwrap();
    println!("$ tern {}\n{}{}", args.join(" "), String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    output
}

/// The JSON lines of stdout.
fn lines(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"))).collect()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).to_string()
}

async fn job_count(cluster: &Cluster) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(&cluster.pg).await.unwrap()
}

#[tokio::test]
async fn tern_transcribes_a_directory_resumably() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "transcribe")]).unwrap();
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("config.toml");
    // The test recordings, some in a subdirectory, and a file that is not audio.
    let recordings = work.path().join("recordings");
    std::fs::create_dir_all(recordings.join("part2")).unwrap();
    let librivox = tern_e2e::models_dir().join("testdata/librivox");
    let mut wavs: Vec<_> = std::fs::read_dir(&librivox).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "wav")).collect();
    wavs.sort();
    for (i, wav) in wavs.iter().enumerate() {
        let target = if i < 2 { recordings.join("part2") } else { recordings.clone() };
        std::fs::copy(wav, target.join(wav.file_name().unwrap())).unwrap();
    }
    std::fs::write(recordings.join("notes.txt"), "not audio").unwrap();
    let out = work.path().join("transcripts");
    let (recordings_arg, out_arg) = (recordings.to_str().unwrap(), out.to_str().unwrap());

    let first = tern(&cluster, &config, &["transcribe", recordings_arg, "--output-dir", out_arg]);
    assert!(first.status.success());
    let progress = stderr(&first);
    assert!(progress.contains(&format!("[{0}/{0}]", wavs.len())), "progress is shown: {progress}");
    let results = lines(&first);
    assert_eq!(results.len(), wavs.len());
    assert!(results.iter().all(|r| r["state"] == "succeeded"), "{results:?}");
    // Each transcript where its recording was, and what was said in it.
    let references = std::fs::read_to_string(librivox.join("transcription")).unwrap();
    for (i, wav) in wavs.iter().enumerate() {
        let stem = wav.file_stem().unwrap().to_str().unwrap();
        let path = if i < 2 { out.join("part2").join(format!("{stem}.txt")) } else { out.join(format!("{stem}.txt")) };
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).to_lowercase();
        let reference = references.lines().find(|l| l.contains(stem)).unwrap();
        let words: Vec<&str> = reference.split_whitespace().filter(|w| w.len() >= 3 && !w.starts_with('<') && !w.contains('(')).collect();
        let heard = words.iter().filter(|w| text.contains(*w)).count();
        assert!(heard * 2 >= words.len(), "{stem}: {text:?} vs {reference:?}");
    }
    let jobs = job_count(&cluster).await;
    assert_eq!(jobs, wavs.len() as i64);

    // Again: nothing left to do, no job made.
    let again = tern(&cluster, &config, &["transcribe", recordings_arg, "--output-dir", out_arg]);
    assert!(again.status.success());
    assert!(stderr(&again).contains(&format!("{0} of {0} already transcribed", wavs.len())), "{}", stderr(&again));
    assert!(lines(&again).iter().all(|r| r["state"] == "skipped"));
    assert_eq!(job_count(&cluster).await, jobs);

    // A transcript lost: the run picks up the job it made before rather than a new one.
    let lost = out.join(format!("{}.txt", wavs[4].file_stem().unwrap().to_str().unwrap()));
    std::fs::remove_file(&lost).unwrap();
    let resumed = tern(&cluster, &config, &["transcribe", recordings_arg, "--output-dir", out_arg]);
    assert!(resumed.status.success());
    assert!(lost.exists());
    assert_eq!(job_count(&cluster).await, jobs, "no job made twice");

    // One file to stdout as subtitles.
    let srt = tern(&cluster, &config, &["transcribe", wavs[0].to_str().unwrap(), "--format", "srt"]);
    assert!(srt.status.success());
    assert!(lines(&srt)[0]["transcript"].as_str().unwrap().contains(" --> "), "{:?}", lines(&srt));
}

#[tokio::test]
async fn tern_runs_every_other_command() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("config.toml");

    // --help everywhere.
    for args in [&["--help"][..], &["transcribe", "--help"], &["image", "--help"], &["jobs", "watch", "--help"], &["batch", "create", "--help"]] {
        let help = tern(&cluster, &config, args);
        assert!(help.status.success() && String::from_utf8_lossy(&help.stdout).contains("Usage"), "{args:?}");
    }

    // A job that cannot run yet (no worker): submit, list, get, cancel.
    let submitted = tern(&cluster, &config, &["submit", "embed", "--input", r#"{"texts": ["to cancel"]}"#, "--priority", "high"]);
    assert!(submitted.status.success());
    let queued = &lines(&submitted)[0];
    let queued_id = queued["id"].as_str().unwrap().to_string();
    assert_eq!((queued["state"].as_str(), queued["priority"].as_str()), (Some("queued"), Some("high")));
    let listed = lines(&tern(&cluster, &config, &["jobs", "list", "--state", "queued"]));
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["id"], queued_id.as_str());
    let got = lines(&tern(&cluster, &config, &["jobs", "get", &queued_id]));
    assert_eq!(got[0]["events"][0]["state"], "queued");
    let canceled = tern(&cluster, &config, &["jobs", "cancel", &queued_id]);
    assert!(canceled.status.success());
    assert_eq!(lines(&canceled)[0]["state"], "canceled");
    // Watching a canceled job: exit 1.
    let watched = tern(&cluster, &config, &["jobs", "watch", &queued_id]);
    assert_eq!(watched.status.code(), Some(1));

    let _worker = cluster.spawn_worker(&[]).unwrap();
    // embed, generate, submit --wait.
    let embedded = tern(&cluster, &config, &["embed", "a cat", "a dog"]);
    assert!(embedded.status.success(), "{}", stderr(&embedded));
    let vectors = &lines(&embedded)[0]["embeddings"];
    assert_eq!(vectors.as_array().unwrap().len(), 2);
    assert_eq!(vectors[0].as_array().unwrap().len(), 384);
    let generated = tern(&cluster, &config, &["generate", "The capital of France is", "--max-tokens", "4"]);
    assert!(generated.status.success(), "{}", stderr(&generated));
    assert!(lines(&generated)[0]["text"].as_str().is_some_and(|t| !t.is_empty()));
    let waited = tern(&cluster, &config, &["submit", "echo", "--input", r#"{"message": {"a": 1}}"#, "--wait"]);
    assert!(waited.status.success(), "{}", stderr(&waited));
    let echo = lines(&waited).pop().unwrap();
    assert_eq!(echo["state"], "succeeded");

    // watch: the job's events as JSON lines, ending with the finished job.
    let job = lines(&tern(&cluster, &config, &["submit", "generate", "--input", r#"{"prompt": "Once", "max_tokens": 8}"#]))[0].clone();
    let watch = tern(&cluster, &config, &["jobs", "watch", job["id"].as_str().unwrap()]);
    assert!(watch.status.success());
    let events = lines(&watch);
    assert_eq!(events.first().unwrap()["event"], "state");
    assert_eq!(events.last().unwrap()["event"], "job");
    assert_eq!(events.last().unwrap()["data"]["state"], "succeeded");

    // A job that fails, then retried: exit 1, then queued again.
    let failing = tern(&cluster, &config, &["submit", "echo", "--input", r#"{"fail_permanently": true}"#, "--wait"]);
    assert_eq!(failing.status.code(), Some(1), "{}", stderr(&failing));
    let failed = lines(&failing).pop().unwrap();
    assert_eq!(failed["state"], "failed");
    let retried = tern(&cluster, &config, &["jobs", "retry", failed["id"].as_str().unwrap()]);
    assert!(retried.status.success(), "{}", stderr(&retried));
    assert!(lines(&retried)[0].to_string().contains(failed["id"].as_str().unwrap()));

    // batch create --wait: the answers downloaded.
    let batch_file = work.path().join("requests.jsonl");
    let requests: String = (0..5)
        .map(|i| json!({ "custom_id": format!("r{i}"), "method": "POST", "url": "/v1/embeddings", "body": { "input": format!("line {i}") } }).to_string() + "\n")
        .collect();
    std::fs::write(&batch_file, requests).unwrap();
    let answers = work.path().join("answers");
    let batch = tern(&cluster, &config, &["batch", "create", batch_file.to_str().unwrap(), "--wait", "-o", answers.to_str().unwrap()]);
    assert!(batch.status.success(), "{}", stderr(&batch));
    let result = lines(&batch).pop().unwrap();
    assert_eq!(result["request_counts"]["completed"], 5);
    let output = std::fs::read_to_string(result["output_path"].as_str().unwrap()).unwrap();
    assert_eq!(output.lines().count(), 5);
    assert_eq!(lines(&tern(&cluster, &config, &["batch", "list"]))[0]["status"], "completed");

    // queues and keys (admin).
    let queues = lines(&tern(&cluster, &config, &["queues"]));
    let kinds: Vec<&str> = queues[0]["queues"].as_array().unwrap().iter().map(|q| q["kind"].as_str().unwrap()).collect();
    assert!(kinds.contains(&"transcribe") && kinds.contains(&"embed"), "{kinds:?}");
    let created = tern(&cluster, &config, &["keys", "create", "--tenant", "cli-test", "--scopes", "jobs:read"]);
    assert!(created.status.success(), "{}", stderr(&created));
    let key = lines(&created)[0].clone();
    assert!(key["key"].as_str().unwrap().starts_with("tern_"));
    assert!(lines(&tern(&cluster, &config, &["keys", "list"])).iter().any(|k| k["tenant"] == "cli-test"));
    let revoked = tern(&cluster, &config, &["keys", "revoke", key["prefix"].as_str().unwrap()]);
    assert!(revoked.status.success(), "{}", stderr(&revoked));

    // Profiles: a named deployment, then used without flags.
    let mut profile = Command::new(tern_e2e::bin_dir().join("tern"));
    profile.env_clear().env("TERN_CONFIG", &config).env("HOME", work.path());
    let set = profile.args(["profile", "set", "test", "--url", &cluster.url(""), "--api-key", &cluster.api_key, "--default"]).output().unwrap();
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    let via_profile = Command::new(tern_e2e::bin_dir().join("tern")).env_clear().env("TERN_CONFIG", &config).args(["jobs", "list", "--limit", "1"]).output().unwrap();
    assert!(via_profile.status.success(), "{}", String::from_utf8_lossy(&via_profile.stderr));
    assert_eq!(lines(&via_profile).len(), 1);
    let missing = Command::new(tern_e2e::bin_dir().join("tern")).env_clear().env("TERN_CONFIG", &config).args(["--profile", "nope", "queues"]).output().unwrap();
    assert_eq!(missing.status.code(), Some(2));

    // Exit codes: a refused key is 3, an unreachable API is 3, bad usage is 2.
    let mut bad_key = Command::new(tern_e2e::bin_dir().join("tern"));
    let refused = bad_key.env_clear().env("TERN_URL", cluster.url("")).env("TERN_API_KEY", "tern_wrong").args(["jobs", "list"]).output().unwrap();
    assert_eq!(refused.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("invalid_api_key"), "{}", String::from_utf8_lossy(&refused.stderr));
    let unreachable = Command::new(tern_e2e::bin_dir().join("tern")).env_clear().env("TERN_URL", "http://127.0.0.1:9").args(["queues"]).output().unwrap();
    assert_eq!(unreachable.status.code(), Some(3));
    let usage = tern(&cluster, &config, &["transcribe"]);
    assert_eq!(usage.status.code(), Some(2));
}

/// A recording over 8 MiB goes as an upload, recorded before its job is submitted: a run cut
/// off between the submit and the record names the same upload again, so its job is a replay,
/// not a conflict or a second job, and a run whose job is recorded uploads nothing.
#[tokio::test]
async fn tern_image_downloads_the_pngs_into_a_folder() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    // The diffusion family's tiny random-weight pipeline.
    let fixtures = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/diffusion");
    let models = fixtures.display().to_string();
    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "image"), ("TERN_MODELS_DIR", models.as_str()), ("TERN_IMAGE_MODEL", "sd-tiny")]).unwrap();
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("config.toml");
    let out = work.path().join("images");
    let made = tern(&cluster, &config, &["image", "a lighthouse at dusk", "--size", "64x128", "--steps", "2", "-n", "2", "--seed", "3", "--scheduler", "ddim", "-o", out.to_str().unwrap()]);
    assert!(made.status.success(), "{}", stderr(&made));
    let answer = &lines(&made)[0];
    let id = answer["id"].as_str().unwrap();
    let images = answer["images"].as_array().unwrap();
    assert_eq!(images.len(), 2, "{answer}");
    for (i, image) in images.iter().enumerate() {
        let path = out.join(format!("{id}-{i}.png"));
        assert_eq!(image["path"].as_str(), Some(path.to_str().unwrap()), "{answer}");
        assert_eq!(image["seed"].as_u64(), Some(3 + i as u64));
        let reader = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&path).unwrap())).read_info().unwrap();
        assert_eq!((reader.info().width, reader.info().height), (64, 128));
    }
    // Bad usage is 2; what the API refuses, 3.
    let usage = tern(&cluster, &config, &["image", "a lighthouse", "--size", "64"]);
    assert_eq!(usage.status.code(), Some(2));
    let refused = tern(&cluster, &config, &["image", "a lighthouse", "--steps", "0"]);
    assert_eq!(refused.status.code(), Some(3));
    assert!(stderr(&refused).contains("invalid_input"), "{}", stderr(&refused));
}

#[tokio::test]
async fn a_large_recording_is_neither_uploaded_nor_submitted_twice_by_runs_again() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("config.toml");
    let recordings = work.path().join("recordings");
    std::fs::create_dir_all(&recordings).unwrap();
    // 300 s of 16-bit audio at 16 kHz: 9.6 MB.
    let samples: Vec<f32> = (0..16_000 * 300).map(|i| 0.1 * (i as f32 * 0.05).sin()).collect();
    std::fs::write(recordings.join("long.wav"), tern_e2e::wav_16k_mono(&samples)).unwrap();
    let out = work.path().join("transcripts");
    let (recordings_arg, out_arg) = (recordings.to_str().unwrap(), out.to_str().unwrap());
    let state = out.join(".tern-transcribe.jsonl");
    let recorded = |field: &str| std::fs::read_to_string(&state).unwrap().lines().filter(|l| l.contains(&format!("\"{field}\""))).count();
    let run = || {
        let output = tern(&cluster, &config, &["transcribe", recordings_arg, "--output-dir", out_arg, "--no-wait"]);
        assert!(output.status.success(), "{}", stderr(&output));
        lines(&output)[0]["job_id"].as_str().unwrap().to_string()
    };

    let first = run();
    assert_eq!((recorded("upload_key"), recorded("job_id")), (1, 1));
    // Cut off after the submit, before the job was recorded.
    let kept: Vec<String> = std::fs::read_to_string(&state).unwrap().lines().filter(|l| !l.contains("\"job_id\"")).map(String::from).collect();
    std::fs::write(&state, kept.join("\n") + "\n").unwrap();
    assert_eq!(run(), first, "the same upload, the same request: the job made before");
    assert_eq!(recorded("upload_key"), 1, "nothing uploaded again");
    assert_eq!(run(), first);
    assert_eq!(recorded("upload_key"), 1, "a recorded job needs no upload");
    assert_eq!(job_count(&cluster).await, 1);
}
