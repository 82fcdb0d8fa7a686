//! Prometheus metrics shared by `tern-api` and `tern-worker`: one global recorder from the
//! `metrics` facade, rendered in the text exposition format by each binary's `/metrics` route.
//!
//! Histograms are true Prometheus histograms: `*_seconds` with buckets from 5 ms to 30 min,
//! batch sizes and costs with powers of two up to 4,096.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::time::Duration;

const SECONDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0];
const COUNTS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the global recorder once per process (later calls return the same handle) and,
/// inside a tokio runtime, a task that runs its upkeep every 5 s (histograms would otherwise
/// grow between scrapes).
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS)
                .and_then(|b| b.set_buckets_for_metric(Matcher::Prefix("tern_batch_".into()), COUNTS))
                .expect("bucket lists are not empty")
                .install_recorder()
                .expect("the metrics recorder is installed once");
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let h = handle.clone();
                rt.spawn(async move {
                    loop {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        h.run_upkeep();
                    }
                });
            }
            handle
        })
        .clone()
}
