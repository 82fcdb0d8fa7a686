#!/usr/bin/env bash
# Renders every overlay of deploy/kubernetes with kubectl's kustomize and validates every
# object offline (deploy/kubernetes/validate.py: Kubernetes' own schemas, strict, and KEDA's
# and the Prometheus Operator's resource models). Installs the tools first
# (scripts/services.sh kubernetes).
#
# Usage: scripts/kubernetes-check.sh [KUBERNETES_VERSION]   (default 1.31.0, 1.25-1.37 bundled)
# Environment: TERN_STATE_DIR (default ~/.cache/tern). Renders go to $TERN_STATE_DIR/kubernetes/rendered.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=env.sh
. scripts/env.sh
bash scripts/services.sh kubernetes

version="${1:-1.31.0}"
venv="$TERN_STATE_DIR/kubernetes/venv"
out="$TERN_STATE_DIR/kubernetes/rendered"
mkdir -p "$out"
rendered=()
for overlay in deploy/kubernetes/overlays/*/; do
  name="$(basename "$overlay")"
  "$venv/bin/kubectl" kustomize "$overlay" >"$out/$name.yaml"
  echo "rendered $overlay: $(grep -c '^kind:' "$out/$name.yaml") objects"
  rendered+=("$out/$name.yaml")
done
"$venv/bin/python" deploy/kubernetes/validate.py "$version" "${rendered[@]}"
