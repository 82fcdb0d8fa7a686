use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How soon a job should run relative to others of its kind. Default: [`Priority::Normal`].
///
/// Within a priority, tenants share the workers by weight and each tenant's jobs run first in,
/// first out. Waiting raises a job's effective priority
/// (aging, see [`crate::config::QueueArgs::aging_step_ms`]) so low jobs are never starved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    Urgent,
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    pub const ALL: &'static [Priority] = &[Priority::Urgent, Priority::High, Priority::Normal, Priority::Low];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Urgent => "urgent",
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    /// 0 for urgent up to 3 for low: how many aging steps a job of this priority is behind an
    /// urgent job that arrived at the same moment.
    pub fn rank(self) -> u8 {
        match self {
            Priority::Urgent => 0,
            Priority::High => 1,
            Priority::Normal => 2,
            Priority::Low => 3,
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Priority {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        Priority::ALL.iter().copied().find(|p| p.as_str() == s).ok_or(())
    }
}
