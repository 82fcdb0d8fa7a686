//! A test bundle for black-box tests and benchmarks: a private Postgres database, Redis key
//! prefix and S3 bucket, and real `tern-api` / `tern-worker` processes started against them.
//!
//! Services: Postgres, Redis and an S3-compatible server must be up (`scripts/services.sh up`).
//! Binaries: `TERN_BIN_DIR`, else the cargo target directory this test was built into.

pub mod batch;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use sqlx::PgPool;
use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tern_jobs::object_store::ObjectStoreSettings;
use tern_jobs::ObjectStore;
use uuid::Uuid;

/// Postgres server URL for creating test databases (`TERN_TEST_POSTGRES_URL`).
pub fn postgres_admin_url() -> String {
    std::env::var("TERN_TEST_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

pub fn redis_url() -> String {
    std::env::var("TERN_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn s3_endpoint() -> String {
    std::env::var("TERN_S3_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:8333".into())
}

fn s3_access_key() -> String {
    std::env::var("TERN_S3_ACCESS_KEY").unwrap_or_else(|_| "tern-dev".into())
}

fn s3_secret_key() -> String {
    std::env::var("TERN_S3_SECRET_KEY").unwrap_or_else(|_| "tern-dev-secret".into())
}

/// Model weights and test speech (`TERN_MODELS_DIR`, filled by scripts/models.sh).
/// Where `scripts/services.sh` installs the tools the tests run (schemathesis, the openai
/// SDK): `TERN_STATE_DIR`, default `~/.cache/tern`.
pub fn state_dir() -> PathBuf {
    match std::env::var_os("TERN_STATE_DIR") {
        Some(dir) => dir.into(),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tern"),
    }
}

pub fn models_dir() -> PathBuf {
    match std::env::var_os("TERN_MODELS_DIR") {
        Some(dir) => dir.into(),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tern/models"),
    }
}

/// A 16 kHz mono 16-bit PCM WAV file holding `samples` (in [-1, 1]).
pub fn wav_16k_mono(samples: &[f32]) -> Vec<u8> {
    wav_mono(samples, 16_000)
}

/// A mono 16-bit PCM WAV file at `rate` Hz holding `samples` (in [-1, 1]).
pub fn wav_mono(samples: &[f32], rate: u32) -> Vec<u8> {
    let data_len = (samples.len() * 2) as u32;
    let mut out = Vec::with_capacity(44 + data_len as usize);
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data_len).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes()); // fmt chunk size
    out.extend_from_slice(&1u16.to_le_bytes()); // PCM
    out.extend_from_slice(&1u16.to_le_bytes()); // mono
    out.extend_from_slice(&rate.to_le_bytes()); // sample rate
    out.extend_from_slice(&(2 * rate).to_le_bytes()); // byte rate
    out.extend_from_slice(&2u16.to_le_bytes()); // block align
    out.extend_from_slice(&16u16.to_le_bytes()); // bits per sample
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data_len.to_le_bytes());
    for s in samples {
        out.extend_from_slice(&((s.clamp(-1.0, 1.0) * 32767.0) as i16).to_le_bytes());
    }
    out
}

/// Where `tern-api` and `tern-worker` are.
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("TERN_BIN_DIR") {
        return dir.into();
    }
    // Test binaries live in target/<profile>/deps; the project's binaries one level up.
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// A progress bar for the benchmark binaries' long steps: `what`, a bar, count, rate and eta.
pub fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg:>28} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Deletes every key under `prefix` on the test Redis: a deployment's Redis losing its data.
pub async fn delete_redis_prefix(prefix: &str) -> Result<()> {
    let mut c = redis::Client::open(redis_url())?.get_multiplexed_async_connection().await?;
    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{prefix}:*")).query_async(&mut c).await?;
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL").arg(&keys).query_async(&mut c).await?;
    }
    Ok(())
}

/// Relays TCP connections from 127.0.0.1:`port` to `target` (`HOST:PORT`) until dropped: a
/// backing service that comes up at `port` only once the relay starts, for tests of what
/// clients do before it does. Dropping it cuts every relayed connection too, as the service
/// going down would.
pub struct Relay {
    accept: tokio::task::JoinHandle<()>,
    connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Relay {
    pub async fn start(port: u16, target: &str) -> Result<Relay> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let target = target.to_string();
        let connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let tracked = connections.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                let relayed = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                let mut tracked = tracked.lock().expect("relay connections");
                tracked.retain(|c| !c.is_finished());
                tracked.push(relayed.abort_handle());
            }
        });
        Ok(Relay { accept, connections })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
        for c in self.connections.lock().expect("relay connections").drain(..) {
            c.abort();
        }
    }
}

/// A running tern process, killed when dropped.
pub struct Process {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
}

impl Process {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// SIGKILL: the process gets no chance to clean up.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then wait up to `timeout` for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let Some(child) = self.child.as_mut() else { bail!("{} is not running", self.name) };
        Command::new("kill").arg("-TERM").arg(child.id().to_string()).status()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("{} did not exit within {timeout:?} of SIGTERM", self.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A private tern deployment for one test.
pub struct Cluster {
    pub name: String,
    pub database_url: String,
    pub redis_prefix: String,
    pub bucket: String,
    /// This test's prefix of every object key in the shared bucket.
    pub key_prefix: String,
    pub base_url: String,
    pub http: reqwest::Client,
    pub pg: PgPool,
    pub objects: ObjectStore,
    pub api: Option<Process>,
    /// An API key of tenant `default` with every scope; `http` sends it with each request.
    pub api_key: String,
    api_env: Vec<(String, String)>,
    api_port: u16,
    workers: usize,
    log_dir: PathBuf,
}

impl Cluster {
    /// Creates the database, bucket and prefix and starts `tern-api` with `api_env` on top of
    /// the defaults (`TERN_*` variables).
    pub async fn start(api_env: &[(&str, &str)]) -> Result<Cluster> {
        let name = format!("t{}", &Uuid::now_v7().simple().to_string()[20..]);
        let admin = PgPool::connect(&postgres_admin_url()).await.context("connecting to Postgres")?;
        sqlx::query(&format!("CREATE DATABASE tern_test_{name}")).execute(&admin).await?;
        admin.close().await;
        let base = postgres_admin_url();
        let database_url = format!("{}/tern_test_{name}", base.rsplit_once('/').map_or(base.as_str(), |(b, _)| b));
        // One bucket for every test: SeaweedFS gives each bucket volumes of its own, and a
        // bucket per test would exhaust them. Each test gets a key prefix instead.
        let bucket = "tern-test".to_string();
        let key_prefix = format!("{name}/");
        let objects = ObjectStore::new(&ObjectStoreSettings {
            endpoint: Some(s3_endpoint()),
            region: "us-east-1".into(),
            bucket: bucket.clone(),
            key_prefix: key_prefix.clone(),
            access_key: s3_access_key(),
            secret_key: s3_secret_key(),
            path_style: true,
            presign_ttl: Duration::from_secs(600),
        });
        let log_dir = bin_dir().join("tern-test-logs");
        std::fs::create_dir_all(&log_dir)?;
        let api_port = free_port();
        let mut cluster = Cluster {
            redis_prefix: format!("tern-test-{name}"),
            base_url: format!("http://127.0.0.1:{api_port}"),
            http: reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?,
            pg: PgPool::connect(&database_url).await.ok().unwrap_or(PgPool::connect_lazy(&database_url)?),
            database_url,
            bucket,
            key_prefix,
            objects,
            api: None,
            api_key: String::new(),
            api_env: api_env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            api_port,
            workers: 0,
            log_dir,
            name,
        };
        cluster.start_api().await?;
        cluster.api_key = cluster.create_key("default", "jobs:write,jobs:read,admin")?;
        cluster.http = cluster.client_for(&cluster.api_key)?;
        Ok(cluster)
    }

    /// Creates an API key with `tern-api keys create` (the operator's way) and returns it.
    pub fn create_key(&self, tenant: &str, scopes: &str) -> Result<String> {
        let mut cmd = Command::new(bin_dir().join("tern-api"));
        for (k, _) in std::env::vars() {
            if k.starts_with("TERN_") {
                cmd.env_remove(k);
            }
        }
        let out = cmd
            .envs(self.base_env())
            .args(["keys", "create", "--tenant", tenant, "--scope", scopes])
            .output()
            .context("running tern-api keys create")?;
        if !out.status.success() {
            bail!("tern-api keys create failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8(out.stdout)?.trim().to_string())
    }

    /// An HTTP client that sends `key` with every request (`None`: no key).
    pub fn client_for(&self, key: &str) -> Result<reqwest::Client> {
        let mut headers = reqwest::header::HeaderMap::new();
        if !key.is_empty() {
            headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {key}").parse()?);
        }
        Ok(reqwest::Client::builder().timeout(Duration::from_secs(60)).default_headers(headers).build()?)
    }

    fn base_env(&self) -> Vec<(String, String)> {
        let env = vec![
            ("TERN_DATABASE_URL", self.database_url.clone()),
            ("TERN_DATABASE_MAX_CONNECTIONS", "8".into()),
            ("TERN_REDIS_URL", redis_url()),
            ("TERN_REDIS_PREFIX", self.redis_prefix.clone()),
            ("TERN_S3_ENDPOINT", s3_endpoint()),
            ("TERN_S3_BUCKET", self.bucket.clone()),
            ("TERN_S3_PREFIX", self.key_prefix.clone()),
            ("TERN_S3_ACCESS_KEY", s3_access_key()),
            ("TERN_S3_SECRET_KEY", s3_secret_key()),
            ("TERN_MODELS_DIR", models_dir().display().to_string()),
            ("TERN_LOG", std::env::var("TERN_TEST_LOG").unwrap_or_else(|_| "info".into())),
            // Tests and benchmarks poll hard with one key; the rate-limit test turns it on.
            ("TERN_RATE_LIMIT_PER_SEC", "0".into()),
            // Receivers and file servers in tests live on 127.0.0.1; the SSRF test turns this off.
            ("TERN_ALLOW_PRIVATE_URLS", "true".into()),
            // Many workers share this host; the metrics test gives its worker a port.
            ("TERN_METRICS_ADDR", "off".into()),
        ];
        env.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    fn spawn(&self, binary: &str, name: &str, env: &[(String, String)]) -> Result<Process> {
        let log = self.log_dir.join(format!("{}-{name}.log", self.name));
        let out = std::fs::File::create(&log)?;
        let mut cmd = Command::new(bin_dir().join(binary));
        // Nothing from the developer's shell leaks into the deployment under test.
        for (k, _) in std::env::vars() {
            if k.starts_with("TERN_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(self.base_env()).envs(env.iter().cloned()).stdout(Stdio::from(out.try_clone()?)).stderr(Stdio::from(out));
        let child = cmd.spawn().with_context(|| format!("starting {binary} from {}", bin_dir().display()))?;
        Ok(Process { name: name.to_string(), child: Some(child), log })
    }

    /// Sets (or replaces) a variable of the API's environment for its next start.
    pub fn set_api_env(&mut self, key: &str, value: &str) {
        self.api_env.retain(|(k, _)| k != key);
        self.api_env.push((key.to_string(), value.to_string()));
    }

    /// (Re)starts the API on its port and waits until `/readyz` answers 200.
    pub async fn start_api(&mut self) -> Result<()> {
        let mut env = vec![("TERN_LISTEN".to_string(), format!("127.0.0.1:{}", self.api_port))];
        env.extend(self.api_env.iter().cloned());
        let mut api = self.spawn("tern-api", "api", &env)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(resp) = self.http.get(format!("{}/readyz", self.base_url)).send().await {
                if resp.status().is_success() {
                    break;
                }
            }
            if !api.is_running() || Instant::now() > deadline {
                bail!("tern-api did not become ready:\n{}", api.log_text());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.api = Some(api);
        Ok(())
    }

    /// Starts a worker with `env` on top of the defaults.
    pub fn spawn_worker(&mut self, env: &[(&str, &str)]) -> Result<Process> {
        self.workers += 1;
        let name = format!("worker{}", self.workers);
        let mut all = vec![("TERN_WORKER_ID".to_string(), name.clone())];
        all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        self.spawn("tern-worker", &name, &all)
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url)
    }

    /// POSTs JSON; returns the status and the JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> Result<(u16, Value)> {
        let resp = self.http.post(self.url(path)).json(body).send().await?;
        let status = resp.status().as_u16();
        Ok((status, resp.json().await.unwrap_or(Value::Null)))
    }

    pub async fn get(&self, path: &str) -> Result<(u16, Value)> {
        let resp = self.http.get(self.url(path)).send().await?;
        let status = resp.status().as_u16();
        Ok((status, resp.json().await.unwrap_or(Value::Null)))
    }

    /// A succeeded job's record and its primary output, read back from S3 through the
    /// record's presigned URL (JSON outputs).
    pub async fn succeeded_output(&self, id: Uuid) -> Result<(Value, Value)> {
        let (_, job) = self.get(&format!("/v1/jobs/{id}")).await?;
        if job["state"] != "succeeded" {
            bail!("job {id} did not succeed: {job}");
        }
        let url = job["output"]["url"].as_str().context("a succeeded job has an output URL")?;
        let output: Value = reqwest::get(url).await?.json().await?;
        Ok((job, output))
    }

    /// Submits jobs through `POST /v1/jobs/batch`, up to 1,000 and under 8 MiB of JSON a request
    /// (half the API's default body limit, so jobs carrying base64 audio fit); returns their ids
    /// in order.
    pub async fn submit_all(&self, jobs: &[Value]) -> Result<Vec<Uuid>> {
        const MAX_JOBS: usize = 1000;
        const MAX_BYTES: usize = 8 << 20;
        let mut ids = Vec::with_capacity(jobs.len());
        let mut start = 0;
        while start < jobs.len() {
            let (mut end, mut bytes) = (start, 0);
            while end < jobs.len() && end - start < MAX_JOBS {
                let size = serde_json::to_vec(&jobs[end])?.len() + 1;
                if end > start && bytes + size > MAX_BYTES {
                    break;
                }
                bytes += size;
                end += 1;
            }
            let chunk = &jobs[start..end];
            start = end;
            let (status, body) = self.post("/v1/jobs/batch", &serde_json::json!({ "jobs": chunk })).await?;
            if status != 201 {
                bail!("batch submit answered {status}: {body}");
            }
            for job in body["jobs"].as_array().context("jobs array")? {
                ids.push(job["id"].as_str().context("id")?.parse()?);
            }
        }
        Ok(ids)
    }

    /// Waits until every job is in a terminal state; returns the count per state.
    pub async fn wait_terminal(&self, ids: &[Uuid], timeout: Duration) -> Result<HashMap<String, i64>> {
        let deadline = Instant::now() + timeout;
        loop {
            let rows: Vec<(String, i64)> =
                sqlx::query_as("SELECT state, count(*) FROM jobs WHERE id = ANY($1) GROUP BY state")
                    .bind(ids)
                    .fetch_all(&self.pg)
                    .await?;
            let counts: HashMap<String, i64> = rows.into_iter().collect();
            let terminal: i64 = ["succeeded", "failed", "canceled"].iter().filter_map(|s| counts.get(*s)).sum();
            if terminal as usize == ids.len() {
                return Ok(counts);
            }
            if Instant::now() > deadline {
                bail!("only {terminal} of {} jobs finished within {timeout:?}: {counts:?}", ids.len());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until `check` holds, polling every 50 ms.
    pub async fn wait_until<F, Fut>(&self, what: &str, timeout: Duration, mut check: F) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool>>,
    {
        let deadline = Instant::now() + timeout;
        while !check().await? {
            if Instant::now() > deadline {
                bail!("timed out after {timeout:?} waiting for {what}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// A job's state straight from Postgres.
    pub async fn state_of(&self, id: Uuid) -> Result<String> {
        Ok(sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1").bind(id).fetch_one(&self.pg).await?)
    }

    /// A Redis connection for inspecting (or wiping) the queue.
    pub async fn redis(&self) -> Result<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(redis_url())?;
        Ok(client.get_multiplexed_async_connection().await?)
    }

    /// Members of one of a kind's queue sets (`ready`: of every priority; `delayed`, `leases`).
    pub async fn queue_len(&self, kind: &str, set: &str) -> Result<u64> {
        let mut r = self.redis().await?;
        let sets = if set == "ready" { (0..4).map(|rank| format!("ready:{rank}")).collect() } else { vec![set.to_string()] };
        let mut total = 0;
        for set in sets {
            let n: u64 = redis::cmd("ZCARD").arg(format!("{}:{{{kind}}}:{set}", self.redis_prefix)).query_async(&mut r).await?;
            total += n;
        }
        Ok(total)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(mut api) = self.api.take() {
            api.kill9();
        }
        // Best effort: the database is private to this test.
        let _ = Command::new("psql")
            .arg(postgres_admin_url())
            .arg("-qc")
            .arg(format!("DROP DATABASE IF EXISTS tern_test_{} WITH (FORCE)", self.name))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
