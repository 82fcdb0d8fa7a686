//! tern's job domain, shared by `tern-api`, `tern-worker` and the black-box tests.
//!
//! - [`Job`], [`JobKind`], [`Priority`] and [`JobState`]: what a job is.
//! - [`Store`]: Postgres, the source of truth. Every state change is one transaction that also
//!   appends to the job's timeline (`job_events`); batch transitions are one statement.
//! - [`Queue`]: Redis, which only holds what is waiting or leased: ready sorted sets per kind
//!   (priority + aging + FIFO folded into the score, with tenants sharing each priority by
//!   weight), a delayed set, and fenced leases.
//! - [`Reaper`] and [`Reconciler`]: the background services that return expired leases to the
//!   queue and restore Redis from Postgres after it lost data.
//! - [`ObjectStore`]: S3-compatible storage for uploads and job outputs.

pub mod admin;
pub mod api_keys;
pub mod config;
pub mod egress;
pub mod error;
pub mod file_ref;
pub mod job;
pub mod kind;
pub mod logging;
pub mod model_versions;
pub mod object_store;
pub mod priority;
pub mod prometheus;
pub mod queue;
pub mod reaper;
pub mod reconciler;
pub mod retry_policy;
pub mod schemas;
pub mod state;
pub mod store;
pub mod tenants;

pub use error::{Error, Result};
pub use job::{Failure, Job, JobOutput, NewJob, Webhook};
pub use kind::JobKind;
pub use object_store::ObjectStore;
pub use priority::Priority;
pub use queue::Queue;
pub use reaper::Reaper;
pub use reconciler::Reconciler;
pub use retry_policy::RetryPolicy;
pub use state::JobState;
pub use store::Store;

/// Migrations embedded from `migrations/`; run by `tern-api migrate` and at API start.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");
