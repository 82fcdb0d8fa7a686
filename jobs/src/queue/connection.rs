//! Where the queue's commands go: one Redis server through a connection pool, or a Redis
//! Cluster through one multiplexed cluster connection that follows `MOVED`/`ASK` redirects and
//! failovers. Both hand out a [`Conn`], so every queue operation is written once.

use crate::Result;
use deadpool_redis::{Config as PoolConfig, Pool, Runtime};
use redis::aio::ConnectionLike;
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OnceCell;

/// How long opening the cluster connection may take before the call fails (and the next call
/// tries again): the client's first slot discovery can hang on a node that accepts but never
/// answers.
const CLUSTER_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one cluster command may take, retries through a failover included. A primary's
/// failover takes its replicas `cluster-node-timeout` (15 s by default) to notice, plus an
/// election.
const CLUSTER_RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// The Redis the queue talks to.
#[derive(Clone)]
pub(crate) enum Redis {
    Single(Pool),
    Cluster {
        client: ClusterClient,
        /// Opened on first use, so building a `Queue` stays synchronous and a cluster that is
        /// down at start-up fails calls, not the process.
        conn: Arc<OnceCell<ClusterConnection>>,
    },
}

impl Redis {
    /// A pool of at most `pool_size` connections to `url`, or with `cluster`, a client of the
    /// cluster that `url`'s comma-separated seed nodes belong to (any subset of its nodes).
    pub(crate) fn open(url: &str, cluster: bool, pool_size: usize) -> Result<Redis> {
        if !cluster {
            let mut config = PoolConfig::from_url(url);
            config.pool = Some(deadpool_redis::PoolConfig::new(pool_size));
            let pool = config
                .create_pool(Some(Runtime::Tokio1))
                .map_err(|e| crate::Error::Other(format!("redis pool: {e}")))?;
            return Ok(Redis::Single(pool));
        }
        let client = ClusterClientBuilder::new(seeds(url))
            .connection_timeout(Duration::from_millis(500))
            .response_timeout(Duration::from_secs(5))
            .overall_response_timeout(Some(CLUSTER_RESPONSE_TIMEOUT))
            // Retries back off 100 ms .. 1 s: enough to ride out a failover.
            .retries(40)
            .min_retry_wait(100)
            .max_retry_wait(1000)
            .build()?;
        Ok(Redis::Cluster { client, conn: Arc::new(OnceCell::new()) })
    }

    pub(crate) async fn conn(&self) -> Result<Conn> {
        match self {
            Redis::Single(pool) => Ok(Conn::Pooled(pool.get().await?)),
            Redis::Cluster { client, conn } => {
                let c = conn
                    .get_or_try_init(|| async {
                        match tokio::time::timeout(CLUSTER_CONNECT_TIMEOUT, client.get_async_connection()).await {
                            Ok(c) => Ok(c?),
                            Err(_) => Err(crate::Error::Other("redis cluster: no node answered in time".into())),
                        }
                    })
                    .await?;
                Ok(Conn::Cluster(c.clone()))
            }
        }
    }

    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Redis::Cluster { .. })
    }
}

/// The seed URLs of a comma-separated list.
pub(crate) fn seeds(url: &str) -> Vec<String> {
    url.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
}

/// Clients for the wake-up subscriptions. A cluster forwards every `PUBLISH` to all its nodes,
/// so a subscription to any one node hears every hint; each new subscription goes to the next
/// seed, so one lost with its node is made again elsewhere.
pub(crate) struct Subscribers {
    clients: Vec<redis::Client>,
    next: AtomicUsize,
}

impl Subscribers {
    pub(crate) fn open(url: &str) -> Result<Subscribers> {
        let clients = seeds(url).iter().map(|s| redis::Client::open(s.as_str())).collect::<Result<Vec<_>, _>>()?;
        if clients.is_empty() {
            return Err(crate::Error::Other(format!("no Redis URL in {url:?}")));
        }
        Ok(Subscribers { clients, next: AtomicUsize::new(0) })
    }

    pub(crate) fn next(&self) -> &redis::Client {
        &self.clients[self.next.fetch_add(1, Ordering::Relaxed) % self.clients.len()]
    }
}

/// One connection of either kind; implements [`ConnectionLike`], so commands, pipelines and
/// scripts run on it alike. A cluster routes a script by its first key, so each queue script
/// names only keys of one slot.
pub(crate) enum Conn {
    Pooled(deadpool_redis::Connection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Pooled(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Pooled(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Pooled(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}
