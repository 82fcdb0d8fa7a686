#!/usr/bin/env bash
# The Python GPU peers of tern's benchmarks, on the same weights and audio, in one run (a few
# minutes on an H100):
#   - Whisper tiny.en and base: transformers' ASR pipeline, fp16, batch 16 and 64, 200 LibriVox
#     clips and one 120 s recording (the HF folders are rebuilt from tern's CTranslate2 weights);
#   - all-MiniLM-L6-v2: sentence-transformers, fp16, batch 32, 128, 256, 4096 texts;
#   - SmolLM2-135M-Instruct (tern's Q4_1 GGUF, dequantised to fp16 by transformers): one greedy
#     request, then 1 and 64 sampled requests in one batched `generate`.
#
# Usage: scripts/peers/gpu/run_peers.sh MODELS_DIR OUT_DIR
#   MODELS_DIR as scripts/models.sh --all fills it; OUT_DIR gets one full log per stage and
#   summary.txt. Offline: the wheels in .whl/ (the `gguf` package) are installed to /tmp/site
#   without an index. Each stage runs on its own: one failing prints its error and the rest go on.
#   PYTHON (default python3), DEVICE (default cuda), STAGE_TIMEOUT (seconds, default 240),
#   PEERS (default "whisper embeddings generate"), WHISPER_MODELS (default "tiny.en base").
set -uo pipefail
models=$(cd "${1:?usage: run_peers.sh MODELS_DIR OUT_DIR}" && pwd)
out=${2:?usage: run_peers.sh MODELS_DIR OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
limit=${STAGE_TIMEOUT:-240}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TERN_MODELS_DIR="$models" TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1 TQDM_DISABLE=1

failed=()
# stage NAME COMMAND...: runs it with a time limit, its output teed to OUT_DIR/NAME.log.
stage() {
  local name=$1 start rc
  shift
  printf '\n== %s: %s\n' "$name" "$*"
  start=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then
    failed+=("$name")
    printf '!! %s failed (exit %s%s) after %ss\n' "$name" "$rc" "$([[ $rc -eq 124 ]] && echo ', timed out')" "$(($(date +%s) - start))" | tee -a "$out/$name.log"
  else
    printf '== %s done in %ss\n' "$name" "$(($(date +%s) - start))"
  fi
}

t0=$(date +%s)
if compgen -G "$root/.whl/*.whl" >/dev/null; then
  stage wheels "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$root"/.whl/*.whl
  if [[ ${failed[*]:-} == *wheels* ]]; then  # no pip: a wheel is a zip
    stage wheels-unzip "$py" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall("/tmp/site") for w in sys.argv[1:]]' "$root"/.whl/*.whl
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
stage environment "$py" - <<'PY'
import importlib, importlib.metadata, os, platform, sys
print("python", platform.python_version(), sys.executable)
for m, dist in (("torch", "torch"), ("transformers", "transformers"), ("sentence_transformers", "sentence-transformers"),
                ("accelerate", "accelerate"), ("safetensors", "safetensors"), ("tokenizers", "tokenizers"),
                ("numpy", "numpy"), ("gguf", "gguf")):
    try:
        mod = importlib.import_module(m)
        print(f"{m:>22} {importlib.metadata.version(dist)}  {os.path.dirname(mod.__file__)}")
    except Exception as e:
        print(f"{m:>22} MISSING ({e})")
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$out/environment.log"

dtype=float16
[[ $device == cpu ]] && dtype=float32
peers=" ${PEERS:-whisper embeddings generate} "
whisper_models=${WHISPER_MODELS:-tiny.en base}
if [[ $peers == *" whisper "* ]]; then
  for m in $whisper_models; do
    rm -rf "/tmp/hf-whisper-$m"
    stage "convert-$m" "$py" "$here/ct2_to_hf_whisper.py" "$models/whisper-$m" "/tmp/hf-whisper-$m" --dtype "$dtype"
  done
  for m in $whisper_models; do
    stage "whisper-$m" "$py" "$here/whisper_pipeline_bench.py" --hf-dir "/tmp/hf-whisper-$m" --device "$device" \
      --models-dir "$models" --clips "${CLIPS:-200}" --long-seconds "${LONG_SECONDS:-120}" --batch-sizes "${WHISPER_BATCHES:-16,64}"
  done
fi
[[ $peers == *" embeddings "* ]] && stage embeddings "$py" "$here/sentence_transformers_gpu_bench.py" --device "$device" \
  --models-dir "$models" --texts "${EMBED_TEXTS:-4096}" --batch-sizes "${EMBED_BATCHES:-32,128,256}"
[[ $peers == *" generate "* ]] && stage generate "$py" "$here/generate_bench.py" --device "$device" --models-dir "$models" \
  --tokens "${GEN_TOKENS:-128}" --batches "${GEN_BATCHES:-1,64}"

{
  printf '\n==== GPU peers summary (%s, %ss in all)\n' "$(date -u +%FT%TZ)" "$(($(date +%s) - t0))"
  grep -h -m1 -E '^cuda ' "$out/environment.log" 2>/dev/null
  for s in whisper-tiny.en whisper-base embeddings generate; do
    f="$out/$s.log"
    printf '\n-- %s\n' "$s"
    [[ -f $f ]] || { echo "(no log)"; continue; }
    grep -h -E '^(cosine check|\(a\) )' "$f"
    # The final table: from its header line to the end of the log.
    awk '/^ +model +/{p=1} p' "$f" | grep -v '^!!'
    if grep -q '^!!' "$f"; then
      grep -h -E '^[A-Za-z_.]*(Error|Exception)\b' "$f" | tail -1
      grep -h '^!!' "$f"
    fi
  done
  [[ ${#failed[@]} -eq 0 ]] && printf '\nall stages succeeded\n' || printf '\nfailed stages: %s\n' "${failed[*]}"
} | tee "$out/summary.txt"
