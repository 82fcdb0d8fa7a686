//! A property test of the queue's Lua scripts against a real Redis (issue 20): random
//! interleavings of enqueue, pull, heartbeat, settle, reap, cancel, restore and loss of all
//! Redis data, driven against a model of what Postgres records, as the API, workers, reaper and
//! reconciler drive them. Jobs belong to three tenants with weights 3, 1 and 1, the last capped
//! at one running job, and have any priority. After every step:
//! - a job is in at most one of the ready, delayed and lease sets;
//! - a ready job is in its rank's set and in its tenant's set of that rank; a tenant takes
//!   turns in a rank exactly while it has jobs ready there; each tenant's count of running jobs
//!   is its number of leases;
//! - a pull never takes a capped tenant past its cap;
//! - fencing tokens only grow, across losses of Redis data too;
//! - a pulled job is one Postgres holds as waiting, never a finished or running one, nor one a
//!   live worker runs with its start not yet recorded (`TERN_RECORD_START_AFTER_MS`: such a
//!   worker records the start, settles the job, or is told its lease is lost and drops it
//!   within a lease; after a loss of Redis data the job it holds is handed out only a lease
//!   later);
//! - a finished job is in no set, and short of a loss of Redis data an unfinished one is always
//!   in one (a lease that expired before its job started puts the job back);
//! and after every reconciler sweep, nothing Postgres holds as waiting or running is missing.

use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tern_jobs::queue::{Enqueue, LeaseStatus, QueueSettings, SettleAction};
use tern_jobs::tenants::TenantShare;
use tern_jobs::{JobKind, Priority, Queue};
use uuid::Uuid;

const KIND: JobKind = JobKind::Echo;
/// Short, so leases expire within a run.
const LEASE_MS: u64 = 40;
const TENANTS: [&str; 3] = ["heavy", "light", "capped"];
const CAP: i64 = 1;

/// What Postgres records of a job, in this model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Recorded {
    Waiting,
    Running(i64),
    Finished,
}

/// xorshift64*: a seeded generator, so a failing seed replays.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

struct World {
    queue: Queue,
    prefix: String,
    redis: redis::aio::MultiplexedConnection,
    jobs: HashMap<Uuid, Recorded>,
    /// Each job's tenant and priority.
    owners: HashMap<Uuid, (&'static str, Priority)>,
    max_token: i64,
    rng: Rng,
    log: Vec<String>,
    /// Redis lost its data and no sweep has run since.
    lost: bool,
    /// Jobs a live worker runs with its start not yet recorded (Postgres holds them as
    /// waiting), its lease's token, and when it last heard from Redis (pulled or heartbeat).
    unrecorded: HashMap<Uuid, (i64, std::time::Instant)>,
}

impl World {
    fn key(&self, set: &str) -> String {
        format!("{}:{{{}}}:{set}", self.prefix, KIND.as_str())
    }

    async fn members(&mut self, set: &str) -> HashSet<Uuid> {
        let key = self.key(set);
        let ids: Vec<String> = redis::cmd("ZRANGE").arg(key).arg(0).arg(-1).query_async(&mut self.redis).await.unwrap();
        ids.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn job(&self, id: Uuid) -> Enqueue {
        let (tenant, priority) = self.owners[&id];
        Enqueue { id, kind: KIND, priority, cost: 1, run_at: None, tenant: tenant.into() }
    }

    async fn ready(&mut self) -> HashSet<Uuid> {
        let mut all = HashSet::new();
        for rank in 0..4 {
            all.extend(self.members(&format!("ready:{rank}")).await);
        }
        all
    }

    fn pick(&mut self, wanted: impl Fn(&Recorded) -> bool) -> Option<(Uuid, Recorded)> {
        let mut matching: Vec<(Uuid, Recorded)> = self.jobs.iter().filter(|(_, r)| wanted(r)).map(|(i, r)| (*i, *r)).collect();
        matching.sort_by_key(|(id, _)| *id);
        (!matching.is_empty()).then(|| matching[self.rng.below(matching.len())])
    }

    fn fail(&self, what: String) -> ! {
        panic!("{what}\nsteps:\n{}", self.log.join("\n"));
    }

    /// The reconciler's sweep: put back every unfinished job Postgres holds, then mark the
    /// kind restored.
    async fn sweep(&mut self) {
        let active: Vec<(Enqueue, Option<i64>)> = self
            .jobs
            .iter()
            .filter(|(_, r)| **r != Recorded::Finished)
            .map(|(id, r)| {
                let token = match r {
                    Recorded::Running(t) => Some(*t),
                    _ => None,
                };
                (self.job(*id), token)
            })
            .collect();
        self.queue.restore(KIND, &active, self.lost).await.unwrap();
        self.queue.set_shares(&shares()).await.unwrap();
        self.queue.mark_restored().await.unwrap();
        self.lost = false;
        let held: HashSet<Uuid> = [self.ready().await, self.members("delayed").await, self.members("leases").await]
            .into_iter()
            .flatten()
            .collect();
        for (id, r) in self.jobs.clone() {
            if r != Recorded::Finished && !held.contains(&id) {
                self.fail(format!("after a sweep, {id} ({r:?} in Postgres) is in no Redis set"));
            }
        }
    }

    async fn step(&mut self) {
        match self.rng.below(10) {
            0 | 1 => {
                let id = Uuid::now_v7();
                let (tenant, priority) = (TENANTS[self.rng.below(3)], Priority::ALL[self.rng.below(4)]);
                self.log.push(format!("enqueue {id} {tenant} {priority}"));
                self.jobs.insert(id, Recorded::Waiting);
                self.owners.insert(id, (tenant, priority));
                self.queue.enqueue(&[self.job(id)]).await.unwrap();
            }
            2 | 3 => {
                // A live worker heartbeats every half lease (as the worker's keeper does), so
                // one with an unrecorded start that has gone that long acts before any pull.
                let due: Vec<Uuid> = self
                    .unrecorded
                    .iter()
                    .filter(|(_, (_, since))| since.elapsed() >= Duration::from_millis(LEASE_MS / 2))
                    .map(|(id, _)| *id)
                    .collect();
                for id in due {
                    self.unrecorded_worker_acts(id).await;
                }
                let max = 1 + self.rng.below(3);
                let capped_running = self.running("capped").await;
                let leases = self.queue.pull(KIND, max, max as i64).await.unwrap();
                let capped_taken = leases.iter().filter(|l| self.owners[&l.id].0 == "capped").count() as i64;
                // (Until the sweep after a loss of Redis data puts the caps back, none holds.)
                if !self.lost && capped_taken > (CAP - capped_running).max(0) {
                    self.fail(format!("a pull took {capped_taken} jobs of a tenant capped at {CAP} with {capped_running} running"));
                }
                for lease in leases {
                    self.log.push(format!("pull {} token {}", lease.id, lease.token));
                    if lease.token <= self.max_token {
                        self.fail(format!("token {} issued after {}", lease.token, self.max_token));
                    }
                    self.max_token = lease.token;
                    // The worker's start: Postgres takes it only if it was waiting. One worker in
                    // eight dies between its pull and its start, leaving the job waiting.
                    if self.unrecorded.contains_key(&lease.id) {
                        self.fail(format!("pulled {} while a live worker runs it with its start unrecorded", lease.id));
                    }
                    match self.jobs.get(&lease.id).copied() {
                        Some(Recorded::Waiting) if self.rng.below(8) == 0 => self.log.push("  (its worker died)".into()),
                        // Runs it, recording the start later (or with its outcome).
                        Some(Recorded::Waiting) if self.rng.below(3) == 0 => {
                            self.log.push("  (start not recorded yet)".into());
                            self.unrecorded.insert(lease.id, (lease.token, std::time::Instant::now()));
                        }
                        Some(Recorded::Waiting) => {
                            self.jobs.insert(lease.id, Recorded::Running(lease.token));
                        }
                        other => self.fail(format!("pulled {} that Postgres holds as {other:?}", lease.id)),
                    }
                }
            }
            4 => {
                if let Some((id, Recorded::Running(token))) = self.pick(|r| matches!(r, Recorded::Running(_))) {
                    let status = self.queue.heartbeat(KIND, &[(id, token)]).await.unwrap();
                    self.log.push(format!("heartbeat {id} {token}: {status:?}"));
                }
            }
            5 => {
                if let Some((id, Recorded::Running(token))) = self.pick(|r| matches!(r, Recorded::Running(_))) {
                    // The worker settles in Postgres (under its token), then in Redis.
                    let retry = self.rng.below(3) == 0;
                    self.log.push(format!("settle {id} {token} retry={retry}"));
                    let action = if retry {
                        self.jobs.insert(id, Recorded::Waiting);
                        SettleAction::At(chrono::Utc::now())
                    } else {
                        self.jobs.insert(id, Recorded::Finished);
                        SettleAction::Done
                    };
                    self.queue.settle(KIND, &[(id, token, action)]).await.unwrap();
                }
            }
            6 => {
                // The reaper: expired leases under Postgres's token are retried; a lease whose
                // job Postgres still holds as waiting puts the job back.
                let expired = self.queue.reap(KIND, 100).await.unwrap();
                for (id, token) in expired {
                    self.log.push(format!("reap {id} {token:?}"));
                    match self.jobs.get(&id).copied() {
                        Some(Recorded::Running(t)) if Some(t) == token => {
                            self.jobs.insert(id, Recorded::Waiting);
                            self.queue.settle(KIND, &[(id, t, SettleAction::At(chrono::Utc::now()))]).await.unwrap();
                        }
                        Some(Recorded::Waiting) => {
                            // An unrecorded start's lease ran out: that worker stopped (it
                            // acts within a lease, so it is gone).
                            self.unrecorded.remove(&id);
                            self.queue.restore(KIND, &[(self.job(id), None)], false).await.unwrap();
                        }
                        _ => {}
                    }
                }
            }
            7 => {
                if let Some((id, _)) = self.pick(|r| *r == Recorded::Waiting) {
                    self.log.push(format!("cancel {id}"));
                    self.jobs.insert(id, Recorded::Finished);
                    self.queue.cancel(KIND, id, false).await.unwrap();
                }
            }
            8 => {
                if self.rng.below(4) == 0 {
                    self.log.push("redis loses its data".into());
                    tern_e2e::delete_redis_prefix(&self.prefix).await.unwrap();
                    self.lost = true;
                    // Before the sweep, a heartbeat is never told its lease is lost.
                    if let Some((id, Recorded::Running(token))) = self.pick(|r| matches!(r, Recorded::Running(_))) {
                        let status = self.queue.heartbeat(KIND, &[(id, token)]).await.unwrap();
                        if status != [LeaseStatus::Unconfirmed] {
                            self.fail(format!("a heartbeat after the loss answered {status:?}"));
                        }
                    }
                }
                self.log.push("sweep".into());
                self.sweep().await;
            }
            9 if self.rng.below(2) == 0 => {
                if let Some(&id) = self.unrecorded.keys().nth(self.rng.below(self.unrecorded.len().max(1))) {
                    self.unrecorded_worker_acts(id).await;
                }
            }
            _ => {
                // Within a lease, every worker with an unrecorded start has acted.
                for id in self.unrecorded.keys().copied().collect::<Vec<_>>() {
                    self.unrecorded_worker_acts(id).await;
                }
                self.log.push("time passes".into());
                tokio::time::sleep(Duration::from_millis(LEASE_MS + 5)).await;
            }
        }
        self.check().await;
    }

    /// A worker running `id` with its start unrecorded heartbeats, then drops the job if told
    /// its lease is lost, else records its start or settles it (the start recorded with the
    /// outcome); Postgres takes either only while it holds the job as waiting.
    async fn unrecorded_worker_acts(&mut self, id: Uuid) {
        let Some((token, _)) = self.unrecorded.remove(&id) else { return };
        let status = self.queue.heartbeat(KIND, &[(id, token)]).await.unwrap();
        self.log.push(format!("unrecorded {id} {token}: heartbeat {status:?}"));
        if status == [LeaseStatus::Lost] {
            self.log.push("  drops it".into());
            return;
        }
        if self.jobs.get(&id) != Some(&Recorded::Waiting) {
            self.log.push("  Postgres refuses it".into());
            return;
        }
        if self.rng.below(2) == 0 {
            self.log.push("  records its start".into());
            self.jobs.insert(id, Recorded::Running(token));
        } else {
            self.log.push("  settles it".into());
            self.jobs.insert(id, Recorded::Finished);
            self.queue.settle(KIND, &[(id, token, SettleAction::Done)]).await.unwrap();
        }
    }

    async fn running(&mut self, tenant: &str) -> i64 {
        let n: Option<i64> = redis::cmd("HGET").arg(self.key("running")).arg(tenant).query_async(&mut self.redis).await.unwrap();
        n.unwrap_or(0)
    }

    /// The per-tenant structures agree with the sets they index.
    async fn check_tenant_sets(&mut self) {
        for rank in 0..4u8 {
            let in_rank = self.members(&format!("ready:{rank}")).await;
            let turns = self.members_str(&format!("vt:{rank}")).await;
            let mut by_tenant = HashSet::new();
            for tenant in TENANTS {
                let own = self.members(&format!("tq:{rank}:{tenant}")).await;
                for id in &own {
                    if self.owners[id] != (tenant, Priority::ALL[rank as usize]) {
                        self.fail(format!("{id} of {:?} is in {tenant}'s set of rank {rank}", self.owners[id]));
                    }
                }
                if own.is_empty() == turns.contains(tenant) {
                    self.fail(format!("{tenant} has {} jobs ready in rank {rank}; in its turns: {}", own.len(), turns.contains(tenant)));
                }
                by_tenant.extend(own);
            }
            if by_tenant != in_rank {
                self.fail(format!("rank {rank}'s set and its tenants' sets differ: {:?}", by_tenant.symmetric_difference(&in_rank)));
            }
        }
        let leases = self.members("leases").await;
        for tenant in TENANTS {
            let leased = leases.iter().filter(|id| self.owners[id].0 == tenant).count() as i64;
            let counted = self.running(tenant).await;
            if leased != counted {
                self.fail(format!("{tenant} holds {leased} leases but its running count is {counted}"));
            }
        }
    }

    async fn members_str(&mut self, set: &str) -> HashSet<String> {
        let key = self.key(set);
        redis::cmd("ZRANGE").arg(key).arg(0).arg(-1).query_async(&mut self.redis).await.unwrap()
    }

    async fn check(&mut self) {
        let ready = self.ready().await;
        self.check_tenant_sets().await;
        let delayed = self.members("delayed").await;
        let leases = self.members("leases").await;
        for (a, b, names) in [(&ready, &delayed, "ready and delayed"), (&ready, &leases, "ready and leases"), (&delayed, &leases, "delayed and leases")] {
            if let Some(id) = a.intersection(b).next() {
                self.fail(format!("{id} is in both {names}"));
            }
        }
        for (id, r) in &self.jobs {
            let held = ready.contains(id) || delayed.contains(id) || leases.contains(id);
            if *r == Recorded::Finished && held {
                self.fail(format!("finished job {id} is still queued or leased"));
            }
            // Short of a loss of Redis data, no unfinished job ever drops out of Redis: one
            // whose lease expired is back once the reaper has run, not at the next sweep.
            if *r != Recorded::Finished && !held && !self.lost {
                self.fail(format!("{id} ({r:?} in Postgres) is in no Redis set"));
            }
        }
    }
}

fn shares() -> Vec<TenantShare> {
    vec![
        TenantShare { tenant: "heavy".into(), weight: 3, max_running: None },
        TenantShare { tenant: "capped".into(), weight: 1, max_running: Some(CAP as i32) },
    ]
}

#[tokio::test]
async fn queue_scripts_keep_their_invariants_under_random_interleavings() {
    let mut steps = 0;
    for seed in 1..=6u64 {
        let prefix = format!("tern-test-props-{}", Uuid::now_v7().simple());
        let settings = QueueSettings { lease: Duration::from_millis(LEASE_MS), ..Default::default() };
        let queue = Queue::connect(&tern_e2e::redis_url(), &prefix, 2, settings).unwrap();
        let redis = redis::Client::open(tern_e2e::redis_url()).unwrap().get_multiplexed_async_connection().await.unwrap();
        let mut world =
            World {
                queue,
                prefix,
                redis,
                jobs: HashMap::new(),
                owners: HashMap::new(),
                max_token: 0,
                rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                log: Vec::new(),
                lost: false,
                unrecorded: HashMap::new(),
            };
        world.queue.mark_restored().await.unwrap();
        world.queue.set_shares(&shares()).await.unwrap();
        for _ in 0..400 {
            world.step().await;
            steps += 1;
        }
        // Settle everything: the reaper and the sweep bring every unfinished job back.
        tokio::time::sleep(Duration::from_millis(LEASE_MS + 5)).await;
        world.sweep().await;
        tern_e2e::delete_redis_prefix(&world.prefix).await.unwrap();
        println!(
            "seed {seed}: {} jobs, {} finished, highest token {}",
            world.jobs.len(),
            world.jobs.values().filter(|r| **r == Recorded::Finished).count(),
            world.max_token
        );
    }
    assert_eq!(steps, 2400);
}

/// Jobs of one priority leave in the order they came, whatever the kind's sequence counter
/// reads. That counter also issues fencing tokens; when ready scores took its value mod 4,096,
/// a batch that crossed a multiple of 4,096 put the jobs after the wrap ahead of those before
/// it (about one run in a hundred of the lifecycle test's FIFO check). The 5,000 jobs of the
/// second call also outnumber the 4,096 places of one millisecond.
#[tokio::test]
async fn jobs_of_one_priority_leave_in_arrival_order_across_the_counters_wrap() {
    let prefix = format!("tern-test-fifo-{}", Uuid::now_v7().simple());
    let queue = Queue::connect(&tern_e2e::redis_url(), &prefix, 2, QueueSettings::default()).unwrap();
    queue.mark_restored().await.unwrap();
    let mut redis = redis::Client::open(tern_e2e::redis_url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    // Three short of a multiple of 4,096, so the first call's jobs straddle it.
    let seq = format!("{prefix}:{{{}}}:seq", KIND.as_str());
    let _: () = redis::cmd("SET").arg(&seq).arg(4096i64 * 400_000_000_000 - 3).query_async(&mut redis).await.unwrap();
    let job = |id| Enqueue { id, kind: KIND, priority: Priority::Normal, cost: 1, run_at: None, tenant: "default".into() };
    let first: Vec<Uuid> = (0..10).map(|_| Uuid::now_v7()).collect();
    let second: Vec<Uuid> = (0..5_000).map(|_| Uuid::now_v7()).collect();
    queue.enqueue(&first.iter().map(|id| job(*id)).collect::<Vec<_>>()).await.unwrap();
    queue.enqueue(&second.iter().map(|id| job(*id)).collect::<Vec<_>>()).await.unwrap();
    let mut pulled = Vec::new();
    let mut last_token = 0;
    loop {
        let leases = queue.pull(KIND, 1_000, i64::MAX).await.unwrap();
        if leases.is_empty() {
            break;
        }
        for lease in leases {
            assert!(lease.token > last_token, "fencing tokens only grow");
            last_token = lease.token;
            pulled.push(lease.id);
        }
    }
    let arrived: Vec<Uuid> = first.into_iter().chain(second).collect();
    assert_eq!(pulled.len(), arrived.len());
    let out_of_order = pulled.iter().zip(&arrived).position(|(p, a)| p != a);
    assert_eq!(out_of_order, None, "the first job pulled out of its arrival order");
}

/// A lease whose start Postgres refused (its job canceled or finished meanwhile) is dropped
/// with the job's metadata, which nothing else would remove; a stale lease dropped after the
/// job went to another worker leaves that worker's metadata alone.
#[tokio::test]
async fn a_refused_lease_leaves_no_metadata_behind() {
    let prefix = format!("tern-test-drop-{}", Uuid::now_v7().simple());
    let settings = QueueSettings { lease: Duration::from_millis(LEASE_MS), ..Default::default() };
    let queue = Queue::connect(&tern_e2e::redis_url(), &prefix, 2, settings).unwrap();
    queue.mark_restored().await.unwrap();
    let mut redis = redis::Client::open(tern_e2e::redis_url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let meta_key = format!("{prefix}:{{{}}}:meta", KIND.as_str());
    let job = |id| Enqueue { id, kind: KIND, priority: Priority::Normal, cost: 1, run_at: None, tenant: "heavy".into() };
    let (refused, moved_on) = (Uuid::now_v7(), Uuid::now_v7());
    queue.enqueue(&[job(refused), job(moved_on)]).await.unwrap();
    let leases = queue.pull(KIND, 2, 2).await.unwrap();
    assert_eq!(leases.len(), 2);
    let token = |id| leases.iter().find(|l| l.id == id).unwrap().token;
    // `moved_on`'s lease expires and another worker takes the job.
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 5)).await;
    for (id, _) in queue.reap(KIND, 10).await.unwrap() {
        if id == moved_on {
            queue.restore(KIND, &[(job(id), None)], false).await.unwrap();
        }
    }
    let again = queue.pull(KIND, 1, 1).await.unwrap();
    assert_eq!(again.iter().map(|l| l.id).collect::<Vec<_>>(), vec![moved_on]);
    queue
        .settle(KIND, &[(refused, token(refused), SettleAction::Drop), (moved_on, token(moved_on), SettleAction::Drop)])
        .await
        .unwrap();
    let metas: Vec<Option<String>> =
        redis::cmd("HMGET").arg(&meta_key).arg(refused.to_string()).arg(moved_on.to_string()).query_async(&mut redis).await.unwrap();
    assert_eq!(metas[0], None, "the refused lease's job keeps no metadata");
    assert!(metas[1].is_some(), "the job another worker holds keeps its metadata");
    tern_e2e::delete_redis_prefix(&prefix).await.unwrap();
}

