// tern admin dashboard: polls the admin API every 2 s with the key given at sign-in.
"use strict";

const POLL_MS = 2000;
const HISTORY = 150; // 5 minutes of 2 s samples
const history = [];
let timer = null;

const $ = (sel) => document.querySelector(sel);

function key() { return sessionStorage.getItem("tern-admin-key"); }

async function api(method, path, body) {
  const resp = await fetch(path, {
    method,
    headers: Object.assign({ authorization: "Bearer " + key() }, body ? { "content-type": "application/json" } : {}),
    body: body ? JSON.stringify(body) : undefined,
  });
  const text = await resp.text();
  const json = text ? JSON.parse(text) : null;
  if (!resp.ok) {
    const err = new Error(json && json.error ? `${json.error.code}: ${json.error.message}` : `HTTP ${resp.status}`);
    err.status = resp.status;
    throw err;
  }
  return json;
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function button(label, onClick) {
  const b = document.createElement("button");
  b.textContent = label;
  b.addEventListener("click", async () => {
    b.disabled = true;
    try { await onClick(); await refresh(); } catch (e) { $("#status").textContent = e.message; }
    b.disabled = false;
  });
  return b;
}

function bytes(n) {
  if (n == null) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function ago(seconds) {
  if (seconds == null) return "-";
  if (seconds < 90) return `${seconds.toFixed(0)} s`;
  if (seconds < 5400) return `${(seconds / 60).toFixed(0)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function renderQueues(queues) {
  const body = $("#queues tbody");
  body.replaceChildren();
  for (const q of queues) {
    const tr = document.createElement("tr");
    tr.dataset.kind = q.kind;
    tr.append(cell(q.kind + (q.paused ? " (paused)" : ""), q.paused ? "paused" : ""));
    for (const s of ["queued", "scheduled", "running", "retrying", "failed"]) {
      const td = cell(String(q.total[s]), "num");
      td.dataset.state = s;
      tr.append(td);
    }
    tr.append(cell(ago(q.oldest_queued_seconds)));
    const done = ["last_1m", "last_5m", "last_15m"].map((w) => q.succeeded[w] + q.failed[w]).join(" / ");
    tr.append(cell(done, "num"));
    const actions = document.createElement("td");
    actions.append(q.paused
      ? button("Resume", () => api("POST", `/v1/admin/queues/${q.kind}/resume`))
      : button("Pause", () => api("POST", `/v1/admin/queues/${q.kind}/pause`)));
    tr.append(actions);
    body.append(tr);
  }
  const sum = (f) => queues.reduce((n, q) => n + f(q), 0);
  history.push({
    queued: sum((q) => q.total.queued),
    running: sum((q) => q.total.running),
    // Jobs finished in the minute before each sample: throughput per minute.
    succeeded: sum((q) => q.succeeded.last_1m),
    failed: sum((q) => q.failed.last_1m),
  });
  while (history.length > HISTORY) history.shift();
  drawChart("#depth-chart", [["queued", "#1f6feb"], ["running", "#2da44e"]]);
  drawChart("#throughput-chart", [["succeeded", "#2da44e"], ["failed", "#cf222e"]], "per minute");
}

/// Draws `series` ([field, colour]) of the sampled history on the canvas `id`.
function drawChart(id, series, unit) {
  const canvas = $(id);
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const max = Math.max(1, ...history.map((h) => Math.max(...series.map(([f]) => h[f]))));
  const x = (i) => (i / (HISTORY - 1)) * width;
  const y = (v) => height - 4 - (v / max) * (height - 20);
  for (const [field, color] of series) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    history.forEach((h, i) => (i ? ctx.lineTo(x(i), y(h[field])) : ctx.moveTo(x(i), y(h[field]))));
    ctx.stroke();
  }
  ctx.fillStyle = "#57606a";
  const last = history[history.length - 1] || {};
  const legend = series.map(([f, c]) => `${f} ${last[f] ?? 0}`).join("   ");
  ctx.fillText(`max ${max}${unit ? " " + unit : ""}   now: ${legend}`, 8, 12);
}

function renderModels(versions) {
  const body = $("#models tbody");
  body.replaceChildren();
  const kinds = new Set();
  for (const v of versions.slice(0, 20)) {
    const tr = document.createElement("tr");
    tr.dataset.version = v.id;
    tr.append(cell(v.kind));
    tr.append(cell(v.model));
    tr.append(cell(v.state + (v.error ? `: ${v.error}` : ""), v.state === "failed" ? "error" : ""));
    tr.append(cell(v.workers.map((w) => `${w.worker_id} ${w.state}`).join(", ") || "-"));
    const actions = document.createElement("td");
    if (v.state === "active" && !kinds.has(v.kind)) {
      kinds.add(v.kind);
      actions.append(button("Roll back", () => api("POST", `/v1/admin/models/${v.kind}/rollback`)));
    }
    tr.append(actions);
    body.append(tr);
  }
}

function renderWorkers(workers) {
  const body = $("#workers tbody");
  body.replaceChildren();
  for (const w of workers) {
    const tr = document.createElement("tr");
    tr.dataset.worker = w.id;
    tr.append(cell(`${w.id} (${w.host})`));
    tr.append(cell(w.state, w.state === "lost" ? "lost" : ""));
    tr.append(cell(w.device));
    const m = w.memory || {};
    tr.append(cell(`${bytes(m.models_bytes)} of ${bytes(m.budget_bytes)} (RSS ${bytes(m.rss_bytes)})`));
    tr.append(cell((w.models || []).map((x) => `${x.name} ${bytes(x.bytes)} (${x.hits} hits)`).join(", ") || "-"));
    tr.append(cell(String(w.batch_in_hand ?? "-"), "num"));
    tr.append(cell(String(w.jobs_done ?? "-"), "num"));
    tr.append(cell(ago(w.seconds_since_heartbeat) + " ago"));
    const actions = document.createElement("td");
    if (w.state === "active") actions.append(button("Drain", () => api("POST", `/v1/admin/workers/${encodeURIComponent(w.id)}/drain`)));
    if (w.state === "draining") actions.append(button("Undrain", () => api("POST", `/v1/admin/workers/${encodeURIComponent(w.id)}/undrain`)));
    tr.append(actions);
    body.append(tr);
  }
}

function renderFailed(jobs) {
  const body = $("#failed tbody");
  body.replaceChildren();
  for (const j of jobs) {
    const tr = document.createElement("tr");
    tr.dataset.job = j.id;
    tr.append(cell(j.id));
    tr.append(cell(j.kind));
    tr.append(cell(j.tenant));
    tr.append(cell(j.error ? `${j.error.code}: ${j.error.message}` : "-", "error"));
    tr.append(cell(j.finished_at || "-"));
    const actions = document.createElement("td");
    actions.append(button("Retry", () => api("POST", "/v1/admin/jobs/retry", { ids: [j.id] })));
    tr.append(actions);
    body.append(tr);
  }
}

async function refresh() {
  try {
    const [queues, workers, failed, models] = await Promise.all([
      api("GET", "/v1/admin/queues"),
      api("GET", "/v1/admin/workers"),
      api("GET", "/v1/admin/jobs?state=failed&limit=50"),
      api("GET", "/v1/admin/models"),
    ]);
    renderQueues(queues.queues);
    renderWorkers(workers.workers);
    renderFailed(failed.jobs);
    renderModels(models.versions);
    $("#status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    if (e.status === 401 || e.status === 403) return signOut(e.message);
    $("#status").textContent = `update failed: ${e.message}`;
  }
}

function showDashboard() {
  $("#sign-in").hidden = true;
  $("#dashboard").hidden = false;
  $("#sign-out").hidden = false;
  refresh();
  timer = setInterval(refresh, POLL_MS);
}

function signOut(message) {
  sessionStorage.removeItem("tern-admin-key");
  clearInterval(timer);
  $("#dashboard").hidden = true;
  $("#sign-out").hidden = true;
  $("#sign-in").hidden = false;
  $("#sign-in-error").textContent = message || "";
}

$("#sign-in-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("tern-admin-key", $("#key").value.trim());
  try {
    await api("GET", "/v1/admin/queues");
    $("#sign-in-error").textContent = "";
    showDashboard();
  } catch (e) {
    signOut(e.message);
  }
});

$("#sign-out").addEventListener("click", () => signOut());

$("#search-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  try {
    const job = await api("GET", `/v1/admin/jobs/${encodeURIComponent($("#search-id").value.trim())}`);
    $("#search-result").textContent = JSON.stringify(job, null, 2);
  } catch (e) {
    $("#search-result").textContent = e.message;
  }
});

if (key()) showDashboard();
