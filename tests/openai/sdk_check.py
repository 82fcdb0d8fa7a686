"""OpenAI's official Python SDK against tern, unchanged: tests/tests/openai_sdk.rs runs it.

Usage: sdk_check.py PHASE BASE_URL API_KEY LIBRIVOX_DIR
  main       models, every transcription response_format and its stream, embeddings (float
             and base64), chat and text completions (plain and streamed), errors, and a
             recording over 30 minutes (on a worker with Whisper tiny.en)
  translate  translations (on a worker with multilingual Whisper base)
  batch      the Batch API: a file uploaded, a batch run to its output file, listed,
             canceled, and the file deleted
  langchain  LangChain's OpenAI client (langchain-openai): chat, streamed chat, embeddings
  images     image generation as URLs and as base64 PNGs, with tern's extensions through
             extra_body, and its errors (on a worker with a Stable Diffusion pipeline)
  tools      chat with tools: a named function's call, plain and streamed, read by the SDK
             into tool_calls; the call answered; the deprecated functions refused (on a
             worker whose model's chat template shows tools)
Prints one line per check; exits non-zero at the first that fails.
"""

import base64
import io
import json
import struct
import urllib.request
import math
import time
import re
import sys
import wave

import openai
from openai import OpenAI

phase, base_url, api_key, librivox = sys.argv[1:5]
client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=600)


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        sys.exit(1)


def words(text):
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def word_error_rate(reference, hypothesis):
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(len(ref), 1)


def clips():
    out = []
    for line in open(f"{librivox}/transcription"):
        text, _, clip_id = line.rstrip().rpartition(" (")
        text = text.replace("<s>", "").replace("</s>", "").strip()
        out.append((f"{librivox}/{clip_id.rstrip(')')}.wav", text))
    return out


CLIP, REFERENCE = clips()[0]


def clip_through(route, **options):
    """The test clip sent to `route` (client.audio.transcriptions or .translations)."""
    with open(CLIP, "rb") as f:
        return route.create(model="whisper-1", file=f, **options)


def expect_error(what, call, status, code, param=None):
    try:
        call()
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        ok = e.status_code == status and body.get("code") == code and (param is None or body.get("param") == param)
        check(what, ok and "message" in body and "type" in body, f"{e.status_code} {body}")
        return
    check(what, False, "no error")


def long_recording(minutes):
    """The LibriVox clips one after another until `minutes` of 16 kHz mono WAV."""
    frames, params = [], None
    for path, _ in clips():
        with wave.open(path) as w:
            params = w.getparams()
            frames.append(w.readframes(w.getnframes()))
    one_pass = b"".join(frames)
    needed = int(minutes * 60 * params.framerate * params.sampwidth * params.nchannels)
    data = (one_pass * (needed // len(one_pass) + 1))[:needed]
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setparams(params)
        w.writeframes(data)
    buffer.name = "long.wav"
    buffer.seek(0)
    return buffer


def main():
    ids = {m.id for m in client.models.list()}
    check("models list the kinds live workers serve", {"transcribe", "embed", "generate"} <= ids, str(sorted(ids)))
    check("a model is fetched by id", client.models.retrieve("embed").id == "embed")

    # Transcription, every response_format.
    result = clip_through(client.audio.transcriptions)
    wer = word_error_rate(REFERENCE, result.text)
    check("transcription json", wer < 0.25, f"WER {wer:.2f}: {result.text!r}")
    text = clip_through(client.audio.transcriptions, response_format="text")
    check("transcription text", isinstance(text, str) and word_error_rate(REFERENCE, text) < 0.25, repr(text)[:80])
    srt = clip_through(client.audio.transcriptions, response_format="srt")
    check("transcription srt", re.match(r"1\n00:00:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n\S", srt) is not None, repr(srt)[:80])
    vtt = clip_through(client.audio.transcriptions, response_format="vtt")
    check("transcription vtt", vtt.startswith("WEBVTT\n\n00:00:") and "." in vtt.split("\n")[2], repr(vtt)[:80])
    verbose = clip_through(client.audio.transcriptions, response_format="verbose_json", timestamp_granularities=["segment"])
    with wave.open(CLIP) as w:
        seconds = w.getnframes() / w.getframerate()
    segments = verbose.segments or []
    check(
        "transcription verbose_json",
        verbose.language == "en" and abs(verbose.duration - seconds) < 0.1 and segments
        and all(s.start <= s.end <= seconds + 0.5 for s in segments),
        f"{verbose.language} {verbose.duration} {len(segments)} segments",
    )
    timed = clip_through(client.audio.transcriptions, response_format="verbose_json", timestamp_granularities=["word", "segment"])
    timed_words = timed.words or []
    check(
        "transcription verbose_json with word timestamps",
        words(" ".join(w.word for w in timed_words)) == words(timed.text) and len(timed_words) > 5
        and all(0 <= w.start <= w.end <= seconds + 0.5 for w in timed_words)
        and all(a.start <= b.start for a, b in zip(timed_words, timed_words[1:])),
        f"{len(timed_words)} words: {[(w.word, w.start, w.end) for w in timed_words[:4]]}",
    )
    expect_error(
        "word timestamps outside verbose_json are refused by name",
        lambda: clip_through(client.audio.transcriptions, response_format="json", timestamp_granularities=["word"]),
        400, "invalid_timestamp_granularity", "timestamp_granularities",
    )
    prompted = clip_through(client.audio.transcriptions, prompt="Sense and Sensibility, by Jane Austen.", temperature=0.2)
    wer = word_error_rate(REFERENCE, prompted.text)
    check("transcription with a prompt and a temperature", wer < 0.35, f"WER {wer:.2f}: {prompted.text!r}")
    expect_error(
        "a temperature above 1 is refused by name",
        lambda: clip_through(client.audio.transcriptions, temperature=1.5),
        400, "invalid_temperature", "temperature",
    )
    events = list(clip_through(client.audio.transcriptions, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    done = [e for e in events if e.type == "transcript.text.done"]
    check("transcription stream", len(done) == 1 and words(deltas) == words(done[0].text) and words(done[0].text) == words(result.text),
          f"{len(events)} events")

    # Embeddings: floats, and the SDK's default base64, the same vectors.
    floats = client.embeddings.create(model="text-embedding-3-small", input=["a cat sat", "the stock market"], encoding_format="float")
    vectors = [d.embedding for d in floats.data]
    check("embeddings as floats", len(vectors) == 2 and len(vectors[0]) == 384
          and all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vectors), f"{len(vectors)} x {len(vectors[0])}")
    packed = client.embeddings.create(model="text-embedding-3-small", input=["a cat sat", "the stock market"])
    check("embeddings as base64", all(abs(a - b) < 1e-6 for v, w in zip(vectors, (d.embedding for d in packed.data)) for a, b in zip(v, w)))
    single = client.embeddings.create(model="x", input="a cat sat", encoding_format="float")
    check("one string is one embedding", len(single.data) == 1 and single.data[0].index == 0)
    expect_error("dimensions the model cannot give are refused",
                 lambda: client.embeddings.create(model="x", input="a", dimensions=128), 400, "dimensions_unsupported", "dimensions")

    # Chat, plain and streamed: greedy, so the same text.
    messages = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    chat = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=16, temperature=0)
    answer = chat.choices[0].message.content
    check("chat completion", bool(answer) and chat.choices[0].finish_reason in ("stop", "length")
          and 0 < chat.usage.completion_tokens <= 16 and chat.object == "chat.completion", repr(answer))
    chunks = list(client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    check("chat completion stream", streamed == answer and finish == [chat.choices[0].finish_reason]
          and len(usage) == 1 and usage[0].completion_tokens == chat.usage.completion_tokens
          and all(c.object == "chat.completion.chunk" for c in chunks), f"{len(chunks)} chunks: {streamed!r}")
    completion = client.completions.create(model="x", prompt="Once upon a time", max_tokens=8, temperature=0)
    check("text completion", bool(completion.choices[0].text) and completion.usage.completion_tokens <= 8, repr(completion.choices[0].text))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
    check("text completion stream", streamed == completion.choices[0].text, repr(streamed))

    # Errors in OpenAI's shape.
    expect_error("n > 1 is refused by name",
                 lambda: client.chat.completions.create(model="x", messages=messages, n=2), 400, "unsupported_parameter", "n")
    bad = OpenAI(base_url=f"{base_url}/v1", api_key="tern_nothing_here", max_retries=0)
    expect_error("a bad key is an authentication error", lambda: bad.models.list(), 401, "invalid_api_key")
    try:
        bad.models.list()
    except openai.AuthenticationError as e:
        check("the SDK raises AuthenticationError, type authentication_error", e.body.get("type") == "authentication_error")

    # A recording over 30 minutes, in one request.
    long = client.audio.transcriptions.create(model="whisper-1", file=long_recording(31), response_format="verbose_json")
    last = (long.segments or [])[-1]
    check("a 31-minute recording", long.duration > 1859 and last.end > 1800 and len(words(long.text)) > 3000,
          f"{long.duration:.0f} s, {len(long.segments)} segments, {len(words(long.text))} words")


def translate():
    result = clip_through(client.audio.translations)
    wer = word_error_rate(REFERENCE, result.text)
    check("translation into English", wer < 0.25, f"WER {wer:.2f}: {result.text!r}")
    srt = clip_through(client.audio.translations, response_format="srt")
    check("translation srt", srt.startswith("1\n00:00:"), repr(srt)[:60])


def batch():
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "m", "input": f"line {i}"}} for i in range(20)]
    lines.append({"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}})
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": 5}})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    check("file uploaded", uploaded.id.startswith("file-") and uploaded.bytes == len(data) and uploaded.purpose == "batch",
          str(uploaded))
    check("file retrieved", client.files.retrieve(uploaded.id).filename == "input.jsonl")
    check("file content", client.files.content(uploaded.id).content == data)
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h",
                                    metadata={"run": "sdk"})
    check("batch created", created.status == "validating" and created.metadata == {"run": "sdk"}, str(created))
    deadline = time.time() + 300
    done = created
    while done.status not in ("completed", "failed", "expired", "cancelled") and time.time() < deadline:
        time.sleep(0.5)
        done = client.batches.retrieve(created.id)
    counts = done.request_counts
    check("batch completed", done.status == "completed" and counts.total == 22 and counts.completed == 21 and counts.failed == 1,
          str(done))
    answers = [json.loads(l) for l in client.files.content(done.output_file_id).text.splitlines()]
    check("output file", sorted(a["custom_id"] for a in answers) == sorted(l["custom_id"] for l in lines[:21])
          and all(a["response"]["status_code"] == 200 for a in answers), f"{len(answers)} answers")
    embedding = next(a for a in answers if a["custom_id"] == "e0")["response"]["body"]["data"][0]["embedding"]
    check("an answer is the route's own", len(embedding) == 384, str(len(embedding)))
    errors = [json.loads(l) for l in client.files.content(done.error_file_id).text.splitlines()]
    check("error file", [e["custom_id"] for e in errors] == ["bad"]
          and errors[0]["response"]["body"]["error"]["code"] == "invalid_request", str(errors))
    listed = client.batches.list(limit=10)
    check("batches listed", created.id in [b.id for b in listed.data])
    again = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    canceled = client.batches.cancel(again.id)
    check("batch cancel", canceled.status in ("cancelling", "cancelled"), canceled.status)
    while canceled.status == "cancelling" and time.time() < deadline:
        time.sleep(0.5)
        canceled = client.batches.retrieve(again.id)
    check("batch cancelled", canceled.status == "cancelled", str(canceled))
    expect_error("bad endpoint", lambda: client.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations",
                                                               completion_window="24h"), 400, "invalid_endpoint", "endpoint")
    expect_error("missing batch", lambda: client.batches.retrieve("batch_nope"), 404, "batch_not_found")
    check("file deleted", client.files.delete(uploaded.id).deleted)
    expect_error("deleted file", lambda: client.files.retrieve(uploaded.id), 404, "file_not_found")


def png_size(data):
    """A PNG's width and height, from its IHDR chunk."""
    check("a PNG", data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", repr(data[:16]))
    return struct.unpack(">II", data[16:24])


def images():
    # Few steps, small images: the worker runs a tiny pipeline.
    fast = {"steps": 2, "seed": 11}
    by_url = client.images.generate(model="dall-e-2", prompt="a lighthouse at dusk", n=2, size="64x128", extra_body=fast)
    check("images as URLs", len(by_url.data) == 2 and by_url.created > 0 and all(d.url for d in by_url.data), str(by_url)[:200])
    pngs = [urllib.request.urlopen(d.url).read() for d in by_url.data]
    check("each URL downloads its PNG", [png_size(p) for p in pngs] == [(64, 128)] * 2)
    inline = client.images.generate(model="x", prompt="a lighthouse at dusk", n=2, size="64x128", response_format="b64_json", extra_body=fast)
    decoded = [base64.b64decode(d.b64_json) for d in inline.data]
    check("images as base64, the same seed's images", decoded == pngs)
    expect_error("a size off the grid", lambda: client.images.generate(prompt="p", size="100x100"), 400, "invalid_size", "size")
    expect_error("a style", lambda: client.images.generate(prompt="p", style="vivid"), 400, "unsupported_parameter", "style")
    expect_error("too many images", lambda: client.images.generate(prompt="p", n=9), 422, "invalid_input")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def tools():
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = client.chat.completions.create(model="x", messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=48, temperature=0)
    choice = chat.choices[0]
    calls = choice.message.tool_calls or []
    check("a named function is called", choice.finish_reason == "tool_calls" and choice.message.content is None and len(calls) == 1
          and calls[0].type == "function" and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_"), str(choice)[:300])
    check("its arguments are a JSON object", isinstance(json.loads(calls[0].function.arguments), dict), calls[0].function.arguments)

    chunks = list(client.chat.completions.create(model="x", messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=48,
                                                 temperature=0, stream=True))
    deltas = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check("the call streamed", text == "" and finish == ["tool_calls"] and len(deltas) == 1 and deltas[0].index == 0
          and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == calls[0].function.arguments,
          f"{len(chunks)} chunks, {deltas}")

    answered = messages + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"sky": "sunny", "celsius": 21})},
    ]
    reply = client.chat.completions.create(model="x", messages=answered, tools=[WEATHER], max_tokens=24, temperature=0)
    check("the call answered", reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
          and reply.usage.prompt_tokens > chat.usage.prompt_tokens, str(reply.choices[0])[:300])
    expect_error("the deprecated functions are refused",
                 lambda: client.chat.completions.create(model="x", messages=messages, functions=[WEATHER["function"]]),
                 400, "unsupported_parameter", "functions")


def langchain():
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    chat = ChatOpenAI(base_url=f"{base_url}/v1", api_key=api_key, model="smollm2", max_tokens=8, temperature=0)
    answer = chat.invoke("Name a colour.")
    check("LangChain chat", isinstance(answer.content, str) and answer.content != ""
          and answer.usage_metadata["output_tokens"] > 0, repr(answer.content))
    pieces = [chunk.content for chunk in chat.stream("Count: one, two,")]
    check("LangChain streamed chat", len(pieces) > 1 and "".join(pieces) != "", repr(pieces))
    # tern's API reads text; LangChain's token-array batching (tiktoken) is turned off.
    embeddings = OpenAIEmbeddings(base_url=f"{base_url}/v1", api_key=api_key, model="minilm", check_embedding_ctx_length=False)
    vectors = embeddings.embed_documents(["a cat", "a dog"])
    query = embeddings.embed_query("a kitten")
    cosine = sum(a * b for a, b in zip(vectors[0], query))
    check("LangChain embeddings", len(vectors) == 2 and len(vectors[0]) == 384 and cosine > 0.5, f"cos(cat, kitten) {cosine:.2f}")


{"main": main, "translate": translate, "batch": batch, "langchain": langchain, "images": images, "tools": tools}[phase]()
print("all checks passed")
