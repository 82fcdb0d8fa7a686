"""sentence-transformers (PyTorch) on the benchmark of `tern-bench-models --only embed`: 1024 texts
of ~15 tokens (tern's `sentence(i)`), all-MiniLM-L6-v2 on the CPU with 2 threads, texts per
second at batch sizes 1, 32 and 128 (normalised embeddings), after one warm-up; plus the cosine
check (reference 0.755) and the largest batched-against-single difference over 64 texts.

Set-up (pulls torch and its CUDA wheels from PyPI, ~6 GB, ~1.5 min):
    python3 -m venv /tmp/peers-venv
    /tmp/peers-venv/bin/pip install sentence-transformers
Run (--quick: 64 texts, a smoke test):
    . scripts/env.sh
    HF_HUB_OFFLINE=1 /tmp/peers-venv/bin/python scripts/peers/sentence_transformers_bench.py [--quick]
"""
import os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only
import numpy as np, torch, sentence_transformers
from sentence_transformers import SentenceTransformer

torch.set_num_threads(2)
n = 64 if "--quick" in sys.argv else 1024
root = os.path.expanduser(os.environ.get("TERN_MODELS_DIR", "~/.cache/tern/models"))
model = SentenceTransformer(os.path.join(root, "all-MiniLM-L6-v2"), device="cpu", local_files_only=True)

def sentence(i):
    s = ["The quiet engineer", "A small red fox", "Our weekly newsletter", "The old harbour crane"][i % 4]
    v = ["quickly reviewed", "slowly crossed", "carefully described", "proudly repaired"][(i // 4) % 4]
    o = ["the long report on river pollution", "a frozen field near the village", "every change to the city budget", "the broken gate behind the station"][(i // 16) % 4]
    return f"{s} {v} {o} number {i}."

texts = [sentence(i) for i in range(n)]
enc = lambda t, b=32: model.encode(t, batch_size=b, normalize_embeddings=True, show_progress_bar=False)
tokens = sum(len(ids) for ids in model.tokenizer(texts)["input_ids"])
pair = enc(["A man is eating food.", "A man is eating a piece of bread."])
batched = enc(texts[:64], 64)  # also the warm-up
worst = max(float(np.abs(enc([t], 1)[0] - b).max()) for t, b in zip(texts[:64], batched))
print(f"sentence-transformers {sentence_transformers.__version__} (torch {torch.__version__}, {torch.get_num_threads()} threads): all-MiniLM-L6-v2, "
      f"{n} texts ({tokens / n:.1f} tokens each on average); cosine check {float(pair[0] @ pair[1]):.4f} (reference 0.755); "
      f"batched vs single, largest difference {worst:.2e}")
print(f"{'batch':>12} {'texts/s':>12}")
for b in (1, 32, 128):
    t = time.perf_counter()
    enc(texts, b)
    print(f"{b:>12} {n / (time.perf_counter() - t):>12.1f}")
