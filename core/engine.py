"""The family-agnostic MoE decoder: attention with a KV cache, a softmax top-k router, SwiGLU
experts served by an expert store, and the generation loop.

All activations are float32. Weights come from the container as dense float32 or int4/int8
(computed by ``core.kernels``). The families only fill in an ``ArchSpec``; tensor names follow the
Hugging Face convention shared by the supported families.
"""
from __future__ import annotations

import threading
import time
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import kernels
from .arch import ArchSpec
from .blocks.routers import SoftmaxTopK
from .cache_kinds import KV
from .container import Container, Weight
from .errors import ColiError
from .events import Done, Stats, Token
from .memory import lazy_array, peak_rss_bytes
from .planner import kv_reserved_positions
from .rope import Rope
from .sampling import Sampler, SamplingParams
from .store import ExpertFFN, ExpertStore


rms_norm = kernels.rms_norm


def expert_ffn(x: np.ndarray, ffn: ExpertFFN) -> np.ndarray:
    return kernels.matmul(kernels.silu(kernels.matmul(x, ffn.gate)) * kernels.matmul(x, ffn.up),
                          ffn.down)


class KVCache:
    """Keys and values per layer, head-major [kv_heads, capacity, D]: one head's positions are
    contiguous, which is how attention reads them (position-major put every position of a head
    on its own page at long contexts).

    The first append reserves core.planner.kv_reserved_positions (4096, or the model's maximum if
    smaller; what the automatic RAM budget keeps free for it) at once, in
    an anonymous mapping (core.memory.lazy_array): address space only until positions are
    written, so RSS grows with the context and a growing array's copies are gone (doubling from
    64 positions stalled decode for 0.3-0.4 s at 256 and 512 positions of the OLMoE geometry).
    Past the reservation it doubles.

    ``recycled``: the arrays of a finished cache (``buffers()``) to write over instead: their
    pages are mapped already (Engine.new_cache). ``dtype``: float32, or the opt-in float16 (half
    the memory and the reads of attention; keys and values rounded to half precision, so outputs
    change slightly -- see README)."""

    def __init__(self, spec: ArchSpec, recycled: tuple[list, list] | None = None, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        if recycled is not None and recycled[0][0].dtype == self.dtype:
            self.k, self.v = list(recycled[0]), list(recycled[1])
        else:
            for i, kind in enumerate(spec.cache_kinds):
                if not isinstance(kind, KV):
                    raise ColiError(f"layer {i} keeps a {kind.name} cache, which this engine does not run")
            self.k = [np.empty((kind.num_kv_heads, 0, kind.head_dim), self.dtype) for kind in spec.cache_kinds]
            self.v = [np.empty((kind.num_kv_heads, 0, kind.head_dim), self.dtype) for kind in spec.cache_kinds]
        self.length = 0     # positions committed (all layers)
        self.reserve = kv_reserved_positions(spec)

    def buffers(self) -> tuple[list, list]:
        return self.k, self.v

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k/v [T, kv_heads, D] for positions [length, length+T) and return views
        [kv_heads, length+T, D] over [0, length+T)."""
        n = self.length + k.shape[0]
        self.ensure(layer, n)
        self.k[layer][:, self.length: n] = k.transpose(1, 0, 2)
        self.v[layer][:, self.length: n] = v.transpose(1, 0, 2)
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def ensure(self, layer: int, n: int) -> None:
        """Room for n positions in a layer's arrays (growing them, positions kept)."""
        if self.k[layer].shape[1] < n:
            cap = max(n, 2 * self.k[layer].shape[1], self.reserve)
            for store in (self.k, self.v):
                old = store[layer]
                grown = lazy_array((old.shape[0], cap, old.shape[2]), self.dtype)
                grown[:, : self.length] = old[:, : self.length]
                store[layer] = grown


class _Layer:
    """One decoder layer's dense (always resident) weights."""

    def __init__(self, c: Container, spec: ArchSpec, i: int):
        p = f"model.layers.{i}."
        vec = lambda n: kernels.vector(c.load(p + n))
        opt = lambda n: kernels.vector(c.load(p + n)) if (p + n) in c else None
        self.input_norm = vec("input_layernorm.weight")
        self.post_norm = vec("post_attention_layernorm.weight")
        self.q, self.k, self.v, self.o = (c.load(p + f"self_attn.{n}_proj.weight") for n in "qkvo")
        self.q_bias, self.k_bias, self.v_bias, self.o_bias = (opt(f"self_attn.{n}_proj.bias") for n in "qkvo")
        self.q_norm = opt("self_attn.q_norm.weight")
        self.k_norm = opt("self_attn.k_norm.weight")
        if spec.qk_norm != "none" and (self.q_norm is None or self.k_norm is None):
            raise ColiError(f"layer {i}: q_norm/k_norm weights are missing from the container")
        self.kind = spec.mlp_kinds[i]
        if self.kind == "moe":
            weight = kernels.vector(c.load(p + "mlp.gate.weight"))
            if weight.shape != (spec.num_experts, spec.hidden_size):
                raise ColiError(f"layer {i}: router shape {weight.shape} does not match the config")
            self.router = SoftmaxTopK(weight, spec.top_k, spec.norm_topk_prob)
        else:
            self.mlp = ExpertFFN(*(c.load(p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down")))
        self.window = spec.sliding_windows[i] if spec.sliding_windows else None
        # decode's attention block (and a MoE layer's router) in one compiled call (None: the
        # step-by-step path)
        moe = self.kind == "moe"
        self.attention_block = kernels.attention_block(
            [self.q, self.k, self.v, self.o], [self.q_bias, self.k_bias, self.v_bias, self.o_bias],
            self.input_norm, spec.qk_norm, self.q_norm, self.k_norm, spec.rms_norm_eps,
            spec.clip_qkv, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            self.router.weight if moe else None, self.post_norm if moe else None, spec.top_k,
            spec.norm_topk_prob)


class _Cancelled(Exception):
    """Engine.cancel() reached a forward pass of a generation (between layers or expert batches)."""


def _biased(y: np.ndarray, bias) -> np.ndarray:
    return y + bias if bias is not None else y


def _linear(x, w: Weight, bias):
    return _biased(kernels.matmul(x, w), bias)


class Engine:
    def __init__(self, container: Container, spec: ArchSpec, store: ExpertStore | None = None,
                 tokenizer=None, threads: int | None = None, kv_dtype=np.float32):
        self.container, self.spec, self.tokenizer = container, spec, tokenizer
        self.kv_dtype = np.dtype(kv_dtype)     # KVCache's: float32, or the opt-in float16
        kernels.set_threads(threads)
        # no count given: follow the machine's load between passes (speed only, never bits)
        self.governor = kernels.thread_governor() if threads is None else None
        c = container
        self.embed = c.load("model.embed_tokens.weight")
        if self.embed.shape[0] != spec.vocab_size:
            raise ColiError(f"embedding has {self.embed.shape[0]} rows but vocab_size is {spec.vocab_size}")
        if spec.tie_word_embeddings:
            self.head = self.embed
        elif "lm_head.weight" not in c:      # never the embedding in silence: the logits would be wrong
            raise ColiError(f"{c.path}: lm_head.weight is missing (tie_word_embeddings is false)")
        else:
            self.head = c.load("lm_head.weight")
        self.final_norm = kernels.vector(c.load("model.norm.weight"))
        self.layers = [_Layer(c, spec, i) for i in range(spec.num_layers)]
        if store is None:
            from .tiered_store import TieredStore
            store = TieredStore(c, cap=spec.num_experts)      # everything fits: no eviction
        self.store = store
        for i, layer in enumerate(self.layers):
            if layer.kind == "moe" and not all(self.store.has(i, e) for e in range(spec.num_experts)):
                raise ColiError(f"layer {i}: the container lacks some of its {spec.num_experts} experts")
        self.rope = Rope(c.config, spec.head_dim)
        self.scale = np.float32(spec.head_dim ** -0.5)
        self._cancel = threading.Event()
        self._cancel_checks = False      # True while generate() runs: forward() may stop early
        moe = [i for i, L in enumerate(self.layers) if L.kind == "moe"]
        # lookahead: after layer i's attention, the next MoE layer's norm + router predict its experts
        self._next_moe = {i: next((j for j in moe if j > i), None) for i in range(spec.num_layers)}
        self.trace = None            # a core.trace.TraceWriter while recording
        self.usage: dict[tuple[int, int], int] = {}        # routing counts since the last save
        self.usage_history: dict[tuple[int, int], float] = {}
        self.usage_file = None       # where save_usage() writes the merged history (.coli_usage)
        self.routed: dict[int, list[int]] = {}     # layer -> experts of the latest step (live view)
        self._kv_spare: tuple[list, list] | None = None    # a finished cache's arrays (new_cache)
        self.fused_attention = True      # False: the step-by-step attention (benchmarks, tests)
        self.reset_counters()

    def new_cache(self) -> KVCache:
        """A KV cache writing over the memory of the last one handed back (recycle_cache), if any.
        Its pages are mapped already: each new page of a cache costs a fault and zeroing, ~16 us
        on the benchmark VM, which for the OLMoE geometry (64 new pages per token) was ~1 ms of
        every decode step; a chat's later turns no longer pay it."""
        spare, self._kv_spare = self._kv_spare, None
        return KVCache(self.spec, spare, self.kv_dtype)

    def recycle_cache(self, cache: KVCache) -> None:
        """Hand back a cache nobody uses any more, for the next new_cache (the larger is kept)."""
        spare = self._kv_spare
        if spare is None or spare[0][0].shape[1] <= cache.k[0].shape[1]:
            self._kv_spare = cache.buffers()

    def placement(self) -> dict[int, dict[int, str]]:
        """layer -> {expert: tier} for every expert not on disk only (the live Brain map)."""
        resident = getattr(self.store, "resident", None)
        return resident() if resident is not None else {}

    def heat(self) -> dict[tuple[int, int], float]:
        """Routing counts, persisted history plus this run, for (layer, expert)."""
        out = dict(self.usage_history)
        for k, v in self.usage.items():
            out[k] = out.get(k, 0) + v
        return out

    def save_usage(self) -> None:
        """Merge this run's routing counts into the persisted history (read by the pinned policy
        and ``coli plan``). A history that cannot be written costs a warning, never the reply."""
        if self.usage_file is None or not self.usage:
            return
        from .usage import save_usage
        for k, v in self.usage.items():
            self.usage_history[k] = self.usage_history.get(k, 0) + v
        self.usage = {}
        try:
            save_usage(self.usage_file, self.usage_history, self.spec.num_layers, self.spec.num_experts)
        except ColiError as e:
            import sys
            print(f"coli: warning: routing history not saved ({e})", file=sys.stderr)
            self.usage_file = None

    def reset_counters(self) -> None:
        self.counters = {"attention_s": 0.0, "experts_s": 0.0, "lm_head_s": 0.0,
                         "predicted": 0, "predicted_hit": 0}
        self._predicted: dict[int, set[int]] = {}

    # --- the forward pass ----------------------------------------------------------------------
    def _attention(self, i: int, L: _Layer, h, cos, sin, cache: KVCache, pos: np.ndarray):
        s, T = self.spec, h.shape[0]
        q, k, v = kernels.matmul_many(h, [L.q, L.k, L.v])       # one pass over x for all three
        q, k, v = _biased(q, L.q_bias), _biased(k, L.k_bias), _biased(v, L.v_bias)
        if s.qk_norm == "full":
            q, k = rms_norm(q, L.q_norm, s.rms_norm_eps), rms_norm(k, L.k_norm, s.rms_norm_eps)
        if s.clip_qkv is not None:
            c = np.float32(s.clip_qkv)
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        q = q.reshape(T, s.num_heads, s.head_dim)
        k = k.reshape(T, s.num_kv_heads, s.head_dim)
        v = v.reshape(T, s.num_kv_heads, s.head_dim)
        if s.qk_norm == "per_head":
            q, k = rms_norm(q, L.q_norm, s.rms_norm_eps), rms_norm(k, L.k_norm, s.rms_norm_eps)
        q, k = kernels.rope(q, cos, sin), kernels.rope(k, cos, sin)
        keys, values = cache.append(i, k, v)
        B = kernels.ATTENTION_QUERY_BLOCK
        if T > B and self._cancel_checks:
            # kernels.attention's own blocks of query rows, called one by one so that a cancel
            # is seen between them (a long prompt's attention is most of a layer): the same bits
            if keys.dtype != np.float32:
                keys, values = keys.astype(np.float32), values.astype(np.float32)
            parts = []
            for t in range(0, T, B):
                parts.append(kernels.attention(q[t: t + B], keys, values, self.scale, pos[t: t + B], L.window))
                self._check_cancel()
            out = np.concatenate(parts)
        else:
            out = kernels.attention(q, keys, values, self.scale, pos, L.window)
        return _linear(out, L.o, L.o_bias)


    def _predict(self, i: int, x: np.ndarray) -> None:
        """Lookahead prefetch: apply the next MoE layer's norm and router to the hidden state
        after layer i's attention and ask the store to start reading those experts."""
        j = self._next_moe[i]
        if j is None or not getattr(self.store, "prefetch_enabled", False):
            return
        L = self.layers[j]
        ranked = L.router.predict(rms_norm(x, L.post_norm, self.spec.rms_norm_eps))
        self._predicted[j] = set(ranked)
        self.store.prefetch(j, ranked)

    def _moe(self, i: int, L: _Layer, h: np.ndarray, pos: np.ndarray, routed=None) -> np.ndarray:
        """routed: (top, weights) of h when the attention block computed them already."""
        top, weights = routed if routed is not None else L.router.route(h)
        if h.shape[0] == 1:
            ids = top[0].tolist()       # one position: k distinct experts, strongest first
            used = sorted(ids)
            for e in ids:
                self.usage[(i, e)] = self.usage.get((i, e), 0) + 1
        else:
            used = np.unique(top).tolist()
            for e in used:
                self.usage[(i, e)] = self.usage.get((i, e), 0) + int((top == e).sum())
        self.routed[i] = used
        predicted = self._predicted.pop(i, None)
        if predicted is not None:
            self.counters["predicted"] += len(used)
            self.counters["predicted_hit"] += len(predicted.intersection(used))
        if self.trace is not None:
            for p, row in zip(pos.tolist(), top.tolist()):
                self.trace.record(p, i, row)
        # Each unique expert of the batch is fetched once; whatever is ready (all hits, then
        # misses as they arrive) runs as one kernel pass; results land in fixed (token, rank)
        # slots and are summed in rank order, so arrival and grouping cannot change the output.
        contrib = np.empty((h.shape[0], top.shape[1], h.shape[1]), np.float32)
        for batch in self.store.request_batches(i, used):
            if h.shape[0] == 1:      # decode: every expert reads the one row (laid out once)
                kernels.swiglu_one(h, [ffn for _, ffn in batch], contrib[0], [ids.index(e) for e, _ in batch])
                continue
            picks = [np.nonzero(top == e) for e, _ in batch]
            rows = np.concatenate([r for r, _ in picks])
            ranks = np.concatenate([k for _, k in picks])
            y = kernels.swiglu_many(h[rows], [ffn for _, ffn in batch], kernels.spans(len(r) for r, _ in picks))
            contrib[rows, ranks] = y * weights[rows, ranks][:, None]
            self._check_cancel()     # a prefill batch of experts can take a while
        if h.shape[0] == 1:
            return kernels.rank_sum(contrib[0], weights[0])
        return np.add.reduce(contrib, axis=1)   # rank 0 + rank 1 + ..., in that order

    def _check_context(self, end: int, what: str) -> None:
        """Positions past max_position_embeddings are refused: RoPE would extrapolate in silence."""
        limit = self.spec.max_position_embeddings
        if limit and end > limit:
            raise ColiError(f"{what} needs {end} positions, past the model's context of {limit} "
                            f"(max_position_embeddings)")

    def forward(self, ids: Sequence[int], cache: KVCache, all_logits: bool = False) -> np.ndarray:
        self._check_context(cache.length + len(ids), "this pass")
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.spec.vocab_size):
            raise ColiError(f"token id out of range 0..{self.spec.vocab_size - 1}")
        s = self.spec
        if self.governor is not None:
            self.governor.update()
        x = kernels.rows(self.embed, ids)
        pos = np.arange(cache.length, cache.length + len(ids))
        cos, sin = self.rope.cos_sin(pos)
        c = self.counters
        # one decode position: each layer's attention (and router) is one compiled call
        block = len(ids) == 1 and self.fused_attention
        for i, L in enumerate(self.layers):
            t0 = time.perf_counter()
            routed = None
            if block and L.attention_block is not None:
                cache.ensure(i, cache.length + 1)
                out = L.attention_block(x, cos, sin, cache.k[i], cache.v[i], cache.length,
                                        kernels.window_start(cache.length, L.window), self.scale)
                if L.kind == "moe":      # the block ran the router too
                    x, h, *routed = out
                else:
                    x = out
            else:
                x = x + self._attention(i, L, rms_norm(x, L.input_norm, s.rms_norm_eps), cos, sin, cache, pos)
            t1 = time.perf_counter()
            self._predict(i, x)
            if routed is None:
                h = rms_norm(x, L.post_norm, s.rms_norm_eps)
            x = x + (self._moe(i, L, h, pos, routed) if L.kind == "moe" else expert_ffn(h, L.mlp))
            t2 = time.perf_counter()
            c["attention_s"] += t1 - t0
            c["experts_s"] += t2 - t1
            self._check_cancel()
        cache.length += len(ids)
        t0 = time.perf_counter()
        x = rms_norm(x if all_logits else x[-1:], self.final_norm, s.rms_norm_eps)
        out = kernels.matmul(x, self.head)
        c["lm_head_s"] += time.perf_counter() - t0
        return out

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits, float32 [T, vocab], from one batched pass."""
        cache = self.new_cache()
        try:
            return self.forward(ids, cache, all_logits=True)
        finally:
            self.recycle_cache(cache)

    # Prompts are prefilled PREFILL_CHUNK positions at a time: a pass's activations grow with its
    # length (the MoE block's [T, top-k, hidden] contributions: 470 MB for 2048 positions of a
    # 7168-wide model; attention is blocked by query rows on its own), and the RAM budget is a
    # promise. The price is paid when experts stream from disk: each pass loads the experts its
    # positions use, so a longer prompt reads them once per chunk (llama.cpp's micro-batch: 512).
    PREFILL_CHUNK = 1024

    def prefill(self, ids: Sequence[int], cache: KVCache) -> np.ndarray:
        """Run the prompt through the model in chunks; the last position's logits [vocab]."""
        logits = None
        for at in range(0, len(ids), self.PREFILL_CHUNK):
            logits = self.forward(ids[at: at + self.PREFILL_CHUNK], cache)
        return logits[-1]

    # --- generation ----------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the running generate() soon: before the next token, or within a prefill (between
        chunks, layers and expert batches); it then ends with Done("cancelled")."""
        self._cancel.set()

    def _check_cancel(self) -> None:
        if self._cancel_checks and self._cancel.is_set():
            raise _Cancelled()

    def prompt_ids(self, prompt: str | list[dict] | Sequence[int], raw: bool = False) -> list[int]:
        if isinstance(prompt, (list, tuple, np.ndarray)) and (len(prompt) == 0 or not isinstance(prompt[0], dict)):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ColiError(f"{self.container.path} has no tokenizer.json; pass token ids (--ids)")
        if isinstance(prompt, str):
            if raw:
                return self.tokenizer.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        try:
            return self.tokenizer.encode_chat(list(prompt), add_generation_prompt=True)
        except ValueError as e:
            raise ColiError(f"chat template: {e}") from None

    def generate(self, prompt, sampling: SamplingParams | None = None, stop: Iterable[str] = (),
                 max_new_tokens: int = 256, raw: bool = False) -> Iterator[Token | Stats | Done]:
        sampling = sampling or SamplingParams()
        ids = self.prompt_ids(prompt, raw=raw)
        if not ids:
            raise ColiError("empty prompt")
        self._check_context(len(ids), "the prompt")
        self._cancel.clear()
        sample, cache = Sampler(sampling), self.new_cache()
        self._cancel_checks = True
        try:
            yield from self._generate(ids, sample, cache, stop, max_new_tokens)
        finally:
            self._cancel_checks = False
            self.recycle_cache(cache)

    def _generate(self, ids, sample, cache, stop, max_new_tokens):
        stops = [s for s in stop if s]
        decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
        eos = set(self.spec.eos_token_ids)
        self.store.reset_stats()
        self.reset_counters()
        t0 = time.perf_counter()
        new, text, emitted, reason = [], "", 0, "length"
        try:
            logits = self.prefill(ids, cache)
        except _Cancelled:
            logits, reason = None, "cancelled"
        t_prefill = time.perf_counter() - t0
        t_decode = time.perf_counter()

        def stats(final: bool) -> Stats:
            st, c = self.store.stats(), self.counters
            steps, elapsed = max(0, len(new) - 1), time.perf_counter() - t_decode
            extra = {k: st[k] for k in ("hits", "misses", "disk_wait_s", "prefetch_issued",
                                        "prefetch_used", "cap", "ram_bytes") if k in st}
            extra.update(attention_s=c["attention_s"], lm_head_s=c["lm_head_s"],
                         experts_s=max(0.0, c["experts_s"] - st.get("disk_wait_s", 0.0)),
                         prefetch_recall=(c["predicted_hit"] / c["predicted"]) if c["predicted"] else None,
                         final=final, kernels=kernels.backend(), threads=kernels.get_threads(),
                         routed={l: list(es) for l, es in self.routed.items()})
            if final:
                extra.update(ids=list(new), text=text, reason=reason)
            return Stats(prompt_tokens=len(ids), new_tokens=len(new), ttft_s=t_prefill,
                         prefill_tok_s=len(ids) / t_prefill if t_prefill > 0 else 0.0,
                         decode_tok_s=steps / elapsed if steps and elapsed > 0 else 0.0,
                         hit_rate=st.get("hit_rate", 1.0), bytes_read=st.get("bytes_read", 0),
                         peak_rss_bytes=peak_rss_bytes(), extra=extra)
        while reason != "cancelled" and len(new) < max_new_tokens:
            if self._cancel.is_set():
                reason = "cancelled"
                break
            tok = sample(logits)
            if tok in eos:
                reason = "eos"
                break
            new.append(tok)
            piece = decoder.push(tok) if decoder is not None else ""
            text += piece
            hit = min((text.find(s) for s in stops if s in text), default=-1)
            if hit >= 0:
                text, reason = text[:hit], "stop"
                yield Token(tok, text[emitted:])
                emitted = len(text)
                break
            # hold back a tail that could still become a stop string
            hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            yield Token(tok, text[emitted: len(text) - hold])
            yield stats(final=False)
            emitted = len(text) - hold
            if len(new) >= max_new_tokens:
                break
            if self.spec.max_position_embeddings and cache.length >= self.spec.max_position_embeddings:
                reason = "context"      # the model's context is full: stop, never extrapolate
                break
            try:
                logits = self.forward([tok], cache)[-1]
            except _Cancelled:
                reason = "cancelled"
                break
        if reason != "stop":
            text += decoder.flush() if decoder is not None else ""
            if emitted < len(text):
                yield Token(-1, text[emitted:])     # held-back tail, no new token
        self.save_usage()
        yield stats(final=True)
        yield Done(reason)
