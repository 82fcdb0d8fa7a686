#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
#
# tern demo: runs tern's main job end to end on this machine.
#
# It starts the services (Postgres, Redis, SeaweedFS S3), builds and starts tern-api and
# one tern-worker, submits a job over the HTTP API, waits for it to finish, prints the
# final job and downloads the job's output object from S3 through its presigned URL.
#
# The job transcribes a real recording (a LibriVox clip from Debian's pocketsphinx-testdata,
# fetched by scripts/models.sh with Whisper tiny.en) and prints the transcript and subtitles.
#
# Usage: scripts/demo.sh     (API address: TERN_LISTEN, default 127.0.0.1:8080)
# Logs: $TERN_STATE_DIR/demo-api.log and demo-worker.log (TERN_STATE_DIR: ~/.cache/tern)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf 'demo: %s\n' "$*" >&2; }
die() {
  printf 'demo: error: %s\n' "$*" >&2
  exit 1
}

bash scripts/services.sh up
bash scripts/models.sh
# shellcheck source=env.sh
. scripts/env.sh

export TERN_LISTEN="${TERN_LISTEN:-127.0.0.1:8080}"

host="${TERN_LISTEN%:*}"
port="${TERN_LISTEN##*:}"
case "$host" in
  "" | 0.0.0.0 | "[::]") host=127.0.0.1 ;;
esac
API="http://$host:$port"

api_log="$TERN_STATE_DIR/demo-api.log"
worker_log="$TERN_STATE_DIR/demo-worker.log"
mkdir -p "$TERN_STATE_DIR"

say "building release binaries (cargo build --release --workspace --bins)"
cargo build --release --workspace --bins

# Print a field of the JSON document on stdin ("id", "output.url"); empty if null/missing.
json_get() {
  python3 -c '
import json, sys
v = json.load(sys.stdin)
for key in sys.argv[1].split("."):
    v = v.get(key) if isinstance(v, dict) else None
print("" if v is None else v if isinstance(v, str) else json.dumps(v))' "$1"
}

pretty_json() { python3 -m json.tool 2>/dev/null; }

alive() { kill -0 "$1" 2>/dev/null; }

API_PID=""
WORKER_PID=""
stop() {
  local pid="$1" i
  [[ -n "$pid" ]] && alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    alive "$pid" || break
    sleep 0.2
  done
  if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  wait "$pid" 2>/dev/null || true
}
cleanup() {
  stop "$WORKER_PID"
  stop "$API_PID"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if curl -s -o /dev/null --max-time 2 "$API/readyz"; then
  die "something already answers on $API; stop it, or set TERN_LISTEN to a free address"
fi

say "starting tern-api on $API (log: $api_log)"
"$TERN_BIN_DIR/tern-api" >"$api_log" 2>&1 </dev/null &
API_PID=$!

deadline=$((SECONDS + 60))
until curl -sf -o /dev/null --max-time 2 "$API/readyz"; do
  if ! alive "$API_PID"; then
    tail -n 30 "$api_log" >&2
    die "tern-api exited during start-up (log: $api_log)"
  fi
  if ((SECONDS >= deadline)); then
    tail -n 30 "$api_log" >&2
    die "tern-api not ready at $API/readyz after 60 s (log: $api_log)"
  fi
  sleep 0.2
done

say "creating an API key for tenant demo (tern-api keys create)"
key="$("$TERN_BIN_DIR/tern-api" keys create --tenant demo --scope jobs:write,jobs:read --name demo 2>/dev/null)" \
  || die "creating an API key failed"
auth="authorization: Bearer $key"

say "starting one tern-worker (log: $worker_log)"
"$TERN_BIN_DIR/tern-worker" >"$worker_log" 2>&1 </dev/null &
WORKER_PID=$!

clip="$TERN_MODELS_DIR/testdata/librivox/sense_and_sensibility_01_austen_64kb-0870.wav"
say "submitting a transcription of $(basename "$clip") (LibriVox speech, sent as base64)"
request_file="$TERN_STATE_DIR/demo-request.json"
python3 - "$clip" >"$request_file" <<'PY'
import base64, json, sys
audio = base64.b64encode(open(sys.argv[1], "rb").read()).decode()
print(json.dumps({"kind": "transcribe", "priority": "high", "input": {"audio": {"base64": audio}}}))
PY
response="$(curl -sS -X POST "$API/v1/jobs" -H 'content-type: application/json' -H "$auth" \
  -d "@$request_file" -w '\n%{http_code}')" || die "POST $API/v1/jobs failed"
status="${response##*$'\n'}"
body="${response%$'\n'*}"
if [[ "$status" != 2?? ]]; then
  printf '%s\n' "$body" >&2
  die "POST $API/v1/jobs answered HTTP $status"
fi
id="$(json_get id <<<"$body")" || die "cannot parse the submit response: $body"
[[ -n "$id" ]] || die "the submit response has no id: $body"
say "job $id submitted; waiting for it to finish"

deadline=$((SECONDS + 180))
state=""
job=""
while :; do
  if job="$(curl -sf --max-time 5 -H "$auth" "$API/v1/jobs/$id")"; then
    state="$(json_get state <<<"$job" 2>/dev/null || true)"
    case "$state" in
      succeeded | failed | canceled) break ;;
    esac
  fi
  if ! alive "$WORKER_PID"; then
    tail -n 30 "$worker_log" >&2
    die "tern-worker exited (log: $worker_log)"
  fi
  if ((SECONDS >= deadline)); then
    [[ -n "$job" ]] && printf '%s\n' "$job" | pretty_json >&2
    die "job $id not finished after 180 s (last state: ${state:-unknown}); logs: $api_log, $worker_log"
  fi
  sleep 0.2
done

echo "Final job:"
printf '%s\n' "$job" | pretty_json || printf '%s\n' "$job"

if [[ "$state" != succeeded ]]; then
  die "job $id ended in state $state (logs: $api_log, $worker_log)"
fi

url="$(json_get output.url <<<"$job")"
[[ -n "$url" ]] || die "job $id succeeded but has no output.url"
object="$(curl -sSf --max-time 30 "$url")" || die "downloading the output object failed: $url"
echo
echo "Output object from S3:"
printf '%s\n' "$object" | pretty_json || printf '%s\n' "$object"

srt_url="$(json_get output.formats.srt.url <<<"$job")"
if [[ -n "$srt_url" ]]; then
  echo
  echo "Subtitles (SRT) from S3:"
  curl -sSf --max-time 30 "$srt_url" || die "downloading the SRT output failed"
fi
echo "Reference transcript: $(grep -F "$(basename "$clip" .wav)" "$TERN_MODELS_DIR/testdata/librivox/transcription" | sed -e 's/<s> //' -e 's/ <\/s>.*//')"
