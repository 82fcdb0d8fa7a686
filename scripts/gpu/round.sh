#!/usr/bin/env bash
# One GPU benchmark round on a lent machine (no registry, no services), from the repository root:
# unpack what scripts/gpu/stage.sh packed, start Postgres, Redis and SeaweedFS, then run the
# stages named on the command line, each logged to $OUT, a summary printed last.
#
# Usage: scripts/gpu/round.sh STAGE...
#   unpack     join the parts in $TERN_GPU_PARTS (default /root/parts) into $TERN_GPU_ROOT
#              (default /opt/tern-gpu: Postgres runs as another user, who cannot enter /root)
#   services   start Postgres 15 (127.0.0.1:5432), Redis (6379) and SeaweedFS S3 (8333)
#   models     tern-bench-models on the GPU: Whisper tiny.en and base (clips and a long
#              recording, window budgets 1..256), embeddings (batch 1..256), generation (1..64)
#   whisper    tern-bench-models on Whisper tiny.en, greedy: window budgets 1..1024 with greedy
#              picks on the device, then 1,024 windows with host picks (as before) and on the
#              device again, GPU use sampled; beam 5 at 256 windows
#   whisper-base  the same for Whisper base (stage.sh's `base` pack): budgets 1 and 1,024
#   generate   tern-bench-models' generation (1..256 requests together) on the language model's
#              matrices quantized as stored and dense (dequantized at load), GPU use sampled
#   sampling   the token picks of generation on the device against the host's on the same
#              logits, then generation (dense, 1..256 requests) with tokens picked on the
#              device and on the host, and kept quantized, GPU use sampled
#   fused      the fused decoding step against candle's ops on the same caches (1 to 256
#              requests, F32 and TF32 products), then generation (dense, fused steps) with F32
#              products (the default) and TF32 ones: one request, 16, 64 and 256 together, GPU
#              use sampled
#   whisper-full  Whisper tiny.en at full 30 s padding (the worker's default, the reference's
#              transcripts): greedy at budgets 1, 256 and 1,024, beam 5 at 256 and 1,024 with
#              picks on the device, beam 5 with host picks
#   service    tern-bench-transcribe through API, queue, worker and S3, tiny.en and base
#              (SERVICE_MODELS names others) at beam 5, the worker's default (SERVICE_BEAMS names
#              others, e.g. "5 1"), window budget 1 and the measured one (SERVICE_BUDGETS), GPU utilisation
#              sampled by nvidia-smi
#   oom        a real CUDA out-of-memory: another process holds all but 3 GB of the device, the
#              worker runs 1,024-window batches with no check against the free memory
#              (TERN_MEMORY_PRECHECK=false), so the CUDA allocator refuses them; each is split
#              and no job fails
#   peers      scripts/peers/gpu/run_peers.sh (transformers, sentence-transformers); PEERS and
#              WHISPER_MODELS pick which (run_peers.sh)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="${TERN_GPU_ROOT:-/opt/tern-gpu}"
PARTS="${TERN_GPU_PARTS:-/root/parts}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export TERN_STATE_DIR=/tmp/tern-state TERN_MODELS_DIR="$ROOT/models" TERN_BIN_DIR="$ROOT/bin"
export TERN_DATABASE_URL=postgres://postgres@127.0.0.1:5432/tern TERN_REDIS_URL=redis://127.0.0.1:6379
export TERN_S3_ENDPOINT=http://127.0.0.1:8333 TERN_S3_ACCESS_KEY=tern-dev TERN_S3_SECRET_KEY=tern-dev-secret
export TERN_S3_REGION=us-east-1 CUDA_COMPUTE_CAP=90
# candle's CUDA backend loads cuBLAS, cuRAND and NVRTC of CUDA 13: PyTorch's copies serve.
cudalibs="$(dirname "$(find / -name 'libcublasLt.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")"
curandlibs="$(dirname "$(find / -name 'libcurand.so.10*' -not -path '/proc/*' 2>/dev/null | head -1)")"
nvrtclibs="$(dirname "$(find / -name 'libnvrtc.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")"
export LD_LIBRARY_PATH="$cudalibs:$curandlibs:$nvrtclibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
svc_env=(env "LD_LIBRARY_PATH=$ROOT/lib")
PG="$ROOT/pg/usr/lib/postgresql/15/bin"

step() { printf '\n== %s (%s)\n' "$*" "$(date +%T)"; }

# nvidia-smi's utilization.gpu (share of time a kernel ran) every 100 ms while "$@" runs.
with_gpu_samples() {
  local file="$1"
  shift
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 100 >"$file" &
  local smi=$!
  "$@"
  local rc=$?
  kill "$smi" 2>/dev/null
  return $rc
}

unpack() {
  step unpack
  mkdir -p "$ROOT"
  cat "$PARTS"/part.* | tar -xzf - -C "$ROOT" && du -sh "$ROOT"
}

services() {
  step services
  # Postgres refuses to run as root.
  id tpg >/dev/null 2>&1 || useradd -M tpg 2>/dev/null || echo 'tpg:x:7777:7777::/tmp:/bin/sh' >>/etc/passwd
  rm -rf /tmp/pgdata && mkdir -p /tmp/pgdata && chown tpg /tmp/pgdata && chmod -R o+rX "$ROOT"
  runuser -u tpg -- "${svc_env[@]}" "$PG/initdb" -D /tmp/pgdata -U postgres --auth=trust >"$OUT/initdb.log" 2>&1 || { tail "$OUT/initdb.log"; return 1; }
  runuser -u tpg -- "${svc_env[@]}" "$PG/pg_ctl" -D /tmp/pgdata -l /tmp/pg.log -w \
    -o "-c listen_addresses=127.0.0.1 -c max_connections=400 -c unix_socket_directories=/tmp" start || { tail /tmp/pg.log; return 1; }
  "${svc_env[@]}" "$PG/psql" -h 127.0.0.1 -U postgres -c 'CREATE DATABASE tern' >/dev/null
  "${svc_env[@]}" "$ROOT/bin/redis-server" --port 6379 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes >/dev/null
  mkdir -p /tmp/weed
  cat >/tmp/weed/s3.json <<'JSON'
{"identities":[{"name":"tern-dev","credentials":[{"accessKey":"tern-dev","secretKey":"tern-dev-secret"}],"actions":["Admin","Read","List","Tagging","Write"]}]}
JSON
  setsid nohup "$ROOT/weed/weed" mini -dir=/tmp/weed/data -ip=127.0.0.1 -ip.bind=127.0.0.1 -s3.port=8333 \
    -s3.config=/tmp/weed/s3.json -master.telemetry=false -webdav=false -admin.ui=false -s3.port.iceberg=0 \
    -s3.port.lance=0 -master.volumeSizeLimitMB=128 >/tmp/weed.log 2>&1 </dev/null &
  local healthy='import urllib.request; urllib.request.urlopen("http://127.0.0.1:8333/healthz", timeout=2)'
  for _ in $(seq 120); do python3 -c "$healthy" 2>/dev/null && break; sleep 0.5; done
  python3 -c "$healthy" || { tail /tmp/weed.log; return 1; }
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv
}

models() {
  local b="$ROOT/bin/tern-bench-models"
  step "models: tiny.en"
  "$b" --device cuda --only transcribe --whisper-model whisper-tiny.en --clips 512 --budgets 1,16,64,256 2>&1 | tee "$OUT/models-tiny.log"
  step "models: base"
  "$b" --device cuda --only transcribe --whisper-model whisper-base --clips 512 --budgets 1,16,64,256 2>&1 | tee "$OUT/models-base.log"
  step "models: embeddings (F16) and generation"
  "$b" --device cuda --only embed,generate --embed-batches 1,32,128,256 --embed-texts 4096 --gen-batches 16,64 2>&1 | tee "$OUT/models-embed-gen.log"
  step "models: embeddings in F32"
  "$b" --device cuda --only embed --precision f32 --embed-batches 128 --embed-texts 4096 2>&1 | tee "$OUT/models-embed-f32.log"
}

whisper() {
  local b="$ROOT/bin/tern-bench-models" m=whisper-tiny.en
  step "whisper: tiny.en greedy, picks on the device, budgets 1..1024"
  "$b" --device cuda --only transcribe --whisper-model $m --clips 1024 --beam-size 1 --budgets 1,64,256,1024 2>&1 | tee "$OUT/whisper-budgets.log"
  step "whisper: tiny.en greedy, full 30 s padding as the pipeline, budgets 1 and 1024"
  "$b" --device cuda --only transcribe --whisper-model $m --clips 512 --beam-size 1 --padding full --budgets 1,1024 2>&1 | tee "$OUT/whisper-full.log"
  local picks clips
  for picks in host device; do
    clips=$([[ $picks == host ]] && echo 8192 || echo 16384)
    step "whisper: tiny.en greedy at 1,024 windows, $clips clips, picks on the $picks, GPU use sampled"
    with_gpu_samples "$OUT/smi-whisper-$picks.csv" "$b" --device cuda --only transcribe --whisper-model $m --clips $clips \
      --long-seconds 1 --beam-size 1 --budgets 1024 $([[ $picks == host ]] && echo --host-picks) 2>&1 | tee "$OUT/whisper-$picks.log"
    busy "$OUT/smi-whisper-$picks.csv" "$OUT/whisper-$picks.log"
  done
  step "whisper: tiny.en beam 5 at 256 windows"
  "$b" --device cuda --only transcribe --whisper-model $m --clips 1024 --beam-size 5 --budgets 256 2>&1 | tee "$OUT/whisper-beam5.log"
}

whisper-base() {
  local b="$ROOT/bin/tern-bench-models"
  step "whisper: base greedy, picks on the device, budgets 1 and 1024, trimmed and full padding"
  "$b" --device cuda --only transcribe --whisper-model whisper-base --clips 512 --beam-size 1 --budgets 1,1024 2>&1 | tee "$OUT/base-trimmed.log"
  "$b" --device cuda --only transcribe --whisper-model whisper-base --clips 512 --beam-size 1 --padding full --budgets 1024 2>&1 | tee "$OUT/base-full.log"
}

# busy SAMPLES.csv LOG: the mean of nvidia-smi's utilization.gpu over the samples taken while
# the clips ran (the span tern-bench-models prints), and how many samples that is.
busy() {
  python3 - "$1" "$2" <<'PY' | tee -a "$OUT/busy.txt"
import re, sys, time
spans = [tuple(map(float, m)) for m in re.findall(r"clips ran from ([0-9.]+) to ([0-9.]+)", open(sys.argv[2]).read())]
rows = []
for line in open(sys.argv[1]):
    stamp, util, _ = [f.strip() for f in line.split(",")]
    whole, frac = stamp.split(".")
    rows.append((time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + float("0." + frac), float(util)))
for a, b in spans:
    inside = [u for t, u in rows if a <= t <= b]
    if inside:
        print(f"{sys.argv[2].split('/')[-1]}: GPU busy {sum(inside) / len(inside):.0f}% over {len(inside)} samples in {b - a:.1f} s of clips")
PY
}

generate() {
  local b="$ROOT/bin/tern-bench-models" weights
  for weights in quantized dense; do
    step "generate: $weights"
    with_gpu_samples "$OUT/smi-generate-$weights.csv" "$b" --device cuda --only generate \
      --llm-weights "$weights" --gen-batches 16,64,128,256 2>&1 | tee "$OUT/generate-$weights.log"
  done
}

sampling() {
  local b="$ROOT/bin/tern-bench-models" m
  step "sampling: device picks against host picks on the same logits"
  "$b" --device cuda --only sampling-check 2>&1 | tee "$OUT/sampling-check.log"
  for m in device host; do
    step "sampling: generation, dense, tokens picked on the $m"
    with_gpu_samples "$OUT/smi-generate-$m.csv" "$b" --device cuda --only generate --llm-weights dense \
      --gen-batches 16,64,256 $([[ $m == host ]] && echo --host-sampling) 2>&1 | tee "$OUT/generate-$m.log"
  done
  step "sampling: generation, kept quantized, tokens picked on the device"
  "$b" --device cuda --only generate --llm-weights quantized --gen-batches 64 2>&1 | tee "$OUT/generate-quantized.log"
}

fused() {
  local b="$ROOT/bin/tern-bench-models" m
  step "fused: the fused step against candle's ops on the same caches"
  "$b" --device cuda --only step-check 2>&1 | tee "$OUT/step-check.log"
  # auto: F32 products (the default); tf32-products: TF32 ones for steps of more than 8 requests.
  for m in auto tf32-products; do
    step "fused: generation, dense, fused steps, precision $m"
    with_gpu_samples "$OUT/smi-generate-$m.csv" "$b" --device cuda --only generate --llm-weights dense \
      --precision $m --gen-batches 16,64,256 2>&1 | tee "$OUT/generate-$m.log"
  done
}

whisper-full() {
  local b="$ROOT/bin/tern-bench-models" m=whisper-tiny.en
  step "whisper-full: tiny.en greedy, full padding, budget 1 (128 clips)"
  "$b" --device cuda --only transcribe --whisper-model $m --clips 128 --long-seconds 1 --beam-size 1 --padding full --budgets 1 2>&1 | tee "$OUT/full-greedy-1.log"
  step "whisper-full: tiny.en greedy, full padding, budgets 256 and 1024 (1,024 clips)"
  "$b" --device cuda --only transcribe --whisper-model $m --clips 1024 --beam-size 1 --padding full --budgets 256,1024 2>&1 | tee "$OUT/full-greedy.log"
  step "whisper-full: tiny.en beam 5, full padding, picks on the device, budgets 256 and 1024"
  "$b" --device cuda --only transcribe --whisper-model $m --clips 1024 --beam-size 5 --padding full --budgets 256,1024 2>&1 | tee "$OUT/full-beam5.log"
  step "whisper-full: tiny.en beam 5, full padding, host picks, budget 256"
  "$b" --device cuda --only transcribe --whisper-model $m --clips 1024 --long-seconds 1 --beam-size 5 --padding full --budgets 256 --host-picks 2>&1 | tee "$OUT/full-beam5-host.log"
}

service() {
  local model beam
  for model in ${SERVICE_MODELS:-whisper-tiny.en whisper-base}; do
    for beam in ${SERVICE_BEAMS:-5}; do
      step "service: $model, beam $beam"
      rm -rf "$ROOT/bin/tern-test-logs"
      TERN_BENCH_WORKER_LOG=info with_gpu_samples "$OUT/smi-$model-$beam.csv" \
        "$ROOT/bin/tern-bench-transcribe" --device cuda --model "$model" --worker-env "TERN_WHISPER_BEAM_SIZE=$beam" --clips 512 --budgets "${SERVICE_BUDGETS:-1,measured}" 2>&1 |
        tee "$OUT/service-$model-$beam.log"
      grep -hE 'budget|probe|unit_bytes|split|warm' "$ROOT"/bin/tern-test-logs/*worker*.log 2>/dev/null | tail -40 >"$OUT/worker-$model-$beam.log"
    done
  done
}

oom() {
  step "oom: 512 clips at a fixed 1,024-window budget with 3 GB of the device left free"
  # Another process holds all but 3 GB of the device while the worker runs.
  python3 -c '
import sys, time, torch
free, _ = torch.cuda.mem_get_info()
hog = torch.empty(free - 3 * 2**30, dtype=torch.uint8, device="cuda")
print(f"hog holds {hog.numel() / 1e9:.1f} GB", flush=True)
time.sleep(600)' &
  local hog=$!
  sleep 15
  nvidia-smi --query-gpu=memory.used,memory.free --format=csv
  rm -rf "$ROOT/bin/tern-test-logs"
  TERN_BENCH_WORKER_LOG=info "$ROOT/bin/tern-bench-transcribe" --device cuda --model whisper-tiny.en \
    --worker-env TERN_MEMORY_PRECHECK=false --clips 512 \
    --budgets 1024 2>&1 | tee "$OUT/oom.log"
  kill "$hog"
  grep -hiE 'split|out of memory|OUT_OF_MEMORY|ALLOC_FAILED|budget' "$ROOT"/bin/tern-test-logs/*worker*.log | tail -20 | tee -a "$OUT/oom.log"
}

peers() {
  step peers
  CLIPS="${CLIPS:-1024}" bash scripts/peers/gpu/run_peers.sh "$TERN_MODELS_DIR" "$OUT/peers"
}

for stage in "$@"; do
  "$stage" || echo "!! stage $stage failed ($?)"
done
step done
