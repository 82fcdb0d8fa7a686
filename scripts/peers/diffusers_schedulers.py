"""The reference schedulers that tern's parity test (models/tests/diffusion_schedulers.rs) compares with.

For each case (a `scheduler_config.json` as published with a model, and the scheduler a request
may name instead: diffusers' `XScheduler.from_config(pipe.scheduler.config)`), writes to OUT:

  schedulers.json         per case: the config, the kind, and for several step counts
                          `scheduler.timesteps`, `scheduler.sigmas` (Euler, Euler-a) and
                          `init_noise_sigma` after `set_timesteps(steps)`
  schedulers.safetensors  per case and loop step count, a denoising loop as the pipelines run
                          it: `{case}/{steps}/latents` (randn * init_noise_sigma), then for each
                          step i `/scaled/{i}` (scale_model_input), `/model_output/{i}` (a fake
                          model: 0.5 * sin(scaled) + 0.1 * randn), `/noise/{i}` (the noise
                          Euler-a drew, recorded from diffusers' `randn_tensor`) and `/prev/{i}`
                          (`step(...).prev_sample`, fed back as the next step's sample)

Set-up: a venv with `pip install torch diffusers safetensors` ($TERN_STATE_DIR/diffusers/venv).
Run:    $TERN_STATE_DIR/diffusers/venv/bin/python scripts/peers/diffusers_schedulers.py \
            --out models/tests/fixtures/diffusion
"""
import argparse, json, os

import torch
import diffusers
from diffusers import DDIMScheduler, EulerAncestralDiscreteScheduler, EulerDiscreteScheduler, PNDMScheduler
from diffusers.schedulers import scheduling_euler_ancestral_discrete
from safetensors.torch import save_file

CLASSES = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_a": EulerAncestralDiscreteScheduler,
    "pndm": PNDMScheduler,
}

# runwayml/stable-diffusion-v1-5 (diffusers 0.6.0: no timestep_spacing, so each class's default).
SD15 = {
    "_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
    "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
    "clip_sample": False,
}
# stabilityai/stable-diffusion-2-1 (768, v-prediction).
SD21 = {
    "_class_name": "DDIMScheduler", "_diffusers_version": "0.8.0", "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
    "num_train_timesteps": 1000, "prediction_type": "v_prediction", "set_alpha_to_one": False,
    "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
}
# stabilityai/stable-diffusion-xl-base-1.0.
SDXL = {
    "_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.19.0.dev0", "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
    "interpolation_type": "linear", "num_train_timesteps": 1000, "prediction_type": "epsilon",
    "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
    "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False,
}
# stabilityai/sd-turbo (and sdxl-turbo): trailing spacing, meant for 1 to 4 steps.
SD_TURBO = {
    "_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.24.0.dev0", "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
    "interpolation_type": "linear", "num_train_timesteps": 1000, "prediction_type": "epsilon",
    "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
    "timestep_spacing": "trailing", "timestep_type": "discrete", "trained_betas": None,
    "use_karras_sigmas": False,
}
# Zero terminal SNR with v-prediction and trailing spacing, as its paper recommends.
ZSNR = {
    "_class_name": "DDIMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "beta_start": 0.00085, "clip_sample": False, "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True, "timestep_spacing": "trailing", "set_alpha_to_one": False,
}
# A small trained-betas schedule, predicting the sample, clipping it to +-0.5.
TRAINED = {
    "_class_name": "DDIMScheduler", "num_train_timesteps": 100,
    "trained_betas": [round(0.001 + 0.0004 * i + 0.00001 * (i % 7), 6) for i in range(100)],
    "prediction_type": "sample", "clip_sample": True, "clip_sample_range": 0.5,
    "timestep_spacing": "linspace",
}

# (name, config, kind, schedule step counts, loop step counts)
COMMON = [1, 2, 3, 4, 7, 10, 20, 25, 30, 50, 61, 103, 999]
CASES = [
    ("sd15_pndm", SD15, "pndm", COMMON, [1, 4, 10]),
    ("sd15_ddim", SD15, "ddim", COMMON, [1, 4, 10]),
    ("sd15_euler", SD15, "euler", COMMON, [4, 10]),
    ("sd15_euler_a", SD15, "euler_a", COMMON, [1, 4, 10]),
    ("sd21_ddim", SD21, "ddim", COMMON, [4, 10]),
    ("sd21_pndm", SD21, "pndm", COMMON, [4, 10]),
    ("sd21_euler_a", SD21, "euler_a", COMMON, [4]),
    ("sdxl_euler", SDXL, "euler", COMMON, [1, 4, 10]),
    ("sd_turbo_euler", SD_TURBO, "euler", COMMON, [1, 4, 61]),
    ("sd_turbo_euler_a", SD_TURBO, "euler_a", COMMON, [1, 4]),
    ("sd_turbo_ddim", SD_TURBO, "ddim", COMMON, [1, 4, 61]),
    ("sd_turbo_pndm", SD_TURBO, "pndm", COMMON, [4]),
    ("cosine_ddim", {"_class_name": "DDIMScheduler", "beta_schedule": "squaredcos_cap_v2",
                     "timestep_spacing": "linspace"}, "ddim", COMMON, [4, 10]),
    ("cosine_euler", {"_class_name": "EulerDiscreteScheduler", "beta_schedule": "squaredcos_cap_v2",
                      "final_sigmas_type": "sigma_min", "prediction_type": "sample"},
     "euler", COMMON, [4, 10]),
    ("cosine_euler_a", {"_class_name": "EulerAncestralDiscreteScheduler",
                        "beta_schedule": "squaredcos_cap_v2"}, "euler_a", COMMON, [4]),
    ("linear_pndm_prk", {"_class_name": "PNDMScheduler"}, "pndm", COMMON[3:], [4, 10]),
    ("linear_pndm_prk_linspace", {"_class_name": "PNDMScheduler", "timestep_spacing": "linspace"},
     "pndm", COMMON[3:], [10]),
    ("zsnr_ddim", ZSNR, "ddim", COMMON, [4, 10]),
    ("zsnr_euler", ZSNR, "euler", COMMON, [4]),
    ("zsnr_euler_a", ZSNR, "euler_a", COMMON, [4]),
    ("euler_v_continuous", {"_class_name": "EulerDiscreteScheduler", "prediction_type": "v_prediction",
                            "timestep_type": "continuous", "beta_schedule": "scaled_linear",
                            "beta_start": 0.00085, "beta_end": 0.012}, "euler", COMMON, [4]),
    ("trained_ddim", TRAINED, "ddim", [1, 2, 3, 4, 7, 10, 33, 100], [4, 10]),
]

SHAPE = (2, 2, 4, 4)


def build(config, kind):
    """The scheduler a pipeline built from `config` runs when a request names `kind`."""
    own = getattr(diffusers, config["_class_name"]).from_config(config)
    cls = CLASSES[kind]
    return own if type(own) is cls else cls.from_config(own.config)


def floats(t):
    """Values of an f32 tensor as the shortest decimals that read back as the same f32s."""
    return [float(str(x)) for x in t.to(torch.float32).flatten().numpy()]


def denoise(name, config, kind, steps, tensors):
    sched = build(config, kind)
    sched.set_timesteps(steps)
    g = torch.Generator().manual_seed(steps)
    prefix = f"{name}/{steps}"
    latents = torch.randn(SHAPE, generator=g, dtype=torch.float32) * sched.init_noise_sigma
    tensors[f"{prefix}/latents"] = latents.clone()
    drawn = []
    original = scheduling_euler_ancestral_discrete.randn_tensor

    def recording(*args, **kwargs):
        noise = original(*args, **kwargs)
        drawn.append(noise.clone())
        return noise

    scheduling_euler_ancestral_discrete.randn_tensor = recording
    try:
        for i, t in enumerate(sched.timesteps):
            scaled = sched.scale_model_input(latents, t)
            model_output = 0.5 * torch.sin(scaled) + 0.1 * torch.randn(SHAPE, generator=g)
            kwargs = {"generator": g} if kind in ("euler", "euler_a", "ddim") else {}
            prev = sched.step(model_output, t, latents, **kwargs).prev_sample
            tensors[f"{prefix}/scaled/{i}"] = scaled.clone()
            tensors[f"{prefix}/model_output/{i}"] = model_output.clone()
            if kind == "euler_a":
                tensors[f"{prefix}/noise/{i}"] = drawn[-1]
            tensors[f"{prefix}/prev/{i}"] = prev.clone()
            latents = prev
    finally:
        scheduling_euler_ancestral_discrete.randn_tensor = original
    return len(sched.timesteps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cases, tensors = [], {}
    for name, config, kind, schedule_steps, loop_steps in CASES:
        schedules = []
        for steps in schedule_steps:
            sched = build(config, kind)
            sched.set_timesteps(steps)
            sigmas = getattr(sched, "sigmas", None)
            schedules.append({
                "steps": steps,
                "timesteps": floats(sched.timesteps),
                "sigmas": floats(sigmas) if sigmas is not None and kind != "ddim" and kind != "pndm" else None,
                "init_noise_sigma": float(sched.init_noise_sigma),
            })
        loops = [{"steps": s, "len": denoise(name, config, kind, s, tensors)} for s in loop_steps]
        cases.append({"name": name, "config": config, "kind": kind, "schedules": schedules, "loops": loops})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "schedulers.json"), "w") as f:
        json.dump({"diffusers": diffusers.__version__, "torch": torch.__version__, "shape": SHAPE,
                   "cases": cases}, f, separators=(",", ":"))
        f.write("\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "schedulers.safetensors"))


if __name__ == "__main__":
    main()
