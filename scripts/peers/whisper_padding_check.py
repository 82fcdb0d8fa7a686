#!/usr/bin/env python3
"""What the features past a short clip's end do to Whisper's transcript, on real weights.

OpenAI's `transcribe` (and transformers' feature extractor) take the log-mel of the clip
followed by silence; faster-whisper (and tern) take the clip's own frames and pad the mel with
zeros. This decodes each LibriVox clip both ways with CTranslate2 (the weights tern runs, F32),
greedy and at beam 5, and prints the transcripts side by side.

Usage (a venv with ctranslate2, transformers and tokenizers):
    python scripts/peers/whisper_padding_check.py MODELS_DIR [MODEL]   (MODEL: whisper-tiny.en)
"""

import glob
import os
import sys
import wave

import ctranslate2
import numpy as np
import tokenizers
from transformers import WhisperFeatureExtractor


def main(models_dir, name="whisper-tiny.en"):
    folder = os.path.join(models_dir, name)
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    model = ctranslate2.models.Whisper(folder, compute_type="float32")
    extractor = WhisperFeatureExtractor(feature_size=model.n_mels)
    prompt = [tokenizer.token_to_id(t) for t in ("<|startoftranscript|>", "<|notimestamps|>")]
    for path in sorted(glob.glob(os.path.join(models_dir, "testdata/librivox/*.wav"))):
        with wave.open(path) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768
        silence = extractor(pcm, sampling_rate=16000, return_tensors="np").input_features.astype(np.float32)
        zeros = silence.copy()
        zeros[0, :, len(pcm) // 160:] = 0.0
        for padding, features in (("silence (OpenAI)", silence), ("zeros (faster-whisper, tern)", zeros)):
            for beam in (1, 5):
                result = model.generate(ctranslate2.StorageView.from_array(features), [prompt], beam_size=beam)
                print(f"{os.path.basename(path)[-8:-4]}  {padding:<29} beam {beam}: {tokenizer.decode(result[0].sequences_ids[0]).strip()}")


if __name__ == "__main__":
    main(*sys.argv[1:])
