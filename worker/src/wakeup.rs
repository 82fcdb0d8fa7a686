//! Wake-up hints: Redis announces on a channel when jobs of a kind become ready, and the idle
//! pull loops wake at once instead of at their next poll (up to `TERN_IDLE_POLL_MAX_MS` later).
//! The poll stays as the fallback: a hint lost while the subscription reconnects costs one poll
//! interval, never a job.

use std::sync::Arc;
use std::time::Duration;
use futures::StreamExt;
use tern_jobs::{JobKind, Queue};
use tokio::sync::{watch, Notify};

/// Keeps a subscription to `kinds`' wake-up channel until `shutdown`, waking every loop waiting
/// on `notify` at each hint. Reconnects after a second when Redis goes away.
pub async fn listen(queue: Queue, kinds: Vec<JobKind>, notify: Arc<Notify>, mut shutdown: watch::Receiver<bool>) {
    while !*shutdown.borrow() {
        match queue.wakeups(&kinds).await {
            Ok(hints) => {
                tokio::pin!(hints);
                loop {
                    tokio::select! {
                        hint = hints.next() => match hint {
                            Some(_) => notify.notify_waiters(),
                            None => break,
                        },
                        _ = shutdown.changed() => return,
                    }
                }
                tracing::debug!("wake-up subscription ended; subscribing again");
                // Jobs may have become ready while it was down: let the loops look.
                notify.notify_waiters();
            }
            Err(e) => tracing::debug!(error = %e, "wake-up subscription failed; the pull loops poll meanwhile"),
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = shutdown.changed() => return,
        }
    }
}
