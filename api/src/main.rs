//! `tern-api`: accepts jobs over HTTP, records them in Postgres, queues them in Redis, and runs
//! the background services that keep the queue honest (lease reaper, reconciler).

mod auth;
mod error;
mod extract;
mod job_watch;
mod middleware;
mod openai;
mod openapi;
mod output_links;
mod routes;
mod state;
mod submission;
mod webhooks;

use anyhow::Context;
use clap::{Parser, Subcommand};
use state::{AppState, Inner, Limits};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tern_jobs::config::ServiceArgs;
use tern_jobs::{ObjectStore, Reaper, Reconciler, Store};


// Many small JSON allocations per request (see Cargo.toml).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(name = "tern-api", version, about = "tern's HTTP API: submit, inspect and cancel inference jobs")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the API (the default).
    Serve,
    /// Apply database migrations and exit.
    Migrate,
    /// Manage API keys (the first admin key is made here).
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
}

#[derive(Subcommand, Debug)]
enum KeysAction {
    /// Create a key and print it (shown this once) on stdout.
    Create {
        /// The tenant the key acts for; its jobs are visible to its keys only.
        #[arg(long)]
        tenant: String,
        /// Scopes: jobs:write, jobs:read, admin. Repeat the flag or separate with commas.
        #[arg(long = "scope", value_delimiter = ',', required = true)]
        scopes: Vec<String>,
        /// A note to tell keys apart.
        #[arg(long)]
        name: Option<String>,
    },
    /// List keys (prefix, tenant, scopes, use), never their secrets.
    List,
    /// Revoke a key by id or prefix (`tern_XXXXXXXX`); it stops working at once.
    Revoke { key: String },
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "TERN_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Where clients reach this API (scheme, host, port), for the signed links to outputs kept
    /// in Postgres. Default: `http://` and the listen address (127.0.0.1 for an unspecified one).
    #[arg(long, env = "TERN_PUBLIC_URL")]
    public_url: Option<String>,
    /// Jobs of one kind that may wait before submissions get 503 `queue_full`.
    #[arg(long, env = "TERN_MAX_QUEUED", default_value_t = 1_000_000)]
    max_queued: u64,
    /// Largest request body in bytes (base64 files count: 10 MiB of file is ~13.4 MiB of body).
    #[arg(long, env = "TERN_MAX_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Largest audio file the OpenAI-compatible `/v1/audio/*` routes take in one multipart
    /// request, bytes (it is stored as an upload, then transcribed as any other).
    #[arg(long, env = "TERN_MAX_AUDIO_UPLOAD_BYTES", default_value_t = 512 * 1024 * 1024)]
    max_audio_upload_bytes: usize,
    /// Largest batch input file `POST /v1/files` takes, bytes (OpenAI's limit: 200 MiB).
    #[arg(long, env = "TERN_MAX_BATCH_FILE_BYTES", default_value_t = 200 * 1024 * 1024)]
    max_batch_file_bytes: usize,
    /// How often (ms) the batch runner looks for batches with work: files to validate, lines
    /// to submit, batches whose jobs all finished.
    #[arg(long, env = "TERN_BATCH_POLL_MS", default_value_t = 500)]
    batch_poll_ms: u64,
    /// How long (ms) a replica's claim on a batch it works on holds unless renewed (every few
    /// seconds while it works): how soon another replica takes over from one that died.
    #[arg(long, env = "TERN_BATCH_CLAIM_MS", default_value_t = 60_000)]
    batch_claim_ms: u64,
    /// Webhook signing secrets, comma-separated `whsec_<base64>` (Standard Webhooks); the first
    /// is current, all sign during a rotation. Unset: jobs cannot name a webhook.
    #[arg(long, env = "TERN_WEBHOOK_SECRETS", value_parser = webhooks::signature::Signer::parse, hide_env_values = true)]
    webhook_secrets: Option<webhooks::signature::Signer>,
    /// Delays (ms) before each webhook attempt: the first attempt, then each retry. Default: the
    /// Standard Webhooks schedule 0 s, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 14 h, 20 h, 24 h
    /// (retries jittered by 10%).
    #[arg(long, env = "TERN_WEBHOOK_SCHEDULE_MS", value_delimiter = ',')]
    webhook_schedule_ms: Vec<u64>,
    /// How often (ms) the webhook dispatcher looks for due deliveries when idle.
    #[arg(long, env = "TERN_WEBHOOK_POLL_MS", default_value_t = 200)]
    webhook_poll_ms: u64,
    /// Most webhook deliveries this process sends at once.
    #[arg(long, env = "TERN_WEBHOOK_CONCURRENCY", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    webhook_concurrency: u32,
    /// Most webhook deliveries this process sends at once to one URL: a receiver that hangs
    /// (up to the 15 s timeout) holds up only this many of its own deliveries.
    #[arg(long, env = "TERN_WEBHOOK_CONCURRENCY_PER_URL", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    webhook_concurrency_per_url: u32,
    /// Origins allowed to call the API from a browser (CORS), comma-separated, or `*`. Default:
    /// none (no CORS headers).
    #[arg(long, env = "TERN_CORS_ORIGINS", value_delimiter = ',')]
    cors_origins: Vec<String>,
    /// Requests per second each API key may make (token bucket in Redis, shared by replicas);
    /// 0 turns the limit off.
    #[arg(long, env = "TERN_RATE_LIMIT_PER_SEC", default_value_t = 200.0)]
    rate_limit_per_sec: f64,
    /// Requests a key may make at once after a quiet spell (the bucket size).
    #[arg(long, env = "TERN_RATE_LIMIT_BURST", default_value_t = 400.0)]
    rate_limit_burst: f64,
    /// Jobs one tenant may have waiting (queued, scheduled, retrying) before its submissions get
    /// 429 `tenant_queue_full`. Default: no cap.
    #[arg(long, env = "TERN_MAX_QUEUED_PER_TENANT")]
    max_queued_per_tenant: Option<i64>,
    /// Streams and waits (`GET /v1/jobs/{id}/stream`, `?wait=`, the OpenAI routes' answers)
    /// one API process holds open at once; one more gets 429 `too_many_streams`.
    #[arg(long, env = "TERN_MAX_STREAMS", default_value_t = 10_000)]
    max_streams: usize,
    /// Streams and waits one API key may hold open at once, per API process.
    #[arg(long, env = "TERN_MAX_STREAMS_PER_KEY", default_value_t = 1_000)]
    max_streams_per_key: usize,
    /// Longest a job's event stream stays open (seconds); the client then resumes it with
    /// `Last-Event-ID`, as EventSource does by itself.
    #[arg(long, env = "TERN_STREAM_MAX_SECONDS", default_value_t = 600)]
    stream_max_seconds: u64,
    /// Apply database migrations at start.
    #[arg(long, env = "TERN_MIGRATE", default_value_t = true, action = clap::ArgAction::Set)]
    migrate: bool,
    /// How often (ms) the reaper returns jobs whose lease expired.
    #[arg(long, env = "TERN_REAPER_INTERVAL_MS", default_value_t = 1_000)]
    reaper_interval_ms: u64,
    /// How often (ms) the reconciler restores Redis from Postgres.
    #[arg(long, env = "TERN_RECONCILE_INTERVAL_MS", default_value_t = 5_000)]
    reconcile_interval_ms: u64,
    /// How long (ms) a job's state must stand before a routine reconcile restores it.
    #[arg(long, env = "TERN_RECONCILE_GRACE_MS", default_value_t = 30_000)]
    reconcile_grace_ms: u64,
    #[command(flatten)]
    services: ServiceArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let args = cli.serve;
    tern_jobs::logging::init(&args.services.log);
    let store = Store::connect(&args.services.database.database_url, args.services.database.database_max_connections)
        .await
        .context("connecting to Postgres")?;
    if matches!(cli.command, Some(Command::Migrate)) {
        store.migrate().await.context("applying migrations")?;
        tracing::info!("migrations applied");
        return Ok(());
    }
    if let Some(Command::Keys { action }) = &cli.command {
        store.migrate().await.context("applying migrations")?;
        return keys_command(&tern_jobs::api_keys::ApiKeys { pool: store.pool().clone() }, action).await;
    }
    if args.migrate {
        store.migrate().await.context("applying migrations")?;
    }
    let queue = args.services.queue.connect().context("configuring Redis")?;
    let objects = ObjectStore::new(&args.services.s3.settings());
    objects.ensure_bucket().await.context("creating the S3 bucket")?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let owner = format!("api-{}", uuid::Uuid::now_v7());
    let reaper = Reaper { store: store.clone(), queue: queue.clone(), retry: args.services.queue.retry_policy() };
    let reaper_task = tokio::spawn(reaper.run(Duration::from_millis(args.reaper_interval_ms), stop_rx.clone()));
    let reconciler = Reconciler {
        store: store.clone(),
        queue: queue.clone(),
        grace: Duration::from_millis(args.reconcile_grace_ms),
        owner,
        cursor: Default::default(),
    };
    let reconciler_task =
        tokio::spawn(reconciler.run(Duration::from_millis(args.reconcile_interval_ms), stop_rx.clone()));

    let keys = tern_jobs::api_keys::ApiKeys { pool: store.pool().clone() };
    let public_url = args.public_url.clone().unwrap_or_else(|| {
        let mut at = args.listen;
        if at.ip().is_unspecified() {
            at.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        format!("http://{at}")
    });
    let output_links = output_links::OutputLinks::new(
        &args.services.s3.s3_secret_key,
        &public_url,
        Duration::from_secs(args.services.s3.presign_ttl_secs),
    );
    let watches = job_watch::JobWatches::start(
        store.pool().clone(),
        job_watch::WatchLimits { per_process: args.max_streams.max(1), per_key: args.max_streams_per_key.max(1) },
    );
    let state = AppState(Arc::new(Inner {
        store,
        queue,
        objects,
        limits: Limits {
            max_queued: args.max_queued,
            max_body_bytes: args.max_body_bytes,
            max_audio_upload_bytes: args.max_audio_upload_bytes,
            max_batch_file_bytes: args.max_batch_file_bytes,
            max_audio_seconds: args.services.max_audio_seconds,
            rate: (args.rate_limit_per_sec > 0.0).then_some(auth::RateLimit {
                per_second: args.rate_limit_per_sec,
                burst: args.rate_limit_burst.max(1.0),
            }),
            max_queued_per_tenant: args.max_queued_per_tenant,
        },
        keys,
        output_links,
        webhooks_enabled: args.webhook_secrets.is_some(),
        allow_private_urls: args.services.allow_private_urls,
        watches,
        stream_lifetime: Duration::from_secs(args.stream_max_seconds.max(1)),
    }));
    let dispatcher_task = {
        let signer = args.webhook_secrets.clone();
        let schedule = if args.webhook_schedule_ms.is_empty() {
            webhooks::DEFAULT_SCHEDULE_MS.to_vec()
        } else {
            args.webhook_schedule_ms.clone()
        };
        let dispatcher = webhooks::Dispatcher {
            state: state.clone(),
            signer,
            allow_private: args.services.allow_private_urls,
            // Redirects are not followed: a receiver must answer at the URL it registered.
            http: tern_jobs::egress::guarded_builder(args.services.allow_private_urls)
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("HTTP client"),
            schedule: schedule.into_iter().map(Duration::from_millis).collect(),
            poll: Duration::from_millis(args.webhook_poll_ms.max(10)),
            in_flight: args.webhook_concurrency as usize,
            per_url: args.webhook_concurrency_per_url as usize,
        };
        tokio::spawn(dispatcher.run(stop_rx.clone()))
    };
    let batch_task = {
        let runner = openai::batch::runner::Runner {
            state: state.clone(),
            owner: format!("api-{}", uuid::Uuid::now_v7()),
            poll: Duration::from_millis(args.batch_poll_ms.max(10)),
            claim: Duration::from_millis(args.batch_claim_ms.max(1_000)),
            input_cache: Default::default(),
        };
        tokio::spawn(runner.run(stop_rx.clone()))
    };
    tern_jobs::prometheus::install();
    let app = routes::router(state, middleware::Cors { origins: args.cors_origins.clone() });
    let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(listen = %args.listen, bucket = %args.services.s3.s3_bucket, "tern-api ready");
    axum::serve(listener, app).with_graceful_shutdown(shutdown_signal()).await?;
    let _ = stop_tx.send(true);
    let _ = tokio::join!(reaper_task, reconciler_task);
    let _ = dispatcher_task.await;
    let _ = batch_task.await;
    tracing::info!("tern-api stopped");
    Ok(())
}

async fn keys_command(keys: &tern_jobs::api_keys::ApiKeys, action: &KeysAction) -> anyhow::Result<()> {
    match action {
        KeysAction::Create { tenant, scopes, name } => {
            routes::admin::check_key_request(tenant, scopes).map_err(anyhow::Error::msg)?;
            let (info, key) = keys.create(tenant, scopes, name.as_deref()).await?;
            eprintln!("created {} for tenant {} with scopes {} (shown once; store it now):", info.prefix, info.tenant, info.scopes.join(","));
            println!("{key}");
        }
        KeysAction::List => {
            for k in keys.list().await? {
                println!(
                    "{}  tenant={}  scopes={}  created={}  last_used={}  {}{}",
                    k.prefix,
                    k.tenant,
                    k.scopes.join(","),
                    k.created_at.format("%Y-%m-%d %H:%M"),
                    k.last_used_at.map_or("never".into(), |t| t.format("%Y-%m-%d %H:%M").to_string()),
                    if k.revoked_at.is_some() { "REVOKED " } else { "" },
                    k.name.unwrap_or_default()
                );
            }
        }
        KeysAction::Revoke { key } => {
            anyhow::ensure!(keys.revoke(key).await?, "no API key {key}");
            eprintln!("revoked {key}");
        }
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}
