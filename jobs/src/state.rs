use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Where a job is in its life. `succeeded`, `failed` and `canceled` are terminal: a job reaches
/// exactly one of them, once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Waiting in its kind's ready queue.
    Queued,
    /// Waiting for its `run_at`.
    Scheduled,
    /// Leased by a worker.
    Running,
    /// Failed an attempt (or lost its lease) and waits for its backoff to run again.
    Retrying,
    Succeeded,
    /// Failed permanently or used its last attempt; kept for inspection (the dead-letter set).
    Failed,
    Canceled,
}

impl JobState {
    pub const ALL: &'static [JobState] = &[
        JobState::Queued,
        JobState::Scheduled,
        JobState::Running,
        JobState::Retrying,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Canceled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Scheduled => "scheduled",
            JobState::Running => "running",
            JobState::Retrying => "retrying",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Canceled => "canceled",
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Canceled)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobState {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        JobState::ALL.iter().copied().find(|p| p.as_str() == s).ok_or(())
    }
}
