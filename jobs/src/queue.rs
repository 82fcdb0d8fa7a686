//! The Redis side of tern: what waits and what is leased. One atomic Lua script per operation
//! (`queue/*.lua`, each headed by its KEYS and ARGV). All keys of a kind share a hash tag
//! (`{prefix}:{kind}:…` with the kind in braces), so every script touches one cluster slot;
//! each script gets that base as its one key and names the rest from it.
//!
//! Within a priority, tenants share a kind's workers by weighted fair queueing on job cost
//! (`queue/fair.lua`): a tenant with 100,000 jobs waiting does not hold back another's 20.

use crate::{JobKind, Priority, Result};
use chrono::{DateTime, Utc};
use deadpool_redis::{Config as PoolConfig, Pool, Runtime};
use redis::{AsyncCommands, Script};
use std::sync::LazyLock;
use std::time::Duration;
use uuid::Uuid;

const CLOCK: &str = include_str!("queue/clock.lua");
const FAIR: &str = include_str!("queue/fair.lua");

fn script(body: &str) -> Script {
    Script::new(&format!("{CLOCK}\n{FAIR}\n{body}"))
}

static ENQUEUE: LazyLock<Script> = LazyLock::new(|| script(include_str!("queue/enqueue.lua")));
static PULL: LazyLock<Script> = LazyLock::new(|| script(include_str!("queue/pull.lua")));
static HEARTBEAT: LazyLock<Script> = LazyLock::new(|| script(include_str!("queue/heartbeat.lua")));
static SETTLE: LazyLock<Script> = LazyLock::new(|| script(include_str!("queue/settle.lua")));
static CANCEL: LazyLock<Script> = LazyLock::new(|| script(include_str!("queue/cancel.lua")));
static REAP: LazyLock<Script> = LazyLock::new(|| script(include_str!("queue/reap.lua")));
static RESTORE: LazyLock<Script> = LazyLock::new(|| script(include_str!("queue/restore.lua")));
static POSITION: LazyLock<Script> = LazyLock::new(|| script(include_str!("queue/position.lua")));
static RATE_LIMIT: LazyLock<Script> = LazyLock::new(|| script(include_str!("queue/rate_limit.lua")));

/// Most jobs passed to one script call; larger sets are sent in chunks so no script holds Redis
/// for long and no variable-length argument list grows without bound.
const CHUNK: usize = 500;

/// Queue tuning shared by the API, the workers and the background services.
#[derive(Debug, Clone, Copy)]
pub struct QueueSettings {
    /// How long a pulled job stays leased without a heartbeat. Default 30 s.
    pub lease: Duration,
    /// How much waiting raises a job by one priority level. Default 10 min: a low job that
    /// waited 10 minutes outranks newly arrived normal jobs.
    pub aging_step: Duration,
}

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings { lease: Duration::from_secs(30), aging_step: Duration::from_secs(600) }
    }
}

/// A job to put in its ready (or delayed) set.
#[derive(Debug, Clone)]
pub struct Enqueue {
    pub id: Uuid,
    pub kind: JobKind,
    pub priority: Priority,
    pub cost: i32,
    pub run_at: Option<DateTime<Utc>>,
    /// Whose share of the workers it runs in.
    pub tenant: String,
}

impl From<&crate::Job> for Enqueue {
    fn from(job: &crate::Job) -> Self {
        Enqueue {
            id: job.id,
            kind: job.kind,
            priority: job.priority,
            cost: job.cost,
            run_at: job.run_at,
            tenant: job.tenant.clone(),
        }
    }
}

impl From<&crate::store::ActiveJob> for Enqueue {
    fn from(job: &crate::store::ActiveJob) -> Self {
        Enqueue {
            id: job.id,
            kind: job.kind,
            priority: job.priority,
            cost: job.cost,
            run_at: job.run_at,
            tenant: job.tenant.clone(),
        }
    }
}

/// A job leased to a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub id: Uuid,
    /// Fencing token: Postgres accepts the job's outcome only under this token.
    pub token: i64,
    pub cost: i64,
}

/// What a heartbeat learned about one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStatus {
    Held,
    /// Another lease holds the job now: its outcome from this lease will be refused.
    Lost,
    /// Held, and the job was asked to cancel.
    CancelRequested,
    /// Redis lost its data and the reconciler has not put the leases back yet: keep working;
    /// the reconciler restores the lease with the token Postgres holds, and Postgres refuses
    /// an outcome whose token is not that one.
    Unconfirmed,
}

/// What to do with a lease's job in Redis after Postgres settled it.
#[derive(Debug, Clone, Copy)]
pub enum SettleAction {
    /// Finished for good.
    Done,
    /// Due again at this time.
    At(DateTime<Utc>),
    /// Postgres refused the lease: release it, keep the job.
    Drop,
}

/// How far a running job got, as GET shows it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    /// Units done: windows (transcribe) or tokens generated (generate).
    pub done: u64,
    /// Units in all (for generate: `max_tokens`, an upper bound).
    pub total: u64,
    /// The text generated so far (generate only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// Redis queue access. Cheap to clone.
#[derive(Clone)]
pub struct Queue {
    pool: Pool,
    /// For the wake-up subscription, which needs a connection of its own.
    client: redis::Client,
    prefix: String,
    pub settings: QueueSettings,
}

impl Queue {
    /// Connects a pool of at most `pool_size` connections; keys start with `prefix`.
    pub fn connect(url: &str, prefix: &str, pool_size: usize, settings: QueueSettings) -> Result<Queue> {
        let mut config = PoolConfig::from_url(url);
        config.pool = Some(deadpool_redis::PoolConfig::new(pool_size));
        let pool = config
            .create_pool(Some(Runtime::Tokio1))
            .map_err(|e| crate::Error::Other(format!("redis pool: {e}")))?;
        let client = redis::Client::open(url)?;
        Ok(Queue { pool, client, prefix: prefix.to_string(), settings })
    }

    /// The channel on which Redis announces that `kind` has jobs ready.
    fn wake_channel(&self, kind: JobKind) -> String {
        format!("{}:wake:{}", self.prefix, kind.as_str())
    }

    /// Tells idle workers of `kind` that jobs are ready, so they pull now instead of at their
    /// next poll. A hint only: a lost one costs one poll interval, never a job.
    async fn wake(&self, c: &mut deadpool_redis::Connection, kind: JobKind) {
        let sent: redis::RedisResult<i64> = redis::cmd("PUBLISH").arg(self.wake_channel(kind)).arg(1).query_async(&mut **c).await;
        if let Err(e) = sent {
            tracing::debug!(error = %e, "wake-up hint not sent");
        }
    }

    /// Wake-up hints for `kinds`: the stream yields a kind each time jobs of it became ready
    /// (enqueued, restored, released). It ends when the connection drops; subscribe again.
    pub async fn wakeups(&self, kinds: &[JobKind]) -> Result<impl futures::Stream<Item = JobKind> + Send + use<>> {
        let mut pubsub = self.client.get_async_pubsub().await?;
        let mut by_channel = std::collections::HashMap::new();
        for kind in kinds {
            let channel = self.wake_channel(*kind);
            pubsub.subscribe(&channel).await?;
            by_channel.insert(channel, *kind);
        }
        Ok(futures::StreamExt::filter_map(pubsub.into_on_message(), move |msg| {
            let kind = by_channel.get(msg.get_channel_name()).copied();
            std::future::ready(kind)
        }))
    }

    async fn conn(&self) -> Result<deadpool_redis::Connection> {
        Ok(self.pool.get().await?)
    }

    /// The base every key of `kind` hangs off: `{prefix}:{kind}` with the kind as hash tag.
    fn base(&self, kind: JobKind) -> String {
        format!("{}:{{{}}}", self.prefix, kind.as_str())
    }

    fn key(&self, kind: JobKind, name: &str) -> String {
        format!("{}:{name}", self.base(kind))
    }

    fn lease_ms(&self) -> u64 {
        self.settings.lease.as_millis() as u64
    }

    fn aging_ms(&self) -> u64 {
        self.settings.aging_step.as_millis() as u64
    }

    pub async fn ping(&self) -> Result<()> {
        let mut c = self.conn().await?;
        let _: String = redis::cmd("PING").query_async(&mut *c).await?;
        Ok(())
    }

    /// Adds jobs to their ready or delayed sets. Harmless for jobs already there or leased.
    pub async fn enqueue(&self, jobs: &[Enqueue]) -> Result<()> {
        let mut c = self.conn().await?;
        for kind in JobKind::ALL {
            let of_kind: Vec<&Enqueue> = jobs.iter().filter(|j| j.kind == *kind).collect();
            for chunk in of_kind.chunks(CHUNK) {
                let mut inv = ENQUEUE.prepare_invoke();
                inv.key(self.base(*kind)).arg(self.aging_ms());
                for j in chunk {
                    inv.arg(j.id.to_string())
                        .arg(j.priority.rank())
                        .arg(j.cost)
                        .arg(&j.tenant)
                        .arg(j.run_at.map_or(0, |t| t.timestamp_millis()));
                }
                let added: i64 = inv.invoke_async(&mut *c).await?;
                if added > 0 {
                    self.wake(&mut c, *kind).await;
                }
            }
        }
        Ok(())
    }

    /// Leases up to `max_jobs` jobs of `kind` whose summed cost fits `budget` (the first job is
    /// taken whatever its cost). Empty when nothing is ready or the kind is paused.
    pub async fn pull(&self, kind: JobKind, max_jobs: usize, budget: i64) -> Result<Vec<Lease>> {
        let mut c = self.conn().await?;
        let flat: Vec<String> = PULL
            .key(self.base(kind))
            .arg(max_jobs)
            .arg(budget)
            .arg(self.lease_ms())
            .arg(self.aging_ms())
            .invoke_async(&mut *c)
            .await?;
        flat.chunks_exact(3)
            .map(|t| {
                Ok(Lease {
                    id: parse_uuid(&t[0])?,
                    token: t[1].parse().map_err(|_| bad_reply("token", &t[1]))?,
                    cost: t[2].parse().map_err(|_| bad_reply("cost", &t[2]))?,
                })
            })
            .collect()
    }

    /// Extends leases; returns each one's status, in order.
    pub async fn heartbeat(&self, kind: JobKind, leases: &[(Uuid, i64)]) -> Result<Vec<LeaseStatus>> {
        let mut c = self.conn().await?;
        let mut out = Vec::with_capacity(leases.len());
        for chunk in leases.chunks(CHUNK) {
            let mut inv = HEARTBEAT.prepare_invoke();
            inv.key(self.base(kind)).arg(self.lease_ms());
            for (id, token) in chunk {
                inv.arg(id.to_string()).arg(*token);
            }
            let codes: Vec<i64> = inv.invoke_async(&mut *c).await?;
            out.extend(codes.into_iter().map(|code| match code {
                0 => LeaseStatus::Held,
                2 => LeaseStatus::CancelRequested,
                3 => LeaseStatus::Unconfirmed,
                _ => LeaseStatus::Lost,
            }));
        }
        Ok(out)
    }

    /// Clears leases after Postgres settled their jobs.
    pub async fn settle(&self, kind: JobKind, items: &[(Uuid, i64, SettleAction)]) -> Result<()> {
        let mut c = self.conn().await?;
        let now = Utc::now();
        let due_now = items.iter().any(|(_, _, a)| matches!(a, SettleAction::At(t) if *t <= now));
        for chunk in items.chunks(CHUNK) {
            let mut inv = SETTLE.prepare_invoke();
            inv.key(self.base(kind));
            for (id, token, action) in chunk {
                let action = match action {
                    SettleAction::Done => "done".to_string(),
                    SettleAction::At(t) => format!("at:{}", t.timestamp_millis()),
                    SettleAction::Drop => "drop".to_string(),
                };
                inv.arg(id.to_string()).arg(*token).arg(action);
            }
            let _: i64 = inv.invoke_async(&mut *c).await?;
        }
        if due_now {
            // Released or requeued jobs: another worker may take them at once.
            self.wake(&mut c, kind).await;
        }
        Ok(())
    }

    /// The running jobs of `kind` flagged for their workers to cancel.
    pub async fn canceled(&self, kind: JobKind) -> Result<Vec<Uuid>> {
        let mut c = self.conn().await?;
        let ids: Vec<String> = c.smembers(self.key(kind, "canceled")).await?;
        ids.iter().map(|s| parse_uuid(s)).collect()
    }

    /// Flags `add` for their workers to cancel and drops the flags of `remove`.
    pub async fn set_canceled(&self, kind: JobKind, add: &[Uuid], remove: &[Uuid]) -> Result<()> {
        let mut c = self.conn().await?;
        let key = self.key(kind, "canceled");
        if !add.is_empty() {
            let _: () = c
                .sadd(&key, add.iter().map(Uuid::to_string).collect::<Vec<_>>())
                .await?;
        }
        if !remove.is_empty() {
            let _: () = c
                .srem(&key, remove.iter().map(Uuid::to_string).collect::<Vec<_>>())
                .await?;
        }
        Ok(())
    }

    /// Makes a delayed job due now (the next pull promotes it); a job not delayed is left as
    /// it is.
    pub async fn run_now(&self, kind: JobKind, id: Uuid) -> Result<()> {
        let mut c = self.conn().await?;
        let _: i64 = redis::cmd("ZADD").arg(self.key(kind, "delayed")).arg("XX").arg(0).arg(id.to_string()).query_async(&mut *c).await?;
        self.wake(&mut c, kind).await;
        Ok(())
    }

    /// Removes a canceled waiting job, or flags a running one for its worker.
    pub async fn cancel(&self, kind: JobKind, id: Uuid, running: bool) -> Result<()> {
        let mut c = self.conn().await?;
        let _: i64 = CANCEL
            .key(self.base(kind))
            .arg(id.to_string())
            .arg(if running { "running" } else { "waiting" })
            .invoke_async(&mut *c)
            .await?;
        Ok(())
    }

    /// Takes up to `max` expired leases of `kind`: (job id, fencing token if known).
    pub async fn reap(&self, kind: JobKind, max: usize) -> Result<Vec<(Uuid, Option<i64>)>> {
        let mut c = self.conn().await?;
        let flat: Vec<String> = REAP
            .key(self.base(kind))
            .arg(max)
            .invoke_async(&mut *c)
            .await?;
        flat.chunks_exact(2).map(|p| Ok((parse_uuid(&p[0])?, p[1].parse().ok()))).collect()
    }

    /// Restores jobs Redis does not know; `token` is set for running jobs. Returns how many
    /// were missing.
    pub async fn restore(&self, kind: JobKind, jobs: &[(Enqueue, Option<i64>)]) -> Result<u64> {
        let mut c = self.conn().await?;
        let mut restored = 0;
        for chunk in jobs.chunks(CHUNK) {
            let mut inv = RESTORE.prepare_invoke();
            inv.key(self.base(kind)).arg(self.aging_ms()).arg(self.lease_ms());
            for (j, token) in chunk {
                inv.arg(j.id.to_string())
                    .arg(j.priority.rank())
                    .arg(j.cost)
                    .arg(&j.tenant)
                    .arg(j.run_at.map_or(0, |t| t.timestamp_millis()))
                    .arg(token.map(|t| t.to_string()).unwrap_or_default());
            }
            let n: u64 = inv.invoke_async(&mut *c).await?;
            restored += n;
        }
        if restored > 0 {
            self.wake(&mut c, kind).await;
        }
        Ok(restored)
    }

    /// Takes a token from `bucket`'s token bucket (`per_second` refill, `burst` size), shared by
    /// every process using this Redis. `None` when one was taken, else how long until one is.
    pub async fn take_token(&self, bucket: &str, per_second: f64, burst: f64) -> Result<Option<std::time::Duration>> {
        let mut c = self.conn().await?;
        let wait_ms: i64 = RATE_LIMIT
            .key(format!("{}:ratelimit:{bucket}", self.prefix))
            .arg(per_second)
            .arg(burst)
            .invoke_async(&mut *c)
            .await?;
        Ok((wait_ms > 0).then(|| std::time::Duration::from_millis(wait_ms as u64)))
    }

    /// Records how far a running job got (`done` of `total` units: windows, tokens).
    pub async fn set_progress(&self, kind: JobKind, id: Uuid, done: u64, total: u64) -> Result<()> {
        self.write_progress(kind, id, &Progress { done, total, text: None }).await
    }

    /// Records progress with the partial result so far (generated text).
    pub async fn set_progress_text(&self, kind: JobKind, id: Uuid, done: u64, total: u64, text: &str) -> Result<()> {
        self.write_progress(kind, id, &Progress { done, total, text: Some(text.to_string()) }).await
    }

    async fn write_progress(&self, kind: JobKind, id: Uuid, p: &Progress) -> Result<()> {
        let mut c = self.conn().await?;
        let v = serde_json::to_string(p).expect("progress serialises");
        let _: () = c.hset(self.key(kind, "progress"), id.to_string(), v).await?;
        Ok(())
    }

    /// How far a running job got, if it reported any progress.
    pub async fn progress(&self, kind: JobKind, id: Uuid) -> Result<Option<Progress>> {
        let mut c = self.conn().await?;
        let v: Option<String> = c.hget(self.key(kind, "progress"), id.to_string()).await?;
        Ok(v.and_then(|v| serde_json::from_str(&v).ok()))
    }

    /// Jobs of `kind` waiting: ready plus delayed.
    pub async fn depth(&self, kind: JobKind) -> Result<u64> {
        let mut c = self.conn().await?;
        let mut pipe = redis::pipe();
        for rank in Priority::ALL.iter().map(|p| p.rank()) {
            pipe.zcard(self.key(kind, &format!("ready:{rank}")));
        }
        let counts: Vec<u64> = pipe.zcard(self.key(kind, "delayed")).query_async(&mut *c).await?;
        Ok(counts.iter().sum())
    }

    /// Stops workers pulling `kind` (its jobs still queue up) until [`Queue::resume`].
    pub async fn pause(&self, kind: JobKind) -> Result<()> {
        let mut c = self.conn().await?;
        let _: () = c.set(self.key(kind, "paused"), 1).await?;
        Ok(())
    }

    /// Lets workers pull `kind` again.
    pub async fn resume(&self, kind: JobKind) -> Result<()> {
        let mut c = self.conn().await?;
        let _: () = c.del(self.key(kind, "paused")).await?;
        Ok(())
    }

    /// Whether `kind` is paused.
    pub async fn is_paused(&self, kind: JobKind) -> Result<bool> {
        let mut c = self.conn().await?;
        Ok(c.exists(self.key(kind, "paused")).await?)
    }

    /// About how many ready jobs of its kind run before this one (0 = next), if it is ready:
    /// its tenant's jobs ahead of it, and the other tenants' that their weights let run
    /// meanwhile (`queue/position.lua`).
    pub async fn position(&self, kind: JobKind, id: Uuid) -> Result<Option<u64>> {
        let mut c = self.conn().await?;
        let n: i64 = POSITION.key(self.base(kind)).arg(id.to_string()).invoke_async(&mut *c).await?;
        Ok(u64::try_from(n).ok())
    }

    /// Takes a short-lived lock (`SET NX PX`); true if this caller holds it now. Lets one of
    /// several API replicas run a periodic sweep.
    pub async fn try_lock(&self, name: &str, owner: &str, ttl: Duration) -> Result<bool> {
        let mut c = self.conn().await?;
        let key = format!("{}:lock:{name}", self.prefix);
        let got: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(owner)
            .arg("NX")
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .query_async(&mut *c)
            .await?;
        if got.is_some() {
            return Ok(true);
        }
        let holder: Option<String> = c.get(&key).await?;
        if holder.as_deref() == Some(owner) {
            let _: () = c.pexpire(&key, ttl.as_millis() as i64).await?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Sets every kind's copy of the tenants' shares (weights and caps) to `shares`, replacing
    /// what was there; tenants not named get weight 1 and no cap.
    pub async fn set_shares(&self, shares: &[crate::tenants::TenantShare]) -> Result<()> {
        let mut c = self.conn().await?;
        for kind in JobKind::ALL {
            let (weights, caps) = (self.key(*kind, "weights"), self.key(*kind, "caps"));
            let mut pipe = redis::pipe();
            pipe.atomic().del(&weights).ignore().del(&caps).ignore();
            for s in shares {
                if s.weight != crate::tenants::WEIGHT_DEFAULT {
                    pipe.hset(&weights, &s.tenant, s.weight).ignore();
                }
                if let Some(cap) = s.max_running {
                    pipe.hset(&caps, &s.tenant, cap).ignore();
                }
            }
            let () = pipe.query_async(&mut *c).await?;
        }
        Ok(())
    }

    /// The marker the reconciler sets after restoring Redis from Postgres; its absence means
    /// Redis lost its data (or never had any).
    pub async fn epoch(&self) -> Result<Option<String>> {
        let mut c = self.conn().await?;
        Ok(c.get(format!("{}:epoch", self.prefix)).await?)
    }

    /// Marks each kind's keys as holding what Postgres holds (the reconciler, after a sweep):
    /// from then on a heartbeat for a lease Redis does not know is refused as lost, where
    /// before it is unconfirmed ([`LeaseStatus::Unconfirmed`]). The marker sits in the kind's
    /// own slot, so a loss of the kind's keys takes it too.
    pub async fn mark_restored(&self) -> Result<()> {
        let mut c = self.conn().await?;
        for kind in JobKind::ALL {
            let _: () = c.set(self.key(*kind, "restored"), 1).await?;
        }
        Ok(())
    }

    pub async fn set_epoch(&self, value: &str) -> Result<()> {
        let mut c = self.conn().await?;
        let _: () = c.set(format!("{}:epoch", self.prefix), value).await?;
        Ok(())
    }
}

fn bad_reply(what: &str, value: &str) -> crate::Error {
    crate::Error::Other(format!("unexpected {what} {value:?} from a queue script"))
}

fn parse_uuid(s: &str) -> Result<Uuid> {
    Uuid::parse_str(s).map_err(|_| bad_reply("job id", s))
}
