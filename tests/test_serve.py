"""`coli serve`: the official openai and anthropic clients against a real server on 127.0.0.1
(uvicorn in a thread, a free port), raw HTTP (httpx) for the bad cases, and the command itself
in a subprocess."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, one_error_line, tiny_app_container

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

DEMO = "qwen3-moe-demo"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from tests.conftest import server_env
    yield from server_env(tmp_path_factory, "serve-env")


@pytest.fixture(scope="module")
def demo(env):
    from models import default_model, open_model
    e = open_model(default_model(), threads=1)
    yield e
    e.container.close()


@pytest.fixture(scope="module")
def endless_dir(env, tmp_path_factory):
    """A tiny container whose eos id is never produced: replies run to max_tokens."""
    return tiny_app_container(tmp_path_factory.mktemp("endless"), "endless", unreachable_eos=True)


@pytest.fixture(scope="module")
def endless(endless_dir):
    from models import open_model
    e = open_model(endless_dir, threads=1)
    yield e
    e.container.close()


class Served:
    """build_app(engine, **kw) served by uvicorn on 127.0.0.1:<free port> in a thread."""

    def __init__(self, engine, **kw):
        from colibri_tui.server import listen, make_server
        from colibri_tui.server.app import build_app
        self.app = build_app(engine, **kw)
        self.state = self.app.state.serve
        sock = listen("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 10, "the server did not start"
            time.sleep(0.01)

    def openai(self, key="none", **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def anthropic(self, key="none", **kw):
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, **kw)

    def health(self, **kw):
        r = httpx.get(self.url + "/health", timeout=5, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    def wait(self, cond, timeout=10.0):
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout, "timed out"
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.state.worker.close()
        self.thread.join(10)


@pytest.fixture
def serve():
    made = []

    def start(engine, **kw) -> Served:
        s = Served(engine, **kw)
        made.append(s)
        return s
    yield start
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def demo_server(demo):
    s = Served(demo)
    yield s
    s.close()


def direct(engine, messages, **kw):
    """The engine's reply without the server."""
    from core.events import Token
    return "".join(ev.text for ev in engine.generate(messages, **kw) if isinstance(ev, Token))


FORTUNE = [{"role": "user", "content": "Tell me a fortune"}]


# --- OpenAI: chat completions -----------------------------------------------------------------

def test_chat_completion_matches_the_engine_with_the_same_sampling(demo_server, demo):
    from core.sampling import SamplingParams
    c = demo_server.openai()
    r = c.chat.completions.create(model=DEMO, messages=FORTUNE, max_tokens=24, temperature=0.9,
                                  top_p=0.9, seed=7, extra_body={"top_k": 20})
    want = direct(demo, FORTUNE, sampling=SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7),
                  max_new_tokens=24)
    assert r.choices[0].message.content == want and want
    assert r.choices[0].message.role == "assistant"
    assert r.model == DEMO and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(demo.prompt_ids(FORTUNE))
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 24 else "stop")
    # another seed, another sample; temperature 0 is greedy
    other = c.chat.completions.create(model=DEMO, messages=FORTUNE, max_tokens=24, temperature=0.9,
                                      top_p=0.9, seed=8, extra_body={"top_k": 20})
    assert other.choices[0].message.content != want
    # no sampling fields: the model's generation_config.json (the demo's: temperature 0.8, top_p 0.95)
    plain = c.chat.completions.create(model=DEMO, messages=FORTUNE, max_tokens=24, seed=7)
    assert plain.choices[0].message.content == direct(
        demo, FORTUNE, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7), max_new_tokens=24)
    greedy = c.chat.completions.create(model=DEMO, messages=FORTUNE, max_tokens=24, temperature=0)
    assert greedy.choices[0].message.content == direct(demo, FORTUNE, sampling=SamplingParams(greedy=True),
                                                       max_new_tokens=24)


def test_chat_stream_carries_the_same_text_finish_reason_and_usage(demo_server):
    c = demo_server.openai()
    kw = dict(model=DEMO, messages=FORTUNE, max_tokens=20, temperature=0.8, seed=3)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1    # streamed
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # without stream_options no usage chunk
    plain = list(c.chat.completions.create(stream=True, **kw))
    assert all(ch.usage is None for ch in plain) and all(ch.choices for ch in plain)


def test_stop_strings_end_the_reply_before_them(demo_server, demo):
    from core.sampling import SamplingParams
    c = demo_server.openai()
    full = direct(demo, FORTUNE, sampling=SamplingParams(greedy=True), max_new_tokens=40)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop.strip()) >= 2, full
    r = c.chat.completions.create(model=DEMO, messages=FORTUNE, max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    s = c.chat.completions.create(model=DEMO, messages=FORTUNE, max_tokens=40, temperature=0, stop=stop, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s) == full[: full.index(stop)]


def test_max_tokens_bounds_the_reply(serve, endless):
    s = serve(endless)
    r = s.openai().chat.completions.create(model="endless", messages=FORTUNE, max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = s.openai().chat.completions.create(model="endless", messages=FORTUNE, max_completion_tokens=5)
    assert r.usage.completion_tokens == 5


def test_models_lists_the_served_model_for_both_clients(demo_server):
    models = demo_server.openai().models.list()
    assert [m.id for m in models.data] == [DEMO]
    assert demo_server.openai().models.retrieve(DEMO).id == DEMO
    with pytest.raises(openai.NotFoundError):
        demo_server.openai().models.retrieve("nope")
    assert [m.id for m in demo_server.anthropic().models.list().data] == [DEMO]


def test_model_name_sets_the_id_clients_send(serve, demo):
    s = serve(demo, model_id="my-model")
    assert [m.id for m in s.openai().models.list().data] == ["my-model"]
    assert s.openai().chat.completions.create(model="my-model", messages=FORTUNE, max_tokens=2).model == "my-model"
    with pytest.raises(openai.NotFoundError):
        s.openai().chat.completions.create(model=DEMO, messages=FORTUNE, max_tokens=2)


def test_an_unknown_model_is_refused_naming_the_served_one(demo_server):
    with pytest.raises(openai.NotFoundError) as e:
        demo_server.openai().chat.completions.create(model="gpt-4o", messages=FORTUNE)
    assert DEMO in str(e.value) and "gpt-4o" in str(e.value)
    with pytest.raises(anthropic.NotFoundError):
        demo_server.anthropic().messages.create(model="claude", max_tokens=5, messages=FORTUNE)


# --- bad input: raw HTTP ------------------------------------------------------------------------

def _post(s, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(s.url + path, content=data, headers={"content-type": "application/json"}, timeout=30, **kw)


def _error(r, status=400) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    assert "Traceback" not in r.text
    body = r.json()
    if body.get("type") == "error":          # Anthropic's shape
        return body["error"]["message"]
    return body["error"]["message"]


OK_CHAT = {"model": DEMO, "messages": FORTUNE, "max_tokens": 2}


@pytest.mark.parametrize("body, says", [
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    (b"\xff\xfe\x00", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"messages": FORTUNE}, "'model' is required"),
    ({**OK_CHAT, "model": 3}, "'model' must be a string"),
    ({**OK_CHAT, "messages": "hi"}, "'messages' must be a non-empty array"),
    ({**OK_CHAT, "messages": []}, "'messages' must be a non-empty array"),
    ({**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "role 'wizard'"),
    ({**OK_CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text content"),
    ({**OK_CHAT, "temperature": "hot"}, "'temperature' must be a number"),
    ({**OK_CHAT, "temperature": 3}, "'temperature' must be between 0 and 2"),
    ({**OK_CHAT, "top_p": 0}, "'top_p' must be greater than 0"),
    ({**OK_CHAT, "top_k": -1}, "'top_k' must be >= 0"),
    ({**OK_CHAT, "seed": -1}, "'seed' must be >= 0"),
    ({**OK_CHAT, "seed": True}, "'seed' must be an integer"),
    ({**OK_CHAT, "max_tokens": 1.5}, "'max_tokens' must be an integer"),
    ({**OK_CHAT, "max_tokens": 0}, "'max_tokens' must be >= 1"),
    ({**OK_CHAT, "max_tokens": 10 ** 9}, "max_position_embeddings"),
    ({**OK_CHAT, "stream": "yes"}, "'stream' must be a boolean"),
    ({**OK_CHAT, "stop": [1]}, "'stop' must be a string or an array of strings"),
    ({**OK_CHAT, "stop": "x" * 257}, "longer than 256 characters"),
    ({**OK_CHAT, "stop": ["a"] * 17}, "at most 16"),
    ({**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "'tools' is not supported"),
    ({**OK_CHAT, "n": 2}, "'n' is not supported"),
    ({**OK_CHAT, "logprobs": True, "top_logprobs": 21}, "'top_logprobs' is 21, more than 20"),
    ({**OK_CHAT, "top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
    ({**OK_CHAT, "stream": True, "stream_options": {"include_usage": "y"}}, "'include_usage' must be a boolean"),
])
def test_bad_chat_requests_get_a_400_with_a_clear_message(demo_server, body, says):
    r = _post(demo_server, "/v1/chat/completions", body)
    assert says in _error(r), r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_prompt_past_the_context_is_a_400_naming_it(demo_server, demo):
    long = " ".join(["fortune"] * 1200)
    assert len(demo.prompt_ids([{"role": "user", "content": long}])) > demo.spec.max_position_embeddings
    r = _post(demo_server, "/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": long}]})
    msg = _error(r)
    assert "max_position_embeddings" in msg and "1024" in msg
    assert r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="max_position_embeddings"):
        demo_server.openai().completions.create(model=DEMO, prompt=long, max_tokens=2)
    r = _post(demo_server, "/v1/messages", {"model": DEMO, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": long}]})
    assert "max_position_embeddings" in _error(r) and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_routes_methods_and_huge_bodies_are_json_errors(demo_server):
    assert "no route" in _error(httpx.get(demo_server.url + "/v2/nothing"), 404)
    assert "not allowed" in _error(httpx.get(demo_server.url + "/v1/chat/completions"), 405)
    r = _post(demo_server, "/v1/chat/completions", b"x" * (17 * 1024 * 1024))
    assert "larger than" in _error(r, 413)


# --- authentication, host, CORS ---------------------------------------------------------------------

def test_an_api_key_is_required_on_every_route(serve, demo):
    s = serve(demo, api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        s.openai(key="wrong").chat.completions.create(model=DEMO, messages=FORTUNE, max_tokens=2)
    assert s.openai(key="s3cret").chat.completions.create(model=DEMO, messages=FORTUNE, max_tokens=2).choices
    with pytest.raises(anthropic.AuthenticationError):
        s.anthropic(key="s3cre").messages.create(model=DEMO, max_tokens=2, messages=FORTUNE)
    assert s.anthropic(key="s3cret").messages.create(model=DEMO, max_tokens=2, messages=FORTUNE).content
    for path in ("/health", "/metrics", "/v1/models"):
        r = httpx.get(s.url + path)
        assert "API key" in _error(r, 401), path
        assert httpx.get(s.url + path, headers={"x-api-key": "s3cret"}).status_code == 200
        assert httpx.get(s.url + path, headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(s.url + path, headers={"authorization": "Bearer s3cret2"}).status_code == 401
    r = _post(s, "/v1/messages", {"model": DEMO, "max_tokens": 2, "messages": FORTUNE})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_the_key_is_compared_in_constant_time(serve, demo, monkeypatch):
    import hmac

    from colibri_tui.server import app
    seen, real = [], hmac.compare_digest

    def compare(a, b):
        seen.append((a, b))
        return real(a, b)
    monkeypatch.setattr(app.hmac, "compare_digest", compare)
    s = serve(demo, api_key="s3cret")
    assert httpx.get(s.url + "/health", headers={"authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(s.url + "/health", headers={"x-api-key": "s3cret"}).status_code == 200
    assert seen == [(b"nope", b"s3cret"), (b"s3cret", b"s3cret")]


def test_another_host_needs_a_key_or_insecure_no_key(env, capsys):
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        line = one_error_line(capsys, ["serve", "--host", host, "--port", "0"])
        assert "--api-key" in line and "--insecure-no-key" in line and host in line
    from colibri_tui.cli import build_parser
    from colibri_tui.server import check_args, is_loopback
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2", "[::1]"))
    p = build_parser()
    check_args(p.parse_args(["serve", "--host", "0.0.0.0", "--api-key", "k"]))
    check_args(p.parse_args(["serve", "--host", "0.0.0.0", "--insecure-no-key"]))
    assert "--max-queue" in one_error_line(capsys, ["serve", "--max-queue", "-1"])
    assert "--port" in one_error_line(capsys, ["serve", "--port", "70000"])


def test_cors_is_off_unless_an_origin_is_given(serve, demo):
    pre = {"origin": "http://app.example", "access-control-request-method": "POST",
           "access-control-request-headers": "content-type,authorization"}
    off = serve(demo)
    r = httpx.options(off.url + "/v1/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(off.url + "/v1/models", headers={"origin": "http://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    on = serve(demo, cors_origins=["http://app.example"])
    r = httpx.options(on.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(on.url + "/v1/chat/completions", headers={**pre, "origin": "http://evil.example"})
    assert r.headers.get("access-control-allow-origin") != "http://evil.example"
    r = httpx.get(on.url + "/v1/models", headers={"origin": "http://app.example"})
    assert r.headers["access-control-allow-origin"] == "http://app.example"


# --- one at a time: the queue, disconnects ----------------------------------------------------------

def _start_stream(s, max_tokens=30000):
    """A long streamed request on its own connection; returns (client, response, lines) once
    three tokens arrived. Keep ``lines``: a line iterator that is garbage-collected closes the
    connection (httpcore closes it on GeneratorExit), which the server rightly takes for a
    client gone."""
    client = httpx.Client(timeout=30)
    req = client.build_request("POST", s.url + "/v1/chat/completions",
                               json={"model": "endless", "messages": FORTUNE, "max_tokens": max_tokens,
                                     "stream": True})
    resp = client.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    got = 0
    for line in lines:
        if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
            got += 1
            if got >= 3:
                break
    return client, resp, lines


def test_a_client_that_disconnects_mid_stream_stops_its_generation(serve, endless):
    s = serve(endless)
    client, resp, lines = _start_stream(s)
    assert s.health()["queue"]["decoding"] is True
    resp.close()
    client.close()
    s.wait(lambda: not s.health()["queue"]["decoding"], timeout=5)
    job = s.state.worker.finished[-1]
    assert job.cancelled and job.tokens < 30000
    assert job.tokens - job.tokens_at_cancel <= 1        # within one token of the cancel
    assert s.health()["requests"]["cancelled"] == 1
    # the engine is free again: the next request is answered in full
    r = s.openai().chat.completions.create(model="endless", messages=FORTUNE, max_tokens=4)
    assert r.usage.completion_tokens == 4


def test_a_non_streaming_client_that_goes_away_is_cancelled_too(serve, endless):
    s = serve(endless)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/completions", json={"model": "endless", "prompt": "hello", "max_tokens": 30000},
                   timeout=httpx.Timeout(30, read=0.5))
    s.wait(lambda: not s.health()["queue"]["decoding"], timeout=5)
    job = s.state.worker.finished[-1]
    assert job.cancelled and job.tokens < 30000 and job.tokens - job.tokens_at_cancel <= 1


def _asgi_tasks(s) -> int:
    """Requests the server is still handling (its tasks running an ASGI cycle)."""
    import asyncio
    loop = s.server.servers[0].get_loop()

    async def count():
        return sum("run_asgi" in repr(t.get_coro()) for t in asyncio.all_tasks())
    return asyncio.run_coroutine_threadsafe(count(), loop).result(5)


def test_a_waiting_client_that_goes_away_leaves_the_queue(serve, endless):
    s = serve(endless, max_queue=2)
    client, resp, lines = _start_stream(s)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/chat/completions", json={"model": "endless", "messages": FORTUNE, "max_tokens": 2},
                   timeout=httpx.Timeout(30, read=0.5))
    s.wait(lambda: s.health()["queue"]["waiting"] == 0, timeout=5)
    assert s.health()["queue"]["decoding"] is True       # the first one goes on
    assert s.health()["requests"]["cancelled"] == 1
    # and a streamed one that waits
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", s.url + "/v1/chat/completions",
                      json={"model": "endless", "messages": FORTUNE, "max_tokens": 2, "stream": True}) as r:
            assert r.status_code == 200
            s.wait(lambda: s.health()["queue"]["waiting"] == 1)
    s.wait(lambda: s.health()["queue"]["waiting"] == 0, timeout=5)
    assert s.health()["requests"]["cancelled"] == 2 and s.health()["queue"]["decoding"] is True
    s.wait(lambda: _asgi_tasks(s) == 1)       # only the decoding stream's: no handler left waiting
    resp.close()
    client.close()


def test_a_full_queue_answers_429_with_retry_after(serve, endless):
    s = serve(endless, max_queue=1)
    client, resp, lines = _start_stream(s)                   # decoding
    waiting = threading.Thread(target=lambda: httpx.post(
        s.url + "/v1/chat/completions", json={"model": "endless", "messages": FORTUNE, "max_tokens": 2},
        timeout=30), daemon=True)
    waiting.start()                                   # queued behind it
    s.wait(lambda: s.health()["queue"]["waiting"] == 1)
    r = _post(s, "/v1/chat/completions", {"model": "endless", "messages": FORTUNE, "max_tokens": 2})
    assert "busy" in _error(r, 429) and r.json()["error"]["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        s.openai().chat.completions.create(model="endless", messages=FORTUNE, max_tokens=2)
    with pytest.raises(anthropic.RateLimitError):
        s.anthropic().messages.create(model="endless", max_tokens=2, messages=FORTUNE)
    assert s.health()["requests"]["rejected"] == 3
    resp.close()
    client.close()                                    # the waiting one runs, then all is idle
    waiting.join(10)
    s.wait(lambda: s.health()["queue"] == {"decoding": False, "waiting": 0, "max_queue": 1})
    assert s.health()["requests"]["served"] == 1


def test_health_answers_while_a_reply_is_generated(serve, endless):
    s = serve(endless)
    client, resp, lines = _start_stream(s)
    worst = 0.0
    for _ in range(10):
        t0 = time.perf_counter()
        h = s.health()
        worst = max(worst, time.perf_counter() - t0)
        assert h["queue"]["decoding"] is True
    assert worst < 2.0
    assert {"hits", "misses", "hit_rate", "bytes_read"} <= set(h["store"])
    resp.close()
    client.close()


# --- OpenAI: completions ---------------------------------------------------------------------------

def test_completions_take_raw_text_and_token_ids(demo_server, demo):
    from core.sampling import SamplingParams
    c = demo_server.openai()
    r = c.completions.create(model=DEMO, prompt="Once upon a time", max_tokens=12, temperature=0)
    want = direct(demo, "Once upon a time", sampling=SamplingParams(greedy=True), max_new_tokens=12, raw=True)
    assert r.choices[0].text == want and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(demo.prompt_ids("Once upon a time", raw=True))
    ids = demo.prompt_ids("Once upon a time", raw=True)
    assert c.completions.create(model=DEMO, prompt=ids, max_tokens=12, temperature=0).choices[0].text == want
    assert "".join(ch.choices[0].text for ch in c.completions.create(
        model=DEMO, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True)) == want
    d = c.completions.create(model=DEMO, prompt="Once upon a time", temperature=0)      # default 16
    assert d.usage.completion_tokens <= 16
    for body, says in (({"prompt": [10 ** 7]}, "out of range"), ({"prompt": ["a", "b"]}, "one prompt"),
                       ({"prompt": 5}, "'prompt' must be"), ({"prompt": "x", "echo": True}, "'echo'")):
        assert says in _error(_post(demo_server, "/v1/completions", {"model": DEMO, **body}))


# --- Anthropic -----------------------------------------------------------------------------------

def test_anthropic_messages_with_system_stop_sequences_and_streaming(demo_server, demo):
    from core.sampling import SamplingParams
    c = demo_server.anthropic()
    system = "You are a fortune teller."
    r = c.messages.create(model=DEMO, max_tokens=30, system=system, messages=FORTUNE, extra_body={"temperature": 0})
    msgs = [{"role": "system", "content": system}] + FORTUNE
    want = direct(demo, msgs, sampling=SamplingParams(greedy=True), max_new_tokens=30)
    assert r.content[0].type == "text" and r.content[0].text == want and want
    # computed + read from the cache (a prefix earlier requests shared: prefix reuse)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(demo.prompt_ids(msgs))
    assert r.usage.output_tokens >= 1 and r.role == "assistant" and r.model == DEMO
    assert r.stop_reason == ("max_tokens" if r.usage.output_tokens == 30 else "end_turn")
    with c.messages.stream(model=DEMO, max_tokens=30, system=system, messages=FORTUNE, extra_body={"temperature": 0}) as st:
        pieces = list(st.text_stream)
        final = st.get_final_message()
    assert "".join(pieces) == want and len(pieces) > 1
    assert final.usage.output_tokens == r.usage.output_tokens and final.stop_reason == r.stop_reason
    stop = want[len(want) // 2: len(want) // 2 + 3]
    r = c.messages.create(model=DEMO, max_tokens=30, system=system, messages=FORTUNE, stop_sequences=["@@", stop],
                          extra_body={"temperature": 0})
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == want[: want.index(stop)]
    # the current client has no sampling arguments: temperature, top_p, top_k (and colibrì's seed)
    # travel as extra body fields
    a = c.messages.create(model=DEMO, max_tokens=20, messages=FORTUNE, extra_body={"temperature": 1, "seed": 5})
    b = c.messages.create(model=DEMO, max_tokens=20, messages=FORTUNE, extra_body={"temperature": 1, "seed": 5})
    assert a.content[0].text == b.content[0].text


@pytest.mark.parametrize("body, says", [
    ({"model": DEMO, "messages": FORTUNE}, "'max_tokens' is required"),
    ({"model": DEMO, "max_tokens": 5, "messages": FORTUNE, "temperature": 1.5}, "between 0 and 1"),
    ({"model": DEMO, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "'user' or 'assistant'"),
    ({"model": DEMO, "max_tokens": 5, "messages": FORTUNE + [{"role": "assistant", "content": "Sure"}]},
     "last message"),
    ({"model": DEMO, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "only text content"),
    ({"model": DEMO, "max_tokens": 5, "messages": FORTUNE, "tools": [{"name": "f"}]}, "'tools'"),
    ({"model": DEMO, "max_tokens": 5000, "messages": FORTUNE}, "max_position_embeddings"),
])
def test_bad_anthropic_requests_get_anthropic_errors(demo_server, body, says):
    r = _post(demo_server, "/v1/messages", body)
    assert says in _error(r)
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


# --- metrics -------------------------------------------------------------------------------------

def test_metrics_are_prometheus_text_and_count(serve, endless):
    from prometheus_client.parser import text_string_to_metric_families
    s = serve(endless)
    c = s.openai()
    for n in (2, 3):
        c.chat.completions.create(model="endless", messages=FORTUNE, max_tokens=n)
    _post(s, "/v1/chat/completions", b"{")
    r = httpx.get(s.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    val = lambda name, **lab: sum(x.value for x in fams[name].samples
                                  if all(x.labels.get(k) == v for k, v in lab.items()) and x.name == name + "_total"
                                  or (x.name == name and all(x.labels.get(k) == v for k, v in lab.items())))
    assert val("coli_requests", route="/v1/chat/completions", code="200") == 2
    assert val("coli_requests", route="/v1/chat/completions", code="400") == 1
    assert val("coli_completion_tokens") == 5
    assert val("coli_generations", outcome="served") == 2
    assert fams["coli_request_duration_seconds"].type == "histogram"
    count = [x.value for x in fams["coli_request_duration_seconds"].samples
             if x.name.endswith("_count") and x.labels["route"] == "/v1/chat/completions"]
    assert count == [2]
    assert val("coli_decoding") == 0 and val("coli_queue_max") == 8


# --- the command ---------------------------------------------------------------------------------

def _coli(*args, env_dir: Path):
    env = {**os.environ, "COLI_DATA_DIR": str(env_dir / "data"), "COLI_CONFIG_DIR": str(env_dir / "config"),
           "COLI_LOG_DIR": str(env_dir / "logs")}
    env.pop("COLI_API_KEY", None)
    return subprocess.Popen([sys.executable, "-m", "colibri_tui", *args], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_coli_serve_prints_its_address_serves_and_stops_on_sigint(env, endless_dir):
    p = _coli("serve", "--model", str(endless_dir), "--port", "0", "--api-key", "k", env_dir=env)
    try:
        line = p.stderr.readline()
        assert line.startswith("coli: serving endless at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split(" ")[0]            # http://127.0.0.1:PORT/v1
        c = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        assert c.chat.completions.create(model="endless", messages=FORTUNE, max_tokens=3).usage.completion_tokens == 3
        # a long stream in progress: SIGINT cancels it and the process ends promptly
        stream = c.chat.completions.create(model="endless", messages=FORTUNE, max_tokens=30000, stream=True)
        next(iter(stream))
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        p.wait(10)
        assert time.monotonic() - t0 < 5
        assert "stopping the server" in p.stderr.read()
        assert p.returncode in (0, 130)
    finally:
        if p.poll() is None:
            p.kill()


def test_coli_serve_refuses_a_port_in_use(env, endless_dir):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        p = _coli("serve", "--model", str(endless_dir), "--port", str(s.getsockname()[1]), env_dir=env)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coli: error: cannot listen on 127.0.0.1:"), err


def test_the_binary_build_carries_the_server_stack():
    import importlib.util
    spec = importlib.util.spec_from_file_location("coli_build", ROOT / "installers" / "build.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    for pkg in ("uvicorn", "starlette", "anyio", "h11"):
        assert pkg in b.COLLECT_SUBMODULES, pkg


def test_the_load_benchmark_runs_clean(env, endless_dir):
    """benchmarks/serve_load.py's plumbing (not its numbers): a short run against a real server."""
    import argparse

    from benchmarks.serve_load import run
    r = run(argparse.Namespace(model=str(endless_dir), clients=3, seconds=2.0, max_tokens=6, max_queue=1))
    assert r["errors"] == 0, r["error_samples"]
    assert r["served"] >= 3 and r["health_failures"] == 0 and r["health_polls"] >= 3
    assert r["tokens"] == 6 * r["served"]            # the endless model always runs to max_tokens
    assert r["latency_p50_s"] <= r["latency_p95_s"] and r["peak_rss_bytes"] > 0
    assert r["server_counts"]["served"] == r["served"]


def test_shutting_down_cancels_the_reply_and_answers_the_waiting_with_503(serve, endless):
    s = serve(endless, max_queue=2)
    client, resp, lines = _start_stream(s)
    got = {}
    waiting = threading.Thread(target=lambda: got.setdefault("r", httpx.post(
        s.url + "/v1/chat/completions", json={"model": "endless", "messages": FORTUNE, "max_tokens": 2},
        timeout=30)), daemon=True)
    waiting.start()
    s.wait(lambda: s.health()["queue"]["waiting"] == 1)
    s.state.worker.close()
    waiting.join(10)
    assert "shutting down" in _error(got["r"], 503)
    job = s.state.worker.finished[-1]
    assert job.cancelled and job.tokens < 30000
    assert "shutting down" in _error(_post(s, "/v1/chat/completions", OK_CHAT | {"model": "endless"}), 503)
    resp.close()
    client.close()
