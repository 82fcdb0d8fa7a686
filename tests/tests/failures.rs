//! Nothing is lost: killed workers, a wiped Redis and shutdowns all end every job exactly once.

use serde_json::{json, Value};
use std::time::Duration;
use tern_e2e::Cluster;
use tern_jobs::store::{Outcome, Settlement, UnrecordedStart};
use tern_jobs::{JobOutput, RetryPolicy, Store};
use uuid::Uuid;

fn sleeping_jobs(n: usize, sleep_ms: u64) -> Vec<Value> {
    (0..n).map(|i| json!({"kind": "echo", "input": {"message": i, "sleep_ms": sleep_ms}})).collect()
}

async fn wait_running(cluster: &Cluster, n: i64) {
    cluster
        .wait_until("the jobs to start", Duration::from_secs(20), || async {
            let running: i64 =
                sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'").fetch_one(&cluster.pg).await?;
            Ok(running == n)
        })
        .await
        .unwrap();
}

/// Jobs whose timeline has other than exactly one terminal event.
async fn jobs_without_exactly_one_terminal_event(cluster: &Cluster, ids: &[Uuid]) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM unnest($1::uuid[]) AS j(id)
         WHERE (SELECT count(*) FROM job_events e
                WHERE e.job_id = j.id AND e.state IN ('succeeded', 'failed', 'canceled')) <> 1",
    )
    .bind(ids)
    .fetch_one(&cluster.pg)
    .await
    .unwrap()
}

#[tokio::test]
async fn jobs_of_a_killed_worker_run_again_elsewhere_and_its_stale_tokens_are_refused() {
    let lease = [("TERN_LEASE_MS", "1500")];
    let mut cluster = Cluster::start(&lease).await.unwrap();
    let ids = cluster.submit_all(&sleeping_jobs(10, 4000)).await.unwrap();
    let mut doomed = cluster.spawn_worker(&[("TERN_LEASE_MS", "1500"), ("TERN_BATCH_SIZE", "10")]).unwrap();
    cluster
        .wait_until("the first worker to hold all ten jobs", Duration::from_secs(20), || async {
            let running: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running' AND worker_id = 'worker1'")
                .fetch_one(&cluster.pg)
                .await?;
            Ok(running == 10)
        })
        .await
        .unwrap();
    let stale: Vec<(Uuid, i64)> = sqlx::query_as("SELECT id, lease_token FROM jobs WHERE id = ANY($1)")
        .bind(&ids)
        .fetch_all(&cluster.pg)
        .await
        .unwrap();
    doomed.kill9();
    let _rescuer = cluster.spawn_worker(&[("TERN_LEASE_MS", "1500")]).unwrap();

    let counts = cluster.wait_terminal(&ids, Duration::from_secs(60)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&10), "{counts:?}");
    let reruns: Vec<(i32, String)> = sqlx::query_as("SELECT attempts, worker_id FROM jobs WHERE id = ANY($1)")
        .bind(&ids)
        .fetch_all(&cluster.pg)
        .await
        .unwrap();
    for (attempts, worker) in &reruns {
        assert_eq!(*attempts, 2, "the lost attempt counts");
        assert_eq!(worker, "worker2");
    }
    assert_eq!(jobs_without_exactly_one_terminal_event(&cluster, &ids).await, 0);

    // The dead worker's leases can no longer settle anything.
    let store = Store::connect(&cluster.database_url, 2).await.unwrap();
    let forged = JobOutput {
        key: Some("forged".into()),
        size: 0,
        sha256: "0".repeat(64),
        content_type: "text/plain".into(),
        formats: Default::default(),
        inline: None,
        body: None,
    };
    let settlements: Vec<Settlement> = stale
        .iter()
        .map(|(id, token)| Settlement { id: *id, token: *token, outcome: Outcome::Succeeded(forged.clone()), unrecorded: None })
        .collect();
    let accepted = store.settle(&settlements, RetryPolicy::default()).await.unwrap();
    assert!(accepted.is_empty(), "a stale token settled {accepted:?}");
    let keys: Vec<Option<String>> = sqlx::query_scalar("SELECT output->>'key' FROM jobs WHERE id = ANY($1)")
        .bind(&ids)
        .fetch_all(&cluster.pg)
        .await
        .unwrap();
    assert!(keys.iter().all(|k| k.as_deref() != Some("forged")));
}

#[tokio::test]
async fn after_redis_flushall_the_reconciler_restores_500_queued_jobs_and_each_runs_once() {
    let mut cluster = Cluster::start(&[("TERN_RECONCILE_INTERVAL_MS", "500")]).await.unwrap();
    let jobs: Vec<Value> = (0..500).map(|i| json!({"kind": "echo", "input": {"message": i}})).collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), 500);

    let mut redis = cluster.redis().await.unwrap();
    let _: () = redis::cmd("FLUSHALL").arg("ASYNC").query_async(&mut redis).await.unwrap();
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), 0);

    let _w1 = cluster.spawn_worker(&[]).unwrap();
    let _w2 = cluster.spawn_worker(&[]).unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(60)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&500), "{counts:?}");
    let ran_more_than_once: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM unnest($1::uuid[]) AS j(id)
         WHERE (SELECT count(*) FROM job_events e WHERE e.job_id = j.id AND e.state = 'running') <> 1",
    )
    .bind(&ids)
    .fetch_one(&cluster.pg)
    .await
    .unwrap();
    assert_eq!(ran_more_than_once, 0);
    assert_eq!(jobs_without_exactly_one_terminal_event(&cluster, &ids).await, 0);
}

/// Routine sweeps (no data loss) check a bounded number of jobs each and go on from there, so
/// their cost does not grow with the backlog, and still find every job Redis does not hold.
#[tokio::test]
async fn routine_sweeps_walk_a_large_backlog_in_bounded_rounds_and_restore_all_of_it() {
    // The API's own reconciler sweeps once at its start and not again during the test.
    let cluster = Cluster::start(&[("TERN_RECONCILE_INTERVAL_MS", "3600000")]).await.unwrap();
    let n = 12_000;
    let jobs: Vec<Value> = (0..n).map(|i| json!({"kind": "echo", "input": {"message": i}})).collect();
    for chunk in jobs.chunks(1000) {
        cluster.submit_all(chunk).await.unwrap();
    }
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), n as u64);

    // Redis loses the kind's queue but not its markers: no data loss is seen, as when
    // processes died between their commits and their Redis calls.
    let mut redis = cluster.redis().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{}:{{echo}}*", cluster.redis_prefix)).query_async(&mut redis).await.unwrap();
    let lost: Vec<&String> = keys.iter().filter(|k| !k.ends_with(":restored")).collect();
    assert!(!lost.is_empty() && lost.len() < keys.len(), "{keys:?}");
    let _: () = redis::cmd("DEL").arg(&lost).query_async(&mut redis).await.unwrap();
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), 0);

    let reconciler = tern_jobs::reconciler::Reconciler {
        store: Store::connect(&cluster.database_url, 2).await.unwrap(),
        queue: tern_jobs::Queue::connect(&tern_e2e::redis_url(), &cluster.redis_prefix, 2, Default::default()).unwrap(),
        grace: Duration::ZERO,
        owner: "test".into(),
        cursor: Default::default(),
    };
    let per_round = tern_jobs::reconciler::ROUTINE_PAGES_PER_ROUND as u64 * 1000;
    let mut rounds = Vec::new();
    loop {
        let restored = reconciler.run_once().await.unwrap();
        rounds.push(restored);
        if restored == 0 {
            break;
        }
        assert!(restored <= per_round, "one round restored {restored}: {rounds:?}");
        assert!(rounds.len() < 10, "{rounds:?}");
    }
    assert_eq!(rounds, [5000, 5000, 2000, 0]);
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), n as u64);
}

#[tokio::test]
async fn sigterm_lets_a_worker_finish_its_batch_within_the_grace_period() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let ids = cluster.submit_all(&sleeping_jobs(3, 1500)).await.unwrap();
    let mut worker = cluster.spawn_worker(&[("TERN_SHUTDOWN_GRACE_MS", "10000")]).unwrap();
    wait_running(&cluster, 3).await;
    let status = worker.terminate(Duration::from_secs(15)).unwrap();
    assert!(status.success(), "{status:?}");
    for id in &ids {
        assert_eq!(cluster.state_of(*id).await.unwrap(), "succeeded");
    }
}

#[tokio::test]
async fn sigterm_hands_unfinished_jobs_back_when_the_grace_period_runs_out() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let ids = cluster.submit_all(&sleeping_jobs(3, 60_000)).await.unwrap();
    let mut worker = cluster.spawn_worker(&[("TERN_SHUTDOWN_GRACE_MS", "500")]).unwrap();
    wait_running(&cluster, 3).await;
    let status = worker.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status:?}");
    let rows: Vec<(String, i32)> = sqlx::query_as("SELECT state, attempts FROM jobs WHERE id = ANY($1)")
        .bind(&ids)
        .fetch_all(&cluster.pg)
        .await
        .unwrap();
    for (state, attempts) in rows {
        assert_eq!(state, "queued");
        assert_eq!(attempts, 0, "a released attempt does not count");
    }
    // Back in the queue, ready for the next worker.
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap() + cluster.queue_len("echo", "delayed").await.unwrap(), 3);
}

#[tokio::test]
async fn a_running_job_canceled_after_its_worker_died_ends_canceled_instead_of_running_again() {
    let mut cluster = Cluster::start(&[("TERN_LEASE_MS", "1500")]).await.unwrap();
    let ids = cluster.submit_all(&sleeping_jobs(1, 60_000)).await.unwrap();
    let mut doomed = cluster.spawn_worker(&[("TERN_LEASE_MS", "1500")]).unwrap();
    cluster
        .wait_until("the job to run", Duration::from_secs(20), || async { Ok(cluster.state_of(ids[0]).await? == "running") })
        .await
        .unwrap();
    doomed.kill9();
    let (status, _) = cluster.post(&format!("/v1/jobs/{}/cancel", ids[0]), &json!({})).await.unwrap();
    assert_eq!(status, 202);
    cluster.wait_terminal(&ids, Duration::from_secs(20)).await.unwrap();
    assert_eq!(cluster.state_of(ids[0]).await.unwrap(), "canceled");
    assert_eq!(jobs_without_exactly_one_terminal_event(&cluster, &ids).await, 0);
}

/// A worker started while Redis and S3 are unreachable waits for them, saying so in its log,
/// instead of exiting; once they come up (here: relays to the real servers start on the ports
/// it was given) it runs the job that waited.
#[tokio::test]
async fn a_worker_started_before_redis_and_s3_are_reachable_waits_for_them() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let (redis_port, s3_port) = (tern_e2e::free_port(), tern_e2e::free_port());
    let redis_url = format!("redis://127.0.0.1:{redis_port}");
    let s3_url = format!("http://127.0.0.1:{s3_port}");
    let mut worker = cluster.spawn_worker(&[("TERN_REDIS_URL", &redis_url), ("TERN_S3_ENDPOINT", &s3_url), ("TERN_WORKER_KINDS", "echo")]).unwrap();
    let ids = cluster.submit_all(&sleeping_jobs(1, 0)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(worker.is_running(), "the worker exited:\n{}", worker.log_text());
    assert!(worker.log_text().contains("waiting for Redis"), "{}", worker.log_text());

    let host_port = |url: String| url.split("://").nth(1).unwrap_or_default().trim_end_matches('/').to_string();
    let _redis = tern_e2e::Relay::start(redis_port, &host_port(tern_e2e::redis_url())).await.unwrap();
    cluster
        .wait_until("the worker to wait for S3 next", Duration::from_secs(20), || async { Ok(worker.log_text().contains("waiting for the S3 bucket")) })
        .await
        .unwrap();
    assert!(worker.is_running(), "the worker exited:\n{}", worker.log_text());
    assert_eq!(cluster.state_of(ids[0]).await.unwrap(), "queued");

    let _s3 = tern_e2e::Relay::start(s3_port, &host_port(tern_e2e::s3_endpoint())).await.unwrap();
    let states = cluster.wait_terminal(&ids, Duration::from_secs(30)).await.unwrap();
    assert_eq!(states.get("succeeded"), Some(&1), "{states:?}\n{}", worker.log_text());
    assert!(worker.log_text().contains("reached the S3 bucket"));
}

/// A queue of its own on the real Redis (a fresh key prefix), with short leases.
fn private_queue(lease_ms: u64) -> (tern_jobs::Queue, String) {
    let prefix = format!("tern-test-{}", Uuid::now_v7().simple());
    let settings = tern_jobs::queue::QueueSettings { lease: Duration::from_millis(lease_ms), ..Default::default() };
    (tern_jobs::Queue::connect(&tern_e2e::redis_url(), &prefix, 4, settings).unwrap(), prefix)
}

/// Deletes every key of `prefix`: Redis losing this queue's data.
async fn lose_data(prefix: &str) {
    tern_e2e::delete_redis_prefix(prefix).await.unwrap();
}

fn echo_job() -> tern_jobs::queue::Enqueue {
    tern_jobs::queue::Enqueue {
        id: Uuid::now_v7(),
        kind: tern_jobs::JobKind::Echo,
        priority: Default::default(),
        cost: 1,
        run_at: None,
        tenant: "default".into(),
    }
}

/// Issue 20, item 2: a heartbeat from a worker whose lease was reaped does not bring the lease
/// back (the job's retry would then wait for that worker's timeout); it is told the lease is
/// lost. After Redis lost its data and before the reconciler restored it, a heartbeat neither
/// recreates the lease nor is told it lost it.
#[tokio::test]
async fn a_stale_heartbeat_cannot_bring_back_a_reaped_lease() {
    use tern_jobs::queue::{LeaseStatus, SettleAction};
    let kind = tern_jobs::JobKind::Echo;
    let (queue, prefix) = private_queue(100);
    queue.mark_restored().await.unwrap();
    let job = echo_job();
    queue.enqueue(std::slice::from_ref(&job)).await.unwrap();
    let lease = queue.pull(kind, 1, 1).await.unwrap().remove(0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(queue.reap(kind, 10).await.unwrap(), vec![(job.id, Some(lease.token))]);
    // The reaper's caller puts the job back for its retry.
    queue.settle(kind, &[(job.id, lease.token, SettleAction::At(chrono::Utc::now()))]).await.unwrap();

    let status = queue.heartbeat(kind, &[(job.id, lease.token)]).await.unwrap();
    assert_eq!(status, vec![LeaseStatus::Lost], "the reaped lease stays reaped");
    let again = queue.pull(kind, 1, 1).await.unwrap();
    assert_eq!(again.len(), 1, "the retry is pulled at once, not held behind a resurrected lease");
    assert!(again[0].token > lease.token);

    lose_data(&prefix).await;
    assert_eq!(queue.heartbeat(kind, &[(job.id, again[0].token)]).await.unwrap(), vec![LeaseStatus::Unconfirmed]);
    assert_eq!(queue.reap(kind, 10).await.unwrap(), vec![], "no lease was recreated by the heartbeat");
}

/// Issue 20, item 3: fencing tokens keep growing after Redis loses its data, so a token a
/// stale worker holds is never issued again.
#[tokio::test]
async fn fencing_tokens_grow_across_a_loss_of_redis_data() {
    let kind = tern_jobs::JobKind::Echo;
    let (queue, prefix) = private_queue(30_000);
    let mut tokens = Vec::new();
    for _ in 0..3 {
        queue.enqueue(&[echo_job()]).await.unwrap();
        tokens.push(queue.pull(kind, 1, 1).await.unwrap().remove(0).token);
        lose_data(&prefix).await;
    }
    assert!(tokens.windows(2).all(|w| w[1] > w[0]), "tokens {tokens:?}");
}

/// Issue 20, item 4: Postgres refusing connections while a batch settles costs nothing: the
/// worker holds its leases and retries, and the job succeeds on its first attempt once
/// Postgres is back, instead of being reaped as `lease_expired` and charged an attempt.
#[tokio::test]
async fn a_postgres_blip_at_settle_keeps_the_batch_and_charges_no_attempt() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "echo")]).unwrap();
    let ids = cluster.submit_all(&sleeping_jobs(1, 2000)).await.unwrap();
    wait_running(&cluster, 1).await;
    let database = cluster.database_url.rsplit('/').next().unwrap().to_string();
    let admin = sqlx::PgPool::connect(&tern_e2e::postgres_admin_url()).await.unwrap();
    let allow = |on: bool| format!("ALTER DATABASE \"{database}\" ALLOW_CONNECTIONS {on}");
    sqlx::query(&allow(false)).execute(&admin).await.unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()")
        .bind(&database)
        .execute(&admin)
        .await
        .unwrap();
    // The job ends at 2 s and its settle fails until connections are allowed again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    sqlx::query(&allow(true)).execute(&admin).await.unwrap();
    let states = cluster.wait_terminal(&ids, Duration::from_secs(20)).await.unwrap();
    assert_eq!(states.get("succeeded"), Some(&1), "{states:?}");
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM jobs WHERE id = $1").bind(ids[0]).fetch_one(&cluster.pg).await.unwrap();
    assert_eq!(attempts, 1, "no attempt charged for the blip");
    assert_eq!(jobs_without_exactly_one_terminal_event(&cluster, &ids).await, 0);
}

/// Issue 20, item 8, as issue 22 changed it: a job whose lease expires before Postgres recorded
/// its start (its worker was killed between pull and settle; workers record a short batch's
/// starts with its outcomes) is returned by the reaper's next round, not after the reconciler's
/// sweep (here kept out of the way with a long grace), and the lease is charged as an attempt,
/// so a job that kills its workers cannot come back for ever.
#[tokio::test]
async fn a_job_pulled_but_never_recorded_is_charged_and_returned_by_the_reaper() {
    let mut cluster = Cluster::start(&[
        ("TERN_RECONCILE_GRACE_MS", "600000"),
        ("TERN_REAPER_INTERVAL_MS", "200"),
        ("TERN_RETRY_BASE_MS", "100"),
    ])
    .await
    .unwrap();
    let ids = cluster
        .submit_all(&[json!({"kind": "echo", "input": {"message": "again"}})])
        .await
        .unwrap();
    // A worker that pulls with a 300 ms lease and is killed before it records anything.
    let settings = tern_jobs::queue::QueueSettings {
        lease: Duration::from_millis(300),
        ..Default::default()
    };
    let doomed =
        tern_jobs::Queue::connect(&tern_e2e::redis_url(), &cluster.redis_prefix, 2, settings)
            .unwrap();
    let pulled = doomed.pull(tern_jobs::JobKind::Echo, 1, 1).await.unwrap();
    assert_eq!(pulled.len(), 1);
    assert_eq!(pulled[0].id, ids[0]);
    drop(doomed);
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), 0);
    assert_eq!(cluster.state_of(ids[0]).await.unwrap(), "queued");
    cluster
        .wait_until(
            "the reaper charged the lost lease",
            Duration::from_secs(10),
            || async { Ok(cluster.state_of(ids[0]).await? == "retrying") },
        )
        .await
        .unwrap();
    let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    assert_eq!(job["attempts"], 1, "{job}");
    assert_eq!(job["error"]["code"], "lease_expired", "{job}");
    let _worker = cluster
        .spawn_worker(&[("TERN_WORKER_KINDS", "echo")])
        .unwrap();
    let states = cluster
        .wait_terminal(&ids, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(states.get("succeeded"), Some(&1), "{states:?}");
    let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    assert_eq!(job["attempts"], 2, "the lost lease and the run: {job}");
    let (_, events) = cluster.get(&format!("/v1/jobs/{}/events", ids[0])).await.unwrap();
    let states: Vec<&str> = events["events"].as_array().unwrap().iter().map(|e| e["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["queued", "running", "retrying", "running", "succeeded"], "{events}");
}

/// Issue 20, item 10: a cancel that commits while a failed attempt is being settled is not
/// overwritten by the retry: the settle reads the job's cancel under its row lock, and the
/// job ends `canceled` instead of running again.
#[tokio::test]
async fn a_cancel_that_commits_while_a_retry_settles_is_not_lost() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let ids = cluster.submit_all(&sleeping_jobs(1, 0)).await.unwrap();
    let store = Store::connect(&cluster.database_url, 4).await.unwrap();
    let token = 1_000_000;
    assert_eq!(
        store
            .start("test-worker", &[(ids[0], token)])
            .await
            .unwrap()
            .len(),
        1
    );
    // The cancel's transaction holds the job's row while the settle starts.
    let mut cancel = cluster.pg.begin().await.unwrap();
    sqlx::query("UPDATE jobs SET cancel_requested = true WHERE id = $1")
        .bind(ids[0])
        .execute(&mut *cancel)
        .await
        .unwrap();
    let settle = tokio::spawn({
        let store = store.clone();
        let id = ids[0];
        async move {
            let failed = Outcome::Retry(tern_jobs::Failure::new(
                "transient",
                "it failed, and may be retried",
            ));
            store
                .settle(
                    &[Settlement {
                        id,
                        token,
                        outcome: failed,
                        unrecorded: None,
                    }],
                    RetryPolicy::default(),
                )
                .await
        }
    });
    cluster
        .wait_until("the settle waits on the job's row", Duration::from_secs(10), || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&cluster.pg)
            .await?;
            Ok(waiting > 0)
        })
        .await
        .unwrap();
    cancel.commit().await.unwrap();
    let settled = settle.await.unwrap().unwrap();
    assert_eq!(settled.len(), 1);
    assert_eq!(settled[0].state, tern_jobs::JobState::Canceled);
    assert_eq!(cluster.state_of(ids[0]).await.unwrap(), "canceled");
}

/// Issue 20, item 10: the flags that tell workers to stop canceled jobs are rebuilt from
/// Postgres after Redis lost them: a job whose cancel Postgres records but Redis forgot still
/// stops, instead of running to its end.
#[tokio::test]
async fn a_cancel_redis_lost_still_reaches_the_worker() {
    let mut cluster = Cluster::start(&[("TERN_RECONCILE_INTERVAL_MS", "500")])
        .await
        .unwrap();
    let ids = cluster
        .submit_all(&sleeping_jobs(1, 120_000))
        .await
        .unwrap();
    let _worker = cluster
        .spawn_worker(&[("TERN_WORKER_KINDS", "echo")])
        .unwrap();
    wait_running(&cluster, 1).await;
    // As after a cancel whose Redis write was lost with the rest of Redis's data.
    sqlx::query("UPDATE jobs SET cancel_requested = true WHERE id = $1")
        .bind(ids[0])
        .execute(&cluster.pg)
        .await
        .unwrap();
    lose_data(&cluster.redis_prefix).await;
    cluster
        .wait_terminal(&ids, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(cluster.state_of(ids[0]).await.unwrap(), "canceled");
    assert_eq!(
        jobs_without_exactly_one_terminal_event(&cluster, &ids).await,
        0
    );
}

/// Issue 22: a batch that ends quickly records its jobs' starts with their outcomes. Such a
/// settle is fenced by the job's attempts and lease token as the worker read them: it is
/// refused once the reaper charged the lease, or a cancel was recorded, meanwhile; a settle
/// that is let through records the `running` event first, at the time the attempt began.
#[tokio::test]
async fn a_settle_of_an_unrecorded_start_is_refused_when_the_job_changed_since_it_was_read() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let ids = cluster
        .submit_all(&[json!({"kind": "echo", "input": {"message": 1}}), json!({"kind": "echo", "input": {"message": 2}})])
        .await
        .unwrap();
    let store = Store::connect_for_batches(&cluster.database_url, 2).await.unwrap();
    let (began, read) = store.waiting_jobs(&ids).await.unwrap();
    assert_eq!(read.len(), 2);
    let unrecorded = |attempts: i32, lease_token: Option<i64>| UnrecordedStart {
        at: Some(began),
        attempts,
        lease_token,
        worker_id: Some("test-worker".into()),
    };
    let output = JobOutput::in_postgres(b"{}".to_vec().into(), "application/json");
    let settle = |id: Uuid, token: i64, outcome: Outcome, from: UnrecordedStart| {
        let store = store.clone();
        async move {
            store
                .settle(&[Settlement { id, token, outcome, unrecorded: Some(from) }], RetryPolicy::default())
                .await
                .unwrap()
        }
    };

    // The reaper charges the first job's lease (token 7) before its worker reports.
    let charged = settle(ids[0], 7, Outcome::Retry(tern_jobs::Failure::new("lease_expired", "gone")), unrecorded(0, None)).await;
    assert_eq!(charged.len(), 1);
    assert_eq!(cluster.state_of(ids[0]).await.unwrap(), "retrying");
    let late = settle(ids[0], 7, Outcome::Succeeded(output.clone()), unrecorded(0, None)).await;
    assert!(late.is_empty(), "a charged lease's outcome was recorded: {late:?}");
    // The next lease reads the job as it is now, and its outcome is recorded.
    let next = settle(ids[0], 8, Outcome::Succeeded(output.clone()), unrecorded(1, Some(7))).await;
    assert_eq!(next.len(), 1);
    let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    assert_eq!((job["state"].as_str(), job["attempts"].as_i64()), (Some("succeeded"), Some(2)), "{job}");
    assert_eq!(job["worker_id"], "test-worker", "{job}");
    let (_, events) = cluster.get(&format!("/v1/jobs/{}/events", ids[0])).await.unwrap();
    let events = events["events"].as_array().unwrap().clone();
    let states: Vec<&str> = events.iter().map(|e| e["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["queued", "running", "retrying", "running", "succeeded"]);
    let at = |i: usize| chrono::DateTime::parse_from_rfc3339(events[i]["at"].as_str().unwrap()).unwrap();
    assert_eq!(at(3), began, "the running event is dated when the attempt began");
    assert!(at(4) >= at(3));

    // The second job is canceled while it runs unrecorded: the cancel stands.
    let (status, body) = cluster.post(&format!("/v1/jobs/{}/cancel", ids[1]), &json!({})).await.unwrap();
    assert_eq!((status, body["state"].as_str()), (200, Some("canceled")), "{body}");
    let refused = settle(ids[1], 9, Outcome::Succeeded(output), unrecorded(0, None)).await;
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(cluster.state_of(ids[1]).await.unwrap(), "canceled");
    assert_eq!(jobs_without_exactly_one_terminal_event(&cluster, &ids).await, 0);
}
