//! OpenAI's Batch API over jobs: `POST /v1/batches` takes a JSONL file uploaded with
//! `POST /v1/files` (`purpose=batch`), and every line of it becomes a job of the line's route
//! (`/v1/audio/transcriptions`, `/v1/audio/translations`, `/v1/embeddings`,
//! `/v1/chat/completions`, `/v1/completions`, `/v1/images/generations`) through the same queue, checks and tenant as any
//! other, at `low` priority unless `X-Tern-Priority` says otherwise. A line's `custom_id`,
//! scoped to its batch, is its job's idempotency key, so a batch submitted twice over (a
//! replica restarting mid-file) makes each job once. The answers go to an output file and
//! the failures to an error file (JSONL in object storage), one line for every request.
//!
//! Beyond OpenAI: a batch's lines may mix routes (OpenAI requires each to be the batch's
//! `endpoint`), audio lines name their file by http(s) URL or upload key, and the
//! `completion_window` may be 1 to 168 hours (`"24h"` is OpenAI's only one).
//!
//! [`runner::Runner`] moves batches along in the background.

pub mod lines;
pub mod routes;
pub mod runner;

use crate::error::ApiError;
use crate::state::AppState;
use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use sqlx::Row;

/// A batch's life, as OpenAI names its states.
pub mod status {
    pub const VALIDATING: &str = "validating";
    pub const FAILED: &str = "failed";
    pub const IN_PROGRESS: &str = "in_progress";
    pub const FINALIZING: &str = "finalizing";
    pub const COMPLETED: &str = "completed";
    pub const EXPIRED: &str = "expired";
    pub const CANCELLING: &str = "cancelling";
    pub const CANCELLED: &str = "cancelled";
}

/// A batch's record.
#[derive(Debug, Clone)]
pub struct Batch {
    pub id: String,
    pub tenant: String,
    pub endpoint: String,
    pub input_file_id: String,
    pub completion_window: String,
    pub priority: String,
    pub metadata: Option<Value>,
    pub status: String,
    pub errors: Option<Value>,
    pub total: i32,
    pub submitted: i32,
    pub completed: Option<i32>,
    pub failed: Option<i32>,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub in_progress_at: Option<DateTime<Utc>>,
    pub finalizing_at: Option<DateTime<Utc>>,
    pub completed_at: Option<DateTime<Utc>>,
    pub failed_at: Option<DateTime<Utc>>,
    pub expired_at: Option<DateTime<Utc>>,
    pub cancelling_at: Option<DateTime<Utc>>,
    pub cancelled_at: Option<DateTime<Utc>>,
}

impl Batch {
    pub fn from_row(r: &sqlx::postgres::PgRow) -> Result<Batch, sqlx::Error> {
        Ok(Batch {
            id: r.try_get("id")?,
            tenant: r.try_get("tenant")?,
            endpoint: r.try_get("endpoint")?,
            input_file_id: r.try_get("input_file_id")?,
            completion_window: r.try_get("completion_window")?,
            priority: r.try_get("priority")?,
            metadata: r.try_get("metadata")?,
            status: r.try_get("status")?,
            errors: r.try_get("errors")?,
            total: r.try_get("total")?,
            submitted: r.try_get("submitted")?,
            completed: r.try_get("completed")?,
            failed: r.try_get("failed")?,
            output_file_id: r.try_get("output_file_id")?,
            error_file_id: r.try_get("error_file_id")?,
            created_at: r.try_get("created_at")?,
            expires_at: r.try_get("expires_at")?,
            in_progress_at: r.try_get("in_progress_at")?,
            finalizing_at: r.try_get("finalizing_at")?,
            completed_at: r.try_get("completed_at")?,
            failed_at: r.try_get("failed_at")?,
            expired_at: r.try_get("expired_at")?,
            cancelling_at: r.try_get("cancelling_at")?,
            cancelled_at: r.try_get("cancelled_at")?,
        })
    }

    /// Batch `id`, whoever's it is.
    pub async fn load(state: &AppState, id: &str) -> Result<Option<Batch>, ApiError> {
        let row = sqlx::query("SELECT * FROM batches WHERE id = $1").bind(id).fetch_optional(state.store.pool()).await.map_err(ApiError::from)?;
        row.as_ref().map(Batch::from_row).transpose().map_err(ApiError::from)
    }

    /// `(completed, failed)`: fixed once it ended; before, counted from its jobs now. A line
    /// refused before it became a job counts as failed.
    pub async fn counts(&self, state: &AppState) -> Result<(i64, i64), ApiError> {
        if let (Some(completed), Some(failed)) = (self.completed, self.failed) {
            return Ok((completed.into(), failed.into()));
        }
        let row = sqlx::query(
            "SELECT count(*) FILTER (WHERE j.state = 'succeeded') AS completed,
                    count(*) FILTER (WHERE r.job_id IS NULL OR j.state IN ('failed', 'canceled')) AS failed
             FROM batch_requests r LEFT JOIN jobs j ON j.id = r.job_id WHERE r.batch_id = $1",
        )
        .bind(&self.id)
        .fetch_one(state.store.pool())
        .await
        .map_err(ApiError::from)?;
        Ok((row.try_get("completed").map_err(ApiError::from)?, row.try_get("failed").map_err(ApiError::from)?))
    }

    /// OpenAI's Batch object, with `request_counts` as they stand.
    pub async fn view(&self, state: &AppState) -> Result<Value, ApiError> {
        let (completed, failed) = self.counts(state).await?;
        let at = |t: &Option<DateTime<Utc>>| t.map(|t| t.timestamp());
        Ok(json!({
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": self.errors.as_ref().map(|data| json!({ "object": "list", "data": data })),
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at.timestamp(),
            "in_progress_at": at(&self.in_progress_at),
            "expires_at": self.expires_at.timestamp(),
            "finalizing_at": at(&self.finalizing_at),
            "completed_at": at(&self.completed_at),
            "failed_at": at(&self.failed_at),
            "expired_at": at(&self.expired_at),
            "cancelling_at": at(&self.cancelling_at),
            "cancelled_at": at(&self.cancelled_at),
            "request_counts": { "total": self.total, "completed": completed, "failed": failed },
            "metadata": self.metadata,
            "priority": self.priority,
        }))
    }
}
