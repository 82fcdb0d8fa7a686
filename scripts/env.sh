# shellcheck shell=sh
# Default environment for running tern against the local dev services started by
# scripts/services.sh. Source it: `. scripts/env.sh`. A variable that is already set
# is left alone, so you can point any of them somewhere else.

export TERN_STATE_DIR="${TERN_STATE_DIR:-$HOME/.cache/tern}"
export TERN_DATABASE_URL="${TERN_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/tern}"
export TERN_REDIS_URL="${TERN_REDIS_URL:-redis://127.0.0.1:6379}"
export TERN_S3_ENDPOINT="${TERN_S3_ENDPOINT:-http://127.0.0.1:8333}"
export TERN_S3_ACCESS_KEY="${TERN_S3_ACCESS_KEY:-tern-dev}"
export TERN_S3_SECRET_KEY="${TERN_S3_SECRET_KEY:-tern-dev-secret}"
export TERN_S3_REGION="${TERN_S3_REGION:-us-east-1}"

# One cargo target directory for the project's scripts (and CI, which may keep it between runs).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tern/target}"
case "$CARGO_TARGET_DIR" in
  /*) ;;
  *) CARGO_TARGET_DIR="$PWD/$CARGO_TARGET_DIR" ;; # tests run from other directories
esac
# The black-box tests and the demo run the release binaries from here.
export TERN_BIN_DIR="${TERN_BIN_DIR:-$CARGO_TARGET_DIR/release}"
# Model weights and test audio, filled by scripts/models.sh.
export TERN_MODELS_DIR="${TERN_MODELS_DIR:-$TERN_STATE_DIR/models}"
