#!/usr/bin/env python3
"""Tiny Stable Diffusion pipelines with random weights, and what diffusers computes on them.

tern's image family is proven equal to diffusers on these (models/tests/diffusion_parity.rs): no
registry package ships Stable Diffusion weights, so this script builds an SD 1.5-style and an
SDXL-style pipeline with the real layouts and small sizes, `save_pretrained`s them (the SD one in
fp32, the SDXL one as an fp16 variant) and records, from given initial latents, the images
diffusers makes with several schedulers, a tiled VAE decode, and the tokenizers' ids.

Usage (torch, diffusers and transformers from PyPI; CPU):
    python3 -m venv ~/.cache/tern/diffusers/venv
    ~/.cache/tern/diffusers/venv/bin/pip install torch diffusers transformers safetensors
    ~/.cache/tern/diffusers/venv/bin/python scripts/peers/diffusers_reference.py \
        models/tests/fixtures/diffusion
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from safetensors.numpy import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

WORDS = "a lighthouse at dusk the sea red blue cat on mat photo of an astronaut riding horse painting by night city".split()
PROMPTS = ["a lighthouse at dusk", "A photo of an astronaut, riding a horse!", "red cat on the mat 1984", ""]


def tiny_tokenizer(folder, pad_token):
    """A CLIP BPE vocabulary: the 256 byte characters, each with `</w>`, merges that spell the
    words above, and the two special tokens, as CLIP's own is laid out."""
    chars = list(bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars]
    merges = []
    for word in WORDS:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            merged = pair[0] + pair[1]
            if f"{pair[0]} {pair[1]}" not in merges:
                merges.append(f"{pair[0]} {pair[1]}")
                vocab.append(merged)
            pieces = [merged] + pieces[2:]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    # Real Stable Diffusion folders ship vocab.json and merges.txt (no tokenizer.json): so do
    # these, and the reference loads them from there.
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump({t: i for i, t in enumerate(dict.fromkeys(vocab))}, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "bos_token": "<|startoftext|>",
                   "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": pad_token}, f)
    return CLIPTokenizer.from_pretrained(folder)


def drop_tokenizer_json(folder):
    """transformers 5 saves a tokenizer.json beside vocab.json and merges.txt; real Stable
    Diffusion folders have none, so tern must build the tokenizer from the two."""
    for side in ("tokenizer", "tokenizer_2"):
        path = os.path.join(folder, side, "tokenizer.json")
        if os.path.exists(path):
            os.remove(path)


def text_encoder(projection, hidden_act):
    config = CLIPTextConfig(
        vocab_size=600, hidden_size=32, intermediate_size=37, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=77, hidden_act=hidden_act, projection_dim=24, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def vae(sample_size, scaling_factor):
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32, 32, 32), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8,
        sample_size=sample_size, scaling_factor=scaling_factor,
    ).eval()


def perturb(model, seed):
    """Random weights everywhere, norms included (a fresh model's norms are exactly 1 and 0,
    which would hide a missing scale or bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p + 0.05 * torch.randn(p.shape, generator=g))
    return model


# UNets keep 32 groups in their norms, as every published one does (candle's blocks assume it).


def sd_pipeline(folder):
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    ).eval()
    scheduler = PNDMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=perturb(vae(32, 0.18215), 1), text_encoder=perturb(text_encoder(False, "quick_gelu"), 2),
        tokenizer=tiny_tokenizer(os.path.join(folder, "tokenizer"), "<|endoftext|>"), unet=perturb(unet, 3),
        scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    drop_tokenizer_json(folder)
    return StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32, safety_checker=None)


def sdxl_pipeline(folder):
    torch.manual_seed(1)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64, 64), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4), cross_attention_dim=64,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=24 + 6 * 8, norm_num_groups=32,
    ).eval()
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        steps_offset=1, timestep_spacing="leading", interpolation_type="linear",
    )
    pipe = StableDiffusionXLPipeline(
        vae=perturb(vae(32, 0.13025), 4), text_encoder=perturb(text_encoder(False, "quick_gelu"), 5),
        text_encoder_2=perturb(text_encoder(True, "gelu"), 6),
        tokenizer=tiny_tokenizer(os.path.join(folder, "tokenizer"), "<|endoftext|>"),
        tokenizer_2=tiny_tokenizer(os.path.join(folder, "tokenizer_2"), "!"), unet=perturb(unet, 7), scheduler=scheduler,
    )
    pipe = pipe.to(torch.float16)
    pipe.save_pretrained(folder, safe_serialization=True, variant="fp16")
    drop_tokenizer_json(folder)
    return StableDiffusionXLPipeline.from_pretrained(folder, torch_dtype=torch.float32, variant="fp16")


def main(out):
    torch.set_grad_enabled(False)
    tensors, cases = {}, []
    for name, build in [("sd-tiny", sd_pipeline), ("sdxl-tiny", sdxl_pipeline)]:
        folder = os.path.join(out, name)
        shutil.rmtree(folder, ignore_errors=True)
        pipe = build(folder)
        default = pipe.scheduler.config
        runs = [
            ("ddim", DDIMScheduler, 4, 7.5, ["a lighthouse at dusk", "red cat on the mat"], ["", "blue sea"]),
            ("euler", EulerDiscreteScheduler, 3, 5.0, ["A photo of an astronaut, riding a horse!"], [""]),
            ("pndm", PNDMScheduler, 5, 7.5, ["painting by night city"], ["photo"]),
            ("euler", EulerDiscreteScheduler, 2, 0.0, ["a cat on a mat"], [""]),
        ]
        for i, (kind, cls, steps, guidance, prompts, negatives) in enumerate(runs):
            pipe.scheduler = cls.from_config(default)
            g = torch.Generator().manual_seed(100 + i)
            latents = torch.randn((len(prompts), 4, 8, 8), generator=g)
            images = pipe(
                prompt=prompts, negative_prompt=negatives if any(negatives) else None, num_inference_steps=steps,
                guidance_scale=guidance, height=64, width=64, latents=latents.clone(), output_type="np",
            ).images
            key = f"{name}/{i}"
            tensors[f"{key}/latents"] = latents.numpy()
            tensors[f"{key}/image"] = (images * 255).round().astype(np.uint8)
            cases.append({
                "model": name, "key": key, "scheduler": kind, "steps": steps, "guidance": guidance,
                "prompts": prompts, "negative_prompts": negatives, "width": 64, "height": 64,
            })
        # A tiled decode of 128x128 (16x16 latents, tiles of 4 latents: 32 pixels).
        g = torch.Generator().manual_seed(7)
        latents = torch.randn((1, 4, 16, 16), generator=g)
        pipe.vae.enable_tiling()
        tiled = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
        pipe.vae.disable_tiling()
        whole = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
        to_u8 = lambda x: ((x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
        tensors[f"{name}/decode/latents"] = latents.numpy()
        tensors[f"{name}/decode/tiled"] = to_u8(tiled)
        tensors[f"{name}/decode/whole"] = to_u8(whole)
        tokenizers = [pipe.tokenizer] + ([pipe.tokenizer_2] if hasattr(pipe, "tokenizer_2") else [])
        ids = [[t(p, padding="max_length", max_length=t.model_max_length, truncation=True).input_ids for p in PROMPTS] for t in tokenizers]
        cases.append({"model": name, "tokens": {"prompts": PROMPTS, "ids": ids}})
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(out, "expected.safetensors"))
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"diffusers": __import__("diffusers").__version__, "torch": torch.__version__, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models/tests/fixtures/diffusion")
