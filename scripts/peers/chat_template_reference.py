#!/usr/bin/env python3
"""Published chat templates rendered by transformers, for tern's template tests.

Takes the templates llama.cpp keeps of real models (vendor/llama.cpp/models/templates in the
llama-cpp-python 0.3.36 source package) and renders a few conversations, two of them with
tools, with transformers' own `render_jinja_template` (what `apply_chat_template` runs; no
torch needed), the current time fixed. Messages are given in tern's (OpenAI's) form; a tool
call's JSON `arguments` text becomes the object it holds, as vLLM hands calls to templates,
and an assistant's turn that only calls tools has empty content (as vLLM joins its text
parts; Qwen3's and Phi-3.5's templates fail on none). Writes
models/tests/fixtures/llm/templates/: the templates and expected.json.
Needs transformers and jinja2 (pip install transformers jinja2; 5.24.0 made the fixtures).

Usage: scripts/peers/chat_template_reference.py LLAMA_CPP_TEMPLATES_DIR
"""
import copy
import json
import os
import sys
from datetime import datetime

import jinja2
from transformers.utils import chat_template_utils

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
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather at a place (<city>, e.g. Zürich).",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now.", "parameters": {"type": "object", "properties": {}}}}
# Tools are written in the order tern shows them (chat_template.rs: type, function, name,
# description, parameters, properties, required, then by name; properties by name).
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Hi there  "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name three colours.\nOne per line."},
    ]},
    {"messages": [
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3"},
        {"role": "user", "content": "Now backwards."},
    ]},
    {"tools": [WEATHER, CLOCK], "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Paris, in celsius?"},
    ]},
    {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\": \"Paris\", \"unit\": \"celsius\"}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18, \"sky\": \"clear\"}"},
    ]},
]


class FixedTime(datetime):
    """The day the expected texts were made, whatever day they are made again."""

    @classmethod
    def now(cls, tz=None):
        return datetime(2026, 11, 28)


def template_messages(messages):
    """tern's messages as vLLM hands them to templates."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("tool_calls"):
            for call in m["tool_calls"]:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def main():
    src = sys.argv[1]
    os.makedirs(OUT, exist_ok=True)
    chat_template_utils.datetime = FixedTime
    expected = {"date": "2026-11-28", "conversations": CONVERSATIONS, "templates": {}}
    for name, (file, bos, eos) in TEMPLATES.items():
        source = open(os.path.join(src, file)).read()
        with open(os.path.join(OUT, f"{name}.jinja"), "w") as f:
            f.write(source)
        rendered = []
        for conversation in CONVERSATIONS:
            try:
                text = chat_template_utils.render_jinja_template(
                    conversations=[template_messages(conversation["messages"])],
                    tools=conversation.get("tools"),
                    chat_template=source,
                    add_generation_prompt=True,
                    bos_token=bos,
                    eos_token=eos,
                )[0][0]
                rendered.append(text)
            except Exception as e:
                # raise_exception raises TemplateError itself (a refusal); its subclasses and
                # other errors are the template failing on such a conversation.
                rendered.append({"error": str(e), "raised": type(e) is jinja2.exceptions.TemplateError})
        expected["templates"][name] = {"bos": bos, "eos": eos, "rendered": rendered}
        print(name, [r if isinstance(r, dict) else len(r) for r in rendered])
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
