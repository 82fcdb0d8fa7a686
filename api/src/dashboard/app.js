// tern admin dashboard: an overview polled every 2 s (queues, workers, models, failed jobs),
// history charts from the server (Postgres) every 10 s, a jobs browser with bulk actions, and
// a page per job. Everything goes through the admin API with the key given at sign-in.
"use strict";

const POLL_MS = 2000;
const HISTORY_POLL_MS = 10000;
const PAGE_SIZE = 50;
let timers = [];
let cursors = [null]; // the cursor of each page seen; the last is the current page's
let nextCursor = null;
const selected = new Set();

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

function button(label, onClick, after) {
  const b = document.createElement("button");
  b.textContent = label;
  b.addEventListener("click", async () => {
    b.disabled = true;
    try { await onClick(); await (after || refresh)(); } catch (e) { $("#status").textContent = e.message; }
    b.disabled = false;
  });
  return b;
}

function jobLink(id) {
  const a = document.createElement("a");
  a.href = `#job/${id}`;
  a.textContent = id;
  a.dataset.openJob = id;
  return a;
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

function secs(v) {
  if (v == null) return "-";
  return v < 10 ? `${v.toFixed(2)} s` : `${v.toFixed(0)} s`;
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "-";
}

// ---- overview ----

function renderQueues(queues) {
  const body = $("#queues tbody");
  body.replaceChildren();
  for (const q of queues) {
    const tr = document.createElement("tr");
    tr.dataset.kind = q.kind;
    tr.append(cell(q.kind + (q.paused ? " (paused)" : ""), q.paused ? "paused" : ""));
    const queued = cell(String(q.total.queued), "num");
    queued.dataset.state = "queued";
    tr.append(queued);
    const byPriority = cell(["urgent", "high", "normal", "low"].map((p) => q.priorities[p].queued).join(" / "), "num");
    byPriority.dataset.priorities = "queued";
    tr.append(byPriority);
    for (const s of ["scheduled", "running", "retrying", "failed"]) {
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
    const purge = button("Purge", async () => {
      if (!confirm(`Cancel every waiting ${q.kind} job?`)) return;
      await api("POST", `/v1/admin/queues/${q.kind}/purge?confirm=${q.kind}`);
    });
    purge.dataset.purge = q.kind;
    actions.append(" ", purge);
    tr.append(actions);
    body.append(tr);
  }
}

// Draws time series on a canvas with axes: `series` is [[label, colour, values]], one value
// a minute of `times`.
function drawChart(id, times, series) {
  const canvas = $(id);
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  const left = 44, bottom = 22, top = 18, right = 8;
  ctx.clearRect(0, 0, width, height);
  const values = series.flatMap(([, , v]) => v);
  const rawMax = Math.max(1, ...values);
  const step = niceStep(rawMax / 4);
  const max = Math.ceil(rawMax / step) * step;
  const n = Math.max(1, times.length - 1);
  const x = (i) => left + (i / n) * (width - left - right);
  const y = (v) => height - bottom - (v / max) * (height - bottom - top);
  ctx.strokeStyle = "#d0d7de";
  ctx.fillStyle = "#57606a";
  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  for (let v = 0; v <= max; v += step) {
    ctx.beginPath(); ctx.moveTo(left, y(v)); ctx.lineTo(width - right, y(v)); ctx.stroke();
    ctx.fillText(String(v), left - 4, y(v) + 4);
  }
  ctx.textAlign = "center";
  const ticks = Math.min(6, times.length);
  for (let t = 0; t < ticks; t++) {
    const i = Math.round((t / Math.max(1, ticks - 1)) * (times.length - 1));
    const d = new Date(times[i]);
    ctx.textAlign = t === 0 ? "left" : t === ticks - 1 ? "right" : "center";
    ctx.fillText(`${String(d.getHours()).padStart(2, "0")}:${String(d.getMinutes()).padStart(2, "0")}`, x(i), height - 6);
  }
  for (const [, color, v] of series) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    v.forEach((value, i) => (i ? ctx.lineTo(x(i), y(value)) : ctx.moveTo(x(i), y(value))));
    ctx.stroke();
  }
  ctx.textAlign = "left";
  let at = left + 4;
  for (const [label, color, v] of series) {
    ctx.fillStyle = color;
    const text = `${label} ${v.length ? v[v.length - 1] : 0}`;
    ctx.fillText(text, at, 12);
    at += ctx.measureText(text).width + 16;
  }
  canvas.dataset.points = String(values.length);
  canvas.dataset.max = String(rawMax === 1 && values.every((v) => v === 0) ? 0 : rawMax);
}

function niceStep(raw) {
  const pow = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1))));
  for (const m of [1, 2, 5, 10]) if (m * pow >= raw) return m * pow;
  return 10 * pow;
}

async function refreshHistory() {
  try {
    const h = await api("GET", `/v1/admin/history?minutes=${$("#history-minutes").value}`);
    const sum = (field) => h.minutes.map((_, i) => Object.values(h.kinds).reduce((n, k) => n + k[field][i], 0));
    drawChart("#depth-chart", h.minutes, [["waiting", "#1f6feb", sum("waiting")], ["running", "#2da44e", sum("running")]]);
    drawChart("#throughput-chart", h.minutes, [["succeeded", "#2da44e", sum("succeeded")], ["failed", "#cf222e", sum("failed")]]);
    const body = $("#timings tbody");
    body.replaceChildren();
    for (const t of h.timings) {
      const tr = document.createElement("tr");
      tr.dataset.kind = t.kind;
      tr.append(cell(t.kind), cell(String(t.succeeded), "num"));
      tr.append(cell(["p50", "p90", "p99"].map((p) => secs(t.run_seconds[p])).join(" / "), "num"));
      tr.append(cell(["p50", "p90", "p99"].map((p) => secs(t.wait_seconds[p])).join(" / "), "num"));
      body.append(tr);
    }
  } catch (e) {
    $("#status").textContent = `history failed: ${e.message}`;
  }
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

function renderWorkers(workers, system) {
  const memoryState = new Map(system.workers.map((w) => [w.id, w.memory.state]));
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
    const state = memoryState.get(w.id) || "-";
    tr.append(cell(state, `memory-${state}`));
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
    const id = document.createElement("td");
    id.append(jobLink(j.id));
    tr.append(id);
    tr.append(cell(j.kind));
    tr.append(cell(j.tenant));
    tr.append(cell(j.error ? `${j.error.code}: ${j.error.message}` : "-", "error"));
    tr.append(cell(when(j.finished_at)));
    const actions = document.createElement("td");
    actions.append(button("Retry", () => api("POST", "/v1/admin/jobs/retry", { ids: [j.id] })));
    tr.append(actions);
    body.append(tr);
  }
}

async function refresh() {
  try {
    const [queues, workers, system, failed, models] = await Promise.all([
      api("GET", "/v1/admin/queues"),
      api("GET", "/v1/admin/workers"),
      api("GET", "/v1/admin/system"),
      api("GET", "/v1/admin/jobs?state=failed&limit=50"),
      api("GET", "/v1/admin/models"),
    ]);
    renderQueues(queues.queues);
    renderWorkers(workers.workers, system);
    renderFailed(failed.jobs);
    renderModels(models.versions);
    $("#status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    if (e.status === 401 || e.status === 403) return signOut(e.message);
    $("#status").textContent = `update failed: ${e.message}`;
  }
}

// ---- jobs browser ----

function filterQuery() {
  const params = new URLSearchParams({ limit: String(PAGE_SIZE) });
  for (const [name, sel] of [["state", "#filter-state"], ["kind", "#filter-kind"], ["priority", "#filter-priority"], ["tenant", "#filter-tenant"]]) {
    const v = $(sel).value.trim();
    if (v) params.set(name, v);
  }
  const cursor = cursors[cursors.length - 1];
  if (cursor) params.set("cursor", cursor);
  return params.toString();
}

function updateSelection() {
  $("#selected-count").textContent = `${selected.size} selected`;
  for (const b of ["#bulk-retry", "#bulk-cancel", "#bulk-delete"]) $(b).disabled = selected.size === 0;
}

async function loadJobs() {
  try {
    const page = await api("GET", `/v1/admin/jobs?${filterQuery()}`);
    nextCursor = page.next_cursor;
    $("#next-page").disabled = !nextCursor;
    selected.clear();
    $("#select-all").checked = false;
    updateSelection();
    const body = $("#jobs-table tbody");
    body.replaceChildren();
    for (const j of page.jobs) {
      const tr = document.createElement("tr");
      tr.dataset.job = j.id;
      tr.dataset.state = j.state;
      const pick = document.createElement("td");
      const box = document.createElement("input");
      box.type = "checkbox";
      box.setAttribute("aria-label", `select ${j.id}`);
      box.addEventListener("change", () => { box.checked ? selected.add(j.id) : selected.delete(j.id); updateSelection(); });
      pick.append(box);
      const id = document.createElement("td");
      id.append(jobLink(j.id));
      tr.append(pick, id, cell(j.kind), cell(j.tenant), cell(j.priority), cell(j.state, `state-${j.state}`));
      tr.append(cell(`${j.attempts} / ${j.max_attempts}`, "num"), cell(when(j.created_at)), cell(when(j.run_at)));
      tr.append(cell(j.error ? j.error.code : "", "error"));
      const actions = document.createElement("td");
      if (j.state === "scheduled" || j.state === "retrying") {
        const run = button("Run now", () => api("POST", `/v1/admin/jobs/${j.id}/run-now`), loadJobs);
        run.dataset.runNow = j.id;
        actions.append(run);
      }
      tr.append(actions);
      body.append(tr);
    }
    if (!page.jobs.length) {
      const tr = document.createElement("tr");
      const td = cell("no jobs match");
      td.colSpan = 11;
      tr.append(td);
      body.append(tr);
    }
  } catch (e) {
    $("#bulk-result").textContent = e.message;
  }
}

// Runs `action` on each selected job; reports how many it did and the first refusal.
async function bulk(label, action) {
  const ids = [...selected];
  let done = 0, first = null;
  for (const id of ids) {
    try { await action(id); done++; } catch (e) { first = first || `${id}: ${e.message}`; }
  }
  $("#bulk-result").textContent = `${label}: ${done} of ${ids.length}` + (first ? ` (${first})` : "");
  await loadJobs();
}

// ---- job page ----

async function openJob(id) {
  showPage("job");
  $("#job-id").textContent = id;
  $("#job-error").textContent = "";
  for (const sel of ["#job-summary tbody", "#job-timeline tbody", "#job-deliveries tbody", "#job-output", "#job-actions"]) $(sel).replaceChildren();
  $("#job-input").textContent = "";
  let job;
  try {
    job = await api("GET", `/v1/admin/jobs/${encodeURIComponent(id)}`);
  } catch (e) {
    $("#job-error").textContent = e.message;
    return;
  }
  const summary = $("#job-summary tbody");
  const row = (k, v) => { const tr = document.createElement("tr"); tr.append(cell(k), cell(v)); summary.append(tr); };
  row("state", job.state + (job.cancel_requested ? " (cancel requested)" : ""));
  row("kind", job.kind);
  row("tenant", job.tenant);
  row("priority", job.priority);
  row("attempts", `${job.attempts} of ${job.max_attempts}`);
  row("created", when(job.created_at));
  row("started", when(job.started_at));
  row("finished", when(job.finished_at));
  if (job.run_at) row("run at", when(job.run_at));
  if (job.queue_position != null) row("queue position", String(job.queue_position));
  if (job.metadata && Object.keys(job.metadata).length) row("metadata", JSON.stringify(job.metadata));
  if (job.error) $("#job-error").textContent = `${job.error.code}: ${job.error.message}`;
  const actions = $("#job-actions");
  const again = () => openJob(id);
  if (["queued", "scheduled", "retrying", "running"].includes(job.state)) actions.append(button("Cancel", () => api("POST", `/v1/admin/jobs/${id}/cancel`), again));
  if (job.state === "scheduled" || job.state === "retrying") actions.append(" ", button("Run now", () => api("POST", `/v1/admin/jobs/${id}/run-now`), again));
  if (job.state === "failed") actions.append(" ", button("Retry", () => api("POST", "/v1/admin/jobs/retry", { ids: [id] }), again));
  const outputs = $("#job-output");
  if (job.output) {
    const link = (label, url) => {
      const li = document.createElement("li");
      const a = document.createElement("a");
      a.href = url; a.textContent = label; a.rel = "noopener";
      li.append(a);
      outputs.append(li);
    };
    link(`output (${job.output.content_type}, ${bytes(job.output.size)})`, job.output.url);
    for (const [format, file] of Object.entries(job.output.formats || {})) link(`${format} (${bytes(file.size)})`, file.url);
  } else {
    const li = document.createElement("li");
    li.textContent = "none yet";
    outputs.append(li);
  }
  const timeline = $("#job-timeline tbody");
  for (const e of job.events) {
    const tr = document.createElement("tr");
    tr.dataset.state = e.state;
    tr.append(cell(when(e.at)), cell(e.state), cell(String(e.attempt), "num"), cell(e.worker_id || "-"), cell(e.detail ? JSON.stringify(e.detail) : ""));
    timeline.append(tr);
  }
  const deliveries = $("#job-deliveries tbody");
  for (const d of job.deliveries) {
    const tr = document.createElement("tr");
    tr.append(cell(d.event), cell(d.url), cell(d.state), cell(String(d.attempts), "num"), cell(d.last_status == null ? "-" : String(d.last_status)), cell(d.last_error || ""));
    deliveries.append(tr);
  }
  if (!job.deliveries.length) {
    const tr = document.createElement("tr");
    const td = cell("none");
    td.colSpan = 6;
    tr.append(td);
    deliveries.append(tr);
  }
  $("#job-input").textContent = JSON.stringify(job.input, null, 2);
}

// ---- pages and sign-in ----

function showPage(name) {
  $("#overview-page").hidden = name !== "overview";
  $("#jobs-page").hidden = name !== "jobs";
  $("#job-page").hidden = name !== "job";
}

function route() {
  const hash = location.hash.slice(1);
  if (hash.startsWith("job/")) return openJob(decodeURIComponent(hash.slice(4)));
  if (hash === "jobs") { showPage("jobs"); return loadJobs(); }
  showPage("overview");
}

function showDashboard() {
  $("#sign-in").hidden = true;
  $("#dashboard").hidden = false;
  $("#sign-out").hidden = false;
  $("#nav").hidden = false;
  refresh();
  refreshHistory();
  timers = [setInterval(refresh, POLL_MS), setInterval(refreshHistory, HISTORY_POLL_MS)];
  route();
}

function signOut(message) {
  sessionStorage.removeItem("tern-admin-key");
  timers.forEach(clearInterval);
  $("#dashboard").hidden = true;
  $("#sign-out").hidden = true;
  $("#nav").hidden = true;
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
window.addEventListener("hashchange", () => { if (key()) route(); });
$("#history-minutes").addEventListener("change", refreshHistory);
$("#job-close").addEventListener("click", () => history.back());
$("#job-filters").addEventListener("submit", (ev) => { ev.preventDefault(); cursors = [null]; loadJobs(); });
$("#first-page").addEventListener("click", () => { cursors = [null]; loadJobs(); });
$("#next-page").addEventListener("click", () => { if (nextCursor) { cursors.push(nextCursor); loadJobs(); } });
$("#select-all").addEventListener("change", () => {
  const on = $("#select-all").checked;
  for (const box of document.querySelectorAll("#jobs-table tbody input[type=checkbox]")) {
    box.checked = on;
    const id = box.closest("tr").dataset.job;
    on ? selected.add(id) : selected.delete(id);
  }
  updateSelection();
});
$("#bulk-retry").addEventListener("click", () => bulk("retried", (id) => api("POST", "/v1/admin/jobs/retry", { ids: [id] }).then((r) => {
  if (!r.retried || !r.retried.length) throw new Error("not failed");
})));
$("#bulk-cancel").addEventListener("click", () => bulk("canceled", (id) => api("POST", `/v1/admin/jobs/${id}/cancel`)));
$("#bulk-delete").addEventListener("click", () => {
  if (confirm(`Delete ${selected.size} finished jobs with their timelines?`)) bulk("deleted", (id) => api("DELETE", `/v1/admin/jobs/${id}`));
});
$("#search-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  location.hash = `job/${encodeURIComponent($("#search-id").value.trim())}`;
});

if (key()) showDashboard();
