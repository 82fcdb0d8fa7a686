"""schemathesis hooks for tests/tests/openapi.rs (loaded through SCHEMATHESIS_HOOKS).

They drop the generated requests whose fate no schema can decide, leaving every other request
to every check:
- a transcribe or audio_embed job with base64 audio: the document says it must be audio, a
  fuzzer's bytes are not (422 `audio_unreadable`, as for any unreadable upload);
- an `Idempotency-Key` header with a different body `idempotency_key`: the two must be equal
  (400 `invalid_request`), which JSON Schema cannot say across a header and a body;
- a long-poll (`GET /v1/jobs/{id}?wait=`) of more than 5 s on a job that may never finish: it
  would answer after schemathesis's 30 s read timeout, not wrongly. Invalid waits stay in.
"""

import re

import schemathesis

SUBMIT_PATHS = ("/v1/jobs", "/v1/jobs/batch")


def _jobs(body):
    if not isinstance(body, dict):
        return []
    if isinstance(body.get("jobs"), list):
        return [job for job in body["jobs"] if isinstance(job, dict)]
    return [body]


def _base64_audio(job):
    audio = job.get("input", {}).get("audio") if isinstance(job.get("input"), dict) else None
    return job.get("kind") in ("transcribe", "audio_embed") and isinstance(audio, dict) and "base64" in audio


def _long_wait(case):
    wait = (case.query or {}).get("wait")
    match = re.fullmatch(r"([0-9]+)s?", wait) if isinstance(wait, str) else None
    return match is not None and int(match.group(1)) > 5


@schemathesis.hook
def filter_case(context, case):
    operation = context.operation
    if operation is not None and operation.method.upper() == "GET" and operation.path == "/v1/jobs/{id}":
        return not _long_wait(case)
    if operation is None or operation.method.upper() != "POST" or operation.path not in SUBMIT_PATHS:
        return True
    if any(_base64_audio(job) for job in _jobs(case.body)):
        return False
    header = {k.lower(): v for k, v in (case.headers or {}).items()}.get("idempotency-key")
    body_key = case.body.get("idempotency_key") if isinstance(case.body, dict) else None
    return header is None or body_key is None or header == body_key
