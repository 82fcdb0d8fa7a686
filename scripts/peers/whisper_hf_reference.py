#!/usr/bin/env python3
"""Whisper in Hugging Face's format, the reference side: tiny random models of large-v3's and
turbo's shapes, and what transformers' `WhisperForConditionalGeneration` computes on them.

No registry package ships large-v3 or turbo, so tern's Hugging Face loader is proven equal to
transformers on models this script makes: large-v3's 128 mel bins, its 51,866-token vocabulary
(`<|yue|>` among the languages, every later special token one up) and its tokenizer; turbo's
decoder of far fewer layers than its encoder; widths tiny so the fixtures stay small. Each
model is saved with `save_pretrained` (fp16 safetensors, `config.json`,
`generation_config.json`) beside a `tokenizer.json`, and `expected.json` records, for a
LibriVox clip, the encoder's output averaged over the clip's positions (tern's audio embedding)
and the greedy transcript of `generate` (English, no timestamps).

Usage (the diffusers venv of docs/images.md has what it needs):
    python scripts/peers/whisper_hf_reference.py MODELS_DIR OUT_DIR
MODELS_DIR is scripts/models.sh's folder (whisper-base's tokenizer and config, the clip);
OUT_DIR is models/tests/fixtures/whisper-hf.
"""

import json
import math
import os
import sys
import wave

import numpy as np
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, WhisperConfig, WhisperFeatureExtractor,
                          WhisperForConditionalGeneration, WhisperTokenizerFast)

CLIP = "testdata/librivox/sense_and_sensibility_01_austen_64kb-0880.wav"
# Where large-v3 adds <|yue|>: after <|su|> (50357), so <|translate|> and everything after move
# up one.
YUE = 50358

SHAPES = {
    # large-v3: 32 + 32 layers of width 1280 in truth; 128 mel bins, 51,866 tokens.
    "large-v3": dict(encoder_layers=2, decoder_layers=2),
    # turbo: large-v3's encoder with a decoder of 4 layers instead of 32.
    "turbo": dict(encoder_layers=4, decoder_layers=1),
}


def v3_id(i):
    return i + 1 if i >= YUE else i


def v3_tokenizer(base_dir, out):
    """whisper-base's tokenizer.json with large-v3's special tokens."""
    t = json.load(open(os.path.join(base_dir, "tokenizer.json")))
    added = []
    for a in t["added_tokens"]:
        if a["id"] == YUE:
            added.append(dict(a, id=YUE, content="<|yue|>"))
        added.append(dict(a, id=v3_id(a["id"])))
    t["added_tokens"] = sorted(added, key=lambda a: a["id"])
    for special in (t.get("post_processor") or {}).get("special_tokens", {}).values():
        special["ids"] = [v3_id(i) for i in special["ids"]]
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(t, f, ensure_ascii=False)
    return {a["content"]: a["id"] for a in t["added_tokens"]}


def generation_config(base_dir, ids):
    """large-v3's decoding rules: whisper-base's (OpenAI's lists) with the v3 ids."""
    ct2 = json.load(open(os.path.join(base_dir, "config.json")))
    langs = {c: i for c, i in ids.items() if c.startswith("<|") and len(c) <= 8 and c.strip("<|>").isalpha()
             and c not in ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>")}
    return dict(
        suppress_tokens=[v3_id(i) for i in ct2["suppress_ids"]],
        begin_suppress_tokens=[v3_id(i) for i in ct2["suppress_ids_begin"]],
        lang_to_id=langs,
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        decoder_start_token_id=ids["<|startoftranscript|>"],
        no_timestamps_token_id=ids["<|notimestamps|>"],
        is_multilingual=True,
        alignment_heads=[[0, 0], [0, 1]],
        max_length=448,
    )


def clip(models_dir):
    with wave.open(os.path.join(models_dir, CLIP)) as w:
        assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0


def make(name, shape, models_dir, out):
    base = os.path.join(models_dir, "whisper-base")
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    ids = v3_tokenizer(base, folder)
    torch.manual_seed({"large-v3": 3, "turbo": 4}[name])
    config = WhisperConfig(
        vocab_size=51866, num_mel_bins=128, d_model=16, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=448,
        decoder_start_token_id=ids["<|startoftranscript|>"], pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"], **shape,
    )
    model = WhisperForConditionalGeneration(config).eval()
    for key, value in generation_config(base, ids).items():
        setattr(model.generation_config, key, value)
    model.half().save_pretrained(folder, safe_serialization=True)
    model.float()

    pcm = clip(models_dir)
    features = WhisperFeatureExtractor(feature_size=128)(pcm, sampling_rate=16000, return_tensors="pt").input_features
    # The features as tern computes them, after faster-whisper: the clip's frames, then zeros.
    # transformers' extractor (and OpenAI's transcribe) pad the audio with silence instead, whose
    # frames are the log floor: a difference of features, not of the model (docs/benchmarks.md,
    # "Why the pipeline reads differently").
    features[0, :, len(pcm) // 160:] = 0.0
    with torch.no_grad():
        hidden = model.model.encoder(features).last_hidden_state[0]
        audio = max(1, min(hidden.shape[0], math.ceil(len(pcm) / 320)))
        mean = hidden[:audio].mean(0)
        embedding = (mean / mean.norm()).tolist()
        # faster-whisper's rules, which tern follows: without timestamps no timestamp token
        # (nor <|notimestamps|>) is ever picked; transformers and OpenAI's reference let one be
        # picked and drop it from the text.
        no_timestamps = ids["<|notimestamps|>"]

        class NoTimestamps(LogitsProcessor):
            def __call__(self, input_ids, scores):
                scores[:, no_timestamps:] = -float("inf")
                return scores

        tokens = model.generate(features, language="en", task="transcribe", return_timestamps=False, max_new_tokens=224,
                                do_sample=False, num_beams=1, logits_processor=LogitsProcessorList([NoTimestamps()]))[0].tolist()
        prompt = [ids["<|startoftranscript|>"], ids["<|en|>"], ids["<|transcribe|>"], no_timestamps]
        logits = model(input_features=features, decoder_input_ids=torch.tensor([prompt])).logits[0, -1]
        top = torch.topk(logits, 10)
    tokenizer = WhisperTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return dict(clip=CLIP, embedding=embedding, prompt=prompt, top_ids=top.indices.tolist(), top_logits=top.values.tolist(),
                tokens=tokens, text=text)


def main(models_dir, out):
    torch.set_grad_enabled(False)
    expected = {name: make(name, shape, models_dir, out) for name, shape in SHAPES.items()}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)
    for name, e in expected.items():
        print(name, len(e["tokens"]), "tokens:", e["text"][:120])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
