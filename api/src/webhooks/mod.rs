//! Webhook delivery. The outbox (`webhook_deliveries`) is filled by a Postgres trigger in the
//! same transaction as each state change; this dispatcher, running in every API process, claims
//! due deliveries (`FOR UPDATE SKIP LOCKED`, so replicas share the work), POSTs them signed, and
//! records every attempt. Delivery is at least once: a process killed mid-delivery leaves its
//! claim to expire, and another attempt follows. Receivers dedupe on `webhook-id`.

pub mod signature;

use crate::routes::jobs::job_view;
use crate::state::AppState;
use chrono::{DateTime, Utc};
use serde_json::json;
use signature::Signer;
use sqlx::Row;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use uuid::Uuid;

/// The retry schedule of the Standard Webhooks spec: the delay before attempt n+1 after n
/// failures. Ten attempts over about 3.5 days.
pub const DEFAULT_SCHEDULE_MS: &[u64] = &[
    0, 5_000, 300_000, 1_800_000, 7_200_000, 18_000_000, 36_000_000, 50_400_000, 72_000_000,
    86_400_000,
];
/// A receiver that takes longer than this is counted as failing.
pub const TIMEOUT: Duration = Duration::from_secs(15);
/// How long a claimed delivery stays out of other dispatchers' reach: longer than one attempt.
const CLAIM: Duration = Duration::from_secs(60);
/// Longest Retry-After honoured.
const RETRY_AFTER_MAX: Duration = Duration::from_secs(24 * 3600);

pub struct Dispatcher {
    pub state: AppState,
    /// Whether targets may be internal addresses (`TERN_ALLOW_PRIVATE_URLS`).
    pub allow_private: bool,
    /// Signs per-job webhooks (`TERN_WEBHOOK_SECRETS`); `None`: jobs cannot name one.
    /// Tenant endpoints sign with their own secrets.
    pub signer: Option<Signer>,
    pub http: reqwest::Client,
    /// Delays before each retry (the first entry is the first attempt's delay).
    pub schedule: Vec<Duration>,
    /// Idle wait between looks at the outbox.
    pub poll: Duration,
    /// Most deliveries in flight in this process.
    pub in_flight: usize,
    /// Most deliveries in flight to one URL, so a receiver that hangs holds up only its own.
    pub per_url: usize,
}

struct Due {
    id: Uuid,
    /// This dispatcher's claim on the delivery; the attempt settles it only while it holds.
    claim: Uuid,
    job_id: Uuid,
    /// The tenant endpoint it goes to, with that endpoint's secrets.
    endpoint: Option<(Uuid, Vec<String>)>,
    event: String,
    url: String,
    attempts: i32,
    created_at: DateTime<Utc>,
    /// Its target said 410 after this delivery was written: it is settled as disabled, unsent.
    disabled: bool,
}

/// What one attempt came to.
struct Attempt {
    /// The target is an address tern may not reach: no retry can help.
    forbidden: bool,
    status: Option<u16>,
    error: Option<String>,
    retry_after: Option<Duration>,
    latency: Duration,
}

/// Deliveries in flight per URL.
type Busy = Arc<Mutex<HashMap<String, usize>>>;

/// One delivery's place in its URL's count: taken when made, given back when its task ends,
/// however it ends.
struct Slot {
    busy: Busy,
    url: String,
}

impl Slot {
    fn take(busy: &Busy, url: &str) -> Slot {
        *busy.lock().expect("busy map").entry(url.to_string()).or_default() += 1;
        Slot { busy: busy.clone(), url: url.to_string() }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut busy = self.busy.lock().expect("busy map");
        if let Some(n) = busy.get_mut(&self.url) {
            *n -= 1;
            if *n == 0 {
                busy.remove(&self.url);
            }
        }
    }
}

impl Dispatcher {
    /// Sends deliveries as slots free up: each is a task of its own, so one slow receiver
    /// delays nothing but its own deliveries (at most `per_url` of them in flight).
    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        let this = Arc::new(self);
        let busy: Busy = Arc::default();
        let mut flying = tokio::task::JoinSet::new();
        while !*stop.borrow() {
            let room = this.in_flight.saturating_sub(flying.len());
            let mut full = room == 0;
            if room > 0 {
                match this.claim(room, &busy).await {
                    Ok(due) => {
                        full = due.len() == room;
                        for d in due {
                            let slot = Slot::take(&busy, &d.url);
                            let me = this.clone();
                            flying.spawn(async move {
                                let _slot = slot;
                                me.deliver(d).await;
                            });
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "webhook dispatch failed"),
                }
            }
            // More may be due once a slot frees; otherwise look again after the poll interval.
            tokio::select! {
                Some(_) = flying.join_next(), if !flying.is_empty() => {
                    while flying.try_join_next().is_some() {}
                }
                _ = tokio::time::sleep(this.poll), if !full => {}
                _ = stop.changed() => {}
            }
        }
        // Attempts under way finish (each within TIMEOUT) and are recorded.
        while flying.join_next().await.is_some() {}
    }

    /// Claims up to `room` due deliveries: the oldest pending one of each job and URL, so a
    /// job's events arrive in order, and no more per URL than its free slots.
    async fn claim(&self, room: usize, busy: &Busy) -> Result<Vec<Due>, sqlx::Error> {
        let (urls, counts): (Vec<String>, Vec<i32>) = busy
            .lock()
            .expect("busy map")
            .iter()
            .map(|(u, n)| (u.clone(), *n as i32))
            .unzip();
        let rows = sqlx::query(
            "WITH candidates AS (
                SELECT id, url, next_attempt_at FROM webhook_deliveries w
                WHERE state = 'pending' AND next_attempt_at <= now()
                  AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::int[]) b(url, n) WHERE b.url = w.url AND b.n >= $5)
                  AND NOT EXISTS (SELECT 1 FROM webhook_deliveries p
                                  WHERE p.job_id = w.job_id AND p.url = w.url AND p.state = 'pending'
                                    AND p.created_at < w.created_at)
                ORDER BY next_attempt_at LIMIT $1 * 4
                FOR UPDATE SKIP LOCKED
             ), chosen AS (
                SELECT c.id FROM (SELECT c.*, row_number() OVER (PARTITION BY c.url ORDER BY c.next_attempt_at) AS nth
                                  FROM candidates c) c
                LEFT JOIN unnest($3::text[], $4::int[]) b(url, n) ON b.url = c.url
                WHERE c.nth <= $5 - coalesce(b.n, 0)
                ORDER BY c.next_attempt_at LIMIT $1
             ), claimed AS (
                UPDATE webhook_deliveries d SET next_attempt_at = now() + make_interval(secs => $2), claim = gen_random_uuid()
                FROM chosen WHERE d.id = chosen.id
                RETURNING d.id, d.claim, d.job_id, d.event, d.url, d.attempts, d.created_at, d.endpoint_id
             )
             -- A state change committed while a 410 was being recorded can still have written a
             -- delivery to the now disabled target; it is caught here.
             SELECT c.*, e.secrets,
                    CASE WHEN c.endpoint_id IS NOT NULL THEN e.disabled_at IS NOT NULL
                         ELSE coalesce((j.webhook->>'disabled')::boolean, false) END AS disabled
             FROM claimed c
             LEFT JOIN webhook_endpoints e ON e.id = c.endpoint_id
             LEFT JOIN jobs j ON j.id = c.job_id",
        )
        .bind(room as i64)
        .bind(CLAIM.as_secs_f64())
        .bind(&urls)
        .bind(&counts)
        .bind(self.per_url as i32)
        .fetch_all(self.state.store.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let endpoint: Option<Uuid> = r.try_get("endpoint_id")?;
                let secrets: Option<Vec<String>> = r.try_get("secrets")?;
                Ok(Due {
                    id: r.try_get("id")?,
                    claim: r.try_get("claim")?,
                    job_id: r.try_get("job_id")?,
                    endpoint: endpoint.map(|e| (e, secrets.unwrap_or_default())),
                    event: r.try_get("event")?,
                    url: r.try_get("url")?,
                    attempts: r.try_get("attempts")?,
                    created_at: r.try_get("created_at")?,
                    disabled: r.try_get::<Option<bool>, _>("disabled")?.unwrap_or(false),
                })
            })
            .collect()
    }

    async fn deliver(&self, d: Due) {
        if d.disabled {
            let settled =
                sqlx::query("UPDATE webhook_deliveries SET state = 'disabled' WHERE id = $1 AND state = 'pending' AND claim = $2")
                    .bind(d.id)
                    .bind(d.claim)
                    .execute(self.state.store.pool())
                    .await;
            if let Err(e) = settled {
                tracing::warn!(error = %e, delivery = %d.id, "could not settle a delivery to a disabled target");
            }
            return;
        }
        let attempt = self.attempt(&d).await;
        if let Err(e) = self.record(&d, &attempt).await {
            // The claim expires and the delivery is tried again: at least once.
            tracing::warn!(error = %e, delivery = %d.id, "could not record a webhook attempt");
        }
    }

    async fn attempt(&self, d: &Due) -> Attempt {
        let started = Instant::now();
        let failed =
            |error: String| Attempt { forbidden: false, status: None, error: Some(error), retry_after: None, latency: started.elapsed() };
        if let Err(e) = tern_jobs::egress::check_url(&d.url, self.allow_private) {
            return Attempt { forbidden: true, ..failed(e.0) };
        }
        let job = match self.state.store.get(d.job_id).await {
            Ok(Some(job)) => job,
            Ok(None) => return failed("the job no longer exists".into()),
            Err(e) => return failed(format!("reading the job: {e}")),
        };
        let data = match job_view(&self.state, &job, false).await {
            Ok(v) => v,
            Err(e) => return failed(format!("rendering the job: {}", e.message)),
        };
        let body = serde_json::to_vec(&json!({
            "type": d.event,
            "timestamp": d.created_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            "data": data,
        }))
        .expect("JSON values serialise");
        let id = format!("msg_{}", d.id.simple());
        let timestamp = Utc::now().timestamp();
        let signer = match &d.endpoint {
            Some((_, secrets)) => Signer::parse(&secrets.join(",")).ok(),
            None => self.signer.clone(),
        };
        let Some(signer) = signer else {
            return Attempt { forbidden: true, ..failed("no webhook signing secret is configured".into()) };
        };
        let signature = signer.sign(&id, timestamp, &body);
        let sent = self
            .http
            .post(&d.url)
            .timeout(TIMEOUT)
            .header("content-type", "application/json")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(body)
            .send()
            .await;
        match sent {
            Ok(response) => {
                let status = response.status();
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(|s| Duration::from_secs(s).min(RETRY_AFTER_MAX));
                Attempt {
                    forbidden: false,
                    status: Some(status.as_u16()),
                    error: (!status.is_success()).then(|| format!("the receiver answered {status}")),
                    retry_after,
                    latency: started.elapsed(),
                }
            }
            Err(e) => match tern_jobs::egress::forbidden_cause(&e) {
                Some(why) => Attempt { forbidden: true, ..failed(why) },
                None if e.is_timeout() => failed(format!("no answer within {} s", TIMEOUT.as_secs())),
                None => failed(e.to_string()),
            },
        }
    }

    /// Records the attempt and decides what follows: delivered, retried later, failed for good,
    /// or, on 410 Gone, the endpoint disabled (this job's later events to it are dropped).
    async fn record(&self, d: &Due, a: &Attempt) -> Result<(), sqlx::Error> {
        let attempts = d.attempts + 1;
        let (state, next): (&str, Option<Duration>) = match a.status {
            _ if a.forbidden => ("failed", None),
            Some(s) if (200..300).contains(&s) => ("delivered", None),
            Some(410) => ("disabled", None),
            _ => match self.schedule.get(attempts as usize) {
                None => ("failed", None),
                Some(delay) => {
                    let honour = matches!(a.status, Some(429 | 503)).then_some(a.retry_after).flatten();
                    ("pending", Some(honour.unwrap_or_else(|| jitter(*delay))))
                }
            },
        };
        metrics::counter!("tern_webhook_attempts_total", "outcome" => state).increment(1);
        let mut tx = self.state.store.pool().begin().await?;
        // A 410 writes the endpoint (or the job) and then its pending deliveries. Taking that
        // parent's lock before touching any delivery keeps one order across transactions:
        // two 410s for one endpoint otherwise each hold a delivery the other must disable.
        if state == "disabled" {
            match &d.endpoint {
                Some((endpoint, _)) => sqlx::query("SELECT 1 FROM webhook_endpoints WHERE id = $1 FOR NO KEY UPDATE").bind(endpoint),
                None => sqlx::query("SELECT 1 FROM jobs WHERE id = $1 FOR NO KEY UPDATE").bind(d.job_id),
            }
            .execute(&mut *tx)
            .await?;
        }
        // The request was sent: its attempt is history whatever became of the claim.
        sqlx::query("INSERT INTO webhook_attempts (delivery_id, status, latency_ms, error) VALUES ($1, $2, $3, $4)")
            .bind(d.id)
            .bind(a.status.map(i32::from))
            .bind(a.latency.as_millis().min(i32::MAX as u128) as i32)
            .bind(&a.error)
            .execute(&mut *tx)
            .await?;
        // Only while the claim holds: a replay or another dispatcher may own the delivery now.
        // Disabled meanwhile by another delivery's 410, it stays disabled.
        let held = sqlx::query(
            "UPDATE webhook_deliveries SET state = CASE WHEN state = 'pending' THEN $2 ELSE state END,
                    attempts = $3, last_status = $4, last_error = $5,
                    delivered_at = CASE WHEN $2 = 'delivered' THEN now() END,
                    next_attempt_at = now() + make_interval(secs => $6), claim = NULL
             WHERE id = $1 AND claim = $7",
        )
        .bind(d.id)
        .bind(state)
        .bind(attempts)
        .bind(a.status.map(i32::from))
        .bind(&a.error)
        .bind(next.unwrap_or_default().as_secs_f64())
        .bind(d.claim)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if !held {
            tx.commit().await?;
            tracing::warn!(delivery = %d.id, job = %d.job_id, status = ?a.status, "webhook attempt recorded, but its claim was lost: the delivery is another's now");
            return Ok(());
        }
        if state == "disabled" {
            match &d.endpoint {
                // A tenant endpoint that said 410 is disabled for every job.
                Some((endpoint, _)) => {
                    sqlx::query("UPDATE webhook_endpoints SET disabled_at = coalesce(disabled_at, now()) WHERE id = $1")
                        .bind(endpoint)
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query("UPDATE webhook_deliveries SET state = 'disabled' WHERE endpoint_id = $1 AND state = 'pending'")
                        .bind(endpoint)
                        .execute(&mut *tx)
                        .await?;
                }
                None => {
                    sqlx::query(
                        "UPDATE webhook_deliveries SET state = 'disabled'
                         WHERE job_id = $1 AND url = $2 AND endpoint_id IS NULL AND state = 'pending'",
                    )
                    .bind(d.job_id)
                    .bind(&d.url)
                    .execute(&mut *tx)
                    .await?;
                    sqlx::query("UPDATE jobs SET webhook = webhook || '{\"disabled\": true}'::jsonb WHERE id = $1")
                        .bind(d.job_id)
                        .execute(&mut *tx)
                        .await?;
                }
            }
        }
        tx.commit().await?;
        tracing::info!(delivery = %d.id, job = %d.job_id, event = %d.event, status = ?a.status, state, attempts, "webhook attempt");
        Ok(())
    }
}

/// ±10% so deliveries that failed together do not come back together.
fn jitter(delay: Duration) -> Duration {
    if delay.is_zero() {
        return delay;
    }
    delay.mul_f64(0.9 + rand::random::<f64>() * 0.2)
}
