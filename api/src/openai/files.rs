//! `/v1/files`: the files of the Batch API, as OpenAI's Files API serves them. A tenant uploads
//! a batch's input (`purpose=batch`, JSONL); a batch writes its output and error files
//! (`purpose=batch_output`). The bytes live in object storage under `files/{tenant}/{id}`,
//! the record in Postgres (`files`).

use super::OpenAiError;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::ApiQuery;
use crate::routes::uploads::tenant_segment;
use crate::state::AppState;
use axum::body::Body;
use axum::extract::{Multipart, Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::Row;
use uuid::Uuid;

/// Default and largest page of `GET /v1/files`.
pub const LIST_LIMIT_DEFAULT: i64 = 100;
pub const LIST_LIMIT_MAX: i64 = 10_000;

/// A file's record.
#[derive(Debug, Clone)]
pub struct FileRecord {
    pub id: String,
    pub tenant: String,
    pub purpose: String,
    pub filename: String,
    pub bytes: i64,
    pub object_key: String,
    pub created_at: DateTime<Utc>,
}

impl FileRecord {
    /// A new record for a file of `tenant`, with its id and object key.
    pub fn new(tenant: &str, purpose: &str, filename: &str) -> FileRecord {
        let id = format!("file-{}", Uuid::now_v7().simple());
        FileRecord {
            object_key: format!("files/{}/{id}", tenant_segment(tenant)),
            id,
            tenant: tenant.to_string(),
            purpose: purpose.to_string(),
            filename: filename.to_string(),
            bytes: 0,
            created_at: Utc::now(),
        }
    }

    /// OpenAI's File object.
    pub fn view(&self) -> Value {
        json!({
            "id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at.timestamp(),
            "filename": self.filename, "purpose": self.purpose, "status": "processed",
            "expires_at": null, "status_details": null,
        })
    }

    pub async fn insert(&self, db: impl sqlx::PgExecutor<'_>) -> Result<(), ApiError> {
        sqlx::query(
            "INSERT INTO files (id, tenant, purpose, filename, bytes, object_key, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&self.id)
        .bind(&self.tenant)
        .bind(&self.purpose)
        .bind(&self.filename)
        .bind(self.bytes)
        .bind(&self.object_key)
        .bind(self.created_at)
        .execute(db)
        .await
        .map_err(ApiError::from)?;
        Ok(())
    }

    fn from_row(row: &sqlx::postgres::PgRow) -> Result<FileRecord, sqlx::Error> {
        Ok(FileRecord {
            id: row.try_get("id")?,
            tenant: row.try_get("tenant")?,
            purpose: row.try_get("purpose")?,
            filename: row.try_get("filename")?,
            bytes: row.try_get("bytes")?,
            object_key: row.try_get("object_key")?,
            created_at: row.try_get("created_at")?,
        })
    }

    /// `tenant`'s file `id`: another tenant's is 404 `file_not_found`, like a missing one.
    pub async fn get(state: &AppState, tenant: &str, id: &str) -> Result<FileRecord, OpenAiError> {
        let row = sqlx::query("SELECT * FROM files WHERE id = $1 AND tenant = $2")
            .bind(id)
            .bind(tenant)
            .fetch_optional(state.store.pool())
            .await
            .map_err(ApiError::from)?;
        match row {
            Some(row) => Ok(FileRecord::from_row(&row).map_err(ApiError::from)?),
            None => Err(not_found(id)),
        }
    }
}

fn not_found(id: &str) -> OpenAiError {
    OpenAiError { status: StatusCode::NOT_FOUND, code: "file_not_found".into(), message: format!("no file {id}"), param: Some("file_id") }
}

/// Upload a file: multipart `purpose` (`batch`) and `file` (JSONL, at most
/// `TERN_MAX_BATCH_FILE_BYTES`), streamed to object storage as it arrives.
pub async fn upload(State(state): State<AppState>, caller: Caller, mut form: Multipart) -> Result<Response, OpenAiError> {
    let tenant = caller.require("jobs:write")?.tenant.clone();
    let bad_form = |e: axum::extract::multipart::MultipartError| OpenAiError {
        status: e.status(),
        code: "invalid_multipart".into(),
        message: format!("the multipart form: {}", e.body_text()),
        param: None,
    };
    let (mut purpose, mut stored) = (None, None);
    while let Some(mut field) = form.next_field().await.map_err(bad_form)? {
        match field.name().unwrap_or_default() {
            "purpose" => purpose = Some(field.text().await.map_err(bad_form)?),
            "file" => {
                let filename = field.file_name().unwrap_or("upload.jsonl").to_string();
                let mut record = FileRecord::new(&tenant, "batch", &filename);
                let mut writer = state.objects.writer(&record.object_key, "application/jsonl");
                while let Some(chunk) = field.chunk().await.map_err(bad_form)? {
                    writer.write(&chunk).await.map_err(ApiError::from)?;
                }
                record.bytes = writer.finish().await.map_err(ApiError::from)?.size;
                stored = Some(record);
            }
            _ => {}
        }
    }
    let record = stored.filter(|r| r.bytes > 0).ok_or_else(|| OpenAiError::invalid("invalid_file", "the form needs a non-empty \"file\"", "file"))?;
    match purpose.as_deref() {
        Some("batch") => {}
        other => {
            // The bytes went to storage as they came; a refused file leaves none behind.
            let _ = state.objects.delete(&record.object_key).await;
            return Err(OpenAiError::invalid(
                "invalid_purpose",
                format!("purpose {other:?}: tern keeps files for batches only (purpose \"batch\")"),
                "purpose",
            ));
        }
    }
    record.insert(state.store.pool()).await?;
    Ok((StatusCode::OK, Json(record.view())).into_response())
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    purpose: Option<String>,
    limit: Option<String>,
    after: Option<String>,
    order: Option<String>,
}

/// List files, newest first (`order=asc` for oldest first), `limit` 1 to 10,000 (default
/// 100), `after` a file id of the previous page.
pub async fn list(State(state): State<AppState>, caller: Caller, ApiQuery(q): ApiQuery<ListQuery>) -> Result<Json<Value>, OpenAiError> {
    let tenant = caller.require("jobs:read")?.tenant.clone();
    let limit = match q.limit.as_deref() {
        None => LIST_LIMIT_DEFAULT,
        Some(l) => l.parse::<i64>().ok().filter(|n| (1..=LIST_LIMIT_MAX).contains(n)).ok_or_else(|| {
            OpenAiError::invalid("invalid_limit", format!("limit must be an integer from 1 to {LIST_LIMIT_MAX}"), "limit")
        })?,
    };
    let ascending = match q.order.as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(other) => return Err(OpenAiError::invalid("invalid_order", format!("order {other:?}: use asc or desc"), "order")),
    };
    let (direction, compare) = if ascending { ("ASC", ">") } else { ("DESC", "<") };
    let sql = format!(
        "SELECT * FROM files WHERE tenant = $1 AND ($2::text IS NULL OR purpose = $2)
           AND ($3::text IS NULL OR (created_at, id) {compare} (SELECT created_at, id FROM files WHERE id = $3 AND tenant = $1))
         ORDER BY created_at {direction}, id {direction} LIMIT $4"
    );
    let rows = sqlx::query(&sql)
        .bind(&tenant)
        .bind(q.purpose.as_deref())
        .bind(q.after.as_deref())
        .bind(limit + 1)
        .fetch_all(state.store.pool())
        .await
        .map_err(ApiError::from)?;
    let mut files: Vec<FileRecord> =
        rows.iter().map(FileRecord::from_row).collect::<Result<_, _>>().map_err(ApiError::from)?;
    let has_more = files.len() as i64 > limit;
    files.truncate(limit as usize);
    Ok(Json(json!({
        "object": "list",
        "data": files.iter().map(FileRecord::view).collect::<Vec<_>>(),
        "first_id": files.first().map(|f| &f.id),
        "last_id": files.last().map(|f| &f.id),
        "has_more": has_more,
    })))
}

/// A file's record.
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, OpenAiError> {
    let tenant = &caller.require("jobs:read")?.tenant;
    Ok(Json(FileRecord::get(&state, tenant, &id).await?.view()))
}

/// A file's bytes, streamed from object storage.
pub async fn content(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Response, OpenAiError> {
    let tenant = &caller.require("jobs:read")?.tenant;
    let record = FileRecord::get(&state, tenant, &id).await?;
    let (size, bytes) = state.objects.stream(&record.object_key).await.map_err(ApiError::from)?.ok_or_else(|| not_found(&id))?;
    let body = Body::from_stream(bytes.map_err(|e| std::io::Error::other(e.to_string())));
    Ok(([(header::CONTENT_TYPE, "application/octet-stream".to_string()), (header::CONTENT_LENGTH, size.to_string())], body).into_response())
}

/// Delete a file. The input file of a batch still running is kept (409 `file_in_use`): the
/// batch reads it again to write its answers.
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, OpenAiError> {
    let tenant = caller.require("jobs:write")?.tenant.clone();
    let record = FileRecord::get(&state, &tenant, &id).await?;
    let in_use: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM batches WHERE input_file_id = $1 AND status IN ('validating', 'in_progress', 'finalizing', 'cancelling'))",
    )
    .bind(&id)
    .fetch_one(state.store.pool())
    .await
    .map_err(ApiError::from)?;
    if in_use {
        return Err(OpenAiError {
            status: StatusCode::CONFLICT,
            code: "file_in_use".into(),
            message: format!("{id} is the input of a batch still running; delete it once the batch ended"),
            param: Some("file_id"),
        });
    }
    // Batches that named it keep its id, which then answers 404, as OpenAI's do.
    sqlx::query("DELETE FROM files WHERE id = $1").bind(&id).execute(state.store.pool()).await.map_err(ApiError::from)?;
    state.objects.delete(&record.object_key).await.map_err(ApiError::from)?;
    Ok(Json(json!({ "id": id, "object": "file", "deleted": true })))
}
