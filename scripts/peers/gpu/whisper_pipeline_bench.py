"""transformers' ASR pipeline (the engine of the fastest Python Whisper servers) on tern's
transcription workload: audio seconds transcribed per wall-clock second, and word error rate
with tern's normalisation (models/src/wer.rs), for
- clips: the `--clips N` LibriVox clips of tern-bench-transcribe (its order, cycled), passed to
  the pipeline as one list of 16 kHz numpy arrays;
- long: tern-bench-transcribe's recording of about `--long-seconds` (the clips cycled, 0.5 s of
  silence after each, through 16-bit PCM), one input, cut by the pipeline into 30 s chunks.

`pipeline("automatic-speech-recognition", model=HF_DIR, dtype=fp16 on cuda / fp32 on cpu)`,
`chunk_length_s=30`, each `--batch-sizes` value as `batch_size`; English, no timestamps
(multilingual models are told `language="en"`, `task="transcribe"`; `--language auto` lets them
detect it, as tern's default does). The clock covers the pipeline call only (feature extraction,
generation, decoding; not the model load), between torch.cuda.synchronize() calls, after one
warm-up call of one batch at each batch size.

HF_DIR is built from tern's CTranslate2 weights by ct2_to_hf_whisper.py:
    python3 scripts/peers/gpu/ct2_to_hf_whisper.py ~/.cache/tern/models/whisper-tiny.en /tmp/hf-tiny.en
    HF_HUB_OFFLINE=1 python3 scripts/peers/gpu/whisper_pipeline_bench.py --hf-dir /tmp/hf-tiny.en \
        --device cuda --clips 200 --long-seconds 120 --batch-sizes 16,64
Test audio from $TERN_MODELS_DIR (default ~/.cache/tern/models)/testdata/librivox (scripts/models.sh).
"""
import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/peers: tern_workloads

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import pipeline  # noqa: E402

from tern_workloads import SAMPLE_RATE, librivox_clips, long_recording, models_dir, short_clips, word_errors, words  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", required=True, help="Hugging Face Whisper folder (ct2_to_hf_whisper.py)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--clips", type=int, default=200)
    ap.add_argument("--long-seconds", type=float, default=120.0)
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--language", default="en", help="en (default) or auto; ignored by English-only models")
    ap.add_argument("--num-workers", type=int, default=None, help="pipeline DataLoader workers (default: the pipeline's)")
    ap.add_argument("--models-dir", default=None, help="default $TERN_MODELS_DIR or ~/.cache/tern/models")
    ap.add_argument("--dtype", choices=["auto", "float16", "bfloat16", "float32"], default="auto",
                    help="auto: float16 on cuda, float32 on cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--verbose", action="store_true", help="print each clip transcript that has errors")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    cuda = args.device == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (torch.float16 if cuda else torch.float32)

    clips = librivox_clips(models_dir(args.models_dir))
    short = short_clips(clips, args.clips)
    short_audio = [c[1] for c in short]
    short_seconds = sum(len(a) for a in short_audio) / SAMPLE_RATE
    long, long_ref = long_recording(clips, args.long_seconds)
    long_seconds = len(long) / SAMPLE_RATE

    t = time.perf_counter()
    asr = pipeline("automatic-speech-recognition", model=args.hf_dir, dtype=dtype, device=args.device)
    load = time.perf_counter() - t
    multilingual = bool(getattr(asr.model.generation_config, "is_multilingual", False))
    gen = {"language": args.language, "task": "transcribe"} if multilingual and args.language != "auto" else {}
    name = os.path.basename(os.path.normpath(args.hf_dir))
    gpu = f" ({torch.cuda.get_device_name()})" if cuda else f" ({torch.get_num_threads()} threads)"
    print(f"whisper_pipeline_bench: {name} on {args.device}{gpu}, {str(dtype).replace('torch.', '')}, "
          f"transformers {transformers.__version__}, torch {torch.__version__}; loaded in {load:.1f} s; "
          f"{len(short)} clips ({short_seconds:.1f} s of audio), one {long_seconds:.1f} s recording; "
          f"language {'en (forced)' if gen else ('auto' if multilingual else 'en (English-only model)')}", flush=True)

    def run(audio, batch):
        kw = dict(batch_size=batch, chunk_length_s=30, ignore_warning=True, generate_kwargs=dict(gen))
        if args.num_workers is not None:
            kw["num_workers"] = args.num_workers
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = asr(audio, **kw)
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    rows, first = [], None
    for b in batch_sizes:
        run(short_audio[: min(b, len(short_audio))], b)  # warm-up: one batch at this size
        out, secs = run(short_audio, b)
        texts = [o["text"] for o in out]
        errors = total = 0
        for (clip, _, ref), text in zip(short, texts):
            r = words(ref)
            e = word_errors(r, words(text))
            errors += e
            total += len(r)
            if args.verbose and e:
                print(f"  {clip}: {e} errors: {text.strip()!r}")
        differ = 0 if first is None else sum(a != x for a, x in zip(first, texts))
        first = first or texts
        (long_out,), long_secs = run([long], b)
        long_err = word_errors(long_ref, words(long_out["text"]))
        if args.verbose:
            print(f"  long file: {long_err} errors in {len(long_ref)} words; starts {long_out['text'][:120].strip()!r}")
        rows.append((b, short_seconds / secs, 100 * errors / total, differ, long_seconds / long_secs,
                     100 * long_err / len(long_ref)))
        print(f"  batch {b}: clips {secs:.2f} s, long file {long_secs:.2f} s", flush=True)
    print(f"{'model':>20} {'batch':>6} {'clips audio-s/s':>16} {'clips WER':>10} {'differ':>7} {'long audio-s/s':>15} {'long WER':>9}")
    for b, rate, wer, differ, long_rate, long_wer in rows:
        print(f"{name:>20} {b:>6} {rate:>16.1f} {wer:>9.1f}% {differ:>7} {long_rate:>15.1f} {long_wer:>8.1f}%")


if __name__ == "__main__":
    main()
