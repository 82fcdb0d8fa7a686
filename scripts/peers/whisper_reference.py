"""The reference Whisper that tern's parity test (models/tests/whisper_parity.rs) compares with.

For each WAV given (16-bit, 16 kHz, mono), writes under OUT:
  features/<name>.f32         faster-whisper's log-mel features of the recording's first window
                              as its encoder sees them (FeatureExtractor, then the segment's
                              content frames, pad_or_trim to 3000): 80 x 3000 little-endian f32
  features/<name>.openai.f32  OpenAI's first 3000 frames, `log_mel_spectrogram` (whisper/audio.py: 30 s of zeros
                              appended, torch.stft centred with reflect padding, periodic Hann,
                              last frame dropped, log10 floored at 1e-10, max - 8, (x + 4) / 4),
                              here in numpy float64, over the frames that hold audio: 80 x content
and OUT/reference.json with the versions, each recording's sample and content-frame counts, and
its transcript by faster-whisper for each --model (a folder under --models; English): greedy (beam_size=1, temperature=0, timestamps on,
no VAD, compute_type float32), and with --beam N also beam search of width N (its default 5).
With --defaults also: `defaults` (faster-whisper's own defaults: beam 5, the temperature
fallback, no VAD), `defaults_prompt` (the same with initial_prompt PROMPT) and `greedy_prompt`
(greedy with initial_prompt PROMPT), PROMPT being --prompt (default "Names: Ann Bob").

Set-up: scripts/services.sh faster-whisper (a venv with faster-whisper from PyPI, no torch).
Run:    $TERN_STATE_DIR/faster-whisper/venv/bin/python scripts/peers/whisper_reference.py \
            --models $TERN_MODELS_DIR --out DIR [--model whisper-tiny.en ...] [--beam 5] WAV...
"""
import argparse, io, json, os, sys, wave
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only
import numpy as np
import ctranslate2, faster_whisper
from faster_whisper import WhisperModel
from faster_whisper.audio import pad_or_trim
from faster_whisper.feature_extractor import FeatureExtractor

N_FFT, HOP, N_SAMPLES = 400, 160, 480_000


def decode(path):  # 16-bit WAV at 16 kHz, channels mixed down like tern's decode_mono_16k
    with wave.open(path) as w:
        assert w.getsampwidth() == 2 and w.getframerate() == 16000, f"{path}: expects 16-bit 16 kHz WAV"
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0
        return np.clip(x.reshape(-1, w.getnchannels()).mean(axis=1), -1.0, 1.0).astype(np.float32)


def openai_log_mel(audio, filters):
    """whisper/audio.py's log_mel_spectrogram(audio, padding=N_SAMPLES), torch ops in numpy."""
    x = np.pad(audio.astype(np.float64), (0, N_SAMPLES))
    x = np.pad(x, (N_FFT // 2, N_FFT // 2), mode="reflect")  # torch.stft(center=True)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # torch.hann_window
    n_frames = 1 + (len(x) - N_FFT) // HOP
    frames = np.lib.stride_tricks.as_strided(x, (n_frames, N_FFT), (x.strides[0] * HOP, x.strides[0]))
    stft = np.fft.rfft(frames * window, axis=-1).T
    magnitudes = np.abs(stft[:, :-1]) ** 2
    mel = filters.astype(np.float64) @ magnitudes
    log_spec = np.log10(np.clip(mel, 1e-10, None))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--beam", type=int, default=0)
    ap.add_argument("--defaults", action="store_true")
    ap.add_argument("--prompt", default="Names: Ann Bob")
    ap.add_argument("wavs", nargs="+")
    args = ap.parse_args()
    os.makedirs(os.path.join(args.out, "features"), exist_ok=True)
    fe = FeatureExtractor(feature_size=80)
    out = {"faster_whisper": faster_whisper.__version__, "ctranslate2": ctranslate2.__version__,
           "numpy": np.__version__, "recordings": {}, "transcripts": {}}
    audios = {}
    for path in args.wavs:
        name = os.path.splitext(os.path.basename(path))[0]
        audio = decode(path)
        audios[name] = audio
        features = fe(audio)  # faster-whisper's transcribe(): padding=160, chunk_length 30 s
        content = features.shape[-1] - 1
        segment = pad_or_trim(features[:, : min(3000, content)]).astype("<f4")
        segment.tofile(os.path.join(args.out, "features", name + ".f32"))
        shown = min(3000, content)
        # The first window as OpenAI's transcribe() reads it: 3000 frames, those past the
        # audio the log-mel of the 30 s of silence it appends.
        openai = openai_log_mel(audio, fe.mel_filters)[:, :3000].astype("<f4")
        openai.tofile(os.path.join(args.out, "features", name + ".openai.f32"))
        out["recordings"][name] = {"samples": int(len(audio)), "content_frames": int(shown),
                                   "max_difference_faster_whisper_openai": float(np.abs(openai[:, :shown] - segment[:, :shown]).max())}
    for model in args.model:
        wm = WhisperModel(os.path.join(args.models, model), device="cpu", compute_type="float32", cpu_threads=2)
        runs = {"greedy": dict(beam_size=1, temperature=0.0)}
        if args.beam:
            runs[f"beam{args.beam}"] = dict(beam_size=args.beam, temperature=0.0)
        if args.defaults:
            runs["defaults"] = dict()
            runs["defaults_prompt"] = dict(initial_prompt=args.prompt)
            runs["greedy_prompt"] = dict(beam_size=1, temperature=0.0, initial_prompt=args.prompt)
        result = {}
        for run, opts in runs.items():
            texts = {}
            for name, audio in audios.items():
                segments, _ = wm.transcribe(audio, language="en" if not model.endswith(".en") else None,
                                            vad_filter=False, **opts)
                texts[name] = " ".join(s.text.strip() for s in segments)
            result[run] = texts
        out["transcripts"][model] = result
        del wm
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
