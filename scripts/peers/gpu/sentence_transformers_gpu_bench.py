"""sentence-transformers on tern's embedding workload (tern-bench-models --only embed) on a GPU:
all-MiniLM-L6-v2, `model.half()` on cuda (fp32 on cpu; `--dtype` overrides), texts = tern's `sentence(i)` (~15
tokens each), `--texts` of them (default 4096) encoded at each of `--batch-sizes` (default
32,128,256) with normalised embeddings returned as numpy arrays (the copy to the host
included); texts per second. The clock covers `encode` only, between torch.cuda.synchronize()
calls, after one warm-up pass over the texts at each batch size; the model load is not timed.

Checks: the facts file's cosine("A man is eating food.", "A man is eating a piece of bread.")
= 0.755, in the benchmark's precision; and the cosine of each text's fp16 vector with its fp32
vector (mean and minimum over the texts).

    HF_HUB_OFFLINE=1 python3 scripts/peers/gpu/sentence_transformers_gpu_bench.py --device cuda
Weights: $TERN_MODELS_DIR (default ~/.cache/tern/models)/all-MiniLM-L6-v2 (scripts/models.sh --all).
"""
import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/peers: tern_workloads

import numpy as np  # noqa: E402
import sentence_transformers  # noqa: E402
import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

from tern_workloads import models_dir, sentence  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--texts", type=int, default=4096)
    ap.add_argument("--batch-sizes", default="32,128,256")
    ap.add_argument("--models-dir", default=None, help="default $TERN_MODELS_DIR or ~/.cache/tern/models")
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto",
                    help="auto: float16 on cuda, float32 on cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    path = os.path.join(models_dir(args.models_dir), args.model)

    t = time.perf_counter()
    model = SentenceTransformer(path, device=args.device, local_files_only=True)
    texts = [sentence(i) for i in range(args.texts)]

    def enc(m, items, b=128):
        return m.encode(items, batch_size=b, normalize_embeddings=True, show_progress_bar=False, convert_to_numpy=True)

    pair_texts = ["A man is eating food.", "A man is eating a piece of bread."]
    ref = enc(model, texts).astype(np.float32)  # fp32 reference vectors
    ref_pair = enc(model, pair_texts)
    half = args.dtype == "float16" or (args.dtype == "auto" and cuda)
    if half:
        model.half()
    load = time.perf_counter() - t
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    vecs = enc(model, texts).astype(np.float32)
    pair = enc(model, pair_texts).astype(np.float32)
    cos = np.sum(vecs * ref, axis=1) / (np.linalg.norm(vecs, axis=1) * np.linalg.norm(ref, axis=1))
    tokens = sum(len(ids) for ids in model.tokenizer(texts)["input_ids"])
    gpu = f" ({torch.cuda.get_device_name()})" if cuda else f" ({torch.get_num_threads()} threads)"
    print(f"sentence_transformers_gpu_bench: {args.model} on {args.device}{gpu}, {dtype}, sentence-transformers "
          f"{sentence_transformers.__version__}, torch {torch.__version__}; loaded in {load:.1f} s; {len(texts)} texts "
          f"({tokens / len(texts):.1f} tokens each on average, max_seq_length {model.max_seq_length})")
    print(f"cosine check {float(pair[0] @ pair[1]):.4f} in {dtype} (fp32 {float(ref_pair[0] @ ref_pair[1]):.4f}; "
          f"reference 0.755); {dtype} vs fp32 vectors: cosine mean {cos.mean():.6f}, min {cos.min():.6f}", flush=True)

    rows = []
    for b in batch_sizes:
        enc(model, texts, b)  # warm-up
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        enc(model, texts, b)
        if cuda:
            torch.cuda.synchronize()
        rows.append((b, len(texts) / (time.perf_counter() - t)))
    print(f"{'model':>18} {'dtype':>8} {'batch':>6} {'texts/s':>10}")
    for b, rate in rows:
        print(f"{args.model:>18} {dtype:>8} {b:>6} {rate:>10.1f}")


if __name__ == "__main__":
    main()
