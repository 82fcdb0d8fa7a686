//! `tern-worker`: pulls batches of jobs from the Redis queue, runs them, writes their outputs to
//! S3-compatible storage and records the outcome in Postgres. Run as many as you like, on as
//! many machines: leases and fencing tokens keep each job's outcome single.

mod engine;
mod family_settings;
mod file_fetch;
mod kinds;
mod lease_keeper;
mod metrics_server;
mod model_swap;
mod registry;
mod resources;
mod runner;
mod stop;
mod wakeup;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser};
use runner::{Runner, RunnerSettings};
use std::sync::Arc;
use std::time::Duration;
use tern_jobs::config::ServiceArgs;
use tern_jobs::{JobKind, ObjectStore, Store};

// Model inference allocates and frees tensors of tens of MB per layer: see tern_models::allocator.
#[global_allocator]
static ALLOCATOR: tern_models::allocator::MiMalloc = tern_models::allocator::MiMalloc;

#[derive(Parser, Debug)]
#[command(name = "tern-worker", version, about = "tern's worker: runs queued inference jobs in batches")]
struct Cli {
    /// This worker's id in job records and logs. Default: host name, process id and a random suffix.
    #[arg(long, env = "TERN_WORKER_ID")]
    worker_id: Option<String>,
    /// Job kinds to run, comma-separated. Default: every kind.
    #[arg(long, env = "TERN_WORKER_KINDS", value_delimiter = ',')]
    kinds: Vec<String>,
    /// Most jobs per batch. Default: 64; for model kinds on a GPU the batch's cost budget (each
    /// job costs at least 1), between 64 and 1,024 jobs, so a batch sized by the device's
    /// memory is not cut short by a count of jobs.
    #[arg(long, env = "TERN_BATCH_SIZE")]
    batch_size: Option<usize>,
    /// Cost budget of a batch of echo jobs (they cost 1 each). Default: the batch size. Model
    /// kinds size their batches by memory (see the options below).
    #[arg(long, env = "TERN_BATCH_BUDGET")]
    batch_budget: Option<i64>,
    /// Bytes the resident models and their batches may use, e.g. `2GiB`, `800MB` or a plain
    /// number. Default: available RAM (MemAvailable) minus 1 GiB of headroom, at least 256 MiB.
    /// Models beyond it are evicted, least recently used first.
    #[arg(long, env = "TERN_MEMORY_BUDGET", value_parser = resources::parse_bytes)]
    memory_budget: Option<u64>,
    /// Device the models run on: `cpu`, `cuda[:N]` or `metal[:N]` (GPU devices need the worker
    /// built with the `cuda` or `metal` cargo feature). On CUDA the default memory budget is the
    /// device's free memory minus 1 GiB; on Metal set TERN_MEMORY_BUDGET (the default is derived
    /// from system RAM).
    #[arg(long, env = "TERN_DEVICE", default_value = "cpu", value_parser = resources::parse_device)]
    device: candle_core::Device,
    /// Precision of Whisper and the embedder: `auto` (F32 on the CPU, F16 on a GPU), `f32`,
    /// `f16` or `bf16`. On a CPU with AVX-512 BF16, `auto` also has Whisper and the embedder
    /// take BF16 products with F32 sums (about twice F32's rate; same word error rates), and
    /// `f32` keeps F32 products. On the CPU the embedder takes `f16` and `bf16` as `auto`. The
    /// language model keeps its GGUF quantisation on the CPU; on a GPU its weights are F32, and
    /// `tf32-products` multiplies its steps of more than 8 requests on TF32 tensor cores
    /// (faster, at a measured cost in results: docs/gpu.md).
    #[arg(long, env = "TERN_PRECISION", default_value = "auto")]
    precision: tern_models::precision::Precision,
    /// On a GPU, check each batch against the device's free memory before running it, and
    /// split it at once when it would not fit (default true). `false` leaves that to the CUDA
    /// allocator: a batch it refuses is split the same way, after the failed allocation.
    #[arg(long, env = "TERN_MEMORY_PRECHECK", default_value_t = true, action = clap::ArgAction::Set)]
    memory_precheck: bool,
    /// How much of the silence padding a Whisper window shorter than 30 s the encoder runs:
    /// `full` (the default: as Whisper was trained, and as faster-whisper and OpenAI's
    /// reference compute it), or the audio plus this many seconds (at least 0.5): a 6 s clip
    /// then costs about a quarter of a full encoder pass, at the word error rates
    /// docs/benchmarks.md measures (tiny.en at beam 5: 5.6% on the LibriVox clips at 2 s, against 4.2%).
    #[arg(long, env = "TERN_WHISPER_PADDING", default_value = "full")]
    whisper_padding: tern_models::whisper::Padding,
    /// What a Whisper window's features hold past its audio: `zeros` (the default: as
    /// faster-whisper computes them; transcripts tested equal to its) or `silence` (as OpenAI's
    /// reference and transformers compute them; word error rates of both in docs/benchmarks.md).
    #[arg(long, env = "TERN_WHISPER_FEATURE_PADDING", default_value = "zeros")]
    whisper_feature_padding: tern_models::whisper::FeaturePadding,
    /// Beam size of transcriptions whose input names none: 5 (faster-whisper's default) or
    /// 1 to 16; 1 decodes greedily, several times faster on a CPU.
    #[arg(long, env = "TERN_WHISPER_BEAM_SIZE", default_value_t = tern_models::whisper::DEFAULT_BEAM_SIZE as u64,
          value_parser = clap::value_parser!(u64).range(1..=tern_models::whisper::MAX_BEAM_SIZE as u64))]
    whisper_beam_size: u64,
    /// Batches in flight at once; more overlaps one batch's database round trips with
    /// another's work.
    #[arg(long, env = "TERN_CONCURRENCY", default_value_t = 4)]
    concurrency: usize,
    /// On SIGTERM, how long (ms) batches in hand may take to finish before their jobs are handed
    /// back to the queue.
    #[arg(long, env = "TERN_SHUTDOWN_GRACE_MS", default_value_t = 30_000)]
    shutdown_grace_ms: u64,
    /// How often (ms) leases are extended (and cancels noticed). Keep well under the lease.
    #[arg(long, env = "TERN_HEARTBEAT_MS", default_value_t = 1_000)]
    heartbeat_ms: u64,
    /// Longest wait (ms) between pulls while the queue is empty. A wake-up hint from Redis (sent
    /// when jobs are enqueued or released) ends the wait at once; the poll is the fallback.
    #[arg(long, env = "TERN_IDLE_POLL_MAX_MS", default_value_t = 100)]
    idle_poll_max_ms: u64,
    /// Most output uploads in flight at once.
    #[arg(long, env = "TERN_UPLOAD_CONCURRENCY", default_value_t = 64)]
    upload_concurrency: usize,
    /// Largest output (bytes) kept in Postgres, in the job's row, instead of an S3 object: one
    /// with other renderings (subtitles) always goes to S3. 0: every output to S3.
    #[arg(long, env = "TERN_OUTPUT_IN_POSTGRES_MAX_BYTES", default_value_t = tern_jobs::job::OUTPUT_IN_POSTGRES_MAX_BYTES_DEFAULT)]
    output_in_postgres_max_bytes: usize,
    /// How long (ms) a batch runs before its jobs are recorded `running` in Postgres. A batch
    /// that ends sooner records each job's start and outcome in one statement (the `running`
    /// event keeps the time the job began), saving a write of every job; meanwhile its jobs
    /// read as waiting. 0: record every start before the batch runs.
    #[arg(long, env = "TERN_RECORD_START_AFTER_MS", default_value_t = runner::RECORD_START_AFTER_DEFAULT.as_millis() as u64)]
    record_start_after_ms: u64,
    /// Largest input file (bytes) a job may bring by URL or upload.
    #[arg(long, env = "TERN_MAX_FILE_BYTES", default_value_t = 512 * 1024 * 1024)]
    max_file_bytes: u64,
    /// Folder of model weights (filled by scripts/models.sh).
    #[arg(long, env = "TERN_MODELS_DIR", default_value = "~/.cache/tern/models")]
    models_dir: String,
    /// Where `GET /metrics` (Prometheus) listens; `off` for nowhere. A port in use is logged
    /// and skipped, so several workers on one host need their own.
    #[arg(long, env = "TERN_METRICS_ADDR", default_value = "0.0.0.0:9464")]
    metrics_addr: String,
    #[command(flatten)]
    services: ServiceArgs,
}

/// `~/x` -> `$HOME/x`, so the default works without a shell.
fn expand_home(path: &str) -> std::path::PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => std::path::PathBuf::from(home).join(rest),
        _ => path.into(),
    }
}

/// What this worker does to run faster or leaner, as the admin's system view lists it.
fn optimisations(cli: &Cli) -> Vec<String> {
    let mut out = vec!["mimalloc allocator, freed memory kept".to_string(), "batches sized by cost and memory budget".into()];
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma") {
        out.push("AVX-512 kernels".into());
    } else if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        out.push("AVX2/FMA kernels".into());
    }
    if cli.device.is_cpu() {
        out.push("LLM weights requantised Q4_1 -> Q8_0 for SIMD".into());
    }
    out.push(match cli.whisper_padding {
        tern_models::whisper::Padding::Full => "whisper: full 30 s windows".into(),
        tern_models::whisper::Padding::Trimmed { margin_seconds } => {
            format!("whisper: padding trimmed to {margin_seconds} s, masked batched decoding")
        }
    });
    out
}

/// First wait between tries to reach a backing service at start-up; it doubles after each
/// failure up to [`START_RETRY_MAX`].
const START_RETRY_FIRST: Duration = Duration::from_millis(250);
const START_RETRY_MAX: Duration = Duration::from_secs(10);

/// Tries `attempt` until it succeeds, logging each failure and waiting longer after each (from
/// [`START_RETRY_FIRST`] up to [`START_RETRY_MAX`]): a worker started while Postgres, Redis or
/// S3 is briefly unreachable waits for it, as it does once running, instead of exiting into a
/// supervisor's restart loop. SIGTERM or Ctrl-C ends the wait (and the worker).
async fn wait_for<T, E, F>(service: &str, mut attempt: impl FnMut() -> F) -> anyhow::Result<T>
where
    E: std::fmt::Display,
    F: std::future::Future<Output = Result<T, E>>,
{
    let (started, mut delay, mut failures) = (std::time::Instant::now(), START_RETRY_FIRST, 0u32);
    loop {
        match attempt().await {
            Ok(value) => {
                if failures > 0 {
                    tracing::info!(service, waited_ms = started.elapsed().as_millis() as u64, "reached {service}");
                }
                return Ok(value);
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(service, error = %e, failures, retry_in_ms = delay.as_millis() as u64, "waiting for {service}: not reachable yet");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown_signal() => anyhow::bail!("stopped while waiting for {service}"),
                }
                delay = (delay * 2).min(START_RETRY_MAX);
            }
        }
    }
}

/// How often the worker writes its row in `workers` (and learns whether to drain).
const REGISTRY_INTERVAL: Duration = Duration::from_secs(2);

fn host_name() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "worker".into())
}

fn default_worker_id() -> String {
    let host = host_name();
    let suffix = uuid::Uuid::now_v7().simple().to_string();
    format!("{host}-{}-{}", std::process::id(), &suffix[suffix.len() - 6..])
}

fn main() -> anyhow::Result<()> {
    let matches = family_settings::declare(Cli::command()).get_matches();
    // These change process-wide settings, so they run before the runtime starts its threads.
    for (variable, value) in family_settings::load_settings_from_flags(&matches) {
        std::env::set_var(variable, value);
    }
    tern_models::allocator::keep_freed_memory();
    tern_models::cpu_threads::settle_thread_count();
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(matches))
}

async fn run(matches: clap::ArgMatches) -> anyhow::Result<()> {
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let (defaults, configured_budgets) = family_settings::read(&matches);
    tern_jobs::logging::init(&cli.services.log);
    let kinds: Vec<JobKind> = if cli.kinds.is_empty() {
        JobKind::ALL.to_vec()
    } else {
        cli.kinds
            .iter()
            .map(|k| k.trim().parse().map_err(|()| anyhow::anyhow!("unknown job kind {k:?}")))
            .collect::<anyhow::Result<_>>()?
    };
    let worker_id = cli.worker_id.clone().unwrap_or_else(default_worker_id);
    let database = &cli.services.database;
    let store = wait_for("Postgres", || Store::connect_for_batches(&database.database_url, database.database_max_connections)).await?;
    let queue = cli.services.queue.connect().context("configuring Redis")?;
    wait_for("Redis", || queue.ping()).await?;
    let objects = ObjectStore::new(&cli.services.s3.settings());
    wait_for("the S3 bucket", || objects.ensure_bucket()).await?;

    // A worker starting after a swap runs the active versions from its first job.
    let active = model_swap::active_at_start(&store, &kinds).await;
    let mut names = defaults.clone();
    for (kind, target) in &active {
        if let Some(family) = engine::cache::Family::of_kind(*kind) {
            names.replace(family, target.model.clone());
        }
    }
    let registry = Arc::new(registry::Registry {
        store: store.clone(),
        worker_id: worker_id.clone(),
        host: host_name(),
        kinds: kinds.clone(),
        device: match &cli.device {
            d if d.is_cuda() => "cuda".into(),
            d if d.is_metal() => "metal".into(),
            _ => "cpu".into(),
        },
        draining: Default::default(),
        in_hand: Default::default(),
        done: Default::default(),
        optimisations: optimisations(&cli),
    });
    let runner = Arc::new(Runner {
        settings: RunnerSettings {
            worker_id: worker_id.clone(),
            kinds: kinds.clone(),
            batch_size: cli.batch_size.map(|n| n.max(1)),
            batch_budget: cli.batch_budget.unwrap_or(cli.batch_size.unwrap_or(runner::DEFAULT_BATCH_SIZE) as i64).max(1),
            heartbeat: Duration::from_millis(cli.heartbeat_ms.max(10)),
            idle_poll_max: Duration::from_millis(cli.idle_poll_max_ms.max(1)),
            retry: cli.services.queue.retry_policy(),
            max_audio_seconds: cli.services.max_audio_seconds,
            whisper_padding: cli.whisper_padding,
            whisper_feature_padding: cli.whisper_feature_padding,
            whisper_beam_size: cli.whisper_beam_size as usize,
            output_in_postgres_max_bytes: cli.output_in_postgres_max_bytes,
            record_start_after: Duration::from_millis(cli.record_start_after_ms),
        },
        store,
        queue,
        objects: objects.clone(),
        files: file_fetch::FileFetcher {
            objects,
            http: tern_jobs::egress::client(cli.services.allow_private_urls, file_fetch::URL_FETCH_TIMEOUT),
            allow_private: cli.services.allow_private_urls,
            max_bytes: cli.max_file_bytes,
        },
        uploads: tokio::sync::Semaphore::new(cli.upload_concurrency.max(1)),
        wake: Arc::new(tokio::sync::Notify::new()),
        registry: registry.clone(),
        engine: kinds.iter().any(|k| *k != JobKind::Echo).then(|| {
            let budget = cli.memory_budget.unwrap_or_else(|| resources::default_budget(&cli.device));
            tracing::info!(memory_budget = budget, device = ?cli.device, precision = %cli.precision, cpu_bf16_products = tern_models::precision::Precision::cpu_bf16_kernel().unwrap_or("none"), "models run here");
            Arc::new(engine::Engine::start(
                expand_home(&cli.models_dir),
                cli.device.clone(),
                cli.precision,
                names,
                budget,
                engine::BatchLimits { configured: configured_budgets, whisper_beams: cli.whisper_beam_size as usize },
                engine::memory::MemoryProbe::for_device(&cli.device, cli.memory_precheck),
            ))
        }),
    });

    // The recorder goes in before the first pull: counters recorded earlier would be lost.
    tern_jobs::prometheus::install();
    if cli.metrics_addr != "off" {
        let addr: std::net::SocketAddr = cli.metrics_addr.parse().context("TERN_METRICS_ADDR: expected HOST:PORT or off")?;
        // Bound before the first pull, so /metrics answers once jobs can run.
        if let Some(listener) = metrics_server::bind(addr).await {
            tokio::spawn(metrics_server::serve(listener, runner.engine.clone()));
        }
    }

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let (abort_tx, abort_rx) = tokio::sync::watch::channel(false);
    // The row is marked stopped after the batches in hand finish, not at the signal.
    let (registry_stop_tx, registry_stop_rx) = tokio::sync::watch::channel(false);
    let registry_task = tokio::spawn(registry.run(runner.engine.clone(), REGISTRY_INTERVAL, registry_stop_rx));
    if let Some(engine) = &runner.engine {
        let swapped = model_swap::swapped_kinds(&kinds);
        let swapper = model_swap::Swapper {
            store: runner.store.clone(),
            engine: engine.clone(),
            worker_id: worker_id.clone(),
            current: swapped.iter().map(|k| (*k, active.get(k).map(|t| t.version))).collect(),
            kinds: swapped,
            defaults,
            failed: Default::default(),
        };
        tokio::spawn(swapper.run(REGISTRY_INTERVAL, shutdown_rx.clone()));
    }
    tokio::spawn(wakeup::listen(runner.queue.clone(), kinds.clone(), runner.wake.clone(), shutdown_rx.clone()));
    let loops: Vec<_> = (0..cli.concurrency.max(1))
        .map(|_| tokio::spawn(runner.clone().run_loop(shutdown_rx.clone(), abort_rx.clone())))
        .collect();
    tracing::info!(worker_id = %worker_id, kinds = ?kinds, batch_size = ?cli.batch_size, concurrency = cli.concurrency, "tern-worker ready");

    shutdown_signal().await;
    tracing::info!(grace_ms = cli.shutdown_grace_ms, "stopping: no more pulls; finishing the batches in hand");
    let _ = shutdown_tx.send(true);
    let grace = Duration::from_millis(cli.shutdown_grace_ms);
    let all = futures::future::join_all(loops);
    tokio::pin!(all);
    tokio::select! {
        _ = &mut all => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!("grace period over: handing the jobs in hand back to the queue");
            let _ = abort_tx.send(true);
            all.await;
        }
    }
    let _ = registry_stop_tx.send(true);
    let _ = registry_task.await;
    if let Some(engine) = &runner.engine {
        let report = engine.report.lock().expect("not poisoned").clone();
        tracing::info!(hits = report.hits, misses = report.misses, evictions = report.evictions, load_failures = report.load_failures, "model cache at exit");
    }
    tracing::info!("tern-worker stopped");
    Ok(())
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
