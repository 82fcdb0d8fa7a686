//! Models named by hub id (`hf:OWNER/NAME`) are downloaded once into the models directory and
//! loaded from there. The hub here is a local HTTP server laid out like the real one
//! (`/{repo}/resolve/{revision}/{file}`, pointed at with HF_ENDPOINT): this machine has no
//! internet, and the path under test is tern's, not the hub's.

use base64::Engine;
use serde_json::json;
use std::net::TcpListener;
use std::time::Duration;
use tern_e2e::Cluster;

/// A `python3 -m http.server` over `root`, killed on drop.
struct FileServer(std::process::Child);

impl FileServer {
    /// Serves `root` on a free port, once it accepts connections.
    async fn serve(root: &std::path::Path) -> (FileServer, u16) {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let server = FileServer(
            std::process::Command::new("python3")
                .args(["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1", "--directory"])
                .arg(root)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("python3"),
        );
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (server, port)
    }
}

impl Drop for FileServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A local hub serving `files` of the folder `source` as the repository `repo` (linked, folders
/// kept), and an empty models directory for a worker to download them into.
struct LocalHub {
    _server: FileServer,
    _root: tempfile::TempDir,
    endpoint: String,
    models: tempfile::TempDir,
}

impl LocalHub {
    async fn serve(repo: &str, source: &std::path::Path, files: &[&str]) -> LocalHub {
        let root = tempfile::tempdir().unwrap();
        let served = root.path().join(repo).join("resolve/main");
        for file in files {
            let target = served.join(file);
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(source.join(file), target).unwrap();
        }
        let (server, port) = FileServer::serve(root.path()).await;
        LocalHub { _server: server, _root: root, endpoint: format!("http://127.0.0.1:{port}"), models: tempfile::tempdir().unwrap() }
    }

    /// A worker's settings for this hub: its endpoint and the models directory.
    fn worker_env(&self) -> [(&str, &str); 2] {
        [("HF_ENDPOINT", self.endpoint.as_str()), ("TERN_MODELS_DIR", self.models.path().to_str().unwrap())]
    }
}

#[tokio::test]
async fn a_hub_model_id_is_downloaded_once_and_serves_jobs() {
    let models = tern_e2e::models_dir();
    let hub = LocalHub::serve("test-org/whisper-tiny.en", &models.join("whisper-tiny.en"), &["model.bin", "config.json", "tokenizer.json"]).await;

    let mut cluster = Cluster::start(&[]).await.unwrap();
    let clip = std::fs::read(models.join("testdata/librivox").join(
        std::fs::read_dir(models.join("testdata/librivox"))
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .find(|n| n.to_string_lossy().ends_with(".wav"))
            .unwrap(),
    ))
    .unwrap();
    let audio = base64::engine::general_purpose::STANDARD.encode(&clip);
    let ids = cluster
        .submit_all(&[
            json!({"kind": "transcribe", "input": {"audio": {"base64": audio}}}),
            json!({"kind": "transcribe", "input": {"audio": {"base64": audio}}}),
        ])
        .await
        .unwrap();
    let worker = cluster
        .spawn_worker(&[hub.worker_env().as_slice(), &[("TERN_WHISPER_MODEL", "hf:test-org/whisper-tiny.en"), ("TERN_WORKER_KINDS", "transcribe")]].concat())
        .unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(120)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&2), "{counts:?}\n{}", worker.log_text());
    let fetched = hub.models.path().join("hf/test-org--whisper-tiny.en--main/model.bin");
    assert_eq!(
        std::fs::metadata(&fetched).unwrap().len(),
        std::fs::metadata(models.join("whisper-tiny.en/model.bin")).unwrap().len(),
        "the weights were downloaded whole"
    );
    assert_eq!(worker.log_text().matches("downloading from the hub").count(), 3, "each file once");
    let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    let out: serde_json::Value = reqwest::get(job["output"]["url"].as_str().unwrap()).await.unwrap().json().await.unwrap();
    assert_eq!(out["model"], "hf:test-org/whisper-tiny.en");
    assert!(!out["text"].as_str().unwrap().is_empty());
}

/// A diffusers repository downloads folder by folder (`unet/`, `vae/`, `tokenizer/`, ...) and
/// serves image jobs: the tiny random SD 1.5-style pipeline of the parity tests, laid out as a
/// hub repository.
#[tokio::test]
async fn a_hub_diffusers_repository_is_downloaded_folder_by_folder_and_makes_images() {
    let fixture = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/diffusion/sd-tiny");
    let repo_files = [
        "model_index.json",
        "scheduler/scheduler_config.json",
        "tokenizer/vocab.json",
        "tokenizer/merges.txt",
        "tokenizer/tokenizer_config.json",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
    ];
    let hub = LocalHub::serve("test-org/sd-tiny", &fixture, &repo_files).await;
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let ids = cluster
        .submit_all(&[json!({"kind": "image", "input": {"prompt": "a lighthouse at dusk", "width": 64, "height": 64, "steps": 2, "seed": 3}})])
        .await
        .unwrap();
    let worker = cluster
        .spawn_worker(&[hub.worker_env().as_slice(), &[("TERN_IMAGE_MODEL", "hf:test-org/sd-tiny"), ("TERN_WORKER_KINDS", "image")]].concat())
        .unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(120)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&1), "{counts:?}\n{}", worker.log_text());
    assert_eq!(worker.log_text().matches("downloading from the hub").count(), 11, "each file once");
    let fetched = hub.models.path().join("hf/test-org--sd-tiny--main/unet/diffusion_pytorch_model.safetensors");
    assert_eq!(std::fs::metadata(&fetched).unwrap().len(), std::fs::metadata(fixture.join("unet/diffusion_pytorch_model.safetensors")).unwrap().len());
    let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    assert_eq!(job["output"]["inline"]["model"], "hf:test-org/sd-tiny", "{job}");
}

/// A Hugging Face Whisper repository (no `model.bin`: `config.json`, `generation_config.json`,
/// `tokenizer.json`, `model.safetensors`) downloads those files and transcribes: the tiny random
/// model of large-v3's shapes that `models/tests/whisper_hf.rs` proves equal to transformers.
#[tokio::test]
async fn a_hub_whisper_repository_in_hugging_faces_format_serves_transcriptions() {
    let fixture = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/whisper-hf/large-v3");
    let hf_files = ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors"];
    let hub = LocalHub::serve("test-org/whisper-large-v3-tiny", &fixture, &hf_files).await;
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let clip = std::fs::read(tern_e2e::models_dir().join("testdata/librivox/sense_and_sensibility_01_austen_64kb-0880.wav")).unwrap();
    let audio = base64::engine::general_purpose::STANDARD.encode(&clip);
    let ids = cluster.submit_all(&[json!({"kind": "transcribe", "input": {"audio": {"base64": audio}, "language": "en"}})]).await.unwrap();
    let model = [("TERN_WHISPER_MODEL", "hf:test-org/whisper-large-v3-tiny"), ("TERN_WORKER_KINDS", "transcribe"), ("TERN_WHISPER_BEAM_SIZE", "1")];
    let worker = cluster.spawn_worker(&[hub.worker_env().as_slice(), &model].concat()).unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(120)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&1), "{counts:?}\n{}", worker.log_text());
    let fetched = hub.models.path().join("hf/test-org--whisper-large-v3-tiny--main");
    for f in hf_files {
        assert!(fetched.join(f).is_file(), "{f} downloaded");
    }
    assert!(!fetched.join("model.bin").exists());
    let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    let out: serde_json::Value = reqwest::get(job["output"]["url"].as_str().unwrap()).await.unwrap().json().await.unwrap();
    assert_eq!(out["model"], "hf:test-org/whisper-large-v3-tiny", "{out}");
    assert_eq!(out["language"], "en", "{out}");
}
