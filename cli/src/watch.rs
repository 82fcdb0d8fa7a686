//! Waiting for jobs: long-polls (`GET /v1/jobs/{id}?wait=`), a few jobs at a time in the
//! order they were submitted, with a bar per running job and one overall on a terminal, and a
//! line per finished job otherwise.

use crate::api::Api;
use crate::output::Output;
use anyhow::Result;
use futures::stream::{FuturesUnordered, StreamExt};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;
use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

/// How long one poll waits on the server for its job to finish.
const POLL_WAIT: &str = "3s";

/// A job being waited for, and what to call it.
pub struct Watched {
    pub id: String,
    pub label: String,
}

pub fn is_terminal(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "canceled")
}

fn job_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner} {wide_msg} {bar:30} {pos}/{len}").expect("a template")
}

/// Waits until every job finished, `parallel` polls at a time; calls `finished` with each job
/// as it finishes (in the order they finish).
pub async fn wait_all<F, Fut>(api: &Api, out: &Output, jobs: Vec<Watched>, parallel: usize, mut finished: F) -> Result<()>
where
    F: FnMut(Watched, Value) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let total = jobs.len() as u64;
    let multi = MultiProgress::new();
    if !out.bars {
        multi.set_draw_target(ProgressDrawTarget::hidden());
    }
    let overall = multi.add(ProgressBar::new(total));
    overall.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} finished {msg} [{elapsed}]").expect("a template"));
    overall.enable_steady_tick(Duration::from_millis(200));
    let mut waiting: VecDeque<(Watched, Option<ProgressBar>)> = jobs.into_iter().map(|w| (w, None)).collect();
    let mut polls = FuturesUnordered::new();
    let mut done = 0u64;
    loop {
        while polls.len() < parallel.max(1) {
            let Some((watched, bar)) = waiting.pop_front() else { break };
            let api = api.clone();
            polls.push(async move {
                let job = api.get(&format!("/v1/jobs/{}?wait={POLL_WAIT}", watched.id)).await;
                (watched, bar, job)
            });
        }
        let Some((watched, bar, job)) = polls.next().await else { break };
        let job = job?;
        let state = job["state"].as_str().unwrap_or_default().to_string();
        if is_terminal(&state) {
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            done += 1;
            overall.inc(1);
            if !out.bars {
                out.note(&format!("[{done}/{total}] {}: {state}", watched.label));
            }
            finished(watched, job).await?;
            continue;
        }
        // A bar for each job while it runs, showing its progress (windows, tokens).
        let bar = match (bar, state.as_str()) {
            (Some(bar), _) => Some(bar),
            (None, "running") => {
                let bar = multi.insert_before(&overall, ProgressBar::new(1));
                bar.set_style(job_style());
                bar.enable_steady_tick(Duration::from_millis(120));
                Some(bar)
            }
            (None, _) => None,
        };
        if let Some(bar) = &bar {
            bar.set_message(format!("{} {state}", watched.label));
            if let (Some(done), Some(total)) = (job["progress"]["done"].as_u64(), job["progress"]["total"].as_u64()) {
                bar.set_length(total.max(1));
                bar.set_position(done);
            }
        }
        overall.set_message(format!("({} running)", multi_running(&waiting, &bar)));
        waiting.push_back((watched, bar));
    }
    overall.finish_and_clear();
    Ok(())
}

/// Jobs with a bar: those seen running.
fn multi_running(waiting: &VecDeque<(Watched, Option<ProgressBar>)>, current: &Option<ProgressBar>) -> usize {
    waiting.iter().filter(|(_, bar)| bar.is_some()).count() + usize::from(current.is_some())
}
