//! API keys: random, shown once, stored as a SHA-256 hash (they are 160 random bits, so a fast
//! hash leaves nothing to brute-force), found by their visible prefix.
//!
//! A key reads `tern_<8 prefix chars>_<32 secret chars>`, both base62.

use crate::Result;
use chrono::{DateTime, Utc};
use rand::Rng;
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};
use uuid::Uuid;

/// What a key may do.
pub const SCOPES: &[&str] = &["jobs:write", "jobs:read", "admin"];

const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

fn random_base62(n: usize) -> String {
    let mut rng = rand::rng();
    (0..n).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

fn digest(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// A key as lists show it: never the secret.
#[derive(Debug, Clone, Serialize)]
pub struct ApiKey {
    pub id: Uuid,
    pub prefix: String,
    pub tenant: String,
    pub scopes: Vec<String>,
    pub name: Option<String>,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    /// When the key was last used, to the minute.
    pub last_used_at: Option<DateTime<Utc>>,
}

/// Who a request is: the tenant and scopes of its key.
#[derive(Debug, Clone)]
pub struct Principal {
    pub key_id: Uuid,
    pub prefix: String,
    pub tenant: String,
    pub scopes: Vec<String>,
}

impl Principal {
    pub fn has(&self, scope: &str) -> bool {
        self.scopes.iter().any(|s| s == scope)
    }
}

/// Why a key was not accepted.
#[derive(Debug, PartialEq, Eq)]
pub enum KeyRejection {
    Malformed,
    Unknown,
    Revoked,
}

/// Key storage in Postgres.
#[derive(Clone)]
pub struct ApiKeys {
    pub pool: PgPool,
}

impl ApiKeys {
    /// Creates a key; returns it with the whole secret, the only time it is shown.
    pub async fn create(&self, tenant: &str, scopes: &[String], name: Option<&str>) -> Result<(ApiKey, String)> {
        let prefix = format!("tern_{}", random_base62(8));
        let key = format!("{prefix}_{}", random_base62(32));
        let row = sqlx::query(
            "INSERT INTO api_keys (id, prefix, sha256, tenant, scopes, name) VALUES ($1, $2, $3, $4, $5, $6)
             RETURNING id, prefix, tenant, scopes, name, created_at, revoked_at, last_used_at",
        )
        .bind(Uuid::now_v7())
        .bind(&prefix)
        .bind(digest(&key))
        .bind(tenant)
        .bind(scopes)
        .bind(name)
        .fetch_one(&self.pool)
        .await?;
        Ok((key_from_row(&row)?, key))
    }

    /// The principal a presented key stands for.
    pub async fn authenticate(&self, key: &str) -> Result<std::result::Result<Principal, KeyRejection>> {
        let Some(prefix) = key.rsplit_once('_').map(|(p, _)| p).filter(|p| p.starts_with("tern_") && p.len() == 13) else {
            return Ok(Err(KeyRejection::Malformed));
        };
        let row = sqlx::query(
            "SELECT id, prefix, sha256, tenant, scopes, revoked_at,
                    last_used_at IS NULL OR last_used_at < now() - interval '1 minute' AS stale
             FROM api_keys WHERE prefix = $1",
        )
        .bind(prefix)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(Err(KeyRejection::Unknown)) };
        let stored: String = row.try_get("sha256")?;
        // Constant-time comparison of the digests.
        let given = digest(key);
        let same = stored.len() == given.len() && stored.bytes().zip(given.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        if !same {
            return Ok(Err(KeyRejection::Unknown));
        }
        let revoked: Option<DateTime<Utc>> = row.try_get("revoked_at")?;
        if revoked.is_some() {
            return Ok(Err(KeyRejection::Revoked));
        }
        // last_used_at to the minute: a write per request would cost every request a commit.
        if row.try_get::<bool, _>("stale")? {
            sqlx::query("UPDATE api_keys SET last_used_at = now() WHERE prefix = $1").bind(prefix).execute(&self.pool).await?;
        }
        Ok(Ok(Principal {
            key_id: row.try_get("id")?,
            prefix: row.try_get("prefix")?,
            tenant: row.try_get("tenant")?,
            scopes: row.try_get("scopes")?,
        }))
    }

    /// Revokes the key with this id or prefix; false when there is none.
    pub async fn revoke(&self, id_or_prefix: &str) -> Result<bool> {
        let id = id_or_prefix.parse::<Uuid>().ok();
        let done = sqlx::query("UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1 OR prefix = $2")
            .bind(id)
            .bind(id_or_prefix)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    pub async fn list(&self) -> Result<Vec<ApiKey>> {
        let rows = sqlx::query(
            "SELECT id, prefix, tenant, scopes, name, created_at, revoked_at, last_used_at FROM api_keys ORDER BY created_at",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(key_from_row).collect()
    }
}

fn key_from_row(r: &sqlx::postgres::PgRow) -> Result<ApiKey> {
    Ok(ApiKey {
        id: r.try_get("id")?,
        prefix: r.try_get("prefix")?,
        tenant: r.try_get("tenant")?,
        scopes: r.try_get("scopes")?,
        name: r.try_get("name")?,
        created_at: r.try_get("created_at")?,
        revoked_at: r.try_get("revoked_at")?,
        last_used_at: r.try_get("last_used_at")?,
    })
}
