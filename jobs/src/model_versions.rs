//! Model versions for hot swaps. An admin registers a version (a model folder or hub id) for a
//! kind; it is the kind's *candidate*. Each worker loads it in the background, health-checks it
//! and switches between batches; the first worker to pass promotes it to *active*, and the
//! version it replaced becomes *previous*, kept for rollback. A candidate that fails a health
//! check is marked *failed* and the workers keep the active one.

use crate::{JobKind, Result, Store};
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::Row;
use uuid::Uuid;

/// A kind's version's place in the rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VersionState {
    /// Registered: workers are loading and health-checking it.
    Candidate,
    /// What workers run.
    Active,
    /// What ran before the active one; `rollback` makes it active again.
    Previous,
    /// Replaced twice, rolled back from, or superseded as a candidate.
    Retired,
    /// Failed to load or failed its health check on a worker.
    Failed,
}

impl VersionState {
    pub const ALL: [VersionState; 5] =
        [VersionState::Candidate, VersionState::Active, VersionState::Previous, VersionState::Retired, VersionState::Failed];

    fn parse(s: &str) -> VersionState {
        match s {
            "candidate" => VersionState::Candidate,
            "active" => VersionState::Active,
            "previous" => VersionState::Previous,
            "retired" => VersionState::Retired,
            _ => VersionState::Failed,
        }
    }
}

/// One worker's swap to a version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SwapState {
    Loading,
    HealthCheck,
    /// Loaded and healthy, about to be switched in.
    Ready,
    Active,
    /// Replaced by a newer version; still resident, so a rollback to it is instant.
    Deprecated,
    Failed,
}

impl SwapState {
    pub const ALL: [SwapState; 6] = [
        SwapState::Loading,
        SwapState::HealthCheck,
        SwapState::Ready,
        SwapState::Active,
        SwapState::Deprecated,
        SwapState::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SwapState::Loading => "loading",
            SwapState::HealthCheck => "health_check",
            SwapState::Ready => "ready",
            SwapState::Active => "active",
            SwapState::Deprecated => "deprecated",
            SwapState::Failed => "failed",
        }
    }
}

/// Where one worker stands with a version.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerSwap {
    pub worker_id: String,
    pub state: String,
    pub error: Option<String>,
    /// Batches the worker ran on the version in use while this one loaded.
    pub batches_during_load: i64,
    pub load_ms: Option<i64>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelVersion {
    pub id: Uuid,
    pub kind: JobKind,
    /// A folder under the workers' models directory, or `hf:OWNER/NAME`.
    pub model: String,
    pub state: VersionState,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub activated_at: Option<DateTime<Utc>>,
    pub workers: Vec<WorkerSwap>,
}

/// The kinds whose model versions are registered: those that run a model, but `audio_embed`,
/// which follows `transcribe`'s ([`JobKind::model_kind`]).
pub fn has_model(kind: JobKind) -> bool {
    kind != JobKind::Echo && kind.model_kind() == kind
}

fn version_from_row(row: &sqlx::postgres::PgRow) -> Result<ModelVersion> {
    let kind: String = row.try_get("kind")?;
    let state: String = row.try_get("state")?;
    Ok(ModelVersion {
        id: row.try_get("id")?,
        kind: kind.parse().map_err(|_| crate::Error::Other(format!("unknown kind {kind} in model_versions")))?,
        model: row.try_get("model")?,
        state: VersionState::parse(&state),
        error: row.try_get("error")?,
        created_at: row.try_get("created_at")?,
        activated_at: row.try_get("activated_at")?,
        workers: Vec::new(),
    })
}

/// What a worker should run for a kind: the candidate while there is one, else the active
/// version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub version: Uuid,
    pub model: String,
    pub candidate: bool,
}

impl Store {
    /// Registers `model` as `kind`'s candidate; a candidate still rolling out is retired.
    pub async fn register_model_version(&self, kind: JobKind, model: &str) -> Result<ModelVersion> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("UPDATE model_versions SET state = 'retired' WHERE kind = $1 AND state = 'candidate'")
            .bind(kind.as_str())
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(
            "INSERT INTO model_versions (id, kind, model, state) VALUES ($1, $2, $3, 'candidate') RETURNING *",
        )
        .bind(Uuid::now_v7())
        .bind(kind.as_str())
        .bind(model)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        version_from_row(&row)
    }

    /// Every version, newest first, with each worker's swap state.
    pub async fn model_versions(&self) -> Result<Vec<ModelVersion>> {
        let rows = sqlx::query("SELECT * FROM model_versions ORDER BY created_at DESC, id DESC").fetch_all(self.pool()).await?;
        let mut versions = rows.iter().map(version_from_row).collect::<Result<Vec<_>>>()?;
        let swaps = sqlx::query("SELECT * FROM worker_models ORDER BY worker_id").fetch_all(self.pool()).await?;
        for row in &swaps {
            let version: Uuid = row.try_get("version_id")?;
            if let Some(v) = versions.iter_mut().find(|v| v.id == version) {
                v.workers.push(WorkerSwap {
                    worker_id: row.try_get("worker_id")?,
                    state: row.try_get("state")?,
                    error: row.try_get("error")?,
                    batches_during_load: row.try_get("batches_during_load")?,
                    load_ms: row.try_get("load_ms")?,
                    updated_at: row.try_get("updated_at")?,
                });
            }
        }
        Ok(versions)
    }

    /// What workers should run for `kind`; `None`: the model each worker was started with.
    pub async fn model_target(&self, kind: JobKind) -> Result<Option<Target>> {
        let row = sqlx::query(
            "SELECT id, model, state FROM model_versions WHERE kind = $1 AND state IN ('candidate', 'active')
             ORDER BY state = 'candidate' DESC LIMIT 1",
        )
        .bind(kind.as_str())
        .fetch_optional(self.pool())
        .await?;
        row.map(|r| {
            let state: String = r.try_get("state")?;
            Ok(Target { version: r.try_get("id")?, model: r.try_get("model")?, candidate: state == "candidate" })
        })
        .transpose()
    }

    /// `kind`'s active version, if an admin made one.
    pub async fn active_model(&self, kind: JobKind) -> Result<Option<Target>> {
        let row = sqlx::query("SELECT id, model FROM model_versions WHERE kind = $1 AND state = 'active'")
            .bind(kind.as_str())
            .fetch_optional(self.pool())
            .await?;
        row.map(|r| Ok(Target { version: r.try_get("id")?, model: r.try_get("model")?, candidate: false })).transpose()
    }

    /// A worker passed `version`'s health check and switched to it: the candidate becomes
    /// active, the active one previous, the previous one retired. Nothing changes if it is no
    /// longer the candidate (another worker promoted it, or it was superseded).
    pub async fn promote_model_version(&self, version: Uuid) -> Result<()> {
        let mut tx = self.pool().begin().await?;
        let kind: Option<String> =
            sqlx::query_scalar("SELECT kind FROM model_versions WHERE id = $1 AND state = 'candidate' FOR UPDATE")
                .bind(version)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(kind) = kind else { return Ok(()) };
        sqlx::query("UPDATE model_versions SET state = 'retired' WHERE kind = $1 AND state = 'previous'")
            .bind(&kind)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE model_versions SET state = 'previous' WHERE kind = $1 AND state = 'active'")
            .bind(&kind)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE model_versions SET state = 'active', activated_at = now() WHERE id = $1")
            .bind(version)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// A candidate failed to load or failed its health check: workers keep the active version.
    pub async fn fail_model_version(&self, version: Uuid, error: &str) -> Result<()> {
        sqlx::query("UPDATE model_versions SET state = 'failed', error = $2 WHERE id = $1 AND state = 'candidate'")
            .bind(version)
            .bind(error)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Makes `kind`'s previous version active again (or, with none, the workers' own models)
    /// and retires the active one and any candidate. Returns the now active version, if any;
    /// `Ok(Err(()))` when there is nothing to roll back from.
    pub async fn rollback_model(&self, kind: JobKind) -> Result<std::result::Result<Option<Uuid>, ()>> {
        let mut tx = self.pool().begin().await?;
        let active: Option<Uuid> =
            sqlx::query_scalar("SELECT id FROM model_versions WHERE kind = $1 AND state = 'active' FOR UPDATE")
                .bind(kind.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        if active.is_none() {
            return Ok(Err(()));
        }
        sqlx::query("UPDATE model_versions SET state = 'retired' WHERE kind = $1 AND state IN ('active', 'candidate')")
            .bind(kind.as_str())
            .execute(&mut *tx)
            .await?;
        let restored: Option<Uuid> = sqlx::query_scalar(
            "UPDATE model_versions SET state = 'active', activated_at = now() WHERE kind = $1 AND state = 'previous' RETURNING id",
        )
        .bind(kind.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Ok(restored))
    }

    /// Records where `worker` stands with `version`.
    pub async fn report_swap(
        &self,
        worker: &str,
        version: Uuid,
        state: SwapState,
        error: Option<&str>,
        batches_during_load: Option<u64>,
        load_ms: Option<u64>,
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO worker_models (worker_id, version_id, state, error, batches_during_load, load_ms)
             VALUES ($1, $2, $3, $4, coalesce($5, 0), $6)
             ON CONFLICT (worker_id, version_id) DO UPDATE SET state = $3, error = $4,
                 batches_during_load = coalesce($5, worker_models.batches_during_load),
                 load_ms = coalesce($6, worker_models.load_ms), updated_at = now()",
        )
        .bind(worker)
        .bind(version)
        .bind(state.as_str())
        .bind(error)
        .bind(batches_during_load.map(|n| n as i64))
        .bind(load_ms.map(|n| n as i64))
        .execute(self.pool())
        .await?;
        Ok(())
    }
}
