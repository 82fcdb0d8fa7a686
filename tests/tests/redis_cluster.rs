//! The queue on a real Redis Cluster (3 primaries, 3 replicas on 127.0.0.1:7000-7005, started by
//! `scripts/services.sh redis-cluster`, which each test runs first): jobs spread over shards on
//! all three primaries run through a primary's failover, and a shard whose node lost its data is
//! restored from Postgres at once.

use anyhow::{bail, Context, Result};
use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use tern_e2e::Cluster;
use tern_jobs::queue::QueueSettings;
use tern_jobs::Queue;
use uuid::Uuid;

const SEEDS: &str = "redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002";
const SHARDS: u16 = 5;

/// Starts the local cluster, or restarts the nodes a test stopped (they rejoin as replicas).
fn cluster_up() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/services.sh");
    let out = Command::new("bash").arg(script).arg("redis-cluster").output().expect("running services.sh");
    assert!(out.status.success(), "scripts/services.sh redis-cluster failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// A plain connection to one node, for what the test asks of the cluster itself.
async fn node(port: u16) -> Result<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    Ok(tokio::time::timeout(Duration::from_secs(2), client.get_multiplexed_async_connection()).await??)
}

/// A node that answers, of the six.
async fn any_node() -> Result<redis::aio::MultiplexedConnection> {
    for port in 7000..7006 {
        if let Ok(c) = node(port).await {
            return Ok(c);
        }
    }
    bail!("no cluster node answers")
}

/// The port of the primary serving `key`'s slot, as the cluster sees it now.
async fn primary_of(key: &str) -> Result<u16> {
    let mut c = any_node().await?;
    let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query_async(&mut c).await?;
    let nodes: String = redis::cmd("CLUSTER").arg("NODES").query_async(&mut c).await?;
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
            continue;
        }
        let port: u16 = fields[1].split(['@', ':']).nth(1).context("node address")?.parse()?;
        for range in &fields[8..] {
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            if let (Ok(lo), Ok(hi)) = (lo.parse::<u16>(), hi.parse::<u16>()) {
                if (lo..=hi).contains(&slot) {
                    return Ok(port);
                }
            }
        }
    }
    bail!("no live primary serves slot {slot}")
}

/// The key base of `echo`'s shard `shard` under `prefix`, as the queue names it.
fn shard_base(prefix: &str, shard: u16) -> String {
    match shard {
        0 => format!("{prefix}:{{echo}}"),
        n => format!("{prefix}:{{echo:{n}}}"),
    }
}

/// The ports of the primaries serving `echo`'s shards. A shard's slot follows from its hash tag
/// alone (`{echo:n}`), so it is the same for every deployment on the cluster: with five shards
/// the tags fall in all three primaries' slot ranges.
async fn shard_primaries(prefix: &str) -> Result<Vec<u16>> {
    let mut primaries = Vec::new();
    for shard in 0..SHARDS {
        primaries.push(primary_of(&shard_base(prefix, shard)).await?);
    }
    primaries.sort_unstable();
    primaries.dedup();
    Ok(primaries)
}

/// The shard the queue puts job `id` in, as every tern process computes it.
fn shard_of(id: Uuid) -> u16 {
    let settings = QueueSettings { shards: SHARDS, ..Default::default() };
    // Dials nothing: only the id-to-shard mapping is asked of it.
    Queue::connect_cluster(SEEDS, "unused", settings).unwrap().shard_of(id)
}

/// A tern deployment whose queue is on the local cluster, `SHARDS` shards a kind.
async fn deployment(extra: &[(&str, &str)]) -> Result<(Cluster, Vec<(String, String)>, String)> {
    let prefix = format!("tern-test-c{}", &Uuid::now_v7().simple().to_string()[20..]);
    let primaries = shard_primaries(&prefix).await?;
    assert_eq!(primaries.len(), 3, "the shards sit on every primary: {primaries:?}");
    let shards = SHARDS.to_string();
    let mut env: Vec<(String, String)> = [
        ("TERN_REDIS_URL", SEEDS),
        ("TERN_REDIS_CLUSTER", "true"),
        ("TERN_REDIS_PREFIX", prefix.as_str()),
        ("TERN_QUEUE_SHARDS", shards.as_str()),
        ("TERN_LEASE_MS", "3000"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let borrowed: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let cluster = Cluster::start(&borrowed).await?;
    Ok((cluster, env, prefix))
}

fn echo_jobs(from: usize, n: usize) -> Vec<serde_json::Value> {
    (from..from + n).map(|i| json!({"kind": "echo", "input": {"message": i, "sleep_ms": 20}})).collect()
}

/// What the nodes that answer say of the cluster, for a failure's message.
async fn cluster_nodes() -> String {
    let mut out = String::new();
    for port in 7000..7006 {
        let nodes: Result<String> = async { Ok(redis::cmd("CLUSTER").arg("NODES").query_async(&mut node(port).await?).await?) }.await;
        out += &format!("-- {port}: {}\n", nodes.unwrap_or_else(|e| format!("{e:#}")));
    }
    out
}

/// Kills the Redis server on `port` (SIGKILL, no shutdown save).
async fn kill_node(port: u16) -> Result<()> {
    let mut c = node(port).await?;
    let info: String = redis::cmd("INFO").arg("server").query_async(&mut c).await?;
    let pid = info.lines().find_map(|l| l.strip_prefix("process_id:")).context("process_id")?.trim().to_string();
    let status = Command::new("kill").arg("-9").arg(&pid).status()?;
    assert!(status.success(), "kill -9 {pid}");
    Ok(())
}

#[tokio::test]
async fn jobs_spread_over_shards_on_three_primaries_all_run_through_a_primary_failover() {
    cluster_up();
    let (mut cluster, env, prefix) = deployment(&[]).await.unwrap();
    let worker_env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let _w1 = cluster.spawn_worker(&worker_env).unwrap();
    let _w2 = cluster.spawn_worker(&worker_env).unwrap();
    let (status, system) = cluster.get("/v1/admin/system").await.unwrap();
    assert_eq!(status, 200, "{system}");
    assert_eq!(system["redis"], json!({"cluster": true, "shards": SHARDS}), "{system}");

    // Half the jobs before the failover; every shard holds some of them.
    let mut ids = cluster.submit_all(&echo_jobs(0, 300)).await.unwrap();
    let mut per_shard = [0usize; SHARDS as usize];
    for id in &ids {
        per_shard[usize::from(shard_of(*id))] += 1;
    }
    assert!(per_shard.iter().all(|&n| n > 20), "jobs per shard: {per_shard:?}");

    // Kill the primary of shard 0 while jobs keep coming; its replica takes over.
    let doomed = primary_of(&shard_base(&prefix, 0)).await.unwrap();
    kill_node(doomed).await.unwrap();
    let killed_at = Instant::now();
    // Submissions go on until a replica has taken over and four more went through; a cluster
    // that never fails over ends the test within a minute, with what the nodes said.
    let (mut rounds, mut refused, mut after_failover) = (0, 0, 0);
    while after_failover < 4 {
        if killed_at.elapsed() > Duration::from_secs(60) {
            panic!("no replica took over within 60 s of the kill; CLUSTER NODES:\n{}", cluster_nodes().await);
        }
        let round = rounds;
        rounds += 1;
        match tokio::time::timeout(Duration::from_secs(45), cluster.submit_all(&echo_jobs(1000 + round * 15, 15))).await {
            Ok(Ok(more)) => ids.extend(more),
            // A submission that fails while the slot has no primary is refused whole (the
            // client sees an error, not a 2xx), so it is not counted as accepted.
            Ok(Err(e)) => {
                refused += 1;
                eprintln!("round {round}: refused at {:.1} s: {e:#}", killed_at.elapsed().as_secs_f64());
            }
            Err(_) => panic!("a submission hung for 45 s, {:.1} s after the kill", killed_at.elapsed().as_secs_f64()),
        }
        if primary_of(&shard_base(&prefix, 0)).await.is_ok_and(|p| p != doomed) {
            after_failover += 1;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!(
        "{} jobs accepted, {refused} of {rounds} submissions refused during the failover ({:.1} s after the kill)",
        ids.len(),
        killed_at.elapsed().as_secs_f64()
    );

    let counts = cluster.wait_terminal(&ids, Duration::from_secs(120)).await.unwrap();
    assert_eq!(counts.get("succeeded").copied(), Some(ids.len() as i64), "{counts:?}");
    let events: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM job_events WHERE job_id = ANY($1) AND state IN ('succeeded', 'failed', 'canceled')",
    )
    .bind(&ids)
    .fetch_one(&cluster.pg)
    .await
    .unwrap();
    assert_eq!(events, ids.len() as i64, "each job reached exactly one terminal state");
    cluster_up();
}

#[tokio::test]
async fn a_shard_that_lost_its_data_is_restored_from_postgres_at_once() {
    cluster_up();
    // A grace of ten minutes: only the shard's lost marker can make the reconciler restore
    // jobs that were accepted a moment ago.
    let (mut cluster, env, prefix) =
        deployment(&[("TERN_RECONCILE_INTERVAL_MS", "500"), ("TERN_RECONCILE_GRACE_MS", "600000")]).await.unwrap();
    let ids = cluster.submit_all(&echo_jobs(0, 150)).await.unwrap();
    // The first sweep marks every shard restored.
    let lost = shard_base(&prefix, 1);
    let port = primary_of(&lost).await.unwrap();
    let mut c = node(port).await.unwrap();
    let marker = format!("{lost}:restored");
    cluster
        .wait_until("the reconciler to mark shard 1 restored", Duration::from_secs(20), || {
            let (mut c, marker) = (c.clone(), marker.clone());
            async move { Ok(redis::cmd("EXISTS").arg(marker).query_async::<bool>(&mut c).await?) }
        })
        .await
        .unwrap();

    // Shard 1's node loses that shard's keys (its jobs, marker and all); the others keep theirs.
    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{lost}:*")).query_async(&mut c).await.unwrap();
    assert!(keys.iter().any(|k| k.ends_with(":ready:2")), "shard 1 held ready jobs: {keys:?}");
    let _: () = redis::cmd("DEL").arg(&keys).query_async(&mut c).await.unwrap();
    let on_shard_1 = ids.iter().filter(|id| shard_of(**id) == 1).count();

    let worker_env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let _worker = cluster.spawn_worker(&worker_env).unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(60)).await.unwrap();
    assert_eq!(counts.get("succeeded").copied(), Some(ids.len() as i64), "{counts:?}");
    assert!(on_shard_1 > 10, "{on_shard_1} jobs were on the lost shard");
}
