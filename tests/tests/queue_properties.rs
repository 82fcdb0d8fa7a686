//! A property test of the queue's Lua scripts against a real Redis (issue 20): random
//! interleavings of enqueue, pull, heartbeat, settle, reap, cancel, restore and loss of all
//! Redis data, driven against a model of what Postgres records, as the API, workers, reaper and
//! reconciler drive them. After every step:
//! - a job is in at most one of the ready, delayed and lease sets;
//! - fencing tokens only grow, across losses of Redis data too;
//! - a pulled job is one Postgres holds as waiting, never a finished or running one;
//! - a finished job is in no set, and short of a loss of Redis data an unfinished one is always
//!   in one (a lease that expired before its job started puts the job back);
//! and after every reconciler sweep, nothing Postgres holds as waiting or running is missing.

use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tern_jobs::queue::{Enqueue, LeaseStatus, QueueSettings, SettleAction};
use tern_jobs::{JobKind, Queue};
use uuid::Uuid;

const KIND: JobKind = JobKind::Echo;
/// Short, so leases expire within a run.
const LEASE_MS: u64 = 40;

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
    max_token: i64,
    rng: Rng,
    log: Vec<String>,
    /// Redis lost its data and no sweep has run since.
    lost: bool,
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
                (Enqueue { id: *id, kind: KIND, priority: Default::default(), cost: 1, run_at: None }, token)
            })
            .collect();
        self.queue.restore(KIND, &active).await.unwrap();
        self.queue.mark_restored().await.unwrap();
        self.lost = false;
        let held: HashSet<Uuid> = [self.members("ready").await, self.members("delayed").await, self.members("leases").await]
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
                self.log.push(format!("enqueue {id}"));
                self.jobs.insert(id, Recorded::Waiting);
                let job = Enqueue { id, kind: KIND, priority: Default::default(), cost: 1, run_at: None };
                self.queue.enqueue(&[job]).await.unwrap();
            }
            2 | 3 => {
                let max = 1 + self.rng.below(3);
                let leases = self.queue.pull(KIND, max, max as i64).await.unwrap();
                for lease in leases {
                    self.log.push(format!("pull {} token {}", lease.id, lease.token));
                    if lease.token <= self.max_token {
                        self.fail(format!("token {} issued after {}", lease.token, self.max_token));
                    }
                    self.max_token = lease.token;
                    // The worker's start: Postgres takes it only if it was waiting. One worker in
                    // eight dies between its pull and its start, leaving the job waiting.
                    match self.jobs.get(&lease.id).copied() {
                        Some(Recorded::Waiting) if self.rng.below(8) == 0 => self.log.push("  (its worker died)".into()),
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
                            let job = Enqueue { id, kind: KIND, priority: Default::default(), cost: 1, run_at: None };
                            self.queue.restore(KIND, &[(job, None)]).await.unwrap();
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
            _ => {
                self.log.push("time passes".into());
                tokio::time::sleep(Duration::from_millis(LEASE_MS + 5)).await;
            }
        }
        self.check().await;
    }

    async fn check(&mut self) {
        let ready = self.members("ready").await;
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

#[tokio::test]
async fn queue_scripts_keep_their_invariants_under_random_interleavings() {
    let mut steps = 0;
    for seed in 1..=6u64 {
        let prefix = format!("tern-test-props-{}", Uuid::now_v7().simple());
        let settings = QueueSettings { lease: Duration::from_millis(LEASE_MS), ..Default::default() };
        let queue = Queue::connect(&tern_e2e::redis_url(), &prefix, 2, settings).unwrap();
        let redis = redis::Client::open(tern_e2e::redis_url()).unwrap().get_multiplexed_async_connection().await.unwrap();
        let mut world =
            World { queue, prefix, redis, jobs: HashMap::new(), max_token: 0, rng: Rng(seed * 0x9e37_79b9_7f4a_7c15), log: Vec::new(), lost: false };
        world.queue.mark_restored().await.unwrap();
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
