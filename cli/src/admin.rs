//! `tern queues` and `tern keys` (admin scope).

use crate::api::Api;
use crate::output::Output;
use crate::Outcome;
use anyhow::Result;
use serde_json::{json, Value};

#[derive(clap::Subcommand)]
pub enum KeysCommand {
    /// Every key (without secrets).
    List,
    /// A new key, printed once.
    Create {
        #[arg(long)]
        tenant: String,
        /// Comma-separated: jobs:read, jobs:write, admin.
        #[arg(long, value_delimiter = ',', default_value = "jobs:read,jobs:write")]
        scopes: Vec<String>,
        #[arg(long)]
        name: Option<String>,
    },
    /// Revoke a key by id or prefix; it stops working at once.
    Revoke { id: String },
}

pub async fn queues(api: &Api, out: &Output) -> Result<Outcome> {
    let queues = api.get("/v1/admin/queues").await?;
    let rows: Vec<Value> = queues["queues"]
        .as_array()
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .map(|q| {
            let t = &q["total"];
            let by_priority = ["urgent", "high", "normal", "low"]
                .iter()
                .map(|p| format!("{}", q["priorities"][p]["queued"].as_i64().unwrap_or(0)))
                .collect::<Vec<_>>()
                .join("/");
            json!({
                "kind": q["kind"], "paused": q["paused"], "queued": t["queued"], "running": t["running"],
                "scheduled": t["scheduled"], "retrying": t["retrying"], "failed": t["failed"],
                "queued_by_priority": by_priority, "oldest_queued_s": q["oldest_queued_seconds"].as_f64().map(|s| (s * 10.0).round() / 10.0),
                "done_last_5m": q["succeeded"]["last_5m"],
            })
        })
        .collect();
    if out.json {
        out.print(&queues);
    } else {
        out.table(&rows, &["kind", "paused", "queued", "running", "scheduled", "retrying", "failed", "queued_by_priority", "oldest_queued_s", "done_last_5m"]);
    }
    Ok(Outcome::Ok)
}

pub async fn keys(api: &Api, out: &Output, command: KeysCommand) -> Result<Outcome> {
    match command {
        KeysCommand::List => {
            let keys = api.get("/v1/admin/keys").await?;
            let rows: Vec<Value> = keys["keys"].as_array().cloned().unwrap_or_default();
            out.table(&rows, &["id", "prefix", "tenant", "scopes", "name", "created_at", "revoked_at"]);
        }
        KeysCommand::Create { tenant, scopes, name } => {
            let key = api.post("/v1/admin/keys", &json!({ "tenant": tenant, "scopes": scopes, "name": name })).await?;
            if out.json {
                out.print(&key);
            } else {
                out.note(&format!("key {} for tenant {} (shown once; store it now):", key["prefix"].as_str().unwrap_or(""), tenant));
                println!("{}", key["key"].as_str().unwrap_or_default());
            }
        }
        KeysCommand::Revoke { id } => out.print(&api.post(&format!("/v1/admin/keys/{id}/revoke"), &json!({})).await?),
    }
    Ok(Outcome::Ok)
}
