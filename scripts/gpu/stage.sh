#!/usr/bin/env bash
# Pack what a GPU benchmark round needs on a machine that reaches no registry (the lent H100s
# and H200s): the CUDA worker and model benchmark, the ordinary API and service benchmark, the
# model weights and test audio, and Postgres 15, Redis and SeaweedFS with the libraries they
# load. The pack is split into parts small enough to carry one at a time; scripts/gpu/round.sh
# unpacks and runs them there.
#
# Usage: scripts/gpu/stage.sh [PART_MB] [generate|models]   (default 60; parts go to .gpu/part.*,
#        git-ignored). `generate` packs only tern-bench-models and the language model, for
#        round.sh's `generate` stage (two parts instead of nine); `models` packs
#        tern-bench-models, Whisper tiny.en, the language model and the test audio, for the
#        in-process stages `whisper` and `generate` and their peers (three parts of 59 MB);
#        `base` the same with Whisper base alone, for `whisper-base`. With no second argument,
#        everything for the services too; STAGE_MODELS (e.g. "whisper-tiny.en
#        smollm2-135m-instruct testdata") limits the weights packed to those folders, and
#        STAGE_BENCH_MODELS=0 leaves tern-bench-models out.
#
# Needs, here: `cargo build --release -p tern-api -p tern-e2e --bins` (ordinary); the CUDA build
# of docs/gpu.md, its tern-worker and tern-bench-models copied to $TERN_CUDA_BIN (default
# ~/.cache/tern/cuda-bin); the models (scripts/models.sh --all) and the services
# (scripts/services.sh up).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/env.sh
part_mb="${1:-60}"
cuda_bin="${TERN_CUDA_BIN:-$HOME/.cache/tern/cuda-bin}"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT

pack() {
  rm -rf .gpu && mkdir -p .gpu
  tar -C "$stage" -cf - . | gzip -4 | split -b "${part_mb}m" - .gpu/part.
  ls -la .gpu
}

if [[ "${2:-}" == generate ]]; then
  mkdir -p "$stage/bin" "$stage/models"
  cp "$cuda_bin/tern-bench-models" "$stage/bin/"
  strip "$stage/bin/tern-bench-models"
  cp -r "$TERN_MODELS_DIR/smollm2-135m-instruct" "$stage/models/"
  pack
  exit 0
fi

if [[ "${2:-}" == models || "${2:-}" == base ]]; then
  mkdir -p "$stage/bin" "$stage/models"
  cp "$cuda_bin/tern-bench-models" "$stage/bin/"
  strip "$stage/bin/tern-bench-models"
  if [[ "$2" == base ]]; then
    cp -r "$TERN_MODELS_DIR"/{whisper-base,testdata} "$stage/models/"
  else
    cp -r "$TERN_MODELS_DIR"/{whisper-tiny.en,smollm2-135m-instruct,testdata} "$stage/models/"
  fi
  pack
  exit 0
fi

mkdir -p "$stage/bin" "$stage/lib" "$stage/weed"
cp "$cuda_bin/tern-worker" "$stage/bin/"
# STAGE_BENCH_MODELS=0 leaves the in-process benchmark out (the service stages do not run it).
[[ "${STAGE_BENCH_MODELS:-1}" == 1 ]] && cp "$cuda_bin/tern-bench-models" "$stage/bin/"
cp "$TERN_BIN_DIR/tern-api" "$TERN_BIN_DIR/tern-bench-transcribe" "$stage/bin/"
strip "$stage"/bin/*
if [[ -n "${STAGE_MODELS:-}" ]]; then
  mkdir -p "$stage/models"
  for m in $STAGE_MODELS; do cp -r "$TERN_MODELS_DIR/$m" "$stage/models/"; done
else
  cp -r "$TERN_MODELS_DIR" "$stage/models"
fi
cp "$TERN_STATE_DIR/seaweedfs/venv/bin/weed" "$stage/weed/"

# Postgres keeps Debian's layout under pg/, so its binaries find share/ by relative path.
mkdir -p "$stage/pg/usr/lib/postgresql" "$stage/pg/usr/share/postgresql"
cp -r /usr/lib/postgresql/15 "$stage/pg/usr/lib/postgresql/"
cp -r /usr/share/postgresql/15 "$stage/pg/usr/share/postgresql/"
cp /usr/bin/redis-server "$stage/bin/"
# The shared libraries of the services, but the C runtime's, which the machine has.
for exe in /usr/lib/postgresql/15/bin/{postgres,initdb,pg_ctl,psql} /usr/bin/redis-server; do
  ldd "$exe" | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s)\.so' |
  xargs -I{} cp -L {} "$stage/lib/"

pack
