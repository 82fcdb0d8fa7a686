"""Word timestamps of faster-whisper beside tern's, on the LibriVox test clips: tiny.en, F32,
greedy (beam 1, temperature 0), no previous-text conditioning, no VAD, word_timestamps=True.
Prints, for the clips whose words are the same in both, how far tern's word starts and ends
are from faster-whisper's; clips whose words differ are named (a transcript difference, not a
timing one).

Set-up: python3 -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install faster-whisper
Run:
    . scripts/env.sh
    cargo run --release -p tern-models --example word_times > /tmp/tern_words.json
    /tmp/peers-venv/bin/python scripts/peers/faster_whisper_words.py /tmp/tern_words.json
"""
import glob, json, os, statistics, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only
from faster_whisper import WhisperModel

root = os.path.expanduser(os.environ.get("TERN_MODELS_DIR", "~/.cache/tern/models"))
tern = json.load(open(sys.argv[1]))
model = WhisperModel(os.path.join(root, "whisper-tiny.en"), device="cpu", compute_type="float32", cpu_threads=2)
starts, ends = [], []
for path in sorted(glob.glob(os.path.join(root, "testdata/librivox/*.wav"))):
    clip = os.path.basename(path)
    segments, _ = model.transcribe(path, beam_size=1, temperature=0, word_timestamps=True,
                                   condition_on_previous_text=False, vad_filter=False)
    theirs = [(w.word, w.start, w.end) for s in segments for w in s.words]
    ours = tern[clip]
    if [w[0] for w in ours] != [w[0] for w in theirs]:
        print(f"{clip}: the words differ: tern {' '.join(w[0] for w in ours)!r} / faster-whisper {' '.join(w[0] for w in theirs)!r}")
        continue
    starts += [a[1] - b[1] for a, b in zip(ours, theirs)]
    ends += [a[2] - b[2] for a, b in zip(ours, theirs)]
within = sum(1 for s, e in zip(starts, ends) if abs(s) <= 0.021 and abs(e) <= 0.021)
print(f"{len(starts)} words in both: tern - faster-whisper, starts mean {statistics.mean(starts):+.3f} s "
      f"(max |{max(map(abs, starts)):.2f}|), ends mean {statistics.mean(ends):+.3f} s (max |{max(map(abs, ends)):.2f}|); "
      f"{within} of {len(starts)} within 0.02 s (one encoder position) at both ends")
