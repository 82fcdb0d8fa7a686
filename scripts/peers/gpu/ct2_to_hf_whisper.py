"""Rebuild a Hugging Face Whisper folder from the CTranslate2 (faster-whisper) folder tern reads,
so that transformers' Whisper runs on exactly the weights tern runs.

    python3 scripts/peers/gpu/ct2_to_hf_whisper.py SRC_CT2_DIR DST_DIR [--dtype float16|float32]

SRC_CT2_DIR is a folder as scripts/models.sh lays it out under $TERN_MODELS_DIR
(whisper-tiny.en/ or whisper-base/: model.bin, config.json, tokenizer.json). DST_DIR receives
model.safetensors (fp16 by default, as shipped), config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, special_tokens_map.json and preprocessor_config.json;
`WhisperForConditionalGeneration.from_pretrained(DST_DIR)` and
`pipeline("automatic-speech-recognition", model=DST_DIR)` then load it with local files only.

Nothing but numpy and safetensors is needed (no torch, no ctranslate2). The model.bin layout and
the CT2 -> HF tensor names follow shared/facts/models.md: the self-attention q/k/v of CT2 are
stacked by rows into one `linear_0`, the cross-attention k/v into `linear_1`; the k biases CT2
carries are zeros and HF's Whisper has none, so they are dropped (and checked to be zero). The
model's shape (d_model, layers, heads, ffn, vocabulary, positions) is read from the tensors; the
suppress tokens, begin-suppress tokens, alignment heads and language ids from the CT2
config.json; the special token ids from its tokenizer.json.

Generation config: no timestamps, English. An English-only model (vocabulary 51864) starts
decoding at <|startoftranscript|> and forces <|notimestamps|>; a multilingual one gets
`lang_to_id`/`task_to_id` and defaults `language` = "en", `task` = "transcribe" (the benchmark
also passes them explicitly).
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # 5 = bf16, handled below


def read_ct2(path):
    """Returns ({name: numpy array}, {alias: target}) from a CTranslate2 model.bin."""
    data = memoryview(open(path, "rb").read())
    pos = 0

    def take(fmt):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<H")
        s = bytes(data[pos : pos + n]).rstrip(b"\0").decode()
        pos += n
        return s

    version = take("<I")
    if version < 5:
        sys.exit(f"unsupported model.bin version {version}")
    spec = string()
    if spec != "WhisperSpec":
        sys.exit(f"{path}: spec {spec!r}, not WhisperSpec")
    take("<I")  # spec revision
    tensors = {}
    for _ in range(take("<I")):
        name = string()
        rank = take("<B")
        dims = [take("<I") for _ in range(rank)]
        dtype = take("<B")
        nbytes = take("<I")
        raw = data[pos : pos + nbytes]
        pos += nbytes
        if dtype == 5:  # bf16: widen to f32 through the high half of the bits
            arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=DTYPES[dtype])
        tensors[name] = arr.reshape(dims)
    aliases = {}
    if pos < len(data):
        for _ in range(take("<I")):
            alias = string()
            aliases[alias] = string()
    return tensors, aliases


def convert_weights(ct2, dtype):
    """CT2 tensors -> HF WhisperForConditionalGeneration state dict (proj_out is tied, not stored)."""
    out = {}

    def put(hf, arr):
        out[hf] = np.ascontiguousarray(arr.astype(dtype))

    def linear(ct2_prefix, hf_prefix, bias=True):
        put(f"{hf_prefix}.weight", ct2[f"{ct2_prefix}/weight"])
        if bias:
            put(f"{hf_prefix}.bias", ct2[f"{ct2_prefix}/bias"])

    def norm(ct2_prefix, hf_prefix):
        put(f"{hf_prefix}.weight", ct2[f"{ct2_prefix}/gamma"])
        put(f"{hf_prefix}.bias", ct2[f"{ct2_prefix}/beta"])

    def split(ct2_prefix, hf_prefix, names):
        w = ct2[f"{ct2_prefix}/weight"]
        b = ct2[f"{ct2_prefix}/bias"]
        d = w.shape[1]
        assert w.shape[0] == d * len(names), (ct2_prefix, w.shape)
        for j, n in enumerate(names):
            put(f"{hf_prefix}.{n}.weight", w[j * d : (j + 1) * d])
            bj = b[j * d : (j + 1) * d]
            if n == "k_proj":
                assert not np.any(bj.astype(np.float32)), f"{ct2_prefix}: non-zero k bias; HF Whisper has none"
            else:
                put(f"{hf_prefix}.{n}.bias", bj)

    def ffn(ct2_prefix, hf_prefix):
        linear(f"{ct2_prefix}/ffn/linear_0", f"{hf_prefix}.fc1")
        linear(f"{ct2_prefix}/ffn/linear_1", f"{hf_prefix}.fc2")
        norm(f"{ct2_prefix}/ffn/layer_norm", f"{hf_prefix}.final_layer_norm")

    for part in ("encoder", "decoder"):
        put(f"model.{part}.embed_positions.weight", ct2[f"{part}/position_encodings/encodings"])
        norm(f"{part}/layer_norm", f"model.{part}.layer_norm")
    for c in ("conv1", "conv2"):
        linear(f"encoder/{c}", f"model.encoder.{c}")
    put("model.decoder.embed_tokens.weight", ct2["decoder/embeddings/weight"])

    enc_layers = count_layers(ct2, "encoder")
    dec_layers = count_layers(ct2, "decoder")
    for i in range(enc_layers):
        c, h = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        split(f"{c}/self_attention/linear_0", f"{h}.self_attn", ["q_proj", "k_proj", "v_proj"])
        linear(f"{c}/self_attention/linear_1", f"{h}.self_attn.out_proj")
        norm(f"{c}/self_attention/layer_norm", f"{h}.self_attn_layer_norm")
        ffn(c, h)
    for i in range(dec_layers):
        c, h = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        split(f"{c}/self_attention/linear_0", f"{h}.self_attn", ["q_proj", "k_proj", "v_proj"])
        linear(f"{c}/self_attention/linear_1", f"{h}.self_attn.out_proj")
        norm(f"{c}/self_attention/layer_norm", f"{h}.self_attn_layer_norm")
        linear(f"{c}/attention/linear_0", f"{h}.encoder_attn.q_proj")
        split(f"{c}/attention/linear_1", f"{h}.encoder_attn", ["k_proj", "v_proj"])
        linear(f"{c}/attention/linear_2", f"{h}.encoder_attn.out_proj")
        norm(f"{c}/attention/layer_norm", f"{h}.encoder_attn_layer_norm")
        ffn(c, h)
    return out, enc_layers, dec_layers


def count_layers(ct2, part):
    n = 0
    while f"{part}/layer_{n}/ffn/linear_0/weight" in ct2:
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="CTranslate2 Whisper folder (model.bin, config.json, tokenizer.json)")
    ap.add_argument("dst", help="Hugging Face folder to write")
    ap.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    args = ap.parse_args()

    from safetensors.numpy import save_file

    ct2, aliases = read_ct2(os.path.join(args.src, "model.bin"))
    proj = aliases.get("decoder/projection/weight")
    if proj not in (None, "decoder/embeddings/weight") or (
        "decoder/projection/weight" in ct2
        and not np.array_equal(ct2["decoder/projection/weight"], ct2["decoder/embeddings/weight"])
    ):
        sys.exit("the output projection is not tied to the token embeddings; this converter assumes it is")
    ct2_config = json.load(open(os.path.join(args.src, "config.json")))
    tok = json.load(open(os.path.join(args.src, "tokenizer.json")))
    dtype = np.float16 if args.dtype == "float16" else np.float32
    weights, enc_layers, dec_layers = convert_weights(ct2, dtype)

    vocab, d_model = ct2["decoder/embeddings/weight"].shape
    enc_heads = int(ct2["encoder/num_heads"])
    dec_heads = int(ct2["decoder/num_heads"])
    enc_ffn = ct2["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    dec_ffn = ct2["decoder/layer_0/ffn/linear_0/weight"].shape[0]
    n_mels = ct2["encoder/conv1/weight"].shape[1]
    src_pos = ct2["encoder/position_encodings/encodings"].shape[0]
    tgt_pos = ct2["decoder/position_encodings/encodings"].shape[0]
    multilingual = vocab >= 51865

    # Special tokens, from the tokenizer itself.
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    eot = ids["<|endoftext|>"]
    sot = ids["<|startoftranscript|>"]
    no_ts = ids["<|notimestamps|>"]
    transcribe, translate = ids["<|transcribe|>"], ids["<|translate|>"]
    prev = ids["<|startofprev|>"]
    lang_tokens = {c: i for c, i in ids.items() if i in set(ct2_config.get("lang_ids", []))}
    # The vocabulary ends with <|notimestamps|> and the 1501 timestamp tokens.
    assert no_ts + 1501 == vocab - 1, (no_ts, vocab)
    # Timestamp tokens <|0.00|> ... <|30.00|> follow <|notimestamps|> (as in the Hub's tokenizers),
    # so that every id the model can emit decodes.
    have = {t["id"] for t in tok["added_tokens"]}
    for k in range(1501):
        i = no_ts + 1 + k
        if i not in have and i < vocab:
            tok["added_tokens"].append(
                {"id": i, "content": f"<|{k * 0.02:.2f}|>", "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": False}
            )

    os.makedirs(args.dst, exist_ok=True)
    save_file(weights, os.path.join(args.dst, "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "activation_function": "gelu",
        "d_model": int(d_model),
        "encoder_layers": enc_layers,
        "decoder_layers": dec_layers,
        "encoder_attention_heads": enc_heads,
        "decoder_attention_heads": dec_heads,
        "encoder_ffn_dim": int(enc_ffn),
        "decoder_ffn_dim": int(dec_ffn),
        "num_hidden_layers": enc_layers,
        "num_mel_bins": int(n_mels),
        "max_source_positions": int(src_pos),
        "max_target_positions": int(tgt_pos),
        "vocab_size": int(vocab),
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": sot,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
        "init_std": 0.02,
        "is_encoder_decoder": True,
        "dtype": args.dtype,
        "torch_dtype": args.dtype,
    }
    json.dump(config, open(os.path.join(args.dst, "config.json"), "w"), indent=2)

    gen = {
        "alignment_heads": ct2_config.get("alignment_heads", []),
        "begin_suppress_tokens": ct2_config.get("suppress_ids_begin", [220, eot]),
        "suppress_tokens": ct2_config.get("suppress_ids", []),
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": sot,
        "no_timestamps_token_id": no_ts,
        "prev_sot_token_id": prev,
        "max_initial_timestamp_index": 50,
        "max_length": int(tgt_pos),
        "return_timestamps": False,
        "is_multilingual": multilingual,
    }
    if multilingual:
        gen["lang_to_id"] = lang_tokens
        gen["task_to_id"] = {"transcribe": transcribe, "translate": translate}
        gen["language"] = "en"
        gen["task"] = "transcribe"
        gen["forced_decoder_ids"] = None
    else:
        gen["forced_decoder_ids"] = None
    json.dump(gen, open(os.path.join(args.dst, "generation_config.json"), "w"), indent=2)

    json.dump(tok, open(os.path.join(args.dst, "tokenizer.json"), "w"), ensure_ascii=False)
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>"}
    specials = [t["content"] for t in sorted(tok["added_tokens"], key=lambda t: t["id"]) if t["special"] and t["id"] != eot]
    json.dump(dict(special, additional_special_tokens=specials),
              open(os.path.join(args.dst, "special_tokens_map.json"), "w"), indent=2)
    json.dump(dict(special, tokenizer_class="WhisperTokenizer", model_max_length=1024, errors="replace",
                   add_prefix_space=False, clean_up_tokenization_spaces=False, extra_special_tokens=specials,
                   additional_special_tokens=specials),
              open(os.path.join(args.dst, "tokenizer_config.json"), "w"), indent=2)
    json.dump({
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": int(n_mels),
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": 30,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }, open(os.path.join(args.dst, "preprocessor_config.json"), "w"), indent=2)
    for f in ("vocabulary.txt",):
        if os.path.exists(os.path.join(args.src, f)):
            shutil.copy(os.path.join(args.src, f), args.dst)
    mb = sum(a.nbytes for a in weights.values()) / 1e6
    kind = "multilingual" if multilingual else "English-only"
    print(f"{args.src} -> {args.dst}: {kind}, d_model {d_model}, {enc_layers}+{dec_layers} layers, "
          f"{enc_heads}/{dec_heads} heads, vocabulary {vocab}, {len(weights)} tensors, {mb:.0f} MB {args.dtype}; "
          f"decoder start {sot}, notimestamps {no_ts}"
          + (f", <|en|> {lang_tokens.get('<|en|>')}, <|transcribe|> {transcribe}" if multilingual else ""))


if __name__ == "__main__":
    main()
