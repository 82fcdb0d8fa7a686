"""faster-whisper (CTranslate2) on the workloads of `tern-bench-transcribe`: the first 20 LibriVox
clips (sorted by file bytes, cycled) one by one, and one >= 120 s recording built from all clips
with 0.5 s pauses, transcribed plainly and with BatchedInferencePipeline (batch 8, Silero VAD
chunks). Greedy (beam 1; --beam N for beam search), 2 threads, CPU; --long-seconds S sets the
recording's length (120 s by default, as tern-bench-models' --long-seconds); one warm-up transcription per model; audio seconds per
wall second, and WER against testdata/librivox/transcription (normalised like tern's wer.rs).

Set-up (wheels only, ~10 s; no torch):
    python3 -m venv /tmp/peers-venv
    /tmp/peers-venv/bin/pip install faster-whisper
Run (--quick: 2 clips and a 10 s recording, a smoke test):
    . scripts/env.sh
    HF_HUB_OFFLINE=1 /tmp/peers-venv/bin/python scripts/peers/faster_whisper_bench.py [--quick] [--beam N]
"""
import glob, io, os, re, sys, time, wave
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only
import numpy as np
import ctranslate2, faster_whisper
from faster_whisper import BatchedInferencePipeline, WhisperModel
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tern_workloads import word_errors as errors, words  # tern's wer.rs, ported

quick = "--quick" in sys.argv
beam = int(sys.argv[sys.argv.index("--beam") + 1]) if "--beam" in sys.argv else 1
n_clips, long_s = (2, 10.0) if quick else (20, 120.0)
if "--long-seconds" in sys.argv:
    long_s = float(sys.argv[sys.argv.index("--long-seconds") + 1])
root = os.path.expanduser(os.environ.get("TERN_MODELS_DIR", "~/.cache/tern/models"))
model_dir = os.path.join(root, "whisper-tiny.en")
data = os.path.join(root, "testdata/librivox")

def decode(b):  # 16-bit PCM WAV, 16 kHz (the test clips); mono mix like tern's decode_mono_16k
    with wave.open(io.BytesIO(b)) as w:
        assert w.getsampwidth() == 2 and w.getframerate() == 16000, "expects 16-bit 16 kHz WAV"
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0
        return np.clip(x.reshape(-1, w.getnchannels()).mean(axis=1), -1.0, 1.0)


# Clips sorted by their bytes, as the Rust `clips.sort()` on Vec<Vec<u8>> does.
clips = sorted((open(p, "rb").read(), os.path.basename(p)[:-4]) for p in glob.glob(f"{data}/*.wav"))
pcm = [decode(b) for b, _ in clips]
refs = {}
for line in open(f"{data}/transcription"):
    m = re.match(r"(.*) \((\S+)\)\s*$", line)
    if m:
        refs[m[2]] = m[1].replace("<s>", "").replace("</s>", "").strip()
short = [i % len(clips) for i in range(n_clips)]
short_s = sum(len(pcm[i]) for i in short) / 16000
long, long_ref, k = [], [], 0
while sum(map(len, long)) / 16000 < long_s:
    long += [pcm[k % len(pcm)], np.zeros(8000, np.float32)]
    long_ref += words(refs.get(clips[k % len(clips)][1], ""))
    k += 1
long = np.concatenate(long)

def text(segments):
    return " ".join(s.text for s in segments)

def wer(pairs):
    e = sum(errors(words(r), words(h)) for r, h in pairs)
    return 100.0 * e / max(1, sum(len(words(r)) for r, _ in pairs))

print(f"faster-whisper {faster_whisper.__version__} (ctranslate2 {ctranslate2.__version__}): whisper-tiny.en, cpu, 2 threads, beam {beam}; "
      f"{n_clips} clips ({short_s:.1f} s of audio), one {len(long) / 16000:.1f} s recording")
print(f"{'compute':>8} {'clips audio-s/s':>16} {'clips WER':>10} {'long audio-s/s':>15} {'long WER':>9} {'batched8 audio-s/s':>19} {'batched WER':>12}")
for ct in ["int8", "float32"]:
    model = WhisperModel(model_dir, device="cpu", compute_type=ct, cpu_threads=2)
    text(model.transcribe(pcm[0], beam_size=beam, language="en")[0])  # warm-up
    t = time.perf_counter()
    hyps = [text(model.transcribe(pcm[i], beam_size=beam, language="en")[0]) for i in short]
    clips_rate = short_s / (time.perf_counter() - t)
    clips_wer = wer([(refs.get(clips[i][1], ""), h) for i, h in zip(short, hyps)])
    t = time.perf_counter()
    h_long = text(model.transcribe(long, beam_size=beam, language="en")[0])
    long_rate = len(long) / 16000 / (time.perf_counter() - t)
    batched = BatchedInferencePipeline(model)
    text(batched.transcribe(pcm[0], batch_size=8, beam_size=beam, language="en")[0])  # warm-up (VAD model)
    t = time.perf_counter()
    h_bat = text(batched.transcribe(long, batch_size=8, beam_size=beam, language="en")[0])
    bat_rate = len(long) / 16000 / (time.perf_counter() - t)
    lw = lambda h: 100.0 * errors(long_ref, words(h)) / max(1, len(long_ref))
    print(f"{ct:>8} {clips_rate:>16.1f} {clips_wer:>9.1f}% {long_rate:>15.1f} {lw(h_long):>8.1f}% {bat_rate:>19.1f} {lw(h_bat):>11.1f}%")
