//! One source of news about jobs for every wait and stream of an API process.
//!
//! Postgres notifies channel `tern_job_events` with the ids of jobs whose timeline grew (a
//! trigger on `job_events`, migration 0016), whoever wrote it: this API, another replica, a
//! worker, the reaper. One connection per process listens ([`JobWatches::start`]) and wakes the
//! watches of those jobs. A wait (`?wait=`, the OpenAI routes' answers) or a stream reads the
//! job from Postgres only when woken, not several times a second, so thousands of open streams
//! cost the database nothing while their jobs wait.
//!
//! A notification can be missed: the listening connection may drop (Postgres restarts), and
//! what was sent meanwhile is lost. The listener then wakes every watch, and every watch also
//! wakes on its own after [`SAFETY_RECHECK`].
//!
//! Open watches are capped per API key and per process ([`WatchLimits`]): one more is refused
//! with 429 `too_many_streams`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::watch;
use uuid::Uuid;

use crate::error::ApiError;

/// The channel migration 0016's trigger notifies: payload, the ids of the jobs whose timeline
/// grew in one statement, comma-separated.
pub const CHANNEL: &str = "tern_job_events";

/// The longest a watch sleeps without news before it looks for itself: the bound on how late a
/// missed notification is noticed.
pub const SAFETY_RECHECK: Duration = Duration::from_secs(30);

/// How many watches may be open at once.
#[derive(Debug, Clone, Copy)]
pub struct WatchLimits {
    /// In this process (`TERN_MAX_STREAMS`, default 10,000).
    pub per_process: usize,
    /// For one API key, in this process (`TERN_MAX_STREAMS_PER_KEY`, default 1,000).
    pub per_key: usize,
}

impl Default for WatchLimits {
    fn default() -> Self {
        WatchLimits { per_process: 10_000, per_key: 1_000 }
    }
}

/// The process's watches. Cheap to clone.
#[derive(Clone)]
pub struct JobWatches(Arc<Inner>);

struct Inner {
    limits: WatchLimits,
    state: Mutex<Registry>,
    /// Bumped to wake every watch (the listener reconnected: notifications may be lost).
    everyone: watch::Sender<u64>,
}

#[derive(Default)]
struct Registry {
    /// Per job: its version, bumped on each notification, and how many watches hold it.
    jobs: HashMap<Uuid, (watch::Sender<u64>, usize)>,
    /// Open watches per API key, and in all.
    per_key: HashMap<Uuid, usize>,
    open: usize,
}

impl JobWatches {
    /// Watches woken by nothing but their own [`SAFETY_RECHECK`] and [`JobWatches::wake`]:
    /// start the listener with [`JobWatches::start`].
    pub fn new(limits: WatchLimits) -> JobWatches {
        JobWatches(Arc::new(Inner { limits, state: Mutex::default(), everyone: watch::channel(0).0 }))
    }

    /// The watches, and the task that listens for Postgres's notifications on one connection of
    /// its own (reconnecting as long as the process lives).
    pub fn start(pool: PgPool, limits: WatchLimits) -> JobWatches {
        let watches = JobWatches::new(limits);
        let this = watches.clone();
        tokio::spawn(async move { this.listen(pool).await });
        watches
    }

    async fn listen(&self, pool: PgPool) {
        loop {
            let mut listener = match PgListener::connect_with(&pool).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "job watches: cannot connect to listen; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            if let Err(e) = listener.listen(CHANNEL).await {
                tracing::warn!(error = %e, "job watches: LISTEN failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            // Anything sent before LISTEN took effect went unheard.
            self.wake_all();
            loop {
                match listener.try_recv().await {
                    Ok(Some(n)) => self.wake(n.payload().split(',').filter_map(|id| id.trim().parse().ok())),
                    // The connection dropped and came back: what was sent meanwhile is lost.
                    Ok(None) => self.wake_all(),
                    Err(e) => {
                        tracing::warn!(error = %e, "job watches: the listening connection failed; reconnecting");
                        self.wake_all();
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        break;
                    }
                }
            }
        }
    }

    /// Wakes the watches of these jobs.
    pub fn wake(&self, ids: impl IntoIterator<Item = Uuid>) {
        let state = self.lock();
        for id in ids {
            if let Some((version, _)) = state.jobs.get(&id) {
                version.send_modify(|v| *v += 1);
            }
        }
    }

    fn wake_all(&self) {
        self.0.everyone.send_modify(|v| *v += 1);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A watch over job `id` for API key `key`; 429 `too_many_streams` when the key or the
    /// process already has as many open as allowed.
    pub fn watch(&self, key: Uuid, id: Uuid) -> Result<JobWatch, ApiError> {
        Ok(self.reserve(key)?.attach(id))
    }

    /// A place for one more watch of `key`'s, counted against the limits, for a job not made
    /// yet: refused (429 `too_many_streams`) before anything is done on the caller's behalf.
    pub fn reserve(&self, key: Uuid) -> Result<WatchSlot, ApiError> {
        let mut state = self.lock();
        let WatchLimits { per_process, per_key } = self.0.limits;
        let held = state.per_key.get(&key).copied().unwrap_or(0);
        if state.open >= per_process || held >= per_key {
            let (count, limit, whose) =
                if held >= per_key { (held, per_key, "this API key") } else { (state.open, per_process, "this server") };
            return Err(ApiError::too_many_streams(format!(
                "{whose} has {count} streams and waits open, its limit is {limit}; close one or try again later"
            )));
        }
        state.open += 1;
        *state.per_key.entry(key).or_default() += 1;
        Ok(WatchSlot { watches: self.clone(), key })
    }

    /// Watches open now, in this process.
    #[cfg(test)]
    pub fn open(&self) -> usize {
        self.lock().open
    }
}

/// A watch counted against the limits, not yet over a job ([`JobWatches::reserve`]).
pub struct WatchSlot {
    watches: JobWatches,
    key: Uuid,
}

impl WatchSlot {
    /// The watch over job `id`.
    pub fn attach(self, id: Uuid) -> JobWatch {
        let mut state = self.watches.lock();
        let entry = state.jobs.entry(id).or_insert_with(|| (watch::channel(0).0, 0));
        entry.1 += 1;
        let job = entry.0.subscribe();
        drop(state);
        let everyone = self.watches.0.everyone.subscribe();
        JobWatch { slot: self, id, job, everyone }
    }
}

impl Drop for WatchSlot {
    fn drop(&mut self) {
        let mut state = self.watches.lock();
        state.open -= 1;
        if let Some(n) = state.per_key.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                state.per_key.remove(&self.key);
            }
        }
    }
}

/// One wait's or stream's watch over a job. Dropping it closes it.
pub struct JobWatch {
    slot: WatchSlot,
    id: Uuid,
    job: watch::Receiver<u64>,
    everyone: watch::Receiver<u64>,
}

impl JobWatch {
    /// Waits until the job may have changed since the last call (or since the watch was made),
    /// or `at_most` passed, capped at [`SAFETY_RECHECK`]. Returns whether it was news (false:
    /// the time ran out).
    pub async fn changed(&mut self, at_most: Duration) -> bool {
        let sleep = tokio::time::sleep(at_most.min(SAFETY_RECHECK));
        tokio::select! {
            r = self.job.changed() => r.is_ok(),
            r = self.everyone.changed() => r.is_ok(),
            _ = sleep => false,
        }
    }

    /// A live stream's wait before it looks again, at most `limit`: `every` while the job runs
    /// (its progress is polled), else until the job changes. Returns whether the job must be
    /// read again: it changed, or the wait was for news of a job not running and ran out (the
    /// [`SAFETY_RECHECK`], or `limit`).
    pub async fn pause(&mut self, running: bool, every: Duration, limit: Duration) -> bool {
        let at_most = if running { every } else { SAFETY_RECHECK };
        self.changed(at_most.min(limit)).await || !running
    }
}

impl Drop for JobWatch {
    fn drop(&mut self) {
        let mut state = self.slot.watches.lock();
        if let Some(entry) = state.jobs.get_mut(&self.id) {
            entry.1 -= 1;
            if entry.1 == 0 {
                state.jobs.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_watch_wakes_for_its_own_job_and_news_sent_before_it_waited() {
        let watches = JobWatches::new(WatchLimits::default());
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let mut wa = watches.watch(Uuid::nil(), a).unwrap();
        // News that came while the watch was busy is not lost.
        watches.wake([a]);
        assert!(wa.changed(Duration::from_secs(5)).await);
        watches.wake([b]);
        assert!(!wa.changed(Duration::from_millis(50)).await, "another job's news");
        watches.wake_all();
        assert!(wa.changed(Duration::from_secs(5)).await);
    }

    #[tokio::test]
    async fn watches_are_capped_per_key_and_per_process_and_closed_on_drop() {
        let watches = JobWatches::new(WatchLimits { per_process: 3, per_key: 2 });
        let (id, a, b, c) = (Uuid::now_v7(), Uuid::from_u128(1), Uuid::from_u128(2), Uuid::from_u128(3));
        let (w1, _w2) = (watches.watch(a, id).unwrap(), watches.watch(a, id).unwrap());
        let refused = watches.watch(a, id).err().expect("a third for key a");
        assert_eq!((refused.status.as_u16(), refused.code), (429, "too_many_streams"));
        let _w3 = watches.watch(b, id).unwrap();
        assert!(watches.watch(c, Uuid::now_v7()).is_err(), "the process's three are open");
        drop(w1);
        assert_eq!(watches.open(), 2);
        let _w4 = watches.watch(c, id).unwrap();
        assert_eq!(watches.lock().jobs[&id].1, 3);
    }
}
