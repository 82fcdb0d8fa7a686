// Drives the /admin dashboard in headless Chromium, as an operator would.
// Usage: node dashboard.mjs BASE_URL ADMIN_KEY FAILED_JOB_ID SCREENSHOT_PATH
// Signs in, submits five echo jobs (their kind is paused) and waits for the queue depth shown
// to rise by five, clicks Retry on the failed job, checks through the API that it left the
// failed state, and saves a screenshot. Exits non-zero with a message on any failure.
import { chromium } from "playwright-core";

const [base, key, failedId, screenshot] = process.argv.slice(2);
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
  await page.screenshot({ path: screenshot, fullPage: true });
} catch (e) {
  console.error(e.stack || String(e));
  await page.screenshot({ path: screenshot, fullPage: true }).catch(() => {});
  failed = true;
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
