#!/usr/bin/env python3
"""Published chat templates rendered as transformers renders them, for tern's template tests.

Takes the templates llama.cpp keeps of real models (vendor/llama.cpp/models/templates in the
llama-cpp-python 0.3.36 source package) and renders a few conversations with Jinja2 set up as
transformers' `apply_chat_template` sets it up (sandboxed, trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, `strftime_now`). Writes models/tests/fixtures/llm/templates/:
the templates and expected.json. Needs jinja2 (pip install jinja2).

Usage: scripts/peers/chat_template_reference.py LLAMA_CPP_TEMPLATES_DIR
"""
import json
import os
import sys
from datetime import datetime

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "models", "tests", "fixtures", "llm", "templates")
TEMPLATES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "", "<|im_end|>"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "phi3.5": ("microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>"),
    "gemma2": ("google-gemma-2-2b-it.jinja", "<bos>", "<eos>"),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B.jinja", "", "<|im_end|>"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Hi there  "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name three colours.\nOne per line."},
    ],
    [
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3"},
        {"role": "user", "content": "Now backwards."},
    ],
]


def raise_exception(message):
    raise ValueError(message)


def main():
    src = sys.argv[1]
    os.makedirs(OUT, exist_ok=True)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    # Fixed so that the expected text does not depend on the day it was made.
    env.globals["strftime_now"] = lambda fmt: datetime(2026, 11, 28).strftime(fmt)
    expected = {"date": "2026-11-28", "conversations": CONVERSATIONS, "templates": {}}
    for name, (file, bos, eos) in TEMPLATES.items():
        source = open(os.path.join(src, file)).read()
        with open(os.path.join(OUT, f"{name}.jinja"), "w") as f:
            f.write(source)
        template = env.from_string(source)
        rendered = []
        for messages in CONVERSATIONS:
            try:
                rendered.append(template.render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos))
            except Exception as e:  # a template that refuses a conversation
                rendered.append({"error": str(e)})
        expected["templates"][name] = {"bos": bos, "eos": eos, "rendered": rendered}
        print(name, [r if isinstance(r, dict) else len(r) for r in rendered])
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
