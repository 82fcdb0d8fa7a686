"""tern's benchmark workloads, ported so the GPU peers measure the same thing on the same data.

- `librivox_clips(dir)`: the LibriVox clips in tern-bench-transcribe's order (the .wav files of
  testdata/librivox sorted by their raw bytes, as `Vec<Vec<u8>>::sort` does), each with its
  reference from the `transcription` file; samples as symphonia decodes 16-bit PCM (s / 32768).
- `short_clips(clips, n)`: clip `i % len` for i in 0..n, as `--clips N` cycles them.
- `long_recording(clips, seconds)`: clips in that order, cycled, each followed by 0.5 s of
  silence, until at least `seconds` long; then quantised to 16-bit as tern-bench-transcribe
  writes it to a WAV (`(s.clamp(-1, 1) * 32767) as i16`) and decoded back (/ 32768).
- `words`, `word_errors`: models/src/wer.rs's normalisation and word-level edit distance.
- `sentence(i)`: tern-bench-models' embedding texts (~15 tokens).
- `CHAT_PROMPT`: tern-bench-models' generation prompt rendered with tern's ChatML template (no
  system message).
"""
import os
import wave

import numpy as np

SAMPLE_RATE = 16_000


def models_dir(arg=None):
    return os.path.expanduser(arg or os.environ.get("TERN_MODELS_DIR", "~/.cache/tern/models"))


def _pcm(path):
    with wave.open(path, "rb") as w:
        assert w.getframerate() == SAMPLE_RATE and w.getnchannels() == 1 and w.getsampwidth() == 2, path
        raw = w.readframes(w.getnframes())
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


def librivox_clips(models):
    """[(name, samples float32, reference text)] in tern-bench-transcribe's order."""
    d = os.path.join(models, "testdata", "librivox")
    refs = {}
    for line in open(os.path.join(d, "transcription")):
        line = line.rstrip("\n")
        if " (" not in line:
            continue
        text, ident = line.rsplit(" (", 1)
        refs[ident.rstrip(")")] = text.replace("<s>", "").replace("</s>", "").strip()
    files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".wav")]
    files.sort(key=lambda p: open(p, "rb").read())  # tern sorts the files' bytes
    return [(os.path.basename(p)[:-4], _pcm(p), refs[os.path.basename(p)[:-4]]) for p in files]


def short_clips(clips, n):
    return [clips[i % len(clips)] for i in range(n)]


def long_recording(clips, seconds):
    """(samples, reference words) of tern's long recording."""
    parts, ref, total = [], [], 0
    i = 0
    while total / SAMPLE_RATE < seconds:
        _, pcm, text = clips[i % len(clips)]
        parts += [pcm, np.zeros(8_000, dtype=np.float32)]
        total += len(pcm) + 8_000
        ref += words(text)
        i += 1
    long = np.concatenate(parts)
    # Through tern's WAV writer (truncating cast) and back through the decoder.
    q = (np.clip(long, -1.0, 1.0) * 32767.0).astype(np.int16)
    return q.astype(np.float32) / 32768.0, ref


def words(text):
    """models/src/wer.rs `words`."""
    text = "".join(c if (c.isalnum() or c == "'") else " " for c in text.lower())
    out = []
    for w in text.split():
        w = w.strip("'")
        if w:
            out.append({"mr": "mister", "mrs": "missus", "dr": "doctor"}.get(w, w))
    return out


def word_errors(reference, hypothesis):
    """models/src/wer.rs `word_errors`: substitutions + insertions + deletions."""
    prev = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference):
        cur = [i + 1]
        for j, h in enumerate(hypothesis):
            cur.append(min(prev[j] + (r != h), prev[j + 1] + 1, cur[j] + 1))
        prev = cur
    return prev[len(hypothesis)]


def sentence(i):
    s = ["The quiet engineer", "A small red fox", "Our weekly newsletter", "The old harbour crane"][i % 4]
    v = ["quickly reviewed", "slowly crossed", "carefully described", "proudly repaired"][(i // 4) % 4]
    o = ["the long report on river pollution", "a frozen field near the village",
         "every change to the city budget", "the broken gate behind the station"][(i // 16) % 4]
    return f"{s} {v} {o} number {i}."


CHAT_PROMPT = ("<|im_start|>user\nWrite a long story about a lighthouse keeper who finds a message in a bottle."
               "<|im_end|>\n<|im_start|>assistant\n")


def _selftest():
    assert word_errors(words("He was not an ill-disposed young man."), words("he was not an ill disposed young man")) == 0
    assert word_errors(words("a b c d"), words("a x c")) == 2
    assert word_errors(words("a b"), words("a b c d")) == 2
    assert words("Mr. Dashwood's 'estate'") == ["mister", "dashwood's", "estate"]


_selftest()
