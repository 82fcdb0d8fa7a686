// Drives the /admin dashboard in headless Chromium, as an operator would.
// Usage: node dashboard.mjs BASE_URL ADMIN_KEY FAILED_JOB_ID SCHEDULED_JOB_ID SCREENSHOT_PATH
// Signs in, submits five echo jobs (no worker runs them) and waits for the queue depth shown
// to rise by five, clicks Retry on the failed job; sees the history charts and run times
// (from the server: a reload keeps them); in the jobs browser cancels two jobs, deletes the
// canceled ones and runs the scheduled job now; opens the failed job's page (timeline, input);
// purges the echo queue. Each step is checked through the API. Any console error (a missing
// favicon included) fails it. Saves screenshots of the overview, the jobs browser and the job
// page. Exits non-zero with a message on any failure.
import { chromium } from "playwright-core";

const [base, key, failedId, scheduledId, screenshot] = process.argv.slice(2);
const shot = (name) => screenshot.replace(/\.png$/, `-${name}.png`);
const api = async (method, path, body) => {
  const resp = await fetch(base + path, {
    method,
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body: body ? JSON.stringify(body) : undefined,
  });
  if (!resp.ok) throw new Error(`${method} ${path}: HTTP ${resp.status} ${await resp.text()}`);
  return resp.json();
};

// Polls `read` (run from node through Playwright's isolated world: the page's CSP forbids the
// main-world evaluation waitForFunction uses) until `ok` holds of its value.
async function until(what, read, ok, timeoutMs = 15000) {
  const deadline = Date.now() + timeoutMs;
  let last;
  while (Date.now() < deadline) {
    last = await read().catch(() => undefined);
    if (ok(last)) return last;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`timed out waiting for ${what} (last seen: ${JSON.stringify(last)})`);
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
});
let failed = false;
const page = await browser.newPage({ viewport: { width: 1280, height: 1000 } });
page.on("pageerror", (e) => { console.error(`page error: ${e.message}`); failed = true; });
page.on("console", (m) => {
  // The wrong key's 401 is the one error the page is meant to meet.
  if (m.type() === "error" && !m.text().includes("401")) { console.error(`console error: ${m.text()}`); failed = true; }
});
page.on("dialog", (d) => d.accept());
const text = (sel) => page.textContent(sel);
const attr = (sel, name) => page.getAttribute(sel, name);
try {
  await page.goto(`${base}/admin`);
  // A wrong key is refused with the API's message.
  await page.fill("#key", "tern_wrong_key");
  await page.click("#sign-in-form button");
  await until("the wrong key's error", () => page.textContent("#sign-in-error"), (t) => t?.includes("invalid_api_key"));

  await page.fill("#key", key);
  await page.click("#sign-in-form button");
  await page.waitForSelector("#dashboard:not([hidden])");
  const queued = 'tr[data-kind="echo"] td[data-state="queued"]';
  await page.waitForSelector(queued);
  const before = Number(await page.textContent(queued));
  await api("POST", "/v1/jobs/batch", { jobs: Array.from({ length: 5 }, () => ({ kind: "echo", input: {} })) });
  await until("the queued count to rise by 5", () => page.textContent(queued), (t) => Number(t) === before + 5);
  console.log(`queue depth shown: ${before} -> ${before + 5}`);

  const row = `tr[data-job="${failedId}"]`;
  await page.waitForSelector(row);
  await page.click(`${row} button`);
  await page.waitForSelector(row, { state: "detached", timeout: 15000 });
  const job = await api("GET", `/v1/admin/jobs/${failedId}`);
  if (job.state === "failed") throw new Error(`the retried job is still failed: ${JSON.stringify(job)}`);
  console.log(`retried job ${failedId} is now ${job.state}`);

  // History from the server, with axes: it has the failed job and the echo jobs; a reload keeps it.
  await until("the finished chart to show the failed job", () => attr("#throughput-chart", "data-max"), (m) => Number(m) >= 1, 20000);
  await until("the depth chart to show waiting jobs", () => attr("#depth-chart", "data-max"), (m) => Number(m) >= 5, 20000);
  await page.waitForSelector('#timings tr[data-kind="echo"]');
  await page.waitForSelector('tr[data-kind="echo"] td[data-priorities="queued"]');
  await page.screenshot({ path: screenshot, fullPage: true });
  await page.reload();
  await page.waitForSelector("#dashboard:not([hidden])");
  await until("the chart after a reload", () => attr("#depth-chart", "data-max"), (m) => Number(m) >= 5, 20000);
  console.log("history charts drawn from the server, also after a reload");

  // The jobs browser: queued echo jobs, two canceled at once.
  await page.click('a[href="#jobs"]');
  await page.selectOption("#filter-state", "queued");
  await page.selectOption("#filter-kind", "echo");
  await page.click("#job-filters button");
  await until("five queued rows", () => page.locator('#jobs-table tbody tr[data-state="queued"]').count(), (n) => n >= 5);
  const ids = await page.locator('#jobs-table tbody tr[data-state="queued"]').evaluateAll((rows) => rows.slice(0, 2).map((r) => r.dataset.job));
  for (const id of ids) await page.check(`#jobs-table tr[data-job="${id}"] input[type=checkbox]`);
  await until("two selected", () => text("#selected-count"), (t) => t === "2 selected");
  await page.click("#bulk-cancel");
  await until("the cancel's report", () => text("#bulk-result"), (t) => t?.startsWith("canceled: 2 of 2"));
  for (const id of ids) {
    const j = await api("GET", `/v1/admin/jobs/${id}`);
    if (j.state !== "canceled") throw new Error(`job ${id} is ${j.state}, not canceled`);
  }
  console.log(`canceled ${ids.join(", ")} from the browser`);

  // The canceled ones deleted, all selected at once.
  await page.selectOption("#filter-state", "canceled");
  await page.click("#job-filters button");
  await until("the canceled rows", () => page.locator('#jobs-table tbody tr[data-state="canceled"]').count(), (n) => n >= 2);
  await page.check("#select-all");
  await page.click("#bulk-delete");
  await until("the delete's report", () => text("#bulk-result"), (t) => /^deleted: (\d+) of \1$/.test(t || ""));
  const gone = await fetch(`${base}/v1/admin/jobs/${ids[0]}`, { headers: { authorization: `Bearer ${key}` } });
  if (gone.status !== 404) throw new Error(`a deleted job answers ${gone.status}`);

  // The scheduled job, run now.
  await page.selectOption("#filter-state", "scheduled");
  await page.selectOption("#filter-kind", "");
  await page.click("#job-filters button");
  await page.click(`button[data-run-now="${scheduledId}"]`);
  await until("the scheduled job to be queued", () => api("GET", `/v1/admin/jobs/${scheduledId}`), (j) => j?.state === "queued");
  await page.screenshot({ path: shot("jobs"), fullPage: true });
  console.log(`scheduled job ${scheduledId} runs now`);

  // The failed (then retried) job's page: its timeline and input.
  await page.goto(`${base}/admin#job/${failedId}`);
  await page.waitForSelector('#job-timeline tr[data-state="failed"]');
  await page.waitForSelector('#job-timeline tr[data-state="queued"]');
  const input = await text("#job-input");
  if (!input.includes("fail_permanently")) throw new Error(`the job page's input: ${input}`);
  await page.screenshot({ path: shot("job"), fullPage: true });
  console.log("job page shows its timeline and input");

  // Purge: every waiting echo job canceled.
  await page.click('a[href="#overview"]');
  await page.click('button[data-purge="echo"]');
  await until("the echo queue to empty", () => page.textContent('tr[data-kind="echo"] td[data-state="queued"]'), (t) => t === "0");
  console.log("echo queue purged");
} catch (e) {
  console.error(e.stack || String(e));
  await page.screenshot({ path: shot("failure"), fullPage: true }).catch(() => {});
  failed = true;
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
