"""transformers' `generate` on tern's generation workload (tern-bench-models --only generate):
SmolLM2-135M-Instruct from the very Q4_1 GGUF tern serves, loaded with
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (transformers dequantises it, needs the
`gguf` package; fp16 on cuda, fp32 on cpu), tokenizer from the same GGUF, left padding; the
prompt is tern-bench-models' chat prompt ("Write a long story about a lighthouse keeper who finds
a message in a bottle.") in tern's ChatML rendering (no system message); <|im_end|> ends a
sequence.

(a) one request alone, greedy, `--tokens` (128) new tokens: decode tokens/s measured as tern does,
    from the first to the last generated token (a streamer stamps each, after a
    torch.cuda.synchronize()), median of `--runs`; also the whole call's tokens/s.
(b) for each of `--batches` (default 1,16,64): one `generate` call on that many copies of the
    prompt, sampled (do_sample, temperature 0.7, no top-k / top-p, as tern's sampler), `--tokens`
    new tokens each: generated tokens (up to and including each sequence's <|im_end|>) over the
    wall time of the call, prompt processing included.
Each figure follows one warm-up run of the same shape; the model load is not timed.

    HF_HUB_OFFLINE=1 python3 scripts/peers/gpu/generate_bench.py --device cuda --batches 1,64
Weights: $TERN_MODELS_DIR (default ~/.cache/tern/models)/smollm2-135m-instruct/model.gguf
(scripts/models.sh --all).
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/peers: tern_workloads

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from tern_workloads import CHAT_PROMPT, models_dir  # noqa: E402


class Stamps(BaseStreamer):
    """Times each generated token (the first `put` is the prompt)."""

    def __init__(self, cuda):
        self.cuda, self.times, self.prompt_seen = cuda, [], False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--batches", default="1,16,64", help="request counts for the sampled batched figure")
    ap.add_argument("--runs", type=int, default=3, help="runs of the single greedy request (median)")
    ap.add_argument("--models-dir", default=None, help="default $TERN_MODELS_DIR or ~/.cache/tern/models")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="folder under the models directory")
    ap.add_argument("--gguf", default="model.gguf")
    ap.add_argument("--dtype", choices=["auto", "float16", "bfloat16", "float32"], default="auto",
                    help="auto: float16 on cuda, float32 on cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--show", type=int, default=300, help="characters of each sample text to print")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (torch.float16 if cuda else torch.float32)
    batches = [int(b) for b in args.batches.split(",") if b]
    folder = os.path.join(models_dir(args.models_dir), args.model)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=args.gguf, local_files_only=True)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=args.gguf, dtype=dtype, local_files_only=True)
    model.to(args.device).eval()
    sync()
    load = time.perf_counter() - t
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    if tok.pad_token_id is None:
        tok.pad_token = "<|im_end|>"
    prompt_ids = tok(CHAT_PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    n_prompt = prompt_ids.shape[1]
    gpu = f" ({torch.cuda.get_device_name()})" if cuda else f" ({torch.get_num_threads()} threads)"
    print(f"generate_bench: {args.model}/{args.gguf} on {args.device}{gpu}, {str(dtype).replace('torch.', '')} "
          f"(dequantised by transformers {transformers.__version__}), torch {torch.__version__}; loaded in {load:.1f} s; "
          f"prompt {n_prompt} tokens; <|im_end|> = {end_id}", flush=True)

    common = dict(max_new_tokens=args.tokens, min_new_tokens=0, eos_token_id=end_id, pad_token_id=tok.pad_token_id)

    def generated(row):
        """Tokens generated in one row: up to and including the first <|im_end|>."""
        ids = row.tolist()
        return ids.index(end_id) + 1 if end_id in ids else len(ids)

    # (a) one request, greedy.
    inputs = tok([CHAT_PROMPT], add_special_tokens=False, return_tensors="pt", padding=True).to(args.device)
    greedy = dict(common, do_sample=False, temperature=None, top_k=None, top_p=None)
    with torch.inference_mode():
        model.generate(**inputs, **greedy)  # warm-up
        decode, whole, text, n = [], [], "", 0
        for _ in range(max(1, args.runs)):
            stamps = Stamps(cuda)
            sync()
            t = time.perf_counter()
            out = model.generate(**inputs, **greedy, streamer=stamps)
            sync()
            secs = time.perf_counter() - t
            row = out[0, n_prompt:]
            n = generated(row)
            if len(stamps.times) > 1:
                decode.append((len(stamps.times) - 1) / (stamps.times[-1] - stamps.times[0]))
            whole.append(n / secs)
            text = tok.decode(row[:n], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    print(f"(a) one request, greedy: decode {statistics.median(decode):.1f} tokens/s (first to last token; "
          f"{n} tokens generated), whole call {statistics.median(whole):.1f} tokens/s; median of {len(decode)} runs")
    print(f"    text: {text[:args.show]!r}", flush=True)

    # (b) batched, sampled.
    rows = []
    for b in batches:
        batch = tok([CHAT_PROMPT] * b, add_special_tokens=False, return_tensors="pt", padding=True).to(args.device)
        sampled = dict(common, do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
        with torch.inference_mode():
            torch.manual_seed(0)
            model.generate(**batch, **sampled)  # warm-up
            torch.manual_seed(1)
            sync()
            t = time.perf_counter()
            out = model.generate(**batch, **sampled)
            sync()
            secs = time.perf_counter() - t
        counts = [generated(r) for r in out[:, batch.input_ids.shape[1]:]]
        rows.append((b, sum(counts) / secs, sum(counts), secs))
        sample = tok.decode(out[0, batch.input_ids.shape[1]:][: counts[0]], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        print(f"(b) {b} requests: {sum(counts)} tokens in {secs:.2f} s; first text: {sample[:args.show // 2]!r}", flush=True)
    print(f"{'model':>22} {'requests':>9} {'sampling':>9} {'tokens/s':>10} {'tokens':>7} {'seconds':>8}")
    print(f"{args.model:>22} {1:>9} {'greedy':>9} {statistics.median(decode):>10.1f} {n:>7} {'(decode)':>8}")
    for b, rate, count, secs in rows:
        print(f"{args.model:>22} {b:>9} {'T=0.7':>9} {rate:>10.1f} {count:>7} {secs:>8.2f}")


if __name__ == "__main__":
    main()
