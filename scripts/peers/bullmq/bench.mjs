// BullMQ's own rates on this machine, the peer figures for tern-bench's echo jobs
// (docs/benchmarks.md, "Job lifecycle"): addBulk submits, then a worker at concurrency 50
// drains the backlog with a no-op processor; then workers running, jobs added, from the first
// add to the last completion. Nothing is durable beyond Redis's own persistence settings.
//
// Usage: node bench.mjs [JOBS=50000] [CONCURRENCY=50]   (REDIS_URL, default redis://127.0.0.1:6379)
import { Queue, Worker } from "bullmq";

const jobs = Number(process.argv[2] ?? 50000);
const concurrency = Number(process.argv[3] ?? 50);
const url = new URL(process.env.REDIS_URL ?? "redis://127.0.0.1:6379");
const connection = { host: url.hostname, port: Number(url.port || 6379), maxRetriesPerRequest: null };
const name = `tern-peer-${process.pid}`;

async function addBulk(queue, n) {
  const started = performance.now();
  for (let i = 0; i < n; i += 1000) {
    const batch = [];
    for (let j = i; j < Math.min(n, i + 1000); j++) batch.push({ name: "echo", data: { message: j } });
    await queue.addBulk(batch);
  }
  return (performance.now() - started) / 1000;
}

function drain(n) {
  return new Promise((resolve) => {
    let done = 0;
    const started = performance.now();
    const worker = new Worker(name, async (job) => job.data, { connection, concurrency, removeOnComplete: { count: 0 } });
    worker.on("completed", () => {
      if (++done === n) {
        const seconds = (performance.now() - started) / 1000;
        worker.close().then(() => resolve(seconds));
      }
    });
  });
}

const queue = new Queue(name, { connection, defaultJobOptions: { removeOnComplete: true } });
await queue.obliterate({ force: true });

// Bulk submit, then drain the backlog.
const submitSeconds = await addBulk(queue, jobs);
const drainSeconds = await drain(jobs);

// End to end: workers running, then the jobs added.
const running = drain(jobs);
const started = performance.now();
await addBulk(queue, jobs);
await running;
const e2eSeconds = (performance.now() - started) / 1000;

console.log(`bullmq ${jobs} jobs, worker concurrency ${concurrency}`);
console.log(`  addBulk: ${(jobs / submitSeconds).toFixed(0)} jobs/s`);
console.log(`  drain:   ${(jobs / drainSeconds).toFixed(0)} jobs/s`);
console.log(`  e2e:     ${(jobs / e2eSeconds).toFixed(0)} jobs/s`);
await queue.obliterate({ force: true });
await queue.close();
