"""The HTTP side of ``coli serve``: a Starlette (ASGI) app over one engine.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (OpenAI), ``POST /v1/messages``
(Anthropic), ``GET /v1/models`` (both APIs' shapes in one list), ``GET /health``, ``GET /metrics``
(Prometheus text). Every error is a JSON body in the shape of the API that was called (OpenAI:
``{"error": {"message", "type", "param", "code"}}``; Anthropic: ``{"type": "error", "error":
{"type", "message"}}``), never a traceback. Generation runs on the worker thread
(``worker.Worker``); the event loop only tokenizes (in a thread), queues and forwards events.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from core.errors import ColiError
from core.sampling import MAX_SEED, SamplingParams

from .metrics import Metrics
from .params import (ApiError, bad, boolean, integer, number, refuse_unsupported, stops, string,
                     text_content)
from .worker import Job, QueueFull, ShuttingDown, Worker

MAX_BODY_BYTES = 16 * 1024 * 1024
NO_CONTEXT_LIMIT = 1 << 20       # max_tokens bound for a model without max_position_embeddings
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
                 "cancelled": "stop"}
ANTHROPIC_STOP = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens",
                  "context": "max_tokens", "cancelled": "end_turn"}
ANTHROPIC_ERROR = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error"}
OPENAI_ERROR = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error"}


# --- the server's state ---------------------------------------------------------------------------

def _generation_defaults(model_dir: Path) -> dict:
    """Sampling defaults from the model's generation_config.json (as vLLM does), else the APIs'
    documented ones (temperature 1, top_p 1, no top_k); do_sample false means greedy."""
    d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    try:
        g = json.loads((model_dir / "generation_config.json").read_text())
    except (OSError, ValueError):
        return d
    if not isinstance(g, dict):
        return d
    for k, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 1e-9, 1.0)):
        v = g.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi:
            d[k] = float(v)
    if isinstance(g.get("top_k"), int) and not isinstance(g["top_k"], bool) and g["top_k"] >= 0:
        d["top_k"] = g["top_k"]
    if g.get("do_sample") is False:
        d["temperature"] = 0.0
    return d


class ServeState:
    def __init__(self, engine, model_id: str, api_key: str | None, max_queue: int, log=None):
        self.engine, self.model_id, self.api_key, self.log = engine, model_id, api_key, log
        self.context = int(getattr(engine.spec, "max_position_embeddings", 0) or 0)
        self.vocab = int(engine.spec.vocab_size)
        self.defaults = _generation_defaults(Path(engine.container.path))
        self.worker = Worker(engine, max_queue=max_queue, log=log)
        self.metrics = Metrics()
        self.started = time.time()

    # authentication: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic)
    def check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        want = self.api_key.encode("utf-8")
        given = []
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given.append(auth[7:].strip())
        if "x-api-key" in request.headers:
            given.append(request.headers["x-api-key"].strip())
        # every candidate compared in constant time (headers arrive as latin-1 text)
        ok = False
        for g in given:
            ok |= hmac.compare_digest(g.encode("latin-1", "replace"), want)
        if not ok:
            raise ApiError(401, "missing or wrong API key (send `Authorization: Bearer KEY` or "
                                "`x-api-key: KEY`)", kind="authentication_error", code="invalid_api_key")

    def check_model(self, body: dict) -> str:
        m = string(body, "model", required=True)
        if m != self.model_id:
            raise ApiError(404, f"model {m!r} is not served here; this server serves "
                                f"{self.model_id!r} (GET /v1/models)", kind="not_found_error",
                           param="model", code="model_not_found")
        return m

    def sampling(self, body: dict, t_max: float) -> SamplingParams:
        d = self.defaults
        temperature = number(body, "temperature", d["temperature"], 0.0, t_max)
        top_p = number(body, "top_p", d["top_p"], 0.0, 1.0)
        if top_p == 0:
            raise bad("'top_p' must be greater than 0", "top_p")
        top_k = integer(body, "top_k", d["top_k"], 0)
        seed = integer(body, "seed", None, 0, MAX_SEED)
        try:
            return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        except ValueError as e:
            raise bad(str(e)) from None

    def max_tokens(self, body: dict, names: tuple[str, ...], n_prompt: int, default: int | None = None,
                   required: bool = False) -> int:
        """The first of ``names`` present; past the model's context it is a 400 naming it. Absent:
        ``default``, else up to the end of the context."""
        limit = self.context or NO_CONTEXT_LIMIT
        why = (f", the model's context (max_position_embeddings = {self.context})" if self.context
               else " (this server's bound)")
        for name in names:
            if body.get(name) is not None:
                return integer(body, name, None, 1, limit, why)
        if required:
            raise bad(f"'{names[0]}' is required", names[0])
        room = max(1, limit - n_prompt)
        return min(default, room) if default is not None else room

    async def tokenize(self, prompt, raw: bool = False, param: str = "messages") -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            bad_ids = [t for t in prompt if not 0 <= t < self.vocab]
            if bad_ids:
                raise bad(f"token id {bad_ids[0]} is out of range 0..{self.vocab - 1}", param)
            ids = list(prompt)
        else:
            try:
                ids = await run_in_threadpool(self.engine.prompt_ids, prompt, raw)
            except ColiError as e:
                raise bad(str(e), param) from None
        if not ids:
            raise bad("the prompt is empty", param)
        if self.context and len(ids) > self.context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, past the model's context of "
                                f"{self.context} tokens (max_position_embeddings)", param=param,
                           code="context_length_exceeded")
        return ids

    def submit(self, ids, sampling, stop, max_new_tokens) -> Job:
        job = Job(ids, sampling, stop, max_new_tokens, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: one request is decoding and "
                                f"{self.worker.max_queue} are waiting (--max-queue); retry in "
                                f"{e.retry_after} s", kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", kind="overloaded_error") from None
        return job

    @staticmethod
    def stop_sequence(job: Job, stop_list: list[str]) -> str | None:
        """Which stop string ended the reply: the engine says (Done.stop)."""
        return job.matched if job.matched is not None else (stop_list[0] if stop_list else None)


async def _items(job: Job):
    """The worker's items for a job, up to (not including) its end."""
    while True:
        item = await job.queue.get()
        if item[0] == "end":
            return
        yield item


async def _collect(state: ServeState, request: Request, job: Job) -> dict:
    """A whole reply (non-streaming); a client that disconnects cancels it."""
    async def watch():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                state.worker.cancel(job)
                return
    watcher = asyncio.ensure_future(watch())
    out = {"text": [], "stats": None, "reason": None, "error": None}
    try:
        async for kind, val in _items(job):
            if kind == "token":
                out["text"].append(val.text)
            elif kind == "stats":
                out["stats"] = val
            elif kind == "done":
                out["reason"] = val
            elif kind == "error":
                out["error"] = val
    finally:
        watcher.cancel()
        state.worker.cancel(job)     # nothing when it finished; the client is gone otherwise
    if out["error"] is not None:
        status, message = out["error"]
        raise ApiError(status, message, kind="invalid_request_error" if status == 400 else "server_error")
    out["text"] = "".join(out["text"])
    return out


def _usage_counts(stats, ids) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, prompt tokens a cached prefix gave: not computed)."""
    return (len(ids), stats.new_tokens if stats is not None else 0,
            getattr(stats, "cached_tokens", 0) if stats is not None else 0)


def _openai_usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """OpenAI's usage: prompt_tokens counts the cached ones too (prompt_tokens_details)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _anthropic_usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """Anthropic's usage: input_tokens are the ones computed, cache_read_input_tokens the rest."""
    return {"input_tokens": prompt - cached, "output_tokens": completion,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _event(name: str, obj) -> str:
    return f"event: {name}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _openai_error_body(status: int, message: str, kind=None, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind if kind and kind != "not_found_error" else
                      OPENAI_ERROR.get(status, "server_error"), "param": param, "code": code}}


def _anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR.get(status, "api_error"), "message": message}}


def _error_response(api: str, e: ApiError) -> JSONResponse:
    body = (_anthropic_error_body(e.status, e.message) if api == "anthropic"
            else _openai_error_body(e.status, e.message, e.kind, e.param, e.code))
    return JSONResponse(body, status_code=e.status, headers=e.headers)


async def _read_json(request: Request) -> dict:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad("the body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:       # JSONDecodeError, bad UTF-8, nesting
        raise bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


def endpoint(api: str, route: str):
    """Authentication, error bodies in the API's shape, metrics; a bug is a JSON 500."""
    def wrap(fn):
        async def handler(request: Request) -> Response:
            state: ServeState = request.app.state.serve
            try:
                state.check_key(request)
                response = await fn(request, state)
            except ApiError as e:
                response = _error_response(api, e)
            except Exception as e:
                if state.log is not None:
                    state.log.exception("request failed")
                response = _error_response(api, ApiError(500, f"internal error: {e.__class__.__name__}: {e}",
                                                         kind="server_error"))
            state.metrics.request(route, response.status_code)
            return response
        return handler
    return wrap


def _streaming(state: ServeState, job: Job, route: str, frames) -> StreamingResponse:
    """An SSE response over ``frames`` (an async iterator of strings); when the client goes away
    (Starlette cancels the iterator) or anything ends it early, the job is cancelled."""
    t0 = time.monotonic()

    async def body():
        try:
            async for frame in frames:
                yield frame
            state.metrics.observe(route, time.monotonic() - t0)
        finally:
            state.worker.cancel(job)
    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


# --- OpenAI ----------------------------------------------------------------------------------------

OPENAI_UNSUPPORTED = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
                      "logprobs": False, "top_logprobs": 0, "n": 1, "presence_penalty": 0,
                      "frequency_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"},
                      "audio": None, "prediction": None}


def _chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise bad(f"messages[{i}].role {role!r} is not supported (system, developer, user, "
                      f"assistant; tools are not supported yet)", "messages")
        if m.get("tool_calls"):
            raise bad(f"messages[{i}].tool_calls: tools are not supported yet", "messages")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": role, "content": text_content(content, f"messages[{i}].content")})
    return out


def _stream_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return boolean(opts, "include_usage", False)


async def chat_completions(request: Request, state: ServeState) -> Response:
    body = await _read_json(request)
    model = state.check_model(body)
    refuse_unsupported(body, OPENAI_UNSUPPORTED)
    messages = _chat_messages(body)
    stream = boolean(body, "stream")
    include_usage = _stream_usage(body) if stream else False
    sampling = state.sampling(body, 2.0)
    stop = stops(body, "stop")
    ids = await state.tokenize(messages)
    max_new = state.max_tokens(body, ("max_completion_tokens", "max_tokens"), len(ids))
    job = state.submit(ids, sampling, stop, max_new)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if not stream:
        t0 = time.monotonic()
        r = await _collect(state, request, job)
        state.metrics.observe("/v1/chat/completions", time.monotonic() - t0)
        p, c, cached = _usage_counts(r["stats"], ids)
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": r["text"]},
                         "logprobs": None, "finish_reason": OPENAI_FINISH.get(r["reason"], "stop")}],
            "usage": _openai_usage(p, c, cached), "system_fingerprint": None})

    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None}

    def chunk(delta, finish=None):
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    frames = _openai_frames(job, ids, head, include_usage, text=lambda t: chunk({"content": t}),
                            final=lambda f: chunk({}, f), opening=chunk({"role": "assistant", "content": ""}))
    return _streaming(state, job, "/v1/chat/completions", frames)


async def _openai_frames(job, ids, head: dict, include_usage: bool, text, final, opening=None):
    """An OpenAI stream's SSE frames, for chat and plain completions alike: ``opening`` first if
    any, ``text(piece)`` per token batch, ``final(finish_reason)``, the usage chunk when asked
    (``head`` + empty choices), then [DONE]; an error mid-stream is one error frame."""
    if opening is not None:
        yield _sse(opening)
    stats, reason = None, None
    async for kind, val in _items(job):
        if kind == "token" and val.text:
            yield _sse(text(val.text))
        elif kind == "stats":
            stats = val
        elif kind == "done":
            reason = val
        elif kind == "error":
            yield _sse(_openai_error_body(val[0], val[1]))
            return
    yield _sse(final(OPENAI_FINISH.get(reason, "stop")))
    if include_usage:
        p, c, cached = _usage_counts(stats, ids)
        yield _sse({**head, "choices": [], "usage": _openai_usage(p, c, cached)})
    yield "data: [DONE]\n\n"


def _completion_prompt(body: dict):
    """A string, an array of one string, token ids, or an array of one array of token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise bad("one prompt per request: 'prompt' has several", "prompt")
    raise bad("'prompt' must be a string or an array of token ids", "prompt")


async def completions(request: Request, state: ServeState) -> Response:
    body = await _read_json(request)
    model = state.check_model(body)
    refuse_unsupported(body, {**OPENAI_UNSUPPORTED, "logprobs": (None, 0, False), "echo": False,
                              "suffix": "", "best_of": 1})
    prompt = _completion_prompt(body)
    stream = boolean(body, "stream")
    include_usage = _stream_usage(body) if stream else False
    sampling = state.sampling(body, 2.0)
    stop = stops(body, "stop")
    ids = await state.tokenize(prompt, raw=True, param="prompt")
    max_new = state.max_tokens(body, ("max_tokens",), len(ids), default=16)     # the API's default
    job = state.submit(ids, sampling, stop, max_new)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def choice(text, finish):
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    if not stream:
        t0 = time.monotonic()
        r = await _collect(state, request, job)
        state.metrics.observe("/v1/completions", time.monotonic() - t0)
        p, c, cached = _usage_counts(r["stats"], ids)
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [choice(r["text"], OPENAI_FINISH.get(r["reason"], "stop"))],
                             "usage": _openai_usage(p, c, cached), "system_fingerprint": None})

    head = {"id": cid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None}
    frames = _openai_frames(job, ids, head, include_usage, text=lambda t: {**head, "choices": [choice(t, None)]},
                            final=lambda f: {**head, "choices": [choice("", f)]})
    return _streaming(state, job, "/v1/completions", frames)


# --- Anthropic -------------------------------------------------------------------------------------

def _anthropic_messages(body: dict) -> list[dict]:
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": text_content(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"messages[{i}].role must be 'user' or 'assistant', got {role!r}")
        out.append({"role": role, "content": text_content(m.get("content"), f"messages[{i}].content")})
    if out[-1]["role"] != "user":
        raise bad("the last message must be the user's (continuing a partial assistant reply is not "
                  "supported)")
    return out


async def messages(request: Request, state: ServeState) -> Response:
    body = await _read_json(request)
    model = state.check_model(body)
    if body.get("tools"):
        raise bad("'tools' is not supported by this server")
    refuse_unsupported(body, {"tool_choice": None, "thinking": {"type": "disabled"}})
    msgs = _anthropic_messages(body)
    stream = boolean(body, "stream")
    sampling = state.sampling(body, 1.0)
    stop = stops(body, "stop_sequences")
    ids = await state.tokenize(msgs)
    max_new = state.max_tokens(body, ("max_tokens",), len(ids), required=True)
    job = state.submit(ids, sampling, stop, max_new)
    mid = f"msg_{uuid.uuid4().hex}"
    if not stream:
        t0 = time.monotonic()
        r = await _collect(state, request, job)
        state.metrics.observe("/v1/messages", time.monotonic() - t0)
        p, c, cached = _usage_counts(r["stats"], ids)
        reason = ANTHROPIC_STOP.get(r["reason"], "end_turn")
        return JSONResponse({
            "id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": r["text"]}], "stop_reason": reason,
            "stop_sequence": state.stop_sequence(job, stop) if reason == "stop_sequence" else None,
            "usage": _anthropic_usage(p, c, cached)})

    async def frames():
        yield _event("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
        yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {"type": "ping"})
        stats, reason, text = None, None, []
        async for kind, val in _items(job):
            if kind == "token" and val.text:
                text.append(val.text)
                yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                     "delta": {"type": "text_delta", "text": val.text}})
            elif kind == "stats":
                stats = val
            elif kind == "done":
                reason = val
            elif kind == "error":
                yield _event("error", _anthropic_error_body(val[0], val[1]))
                return
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        why = ANTHROPIC_STOP.get(reason, "end_turn")
        seq = state.stop_sequence(job, stop) if why == "stop_sequence" else None
        # cumulative counts: the client replaces message_start's input_tokens (the cache was not
        # known then) with these
        yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": why, "stop_sequence": seq},
                                       "usage": _anthropic_usage(*_usage_counts(stats, ids))})
        yield _event("message_stop", {"type": "message_stop"})
    return _streaming(state, job, "/v1/messages", frames())


# --- models, health, metrics -----------------------------------------------------------------------

async def list_models(request: Request, state: ServeState) -> Response:
    entry = _model_entry(state)
    return JSONResponse({"object": "list", "data": [entry], "has_more": False,
                         "first_id": entry["id"], "last_id": entry["id"]})


def _model_entry(state: ServeState) -> dict:
    created = int(state.started)
    # OpenAI's fields and Anthropic's (type, display_name, created_at) in one object
    return {"id": state.model_id, "object": "model", "created": created, "owned_by": "colibri",
            "type": "model", "display_name": state.model_id,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
            "context_length": state.context or None}


async def get_model(request: Request, state: ServeState) -> Response:
    name = request.path_params["name"]
    if name != state.model_id:
        raise ApiError(404, f"model {name!r} is not served here; this server serves {state.model_id!r}",
                       kind="not_found_error", code="model_not_found")
    return JSONResponse(_model_entry(state))


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


async def health(request: Request, state: ServeState) -> Response:
    from core.memory import peak_rss_bytes, rss_bytes
    w = state.worker
    return JSONResponse({
        "status": "ok", "model": state.model_id, "context": state.context or None,
        "uptime_s": round(time.time() - state.started, 3),
        "queue": w.queue_state(),
        "requests": {k: w.counts[k] for k in ("served", "cancelled", "errors", "rejected")},
        "tokens": {"prompt": w.counts["prompt_tokens"], "cached": w.counts["cached_tokens"],
                   "completion": w.counts["completion_tokens"]},
        "store": _jsonable(state.engine.store.stats()),        # the latest generation's tier stats
        "store_totals": {k: w.totals[k] for k in ("hits", "misses", "bytes_read")},
        "last_generation": _jsonable(w.last_stats),
        "rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes()})


async def metrics(request: Request, state: ServeState) -> Response:
    return PlainTextResponse(state.metrics.render(state), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _not_found(request: Request, exc: HTTPException) -> Response:
    api = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
    msg = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
           else f"{request.method} is not allowed on {request.url.path}")
    return _error_response(api, ApiError(exc.status_code, msg, kind="not_found_error" if exc.status_code == 404
                                         else "invalid_request_error"))


async def _internal(request: Request, exc: Exception) -> Response:
    return _error_response("openai", ApiError(500, "internal error", kind="server_error"))


def build_app(engine, model_id: str | None = None, api_key: str | None = None, max_queue: int = 8,
              cors_origins: tuple[str, ...] | list[str] = (), log=None) -> Starlette:
    """The ASGI app; ``app.state.serve`` holds the worker (close it with ``app.state.serve.worker.close()``)."""
    model_id = model_id or Path(engine.container.path).name
    state = ServeState(engine, model_id, api_key, max_queue, log)
    routes = [
        Route("/v1/chat/completions", endpoint("openai", "/v1/chat/completions")(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint("openai", "/v1/completions")(completions), methods=["POST"]),
        Route("/v1/messages", endpoint("anthropic", "/v1/messages")(messages), methods=["POST"]),
        Route("/v1/models", endpoint("openai", "/v1/models")(list_models), methods=["GET"]),
        Route("/v1/models/{name:path}", endpoint("openai", "/v1/models")(get_model), methods=["GET"]),
        Route("/health", endpoint("openai", "/health")(health), methods=["GET"]),
        Route("/metrics", endpoint("openai", "/metrics")(metrics), methods=["GET"]),
    ]
    middleware = []
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["authorization", "content-type", "x-api-key",
                                                    "anthropic-version", "anthropic-beta"]))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={404: _not_found, 405: _not_found, Exception: _internal})
    app.state.serve = state
    return app
