#!/usr/bin/env python3
"""Speed of diffusers beside tern on SD-Turbo's and SDXL-Turbo's real architectures.

Time does not depend on the weights' values, so both run random weights of the real sizes:
`make` builds the pipelines from the published configs (no hub access needed) and saves them as
fp16 diffusers folders; `run` times diffusers on one (CPU by default) and prints JSON lines.
tern's side is `tern-bench-models --only image --model-dir DIR`, on the same folder.

Usage:
    python scripts/peers/diffusers_bench.py make sd-turbo DIR
    python scripts/peers/diffusers_bench.py run DIR --batch 1 --steps 1 --size 512 [--device cuda]
"""

import argparse
import json
import os
import time

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

# stabilityai/sd-turbo and stabilityai/sdxl-turbo, unet/config.json, vae/config.json and
# text_encoder*/config.json as published.
SD_TURBO_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, attention_head_dim=(5, 10, 20, 20),
    cross_attention_dim=1024, use_linear_projection=True, upcast_attention=False,
)
SDXL_TURBO_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280), layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(5, 10, 20),
    transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
)
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              hidden_act="quick_gelu", projection_dim=768)
OPEN_CLIP_H = dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16,
                   hidden_act="gelu", projection_dim=512)
OPEN_CLIP_BIG_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                       num_attention_heads=20, hidden_act="gelu", projection_dim=1280)
SCHEDULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                 steps_offset=1, timestep_spacing="trailing", prediction_type="epsilon")


def tokenizer(folder, pad):
    """CLIP's byte-level vocabulary layout with few merges: speed does not depend on them."""
    chars = list(bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "pad_token": pad}, f)
    return CLIPTokenizer.from_pretrained(folder)


def make(kind, out):
    torch.manual_seed(0)
    scheduler = EulerDiscreteScheduler(**SCHEDULER)
    if kind == "sd-turbo":
        pipe = StableDiffusionPipeline(
            vae=AutoencoderKL(**VAE, sample_size=768), text_encoder=CLIPTextModel(CLIPTextConfig(**OPEN_CLIP_H)),
            tokenizer=tokenizer(os.path.join(out, "tokenizer"), "!"), unet=UNet2DConditionModel(**SD_TURBO_UNET),
            scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
    else:
        pipe = StableDiffusionXLPipeline(
            vae=AutoencoderKL(**VAE, sample_size=1024, scaling_factor=0.13025),
            text_encoder=CLIPTextModel(CLIPTextConfig(**CLIP_L)),
            text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**OPEN_CLIP_BIG_G)),
            tokenizer=tokenizer(os.path.join(out, "tokenizer"), "<|endoftext|>"),
            tokenizer_2=tokenizer(os.path.join(out, "tokenizer_2"), "!"),
            unet=UNet2DConditionModel(**SDXL_TURBO_UNET), scheduler=scheduler,
        )
    pipe.to(torch.float16).save_pretrained(out, safe_serialization=True, variant="fp16")


def run(folder, batch, steps, size, device, repeats):
    xl = json.load(open(os.path.join(folder, "model_index.json")))["_class_name"] == "StableDiffusionXLPipeline"
    cls = StableDiffusionXLPipeline if xl else StableDiffusionPipeline
    dtype = torch.float16 if device == "cuda" else torch.float32
    pipe = cls.from_pretrained(folder, torch_dtype=dtype, variant="fp16").to(device)
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a lighthouse at dusk"] * batch
    pipe(prompts, num_inference_steps=steps, guidance_scale=0.0, height=size, width=size)  # warmup
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        pipe(prompts, num_inference_steps=steps, guidance_scale=0.0, height=size, width=size, output_type="np")
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    best = min(times)
    print(json.dumps({"engine": "diffusers", "model": os.path.basename(folder.rstrip("/")), "device": device, "batch": batch,
                      "steps": steps, "size": size, "seconds": round(best, 3), "seconds_per_image": round(best / batch, 3),
                      "images_per_minute": round(60 * batch / best, 2), "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("kind", choices=["sd-turbo", "sdxl-turbo"])
    m.add_argument("out")
    r = sub.add_parser("run")
    r.add_argument("folder")
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--steps", type=int, default=1)
    r.add_argument("--size", type=int, default=512)
    r.add_argument("--device", default="cpu")
    r.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    torch.set_grad_enabled(False)
    if a.cmd == "make":
        make(a.kind, a.out)
    else:
        run(a.folder, a.batch, a.steps, a.size, a.device, a.repeats)
