#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Run tern's whole test suite against real services: installs/starts Postgres, Redis and
# SeaweedFS (scripts/services.sh), builds the release binaries the black-box tests spawn
# (tern-api, tern-worker), then runs every test in the workspace.
#
# Usage: scripts/test.sh [ARGS...]
#   ARGS go to `cargo nextest run` when cargo-nextest is installed (e.g. a test-name
#   filter), otherwise to `cargo test` (there, test-binary flags go after `--`).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/services.sh up
bash scripts/services.sh browser
bash scripts/services.sh schemathesis
bash scripts/services.sh openai
bash scripts/services.sh kubernetes
bash scripts/services.sh faster-whisper
bash scripts/models.sh --all
# shellcheck source=env.sh
. scripts/env.sh


cargo build --release --workspace --bins

if cargo nextest --version >/dev/null 2>&1; then
  exec cargo nextest run --workspace --release --no-fail-fast "$@"
else
  exec cargo test --workspace --release --no-fail-fast "$@"
fi
