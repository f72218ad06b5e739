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

from ..thinking import THINK_OPEN, ThinkSplitter, prompt_opens_think, split_think
from .metrics import Metrics
from .params import (ApiError, bad, boolean, integer, number, refuse_unsupported, stops, string,
                     text_content)
from .logprobs import MAX_TOP_LOGPROBS, CompletionLogprobs, TokenText, chat_entries
from .tools import (ReplyAssembler, anthropic_tools, arguments_object, call_id, openai_tools,
                    split_reply)
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
    def __init__(self, engine, model_id: str, api_key: str | None, max_queue: int, log=None, lock=None):
        self.engine, self.model_id, self.api_key, self.log = engine, model_id, api_key, log
        self.context = int(getattr(engine.spec, "max_position_embeddings", 0) or 0)
        self.vocab = int(engine.spec.vocab_size)
        self.defaults = _generation_defaults(Path(engine.container.path))
        self.worker = Worker(engine, max_queue=max_queue, log=log, lock=lock)
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

    def think_mode(self, ids: list[int]) -> bool | None:
        """None when the chat template never writes <think> (a reply is all content); else
        whether this prompt ends inside an open think block (the reply starts as thinking)."""
        tok = self.engine.tokenizer
        template = tok.chat_template if tok is not None else None
        if not isinstance(template, str) or THINK_OPEN not in template:
            return None
        return prompt_opens_think(tok.decode(ids[-16:], skip_special_tokens=False))

    def check_tools(self, tools) -> None:
        """Tools reach the model only through its chat template: one that never reads ``tools``
        refuses them (ignoring them would answer as if the client had sent none)."""
        if tools is None:
            return
        tok = self.engine.tokenizer
        if tok is None or not tok.template_uses("tools", tools):
            raise bad(f"'tools' is not supported by this model: its chat template "
                      f"{'is missing' if tok is None or not tok.has_chat_template else 'never reads a `tools` variable'}"
                      f", so the model could not see them", "tools")

    async def tokenize(self, prompt, raw: bool = False, param: str = "messages", tools=None) -> list[int]:
        if tools is not None:
            try:
                ids = await run_in_threadpool(lambda: self.engine.tokenizer.encode_chat(
                    list(prompt), add_generation_prompt=True, tools=tools))
            except ValueError as e:
                raise bad(f"chat template: {e}", param) from None
            return self._checked(ids, param)
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
        return self._checked(ids, param)

    def _checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad("the prompt is empty", param)
        if self.context and len(ids) > self.context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, past the model's context of "
                                f"{self.context} tokens (max_position_embeddings)", param=param,
                           code="context_length_exceeded")
        return ids

    def submit(self, ids, sampling, stop, max_new_tokens, logprobs: int | None = None) -> Job:
        job = Job(ids, sampling, stop, max_new_tokens, asyncio.get_running_loop(), logprobs)
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
    out = {"text": [], "stats": None, "reason": None, "error": None, "logprobs": []}
    try:
        async for kind, val in _items(job):
            if kind == "token":
                out["text"].append(val.text)
                if val.logprobs is not None:
                    out["logprobs"].append((val.id, val.logprobs))
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

OPENAI_UNSUPPORTED = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {},
                      "response_format": {"type": "text"}, "audio": None, "prediction": None}


def _chat_logprobs(body: dict) -> int | None:
    """``logprobs: true`` (+ ``top_logprobs`` 0..20): the alternatives each token reports; None: off."""
    want = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if want else None


def _openai_call(call: dict) -> dict:
    return {"id": call_id("openai"), "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def _finish(reason, calls: int) -> str:
    if calls and reason not in ("length", "context"):
        return "tool_calls"
    return OPENAI_FINISH.get(reason, "stop")


def _chat_messages(body: dict, tools: bool = False) -> list[dict]:
    """The messages for the chat template; with tools, a "tool" message (a call's result) and an
    assistant message's ``tool_calls`` travel as transformers' templates read them."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role {role!r} is not supported (system, developer, user, "
                      f"assistant, tool)", "messages")
        if (role == "tool" or m.get("tool_calls")) and not tools:
            raise bad(f"messages[{i}] is a tool {'result' if role == 'tool' else 'call'}: send the "
                      f"request's 'tools' too", "messages")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        msg = {"role": role, "content": text_content(content, f"messages[{i}].content")}
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = string(m, "tool_call_id")
            if m.get("name") is not None:
                msg["name"] = string(m, "name")
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"messages[{i}].tool_calls must be an array on an assistant message", "messages")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    raise bad(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}}", "messages")
                msg["tool_calls"].append({"id": c.get("id") if isinstance(c.get("id"), str) else call_id(),
                                          "type": "function", "function": {
                                              "name": f["name"],
                                              "arguments": arguments_object(f.get("arguments"), f"{where}.function.arguments")}})
        out.append(msg)
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
    tools, parse = openai_tools(body)
    state.check_tools(tools)
    max_calls = None if boolean(body, "parallel_tool_calls", True) else 1
    messages = _chat_messages(body, tools is not None)
    top = _chat_logprobs(body)
    stream = boolean(body, "stream")
    include_usage = _stream_usage(body) if stream else False
    sampling = state.sampling(body, 2.0)
    stop = stops(body, "stop")
    ids = await state.tokenize(messages, tools=tools)
    max_new = state.max_tokens(body, ("max_completion_tokens", "max_tokens"), len(ids))
    job = state.submit(ids, sampling, stop, max_new, top)
    tt = TokenText(state.engine.tokenizer) if top is not None else None
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if not stream:
        t0 = time.monotonic()
        r = await _collect(state, request, job)
        state.metrics.observe("/v1/chat/completions", time.monotonic() - t0)
        p, c, cached = _usage_counts(r["stats"], ids)
        text, reasoning = r["text"], None
        mode = state.think_mode(ids)
        if mode is not None:             # the thinking goes apart, as vLLM / DeepSeek return it
            thinking, answer, _ = split_think(text, mode, final=True, loose=False)
            if thinking is not None:
                text, reasoning = answer, thinking
        content, calls = split_reply(text, max_calls) if parse else (text, [])
        message = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [_openai_call(x) for x in calls]
        lp = ({"content": [chat_entries(tt, v, i) for i, v in r["logprobs"]], "refusal": None}
              if tt is not None else None)
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": lp,
                         "finish_reason": _finish(r["reason"], len(calls))}],
            "usage": _openai_usage(p, c, cached), "system_fingerprint": None})

    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None}

    def chunk(delta, finish=None, logprobs=None):
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    mode = state.think_mode(ids)
    frames = _chat_frames(job, ids, head, include_usage, chunk, ReplyAssembler(max_calls) if parse else None, tt,
                          ThinkSplitter(mode) if mode is not None else None)
    return _streaming(state, job, "/v1/chat/completions", frames)


async def _chat_frames(job, ids, head: dict, include_usage: bool, chunk, assembler, tt, splitter=None):
    """A chat stream: the role, then content deltas and tool_call deltas (one per call: its id,
    name and whole arguments) as the assembler parts them; logprobs entries ride on the next
    chunk going out (an empty content delta while text is held back). With a ``splitter`` (the
    template thinks) the thinking goes out first as ``reasoning_content`` deltas."""
    yield _sse(chunk({"role": "assistant", "content": ""}))
    stats, reason, pending, ncalls = None, None, [], 0

    def lp():
        nonlocal pending
        if tt is None:
            return None
        out, pending = {"content": pending, "refusal": None}, []
        return out

    def frames_for(parts):
        nonlocal ncalls
        for k, v in parts:
            if k == "text":
                yield _sse(chunk({"content": v}, logprobs=lp()))
            else:
                yield _sse(chunk({"tool_calls": [{"index": ncalls, **_openai_call(v)}]}, logprobs=lp()))
                ncalls += 1
    async for kind, val in _items(job):
        if kind == "token":
            if tt is not None and val.logprobs is not None:
                pending.append(chat_entries(tt, val.logprobs, val.id))
            piece = val.text
            if splitter is not None and piece:
                thought, piece = splitter.feed(piece)
                if thought:
                    yield _sse(chunk({"reasoning_content": thought}, logprobs=lp()))
            parts = (assembler.feed(piece) if assembler is not None
                     else [("text", piece)] if piece else [])
            for f in frames_for(parts):
                yield f
            if pending:
                yield _sse(chunk({"content": ""}, logprobs=lp()))
        elif kind == "stats":
            stats = val
        elif kind == "done":
            reason = val
        elif kind == "error":
            yield _sse(_openai_error_body(val[0], val[1]))
            return
    if splitter is not None:
        thought, piece = splitter.flush()
        if thought:
            yield _sse(chunk({"reasoning_content": thought}))
        for f in frames_for(assembler.feed(piece) if assembler is not None else
                            [("text", piece)] if piece else []):
            yield f
    if assembler is not None:
        for f in frames_for(assembler.flush()):
            yield f
    yield _sse(chunk({}, _finish(reason, ncalls)))
    if include_usage:
        p, c, cached = _usage_counts(stats, ids)
        yield _sse({**head, "choices": [], "usage": _openai_usage(p, c, cached)})
    yield "data: [DONE]\n\n"


async def _openai_frames(job, ids, head: dict, include_usage: bool, text, final, logprobs=None):
    """A completions stream's SSE frames: ``text(piece, logprobs)`` per token, ``final(finish_reason)``,
    the usage chunk when asked (``head`` + empty choices), then [DONE]; an error mid-stream is one
    error frame. ``logprobs``: a CompletionLogprobs when asked."""
    stats, reason = None, None
    async for kind, val in _items(job):
        if kind == "token" and (val.text or (logprobs is not None and val.logprobs is not None)):
            lp = (logprobs.take([(val.id, val.logprobs)]) if logprobs is not None and val.logprobs is not None
                  else None)
            yield _sse(text(val.text, lp))
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
    refuse_unsupported(body, {**OPENAI_UNSUPPORTED, "tools": [], "tool_choice": "none", "echo": False,
                              "suffix": "", "best_of": 1})
    top = integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)     # the legacy API: an integer
    prompt = _completion_prompt(body)
    stream = boolean(body, "stream")
    include_usage = _stream_usage(body) if stream else False
    sampling = state.sampling(body, 2.0)
    stop = stops(body, "stop")
    ids = await state.tokenize(prompt, raw=True, param="prompt")
    max_new = state.max_tokens(body, ("max_tokens",), len(ids), default=16)     # the API's default
    job = state.submit(ids, sampling, stop, max_new, top)
    clp = CompletionLogprobs(TokenText(state.engine.tokenizer)) if top is not None else None
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def choice(text, finish, logprobs=None):
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
    if not stream:
        t0 = time.monotonic()
        r = await _collect(state, request, job)
        state.metrics.observe("/v1/completions", time.monotonic() - t0)
        p, c, cached = _usage_counts(r["stats"], ids)
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [choice(r["text"], OPENAI_FINISH.get(r["reason"], "stop"),
                                                clp.take(r["logprobs"]) if clp is not None else None)],
                             "usage": _openai_usage(p, c, cached), "system_fingerprint": None})

    head = {"id": cid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None}
    frames = _openai_frames(job, ids, head, include_usage,
                            text=lambda t, lp: {**head, "choices": [choice(t, None, lp)]},
                            final=lambda f: {**head, "choices": [choice("", f)]}, logprobs=clp)
    return _streaming(state, job, "/v1/completions", frames)


# --- Anthropic -------------------------------------------------------------------------------------

def _anthropic_turn(role: str, content, where: str, tools: bool) -> list[dict]:
    """One Anthropic message as the template's messages: text blocks join; an assistant's
    ``tool_use`` blocks become its ``tool_calls``; a user's ``tool_result`` blocks become
    "tool" messages (before the user's text, in their order); an assistant's ``thinking`` block
    (as this server returned it) becomes its ``reasoning_content``, a ``redacted_thinking`` one is
    dropped."""
    if isinstance(content, str) or not isinstance(content, list):
        return [{"role": role, "content": text_content(content, where)}]
    text, calls, results, reasoning = [], [], [], []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("thinking", "redacted_thinking") and role == "assistant":
            if kind == "thinking" and isinstance(part.get("thinking"), str):
                reasoning.append(part["thinking"])
            continue
        if kind not in ("tool_use", "tool_result"):
            text.append(part)
            continue
        if not tools:
            raise bad(f"{where}[{i}] is a {kind} block: send the request's 'tools' too")
        if kind == "tool_use":
            if role != "assistant" or not isinstance(part.get("name"), str):
                raise bad(f"{where}[{i}]: a tool_use block belongs to an assistant message and has a 'name'")
            calls.append({"id": part.get("id") if isinstance(part.get("id"), str) else call_id("anthropic"),
                          "type": "function", "function": {
                              "name": part["name"], "arguments": arguments_object(part.get("input", {}), f"{where}[{i}].input")}})
        else:
            if role != "user":
                raise bad(f"{where}[{i}]: a tool_result block belongs to a user message")
            body = part.get("content", "")
            msg = {"role": "tool", "content": text_content(body if body is not None else "", f"{where}[{i}].content")}
            if isinstance(part.get("tool_use_id"), str):
                msg["tool_call_id"] = part["tool_use_id"]
            results.append(msg)
    out = list(results)
    joined = text_content(text, where) if text else ""
    if role == "assistant":
        msg = {"role": "assistant", "content": joined}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif text or not results:
        out.append({"role": "user", "content": joined})
    return out


def _anthropic_messages(body: dict, tools: bool = False) -> list[dict]:
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
        out.extend(_anthropic_turn(role, m.get("content"), f"messages[{i}].content", tools))
    if out[-1]["role"] not in ("user", "tool"):
        raise bad("the last message must be the user's (continuing a partial assistant reply is not "
                  "supported)")
    return out


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call_id("anthropic"), "name": call["name"], "input": call["arguments"]}


def _anthropic_thinking(body: dict) -> bool:
    """Whether the client asks for thinking blocks (``{"type": "enabled", "budget_tokens": n}``
    or ``"adaptive"``); ``disabled`` or absent: no."""
    v = body.get("thinking")
    if v is None:
        return False
    if not isinstance(v, dict) or v.get("type") not in ("enabled", "adaptive", "disabled"):
        raise bad("'thinking' must be an object with type 'enabled', 'adaptive' or 'disabled'", "thinking")
    return v["type"] != "disabled"


async def messages(request: Request, state: ServeState) -> Response:
    body = await _read_json(request)
    model = state.check_model(body)
    wants_thinking = _anthropic_thinking(body)
    tools, parse = anthropic_tools(body)
    state.check_tools(tools)
    choice = body.get("tool_choice")
    max_calls = 1 if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True else None
    msgs = _anthropic_messages(body, tools is not None)
    stream = boolean(body, "stream")
    sampling = state.sampling(body, 1.0)
    stop = stops(body, "stop_sequences")
    ids = await state.tokenize(msgs, tools=tools)
    max_new = state.max_tokens(body, ("max_tokens",), len(ids), required=True)
    mode = state.think_mode(ids) if wants_thinking else None
    if wants_thinking and mode is None:
        raise bad("'thinking' is not supported by this model: its chat template writes no <think>", "thinking")
    job = state.submit(ids, sampling, stop, max_new)
    mid = f"msg_{uuid.uuid4().hex}"

    def stop_reason(reason, calls: int) -> str:
        if calls and reason not in ("length", "context"):
            return "tool_use"
        return ANTHROPIC_STOP.get(reason, "end_turn")
    if not stream:
        t0 = time.monotonic()
        r = await _collect(state, request, job)
        state.metrics.observe("/v1/messages", time.monotonic() - t0)
        p, c, cached = _usage_counts(r["stats"], ids)
        text, thought = r["text"], []
        if mode is not None:
            thinking, answer, _ = split_think(text, mode, final=True, loose=False)
            if thinking is not None:
                text, thought = answer, [{"type": "thinking", "thinking": thinking, "signature": ""}]
        text, calls = split_reply(text, max_calls) if parse else (text, [])
        reason = stop_reason(r["reason"], len(calls))
        content = thought + ([{"type": "text", "text": text}] if text or not calls else []) + \
            [_tool_use(x) for x in calls]
        return JSONResponse({
            "id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason,
            "stop_sequence": state.stop_sequence(job, stop) if reason == "stop_sequence" else None,
            "usage": _anthropic_usage(p, c, cached)})

    assembler = ReplyAssembler(max_calls) if parse else None

    async def frames():
        yield _event("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
        splitter = ThinkSplitter(mode) if mode is not None else None
        yield _event("content_block_start", {"type": "content_block_start", "index": 0, "content_block":
                     {"type": "thinking", "thinking": "", "signature": ""} if splitter else {"type": "text", "text": ""}})
        yield _event("ping", {"type": "ping"})
        stats, reason = None, None
        at, text_open, ncalls = 0, splitter is None, 0       # the block index; whether a text block is open
        thinking_open = splitter is not None

        def end_thinking():
            nonlocal thinking_open
            if thinking_open:
                thinking_open = False
                yield _event("content_block_delta", {"type": "content_block_delta", "index": at,
                                                     "delta": {"type": "signature_delta", "signature": ""}})
                yield _event("content_block_stop", {"type": "content_block_stop", "index": at})

        def thought_and_text(piece, final=False):
            """The thinking deltas of ``piece``; then what the answer blocks get."""
            thought, piece = splitter.flush() if final else splitter.feed(piece)
            if thought and thinking_open:
                yield _event("content_block_delta", {"type": "content_block_delta", "index": at,
                                                     "delta": {"type": "thinking_delta", "thinking": thought}})
            if piece:
                for f in end_thinking():
                    yield f
                for f in blocks(assembler.feed(piece) if assembler is not None else [("text", piece)]):
                    yield f

        def blocks(parts):
            nonlocal at, text_open, ncalls
            for k, v in parts:
                if k == "text":
                    if not text_open:
                        at, text_open = at + 1, True
                        yield _event("content_block_start", {"type": "content_block_start", "index": at,
                                                             "content_block": {"type": "text", "text": ""}})
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": at,
                                                         "delta": {"type": "text_delta", "text": v}})
                    continue
                if text_open:
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": at})
                    text_open = False
                at += 1
                ncalls += 1
                block = _tool_use(v)
                yield _event("content_block_start", {"type": "content_block_start", "index": at,
                                                     "content_block": {**block, "input": {}}})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": at, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                yield _event("content_block_stop", {"type": "content_block_stop", "index": at})
        async for kind, val in _items(job):
            if kind == "token" and val.text and splitter is not None:
                for f in thought_and_text(val.text):
                    yield f
            elif kind == "token" and val.text:
                for f in blocks(assembler.feed(val.text) if assembler is not None else [("text", val.text)]):
                    yield f
            elif kind == "stats":
                stats = val
            elif kind == "done":
                reason = val
            elif kind == "error":
                yield _event("error", _anthropic_error_body(val[0], val[1]))
                return
        if splitter is not None:
            for f in thought_and_text("", final=True):
                yield f
            for f in end_thinking():
                yield f
        if assembler is not None:
            for f in blocks(assembler.flush()):
                yield f
        if text_open:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": at})
        why = stop_reason(reason, ncalls)
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
              cors_origins: tuple[str, ...] | list[str] = (), log=None, lock=None) -> Starlette:
    """The ASGI app; ``app.state.serve`` holds the worker (close it with ``app.state.serve.worker.close()``).
    ``lock``: held by the worker while it generates (the app's chat shares the engine)."""
    model_id = model_id or Path(engine.container.path).name
    state = ServeState(engine, model_id, api_key, max_queue, log, lock)
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
