#!/usr/bin/env python3
"""Reference outputs of llama.cpp (llama-cpp-python, PyPI) for tern's language-model tests.

1. Tiny GGUFs with random weights, one per architecture tern serves (llama with Llama 3's
   pre-tokenizer and rotary factors, qwen2, qwen3, phi3, gemma3), written with the `gguf`
   package: matrices Q8_0 (as llama.cpp multiplies them, activations rounded to Q8_0 too),
   vectors F32, a byte-level BPE or SentencePiece vocabulary with its metadata. For each, the
   logits llama.cpp computes at every position of a token sequence, and how it tokenises a few
   texts.
2. Two llama files quantized by llama.cpp itself (`llama_model_quantize`) from random F32
   weights, as Q4_K_M and Q5_K_M: the mixes of block types those files hold (Q4_K, Q5_K,
   Q6_K, and Q5_0, Q5_1, Q8_0 where rows are not whole 256-value blocks), with their logits.
3. With --gemma MODEL.gguf: the greedy tokens llama.cpp generates on the real Gemma 3 270M for
   a few prompts (without it, those of the existing reference.json are kept).

Writes models/tests/fixtures/llm/{ARCH}.gguf, {NAME}.gguf and reference.json. Needs
`pip install gguf numpy llama-cpp-python` (llama-cpp-python builds llama.cpp from source).

Usage: scripts/peers/llama_cpp_reference.py [--gemma ~/.cache/tern/models/gemma-3-270m/model.gguf]
"""
import argparse
import json
import os
import re
from collections import Counter

import numpy as np
import gguf
from gguf.constants import GGMLQuantizationType as Q

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "models", "tests", "fixtures", "llm")

SAMPLE = (
    "The quick brown fox jumps over the lazy dog. Then the dog sleeps in the sun, "
    "and the fox runs into the forest. 12345 apples cost 67.89 dollars! "
    "It's what they're doing: they'll see the THE the.\n\nNew lines\tand tabs."
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! 12345 apples, 67.89 dollars.",
    "  two spaces, and\nnew lines\n\n and tabs\tdone",
    "émoji ☕ and ümlauts",
]


def bytes_to_unicode():
    """GPT-2's byte to printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def learn_merges(words, wanted):
    """Up to `wanted` merges learnt greedily from `words` (lists of symbols, merged in place):
    each time the most frequent adjacent pair, while it occurs at least twice."""
    merges = []
    for _ in range(wanted):
        pairs = Counter()
        for w in words:
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += 1
        if not pairs:
            break
        (a, b), count = pairs.most_common(1)[0]
        if count < 2:
            break
        merges.append((a, b))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i : i + 2] = [a + b]
                i += 1
    return merges


def byte_level_vocab(specials, merges_wanted=120):
    """256 byte tokens and merges learnt greedily from SAMPLE (words split at spaces)."""
    table = bytes_to_unicode()
    words = [[table[b] for b in w.encode()] for w in re.findall(r" ?\S+|\s+", SAMPLE)]
    learnt = learn_merges(words, merges_wanted)
    tokens = [table[b] for b in range(256)] + [a + b for a, b in learnt]
    merges = [f"{a} {b}" for a, b in learnt]
    types = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, types, merges


def sentencepiece_vocab(specials, user_defined):
    """<unk>, control tokens, byte tokens, single characters and merged pieces, scored by rank."""
    text = SAMPLE.replace(" ", "▁")
    chars = sorted(set(text) | set("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!'"))
    words = [list(w) for w in re.findall(r"▁?[^▁]+|▁+", text)]
    pieces = [a + b for a, b in learn_merges(words, 120)]
    tokens, types, scores = ["<unk>"], [2], [0.0]
    for s in specials:
        tokens.append(s), types.append(3), scores.append(0.0)
    for u in user_defined:
        tokens.append(u), types.append(4), scores.append(0.0)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>"), types.append(6), scores.append(0.0)
    for c in chars:
        if c not in tokens:
            tokens.append(c), types.append(1), scores.append(-1000.0)
    for rank, p in enumerate(pieces):
        if p not in tokens:
            tokens.append(p), types.append(1), scores.append(-float(rank))
    return tokens, types, scores


ARCHS = {
    # hidden, heads, kv_heads, head_dim, ffn, layers
    "llama": dict(hidden=64, heads=4, kv=2, head_dim=16, ffn=128, layers=2),
    "qwen2": dict(hidden=64, heads=4, kv=2, head_dim=16, ffn=128, layers=2),
    "qwen3": dict(hidden=64, heads=4, kv=2, head_dim=32, ffn=128, layers=2),
    "phi3": dict(hidden=64, heads=4, kv=4, head_dim=16, ffn=128, layers=2),
    "gemma3": dict(hidden=64, heads=2, kv=1, head_dim=48, ffn=128, layers=7),
}


def add_shape(w, name, s, file_type):
    """The model's name, shape and file type, as every test file states them."""
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(s["head_dim"])
    w.add_file_type(file_type)


def add_byte_level_vocab(w, specials, pre, eos, add_bos):
    """A byte-level BPE vocabulary with `specials` (BOS the first, EOS the one named `eos`)."""
    tokens, types, merges = byte_level_vocab(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(specials[0]))
    w.add_eos_token_id(tokens.index(eos))
    w.add_add_bos_token(add_bos)
    return tokens


def write(arch, path, rng):
    s = ARCHS[arch]
    h, heads, kv, hd, ffn, layers = s["hidden"], s["heads"], s["kv"], s["head_dim"], s["ffn"], s["layers"]
    w = gguf.GGUFWriter(path, arch)
    add_shape(w, f"tern test {arch}", s, gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch == "gemma3":
        w.add_rope_freq_base(1_000_000.0)
        w.add_sliding_window(4)
    elif arch == "llama":
        w.add_rope_freq_base(500_000.0)
    else:
        w.add_rope_freq_base(10_000.0)

    if arch in ("phi3", "gemma3"):
        specials = ["<s>", "</s>"] + (["<start_of_turn>", "<end_of_turn>"] if arch == "gemma3" else ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"])
        tokens, types, scores = sentencepiece_vocab(specials, ["\n", "\n\n"] if arch == "gemma3" else [])
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(tokens.index("<s>"))
        w.add_eos_token_id(tokens.index("</s>"))
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(arch == "phi3")
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if arch != "llama" else ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
        pre = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}[arch]
        tokens = add_byte_level_vocab(w, specials, pre, specials[1] if arch == "llama" else specials[2], arch == "llama")
    vocab = len(tokens)

    def matrix(name, rows, cols, scale=None):
        scale = scale or 1.0 / np.sqrt(cols)
        data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)

    def vector(name, n, around=1.0, spread=0.1):
        w.add_tensor(name, (around + spread * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", vocab, h, scale=0.5 if arch == "gemma3" else 1.0)
    vector("output_norm.weight", h)
    if arch in ("qwen2", "phi3"):
        matrix("output.weight", vocab, h)
    if arch == "llama":
        # Llama 3.1's rotary frequency divisors.
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, hd // 2).astype(np.float32))
    for l in range(layers):
        b = f"blk.{l}."
        vector(b + "attn_norm.weight", h)
        vector(b + "ffn_norm.weight", h)
        if arch == "phi3":
            matrix(b + "attn_qkv.weight", (heads + 2 * kv) * hd, h)
            matrix(b + "ffn_up.weight", 2 * ffn, h)
        else:
            matrix(b + "attn_q.weight", heads * hd, h)
            matrix(b + "attn_k.weight", kv * hd, h)
            matrix(b + "attn_v.weight", kv * hd, h)
            matrix(b + "ffn_gate.weight", ffn, h)
            matrix(b + "ffn_up.weight", ffn, h)
        matrix(b + "attn_output.weight", h, heads * hd)
        matrix(b + "ffn_down.weight", h, ffn)
        if arch == "qwen2":
            vector(b + "attn_q.bias", heads * hd, 0.0, 0.5)
            vector(b + "attn_k.bias", kv * hd, 0.0, 0.5)
            vector(b + "attn_v.bias", kv * hd, 0.0, 0.5)
        if arch in ("qwen3", "gemma3"):
            vector(b + "attn_q_norm.weight", hd)
            vector(b + "attn_k_norm.weight", hd)
        if arch == "gemma3":
            vector(b + "post_attention_norm.weight", h)
            vector(b + "post_ffw_norm.weight", h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return vocab


# Hidden size 320 is no whole number of 256-value blocks: q/k/v/gate/up (320 columns) take the
# mixes' fallback types, attn_output and ffn_down (256) their K types.
QUANTIZED = {"llama-q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "llama-q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M"}
QUANTIZED_SHAPE = dict(hidden=320, heads=4, kv=2, head_dim=64, ffn=256, layers=2)


def write_f32_llama(path, rng):
    """A llama of QUANTIZED_SHAPE with F32 weights, for llama.cpp to quantize."""
    s = QUANTIZED_SHAPE
    h, heads, kv, hd, ffn, layers = s["hidden"], s["heads"], s["kv"], s["head_dim"], s["ffn"], s["layers"]
    w = gguf.GGUFWriter(path, "llama")
    add_shape(w, "tern test quantized llama", s, gguf.LlamaFileType.ALL_F32)
    w.add_rope_freq_base(10_000.0)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokens = add_byte_level_vocab(w, specials, "llama-bpe", specials[1], True)

    def matrix(name, rows, cols, scale=None):
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * (scale or 1.0 / np.sqrt(cols))).astype(np.float32))

    def vector(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), h, scale=1.0)
    vector("output_norm.weight", h)
    matrix("output.weight", len(tokens), h)
    for l in range(layers):
        b = f"blk.{l}."
        vector(b + "attn_norm.weight", h)
        vector(b + "ffn_norm.weight", h)
        matrix(b + "attn_q.weight", heads * hd, h)
        matrix(b + "attn_k.weight", kv * hd, h)
        matrix(b + "attn_v.weight", kv * hd, h)
        matrix(b + "ffn_gate.weight", ffn, h)
        matrix(b + "ffn_up.weight", ffn, h)
        matrix(b + "attn_output.weight", h, heads * hd)
        matrix(b + "ffn_down.weight", h, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(tokens)


def llama_cpp_quantize(source, path, ftype):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(source.encode(), path.encode(), params)
    assert rc == 0, f"llama_model_quantize failed ({rc})"
    return Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)


def logits_of(llm, tokens):
    llm.reset()
    llm.eval(tokens)
    return [[round(float(x), 5) for x in row] for row in np.array(llm.scores[: len(tokens)], dtype=np.float32)]


def llama_cpp(path, n_ctx=256):
    import llama_cpp

    return llama_cpp.Llama(
        model_path=path, n_ctx=n_ctx, n_threads=2, n_batch=n_ctx, logits_all=True, verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False, seed=0,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", help="the real Gemma 3 270M GGUF, for its greedy tokens")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261128)
    reference = {"architectures": {}}
    for arch in ARCHS:
        path = os.path.join(OUT, f"{arch}.gguf")
        vocab = write(arch, path, rng)
        llm = llama_cpp(path)
        tokenised = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in TEXTS]
        # A sequence longer than Gemma's window of 4, through the model in one pass.
        sequence = [int(t) for t in tokenised[0][:12]]
        llm.reset()
        llm.eval(sequence)
        logits = np.array(llm.scores[: len(sequence)], dtype=np.float32)
        reference["architectures"][arch] = {
            "vocab": vocab,
            "texts": TEXTS,
            "tokens": [[int(t) for t in ts] for ts in tokenised],
            "sequence": sequence,
            "logits": [[round(float(x), 5) for x in row] for row in logits],
        }
        print(f"{arch}: {vocab} tokens, {os.path.getsize(path)} bytes, sequence {sequence}")
        del llm
    reference["quantized"] = {}
    rng = np.random.default_rng(20261129)
    source = os.path.join(OUT, "f32-llama.gguf")
    vocab = write_f32_llama(source, rng)
    for name, ftype in QUANTIZED.items():
        path = os.path.join(OUT, f"{name}.gguf")
        types = llama_cpp_quantize(source, path, ftype)
        llm = llama_cpp(path)
        sequence = [int(t) for t in llm.tokenize(SAMPLE.encode(), add_bos=True, special=True)[:24]]
        reference["quantized"][name] = {"vocab": vocab, "types": dict(types), "sequence": sequence, "logits": logits_of(llm, sequence)}
        print(f"{name}: matrices {dict(types)}, {os.path.getsize(path)} bytes")
        del llm
    os.remove(source)
    if not args.gemma:
        with open(os.path.join(OUT, "reference.json")) as f:
            reference["gemma3_270m"] = json.load(f)["gemma3_270m"]
    if args.gemma:
        llm = llama_cpp(args.gemma, n_ctx=512)
        runs = []
        for prompt in ["Question: What is the capital of France?\nAnswer:", "The three primary colors are"]:
            tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
            out = llm.create_completion(prompt, max_tokens=24, temperature=0.0, top_k=1)
            llm.reset()
            llm.eval(tokens)
            generated = []
            for _ in range(24):
                t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                generated.append(t)
                if t == llm.token_eos():
                    break
                llm.eval([t])
            runs.append({"prompt": prompt, "prompt_tokens": [int(t) for t in tokens], "greedy": generated, "text": out["choices"][0]["text"]})
            print(f"gemma: {prompt!r} -> {out['choices'][0]['text']!r}")
        reference["gemma3_270m"] = runs
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(reference, f)


if __name__ == "__main__":
    main()
