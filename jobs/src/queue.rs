//! The Redis side of tern: what waits and what is leased. One atomic Lua script per operation
//! (`queue/*.lua`, each headed by its KEYS and ARGV). All keys of a kind share a hash tag
//! (`{prefix}:{kind}:…` with the kind in braces), so every script touches one cluster slot;
//! each script gets that base as its one key and names the rest from it.
//!
//! Within a priority, tenants share a kind's workers by weighted fair queueing on job cost
//! (`queue/fair.lua`): a tenant with 100,000 jobs waiting does not hold back another's 20.
//!
//! On a Redis Cluster (`TERN_REDIS_CLUSTER`) a kind's keys sit on one node. A hot kind can be
//! spread over [`QueueSettings::shards`] shards, each with keys of its own hash tag
//! (`{kind:n}`): a job's shard follows from its id, so every operation on one job goes to one
//! shard, and workers pull the shards in turn. Priority, aging and tenants' shares then hold
//! within each shard.

mod connection;

use crate::{JobKind, Priority, Result};
use chrono::{DateTime, Utc};
use connection::{Conn, Redis, Subscribers};
use redis::{AsyncCommands, Script};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
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

/// Default for [`QueueSettings::shards`].
pub const SHARDS_DEFAULT: u16 = 1;
/// Most shards a kind may be spread over.
pub const SHARDS_MAX: u16 = 64;
/// How long a wake-up hint may take: it is only a hint, and on a cluster whose node is failing
/// over it would otherwise hold the enqueue that sends it for the whole failover.
const WAKE_TIMEOUT: Duration = Duration::from_millis(250);

/// Queue tuning shared by the API, the workers and the background services.
#[derive(Debug, Clone, Copy)]
pub struct QueueSettings {
    /// How long a pulled job stays leased without a heartbeat. Default 30 s.
    pub lease: Duration,
    /// How much waiting raises a job by one priority level. Default 10 min: a low job that
    /// waited 10 minutes outranks newly arrived normal jobs.
    pub aging_step: Duration,
    /// Shards each kind's queue is spread over, 1 to [`SHARDS_MAX`]; default 1. Every process
    /// of a deployment must use the same number. More shards spread a kind over a cluster's
    /// nodes, at the price of priority, aging and tenants' shares holding within each shard
    /// only, a tenant's cap applying per shard (split evenly, rounded up), and an idle pull
    /// asking every shard.
    pub shards: u16,
}

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings { lease: Duration::from_secs(30), aging_step: Duration::from_secs(600), shards: SHARDS_DEFAULT }
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
    redis: Redis,
    /// For the wake-up subscription, which needs a connection of its own.
    subscribers: Arc<Subscribers>,
    prefix: String,
    pub settings: QueueSettings,
    /// The shard the next pull of a kind starts at: pulls take the shards in turn.
    turn: Arc<AtomicUsize>,
}

impl Queue {
    /// Connects to one Redis server through a pool of at most `pool_size` connections; keys
    /// start with `prefix`. Nothing is dialled until the first call.
    pub fn connect(url: &str, prefix: &str, pool_size: usize, settings: QueueSettings) -> Result<Queue> {
        Self::open(url, false, prefix, pool_size, settings)
    }

    /// Connects to a Redis Cluster through `url`'s seed nodes (comma-separated URLs, any of
    /// its nodes), following its redirects and failovers. Nothing is dialled until the first
    /// call.
    pub fn connect_cluster(url: &str, prefix: &str, settings: QueueSettings) -> Result<Queue> {
        Self::open(url, true, prefix, 1, settings)
    }

    fn open(url: &str, cluster: bool, prefix: &str, pool_size: usize, settings: QueueSettings) -> Result<Queue> {
        if !(1..=SHARDS_MAX).contains(&settings.shards) {
            return Err(crate::Error::Other(format!("queue shards must be 1 to {SHARDS_MAX}, not {}", settings.shards)));
        }
        if !cluster && connection::seeds(url).len() != 1 {
            return Err(crate::Error::Other(format!("one Redis URL without a cluster, not {url:?}")));
        }
        Ok(Queue {
            redis: Redis::open(url, cluster, pool_size)?,
            subscribers: Arc::new(Subscribers::open(url)?),
            prefix: prefix.to_string(),
            settings,
            turn: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Whether this queue is on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.redis.is_cluster()
    }

    fn shards(&self) -> u16 {
        self.settings.shards
    }

    /// The shard of the job `id`: fixed by the id's random bits, so every process finds it.
    pub fn shard_of(&self, id: Uuid) -> u16 {
        (id.as_u128() as u64 % u64::from(self.shards())) as u16
    }

    /// The channel on which Redis announces that `kind` has jobs ready.
    fn wake_channel(&self, kind: JobKind) -> String {
        format!("{}:wake:{}", self.prefix, kind.as_str())
    }

    /// Tells idle workers of `kind` that jobs are ready, so they pull now instead of at their
    /// next poll. A hint only: a lost one costs one poll interval, never a job.
    async fn wake(&self, c: &mut Conn, kind: JobKind) {
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(self.wake_channel(kind)).arg(1);
        match tokio::time::timeout(WAKE_TIMEOUT, publish.query_async::<i64>(c)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "wake-up hint not sent"),
            Err(_) => tracing::debug!("wake-up hint timed out"),
        }
    }

    /// Wake-up hints for `kinds`: the stream yields a kind each time jobs of it became ready
    /// (enqueued, restored, released). It ends when the connection drops; subscribe again.
    pub async fn wakeups(&self, kinds: &[JobKind]) -> Result<impl futures::Stream<Item = JobKind> + Send + use<>> {
        let mut pubsub = self.subscribers.next().get_async_pubsub().await?;
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

    async fn conn(&self) -> Result<Conn> {
        self.redis.conn().await
    }

    /// The base every key of `kind`'s `shard` hangs off, its hash tag in braces:
    /// `{prefix}:{kind}` for shard 0 (as before shards existed), `{prefix}:{kind:n}` for the
    /// others.
    fn base(&self, kind: JobKind, shard: u16) -> String {
        match shard {
            0 => format!("{}:{{{}}}", self.prefix, kind.as_str()),
            n => format!("{}:{{{}:{n}}}", self.prefix, kind.as_str()),
        }
    }

    fn key(&self, kind: JobKind, shard: u16, name: &str) -> String {
        format!("{}:{name}", self.base(kind, shard))
    }

    fn all_shards(&self) -> std::ops::Range<u16> {
        0..self.shards()
    }

    /// `items` grouped by the shard of each one's job id, each group in `items`' order, with
    /// each item's index in `items`.
    fn by_shard<'a, T>(&self, items: &'a [T], id: impl Fn(&T) -> Uuid) -> Vec<(u16, Vec<(usize, &'a T)>)> {
        let mut groups: Vec<Vec<(usize, &T)>> = (0..self.shards()).map(|_| Vec::new()).collect();
        for (i, item) in items.iter().enumerate() {
            groups[usize::from(self.shard_of(id(item)))].push((i, item));
        }
        groups.into_iter().enumerate().filter(|(_, g)| !g.is_empty()).map(|(s, g)| (s as u16, g)).collect()
    }

    fn lease_ms(&self) -> u64 {
        self.settings.lease.as_millis() as u64
    }

    fn aging_ms(&self) -> u64 {
        self.settings.aging_step.as_millis() as u64
    }

    pub async fn ping(&self) -> Result<()> {
        let mut c = self.conn().await?;
        let _: String = redis::cmd("PING").query_async(&mut c).await?;
        Ok(())
    }

    /// Adds jobs to their ready (or delayed) sets. Harmless for jobs already there or leased.
    pub async fn enqueue(&self, jobs: &[Enqueue]) -> Result<()> {
        let mut c = self.conn().await?;
        for kind in JobKind::ALL {
            let of_kind: Vec<&Enqueue> = jobs.iter().filter(|j| j.kind == *kind).collect();
            let mut added = 0;
            for (shard, group) in self.by_shard(&of_kind, |j| j.id) {
                for chunk in group.chunks(CHUNK) {
                    let mut inv = ENQUEUE.prepare_invoke();
                    inv.key(self.base(*kind, shard)).arg(self.aging_ms());
                    for (_, j) in chunk {
                        inv.arg(j.id.to_string())
                            .arg(j.priority.rank())
                            .arg(j.cost)
                            .arg(&j.tenant)
                            .arg(j.run_at.map_or(0, |t| t.timestamp_millis()));
                    }
                    let n: i64 = inv.invoke_async(&mut c).await?;
                    added += n;
                }
            }
            if added > 0 {
                self.wake(&mut c, *kind).await;
            }
        }
        Ok(())
    }

    /// Leases up to `max_jobs` jobs of `kind` whose summed cost fits `budget` (the first job is
    /// taken whatever its cost). Empty when nothing is ready or the kind is paused. With
    /// several shards, each pull starts at the next shard and goes on to the others while
    /// jobs and budget are left.
    pub async fn pull(&self, kind: JobKind, max_jobs: usize, budget: i64) -> Result<Vec<Lease>> {
        let mut c = self.conn().await?;
        let shards = self.shards();
        let first = (self.turn.fetch_add(1, Ordering::Relaxed) % usize::from(shards)) as u16;
        let mut leases: Vec<Lease> = Vec::new();
        for i in 0..shards {
            let shard = (first + i) % shards;
            let spent: i64 = leases.iter().map(|l| l.cost).sum();
            if leases.len() >= max_jobs || (!leases.is_empty() && spent >= budget) {
                break;
            }
            let flat: Vec<String> = PULL
                .key(self.base(kind, shard))
                .arg(max_jobs - leases.len())
                .arg(if leases.is_empty() { budget } else { budget - spent })
                .arg(self.lease_ms())
                .arg(self.aging_ms())
                .invoke_async(&mut c)
                .await?;
            for t in flat.chunks_exact(3) {
                leases.push(Lease {
                    id: parse_uuid(&t[0])?,
                    token: t[1].parse().map_err(|_| bad_reply("token", &t[1]))?,
                    cost: t[2].parse().map_err(|_| bad_reply("cost", &t[2]))?,
                });
            }
        }
        Ok(leases)
    }

    /// Extends leases; returns each one's status, in order.
    pub async fn heartbeat(&self, kind: JobKind, leases: &[(Uuid, i64)]) -> Result<Vec<LeaseStatus>> {
        let mut c = self.conn().await?;
        let mut out = vec![LeaseStatus::Lost; leases.len()];
        for (shard, group) in self.by_shard(leases, |l| l.0) {
            for chunk in group.chunks(CHUNK) {
                let mut inv = HEARTBEAT.prepare_invoke();
                inv.key(self.base(kind, shard)).arg(self.lease_ms());
                for (_, (id, token)) in chunk {
                    inv.arg(id.to_string()).arg(*token);
                }
                let codes: Vec<i64> = inv.invoke_async(&mut c).await?;
                for ((i, _), code) in chunk.iter().zip(codes) {
                    out[*i] = match code {
                        0 => LeaseStatus::Held,
                        2 => LeaseStatus::CancelRequested,
                        3 => LeaseStatus::Unconfirmed,
                        _ => LeaseStatus::Lost,
                    };
                }
            }
        }
        Ok(out)
    }

    /// Clears leases after Postgres settled their jobs.
    pub async fn settle(&self, kind: JobKind, items: &[(Uuid, i64, SettleAction)]) -> Result<()> {
        let mut c = self.conn().await?;
        let now = Utc::now();
        let due_now = items.iter().any(|(_, _, a)| matches!(a, SettleAction::At(t) if *t <= now));
        for (shard, group) in self.by_shard(items, |i| i.0) {
            for chunk in group.chunks(CHUNK) {
                let mut inv = SETTLE.prepare_invoke();
                inv.key(self.base(kind, shard));
                for (_, (id, token, action)) in chunk {
                    let action = match action {
                        SettleAction::Done => "done".to_string(),
                        SettleAction::At(t) => format!("at:{}", t.timestamp_millis()),
                        SettleAction::Drop => "drop".to_string(),
                    };
                    inv.arg(id.to_string()).arg(*token).arg(action);
                }
                let _: i64 = inv.invoke_async(&mut c).await?;
            }
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
        let mut out = Vec::new();
        for shard in self.all_shards() {
            let ids: Vec<String> = c.smembers(self.key(kind, shard, "canceled")).await?;
            for id in &ids {
                out.push(parse_uuid(id)?);
            }
        }
        Ok(out)
    }

    /// Flags `add` for their workers to cancel and drops the flags of `remove`.
    pub async fn set_canceled(&self, kind: JobKind, add: &[Uuid], remove: &[Uuid]) -> Result<()> {
        let mut c = self.conn().await?;
        for (shard, group) in self.by_shard(add, |id| *id) {
            let ids: Vec<String> = group.iter().map(|(_, id)| id.to_string()).collect();
            let _: () = c.sadd(self.key(kind, shard, "canceled"), ids).await?;
        }
        for (shard, group) in self.by_shard(remove, |id| *id) {
            let ids: Vec<String> = group.iter().map(|(_, id)| id.to_string()).collect();
            let _: () = c.srem(self.key(kind, shard, "canceled"), ids).await?;
        }
        Ok(())
    }

    /// Makes a delayed job due now (the next pull promotes it); a job not delayed is left as
    /// it is.
    pub async fn run_now(&self, kind: JobKind, id: Uuid) -> Result<()> {
        let mut c = self.conn().await?;
        let key = self.key(kind, self.shard_of(id), "delayed");
        let _: i64 = redis::cmd("ZADD").arg(key).arg("XX").arg(0).arg(id.to_string()).query_async(&mut c).await?;
        self.wake(&mut c, kind).await;
        Ok(())
    }

    /// Removes a canceled waiting job, or flags a running one for its worker.
    pub async fn cancel(&self, kind: JobKind, id: Uuid, running: bool) -> Result<()> {
        let mut c = self.conn().await?;
        let _: i64 = CANCEL
            .key(self.base(kind, self.shard_of(id)))
            .arg(id.to_string())
            .arg(if running { "running" } else { "waiting" })
            .invoke_async(&mut c)
            .await?;
        Ok(())
    }

    /// Takes up to `max` expired leases of `kind`: (job id, fencing token if known).
    pub async fn reap(&self, kind: JobKind, max: usize) -> Result<Vec<(Uuid, Option<i64>)>> {
        let mut c = self.conn().await?;
        let mut out = Vec::new();
        for shard in self.all_shards() {
            if out.len() >= max {
                break;
            }
            let flat: Vec<String> = REAP.key(self.base(kind, shard)).arg(max - out.len()).invoke_async(&mut c).await?;
            for p in flat.chunks_exact(2) {
                out.push((parse_uuid(&p[0])?, p[1].parse().ok()));
            }
        }
        Ok(out)
    }

    /// Restores jobs Redis does not know; `token` is set for running jobs. `after_loss`: Redis
    /// lost its data, so a waiting job may be one a live worker runs with its start not yet
    /// recorded; such jobs are held back one lease (`restore.lua`). Counts each tenant's
    /// running jobs again from the leases. Returns how many were missing.
    pub async fn restore(&self, kind: JobKind, jobs: &[(Enqueue, Option<i64>)], after_loss: bool) -> Result<u64> {
        let mut c = self.conn().await?;
        let mut restored = 0;
        for (shard, group) in self.by_shard(jobs, |(j, _)| j.id) {
            for chunk in group.chunks(CHUNK) {
                let mut inv = RESTORE.prepare_invoke();
                let hold = if after_loss { self.lease_ms() } else { 0 };
                inv.key(self.base(kind, shard)).arg(self.aging_ms()).arg(self.lease_ms()).arg(hold);
                for (_, (j, token)) in chunk {
                    inv.arg(j.id.to_string())
                        .arg(j.priority.rank())
                        .arg(j.cost)
                        .arg(&j.tenant)
                        .arg(j.run_at.map_or(0, |t| t.timestamp_millis()))
                        .arg(token.map(|t| t.to_string()).unwrap_or_default());
                }
                let n: u64 = inv.invoke_async(&mut c).await?;
                restored += n;
            }
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
            .invoke_async(&mut c)
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
        let _: () = c.hset(self.key(kind, self.shard_of(id), "progress"), id.to_string(), v).await?;
        Ok(())
    }

    /// How far a running job got, if it reported any progress.
    pub async fn progress(&self, kind: JobKind, id: Uuid) -> Result<Option<Progress>> {
        let mut c = self.conn().await?;
        let v: Option<String> = c.hget(self.key(kind, self.shard_of(id), "progress"), id.to_string()).await?;
        Ok(v.and_then(|v| serde_json::from_str(&v).ok()))
    }

    /// Jobs of `kind` waiting: ready plus delayed.
    pub async fn depth(&self, kind: JobKind) -> Result<u64> {
        Ok(self.depth_by_shard(kind, true).await?.iter().sum())
    }

    /// Each shard's jobs of `kind` that are ready, and with `delayed` also those delayed.
    async fn depth_by_shard(&self, kind: JobKind, delayed: bool) -> Result<Vec<u64>> {
        let mut c = self.conn().await?;
        let mut out = Vec::with_capacity(usize::from(self.shards()));
        for shard in self.all_shards() {
            // One shard's keys share a slot, so a cluster sends the pipeline to one node.
            let mut pipe = redis::pipe();
            for rank in Priority::ALL.iter().map(|p| p.rank()) {
                pipe.zcard(self.key(kind, shard, &format!("ready:{rank}")));
            }
            if delayed {
                pipe.zcard(self.key(kind, shard, "delayed"));
            }
            let counts: Vec<u64> = pipe.query_async(&mut c).await?;
            out.push(counts.iter().sum());
        }
        Ok(out)
    }

    /// Stops workers pulling `kind` (its jobs still queue up) until [`Queue::resume`].
    pub async fn pause(&self, kind: JobKind) -> Result<()> {
        let mut c = self.conn().await?;
        for shard in self.all_shards() {
            let _: () = c.set(self.key(kind, shard, "paused"), 1).await?;
        }
        Ok(())
    }

    /// Lets workers pull `kind` again.
    pub async fn resume(&self, kind: JobKind) -> Result<()> {
        let mut c = self.conn().await?;
        for shard in self.all_shards() {
            let _: () = c.del(self.key(kind, shard, "paused")).await?;
        }
        Ok(())
    }

    /// Whether `kind` is paused: any of its shards (the reconciler sets them all alike).
    pub async fn is_paused(&self, kind: JobKind) -> Result<bool> {
        let mut c = self.conn().await?;
        for shard in self.all_shards() {
            if c.exists(self.key(kind, shard, "paused")).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// About how many ready jobs of its kind run before this one (0 = next), if it is ready:
    /// its tenant's jobs ahead of it, and the other tenants' that their weights let run
    /// meanwhile (`queue/position.lua`). With several shards, pulled in turn, each other shard
    /// adds as many of its ready jobs as this one has ahead of it, at most.
    pub async fn position(&self, kind: JobKind, id: Uuid) -> Result<Option<u64>> {
        let shard = self.shard_of(id);
        let mut c = self.conn().await?;
        let n: i64 = POSITION.key(self.base(kind, shard)).arg(id.to_string()).invoke_async(&mut c).await?;
        let Ok(ahead) = u64::try_from(n) else { return Ok(None) };
        if self.shards() == 1 {
            return Ok(Some(ahead));
        }
        let ready = self.depth_by_shard(kind, false).await?;
        let others: u64 = ready.iter().enumerate().filter(|(s, _)| *s != usize::from(shard)).map(|(_, &r)| r.min(ahead)).sum();
        Ok(Some(ahead + others))
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
            .query_async(&mut c)
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
    /// what was there; tenants not named get weight 1 and no cap. A cap is split evenly over
    /// the shards, rounded up.
    pub async fn set_shares(&self, shares: &[crate::tenants::TenantShare]) -> Result<()> {
        let mut c = self.conn().await?;
        let shards = i64::from(self.shards());
        for kind in JobKind::ALL {
            for shard in self.all_shards() {
                let (weights, caps) = (self.key(*kind, shard, "weights"), self.key(*kind, shard, "caps"));
                let mut pipe = redis::pipe();
                pipe.atomic().del(&weights).ignore().del(&caps).ignore();
                for s in shares {
                    if s.weight != crate::tenants::WEIGHT_DEFAULT {
                        pipe.hset(&weights, &s.tenant, s.weight).ignore();
                    }
                    if let Some(cap) = s.max_running {
                        pipe.hset(&caps, &s.tenant, (i64::from(cap) + shards - 1) / shards).ignore();
                    }
                }
                let () = pipe.query_async(&mut c).await?;
            }
        }
        Ok(())
    }

    /// The marker the reconciler sets after restoring Redis from Postgres; its absence means
    /// Redis lost its data (or never had any).
    pub async fn epoch(&self) -> Result<Option<String>> {
        let mut c = self.conn().await?;
        Ok(c.get(format!("{}:epoch", self.prefix)).await?)
    }

    /// The shards (of every kind) that lost their data since the reconciler last restored
    /// them: their `restored` marker is gone. On a cluster one node may lose its data (a
    /// primary restarted empty, a failover to a replica that had not caught up) while the
    /// others keep theirs, so each shard carries its own marker.
    pub async fn lost_shards(&self) -> Result<Vec<(JobKind, u16)>> {
        let mut c = self.conn().await?;
        let mut lost = Vec::new();
        for &kind in JobKind::ALL {
            for shard in self.all_shards() {
                if !c.exists::<_, bool>(self.key(kind, shard, "restored")).await? {
                    lost.push((kind, shard));
                }
            }
        }
        Ok(lost)
    }

    /// Marks each shard's keys as holding what Postgres holds (the reconciler, after a sweep):
    /// from then on a heartbeat for a lease Redis does not know is refused as lost, where
    /// before it is unconfirmed ([`LeaseStatus::Unconfirmed`]). The marker sits in the shard's
    /// own slot, so a loss of the shard's keys takes it too.
    pub async fn mark_restored(&self) -> Result<()> {
        let mut c = self.conn().await?;
        for kind in JobKind::ALL {
            for shard in self.all_shards() {
                let _: () = c.set(self.key(*kind, shard, "restored"), 1).await?;
            }
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
