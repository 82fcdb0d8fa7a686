//! Why a running job must stop early. Each job in hand has a [`StopSignal`]; the lease keeper
//! and the shutdown path raise it, and the job's executor checks it at its safe points.

use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A user canceled the job: it ends `canceled`.
    Cancel,
    /// The lease was lost (another worker holds the job): stop and report nothing.
    LeaseLost,
    /// The worker is shutting down and its grace period ran out: hand the job back unrun.
    Release,
}

#[derive(Clone)]
pub struct StopSignal(watch::Sender<Option<StopReason>>);

impl StopSignal {
    pub fn new() -> Self {
        StopSignal(watch::channel(None).0)
    }

    /// Raises the signal; the first reason wins.
    pub fn raise(&self, reason: StopReason) {
        self.0.send_if_modified(|r| {
            if r.is_none() {
                *r = Some(reason);
                true
            } else {
                false
            }
        });
    }

    pub fn reason(&self) -> Option<StopReason> {
        *self.0.borrow()
    }

    /// Resolves once the signal is raised.
    pub async fn raised(&self) -> StopReason {
        let mut rx = self.0.subscribe();
        let r = rx.wait_for(Option::is_some).await.map(|r| r.expect("checked"));
        r.unwrap_or(StopReason::Release)
    }
}
