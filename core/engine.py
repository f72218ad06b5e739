"""The family-agnostic MoE decoder: the forward driver (the embedding, layers and head the family
declared from ``core.blocks``, each called with the pass's context, ``core.step.Step``), the
timers, lookahead prefetch, cancel, and the generation loop. No tensor names, no residual,
attention or router math, no cache storage (``core.cache``): those are the blocks' and kinds'.

All activations are float32. Weights come from the container as dense float32 or int4/int8
(computed by ``core.kernels``).
"""
from __future__ import annotations

import threading
import time
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import kernels
from .arch import ArchSpec
from .cache import KVCache
from .container import Container
from .errors import ColiError
from .events import Done, Stats, Token
from .memory import peak_rss_bytes
from .planner import kv_reserved_positions
from .rope import Rope
from .sampling import Sampler, SamplingParams
from .step import Step
from .blocks.mlp import expert_ffn  # noqa: F401  (re-exported: tools and tests use it)
from .blocks.embed import ends
from .store import ExpertStore


def token_logprobs(logits: np.ndarray, tok: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log p(tok), the ``top`` most likely (id, log p), most likely first; ties by id) under
    log_softmax of the raw logits (float64), the model's own distribution at this step."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    best = []
    if top > 0:
        n = min(top, x.size)
        idx = np.argpartition(-x, n - 1)[:n]
        best = [(int(i), float(x[i] - lse)) for i in sorted(idx.tolist(), key=lambda i: (-x[i], i))]
    return float(x[tok] - lse), best


class _Cancelled(Exception):
    """Engine.cancel() reached a forward pass of a generation (between layers or expert batches)."""


class Engine:
    def __init__(self, container: Container, spec: ArchSpec, store: ExpertStore | None = None,
                 tokenizer=None, threads: int | None = None, kv_dtype=np.float32):
        self.container, self.spec, self.tokenizer = container, spec, tokenizer
        self.kv_dtype = np.dtype(kv_dtype)     # KVCache's: float32, or the opt-in float16
        kernels.set_threads(threads)
        # no count given: follow the machine's load between passes (speed only, never bits)
        self.governor = kernels.thread_governor() if threads is None else None
        c = container
        p = spec.prefix      # the language model's tensors in the checkpoint (core.arch.ArchSpec)
        # the ends as the family declared them (core.blocks.embed), else from the spec's fields
        embedding, head = ends(spec)
        self.embed = embedding.build(c, p)
        self.head = head.build(c, p, spec.rms_norm_eps, self.embed)
        # each layer as the family composed it (ArchSpec.layers: core.blocks.residual): the
        # engine calls L(i, x, step) and knows nothing more of what a layer does
        self.layers = [decl.build(c, f"{p}layers.{i}.", spec.rms_norm_eps)
                       for i, decl in enumerate(spec.layers)]
        if store is None:
            from .tiered_store import TieredStore
            store = TieredStore(c, cap=spec.num_experts)      # everything fits: no eviction
        self.store = store
        for i, layer in enumerate(self.layers):
            if layer.kind == "moe" and not all(self.store.has(i, e) for e in range(spec.num_experts)):
                raise ColiError(f"layer {i}: the container lacks some of its {spec.num_experts} experts")
        # the named rotary tables a pass offers its blocks (Step.rope): those the family declares,
        # and "main" from the spec's fields unless it declares that one too
        self.rope_tables = dict(spec.rope_tables)
        if "main" not in self.rope_tables:
            self.rope_tables["main"] = Rope(spec.text_config or c.config, spec.rope_dim or spec.head_dim,
                                            partial=spec.rope_partial)
        self._cancel = threading.Event()
        self._cancel_checks = False      # True while generate() runs: forward() may stop early
        moe = [i for i, L in enumerate(self.layers) if L.kind == "moe"]
        # lookahead: after layer i's mixer, the next MoE layer's router predicts its experts
        self._next_moe = {i: next((j for j in moe if j > i), None) for i in range(spec.num_layers)}
        # layers whose experts follow from the token ids alone (hash routing): read before layer 0
        self._known = [(i, L) for i, L in enumerate(self.layers) if hasattr(L, "known_experts")]
        self.trace = None            # a core.trace.TraceWriter while recording
        self.usage: dict[tuple[int, int], int] = {}        # routing counts since the last save
        self.usage_history: dict[tuple[int, int], float] = {}
        self.usage_file = None       # where save_usage() writes the merged history (.coli_usage)
        self.routed: dict[int, list[int]] = {}     # layer -> experts of the latest step (live view)
        self._all_in_ram = False     # warm_experts() read every expert: nothing left to predict
        self._kv_spare: list[dict] | None = None    # a finished cache's arrays (new_cache)
        self._spare_capacity = 0
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
        if spare is None or self._spare_capacity <= cache.capacity():
            self._kv_spare, self._spare_capacity = cache.buffers(), cache.capacity()

    @property
    def known_layers(self) -> list[int]:
        """The layers whose experts follow from the token ids (hash routing), not from a router
        the lookahead predicts: plain ints, for the Brain map."""
        return [i for i, _ in self._known]

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
    @property
    def cancel_checks(self) -> bool:
        """True while generate() runs: a block may stop a long pass early (check_cancel)."""
        return self._cancel_checks

    def _prefetching(self) -> bool:
        return getattr(self.store, "prefetch_enabled", False) and not (
            self._all_in_ram and self.store.cap >= self.spec.num_experts)    # not if the pool shrank since

    def lookahead(self, i: int, x: np.ndarray, step) -> None:
        """Lookahead prefetch (Step.mixed): the next MoE layer's router predicts from what it would
        see of the residual x after layer i's mixer (its ``router_input``), and the store starts
        reading those experts."""
        j = self._next_moe[i]
        if j is None or not self._prefetching():
            return
        L = self.layers[j]
        known = getattr(L, "known_experts", None)      # hash routing: certain, from the ids
        ranked = known(step) if known is not None else L.router.predict(L.router_input(x, step))
        self._predicted[j] = set(ranked)
        self.store.prefetch(j, ranked)

    def _known_experts(self, step) -> None:
        """Before layer 0: the experts of layers that pick them from the token ids alone (hash
        routing) are known with certainty; the store starts reading them."""
        if self._known and self._prefetching():
            for i, L in self._known:
                self.store.prefetch(i, L.known_experts(step))

    def record_routing(self, i: int, top: np.ndarray, pos: np.ndarray) -> tuple[list[int], list[int]]:
        """A MoE block's routing of its positions (top [T, k]): counted for the routing history,
        the live view, prefetch recall and the trace. Returns (the one position's experts
        strongest first, or [] for several; the distinct experts used, ascending)."""
        if top.shape[0] == 1:
            ids = top[0].tolist()       # one position: k distinct experts, strongest first
            used = sorted(ids)
            for e in ids:
                self.usage[(i, e)] = self.usage.get((i, e), 0) + 1
        else:
            ids, used = [], np.unique(top).tolist()
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
        return ids, used

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
        plan = getattr(self, "plan", None)
        if plan is not None and cache.length + len(ids) > plan.kv_positions:
            from .planner import grow_kv_room     # the budget pays for the longer context
            grow_kv_room(plan, cache.length + len(ids), self.store, getattr(self, "_prefixes", None))
        if self.governor is not None:
            self.governor.update()
        step = self.step(ids, cache)
        self._known_experts(step)
        x = self.embed(ids, step)
        c = self.counters
        for i, L in enumerate(self.layers):
            t0 = time.perf_counter()
            x = L(i, x, step)
            t2 = time.perf_counter()
            c["attention_s"] += step.mixed_at - t0
            c["experts_s"] += t2 - step.mixed_at
            self.check_cancel()
        cache.length += len(ids)
        t0 = time.perf_counter()
        out = self.head(x if all_logits else x[-1:], step)
        c["lm_head_s"] += time.perf_counter() - t0
        return out

    def step(self, ids: np.ndarray, cache: KVCache) -> Step:
        """The context of one pass of ids (int64) continuing cache (core.step)."""
        return Step(ids, np.arange(cache.length, cache.length + len(ids)), cache, self.rope_tables, self)

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
    # Prompt-prefix reuse (core.prefix_cache): a finished generation's cache stays in a small pool
    # with the ids its positions hold (the prompt and the generated tokens fed back; the last
    # sampled token never is), and the next generate() continues the entry sharing the longest
    # prefix with its prompt, computing only the positions after it. False (--no-prefix-cache):
    # every generation prefills its whole prompt in a fresh cache, the bits of one batched pass.
    prefix_cache = True
    prefix_cache_entries = 4     # cached sequences at most (the server's clients; the app's chats)

    @property
    def prefixes(self):
        """The pool of finished caches (core.prefix_cache.PrefixPool), bounded by the RAM the
        planner keeps free for caches (Plan.kv_reserved_bytes)."""
        pool = getattr(self, "_prefixes", None)
        if pool is None:
            from . import cache_kinds
            from .prefix_cache import PrefixPool, can_truncate
            plan = getattr(self, "plan", None)
            budget = getattr(plan, "kv_reserved_bytes", 0) or (
                cache_kinds.bytes_per_position(self.spec.cache_kinds, self.kv_dtype.name)
                * kv_reserved_positions(self.spec))
            pool = self._prefixes = PrefixPool(budget, self.prefix_cache_entries,
                                               truncatable=can_truncate(self.spec), release=self.recycle_cache)
            pool.bytes_per_position = cache_kinds.bytes_per_position(self.spec.cache_kinds, self.kv_dtype.name)
        return pool

    def warm_experts(self) -> bool:
        """When the store's RAM tier has a slot for every routed expert (the model fits), start
        reading them all now (the store's I/O threads when prefetch is on, else here), as
        llama.cpp's default load copies every weight: a first generation then decodes at the
        speed of the next ones instead of reading each expert at its first use (benchmarks/
        README.md, "The speed users see"). Placement only, never bits. False: not everything fits."""
        st, n = self.store, self.spec.num_experts
        if getattr(st, "cap", 0) < n:
            return False
        for i, L in enumerate(self.layers):
            if L.kind != "moe":
                continue
            if getattr(st, "prefetch_enabled", False):
                st.prefetch(i, range(n))
            else:
                for _ in st.request(i, range(n)):
                    pass
        self._all_in_ram = True      # no step can miss: lookahead prediction would be wasted work
        return True

    def cancel(self) -> None:
        """Stop the running generate() soon: before the next token, or within a prefill (between
        chunks, layers and expert batches); it then ends with Done("cancelled"). Only the
        generation running now: each has its own flag (generate(cancel=...))."""
        self._cancel.set()

    def check_cancel(self) -> None:
        """Raise _Cancelled inside a generation whose cancel flag is set (blocks call it between
        pieces of a long pass)."""
        if self._cancel_checks and self._cancel.is_set():
            raise _Cancelled()

    def prompt_ids(self, prompt: str | list[dict] | Sequence[int], raw: bool = False) -> list[int]:
        if isinstance(prompt, (list, tuple, np.ndarray)) and (len(prompt) == 0 or not isinstance(prompt[0], dict)):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ColiError(f"{self.container.path} has no tokenizer (tokenizer.json or tiktoken.model); pass token ids (--ids)")
        if isinstance(prompt, str):
            if raw:
                return self.tokenizer.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        try:
            return self.tokenizer.encode_chat(list(prompt), add_generation_prompt=True)
        except ValueError as e:
            raise ColiError(f"chat template: {e}") from None

    def generate(self, prompt, sampling: SamplingParams | None = None, stop: Iterable[str] = (),
                 max_new_tokens: int = 256, raw: bool = False,
                 cancel: threading.Event | None = None,
                 logprobs: int | None = None) -> Iterator[Token | Stats | Done]:
        """The events of one generation. The prompt is checked here, at the call (ColiError: no
        tokenizer, an empty prompt, past the model's context); the work starts at the first
        next(). ``cancel``: this generation's own flag (set it to stop this one and no other;
        Engine.cancel() sets the running generation's). ``logprobs``: None, or N >= 0: each
        Token carries its log-probability and the N most likely tokens' (Token.logprobs; computed
        only when asked)."""
        sampling = sampling or SamplingParams()
        ids = self.prompt_ids(prompt, raw=raw)
        if not ids:
            raise ColiError("empty prompt")
        self._check_context(len(ids), "the prompt")
        return self._run(ids, Sampler(sampling), stop, max_new_tokens,
                         cancel if cancel is not None else threading.Event(), logprobs)

    def _run(self, ids, sample, stop, max_new_tokens, flag, logprobs=None):
        self._cancel = flag
        if self.prefix_cache:
            # room for the prompt: older entries leave first (the reply's growth is settled when
            # the cache comes back, put() evicting past the budget)
            cache, cached, logits = self.prefixes.take(ids, self.new_cache, len(ids))
        else:
            cache, cached, logits = self.new_cache(), 0, None
        # a cache whose state cannot truncate checkpoints it at the prompt's end (a turn boundary)
        turn = {"cached": cached, "logits": logits, "new": [],
                "checkpoint": self.prefix_cache and not self.prefixes.truncatable}
        keep = False
        self._cancel_checks = True
        try:
            yield from self._generate(ids, sample, cache, stop, max_new_tokens, turn, logprobs)
            keep = True
        except GeneratorExit:        # the listener closed it between two events: the cache is whole
            keep = True
            raise
        finally:
            self._cancel_checks = False
            # a cache whose kinds cannot truncate is kept only if no pass was cut short (a cut
            # pass commits no position, but a fixed-size state may have folded some in)
            if keep and self.prefix_cache and (self.prefixes.truncatable or not turn.get("cut")):
                # the positions committed: the prompt, then the generated tokens fed back
                checkpoint = turn["checkpoint"] if not isinstance(turn["checkpoint"], bool) else None
                self.prefixes.put((ids + turn["new"])[: cache.length], cache, len(ids), turn["logits"],
                                  checkpoint)
            else:
                self.recycle_cache(cache)

    def _generate(self, ids, sample, cache, stop, max_new_tokens, turn=None, logprobs=None):
        """turn (prefix reuse): "cached", the prompt's first positions the cache holds already;
        "logits", the last prompt position's when it holds them all (else None: computed, and
        left there); "new", the list the generated ids go into (the cache's ids, with the prompt)."""
        turn = {"cached": 0, "logits": None, "new": []} if turn is None else turn
        cached, new = turn["cached"], turn["new"]
        stops = [s for s in stop if s]
        decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
        eos = set(self.spec.eos_token_ids)
        self.store.reset_stats()
        self.reset_counters()
        t0 = time.perf_counter()
        text, emitted, reason, matched = "", 0, "length", None
        logits = turn["logits"]
        try:
            if logits is None:
                logits = turn["logits"] = self.prefill(ids[cached:], cache)
            if turn.get("checkpoint") is True:
                turn["checkpoint"] = cache.checkpoint() if cache.length == len(ids) else None
        except _Cancelled:
            logits, reason = None, "cancelled"
            turn["cut"] = True       # a pass stopped inside: only its layers' fixed state saw it
        t_prefill = time.perf_counter() - t0
        t_decode = time.perf_counter()
        at_decode = self.store.stats()      # the decode window's reads are counted from here

        def stats(final: bool) -> Stats:
            st, c = self.store.stats(), self.counters
            steps, elapsed = max(0, len(new) - 1), time.perf_counter() - t_decode
            extra = {k: st[k] for k in ("hits", "misses", "disk_wait_s", "prefetch_issued",
                                        "prefetch_used", "cap", "ram_bytes", "disk_bytes",
                                        "page_cache_share", "page_cache_source") if k in st}
            extra.update(attention_s=c["attention_s"], lm_head_s=c["lm_head_s"],
                         experts_s=max(0.0, c["experts_s"] - st.get("disk_wait_s", 0.0)),
                         prefetch_recall=(c["predicted_hit"] / c["predicted"]) if c["predicted"] else None,
                         final=final, kernels=kernels.backend(), threads=kernels.get_threads(),
                         routed={l: list(es) for l, es in self.routed.items()})
            for k in ("bytes_read", "disk_bytes", "hits", "misses"):     # decode only (benchmarks)
                if st.get(k) is not None and at_decode.get(k) is not None:
                    extra["decode_" + k] = st[k] - at_decode[k]
            if final:
                extra.update(ids=list(new), text=text, reason=reason)
            return Stats(prompt_tokens=len(ids), new_tokens=len(new), ttft_s=t_prefill,
                         prefill_tok_s=(len(ids) - cached) / t_prefill if t_prefill > 0 else 0.0,
                         decode_tok_s=steps / elapsed if steps and elapsed > 0 else 0.0,
                         hit_rate=st.get("hit_rate", 1.0), bytes_read=st.get("bytes_read", 0),
                         peak_rss_bytes=peak_rss_bytes(), cached_tokens=cached, extra=extra)
        while reason != "cancelled" and len(new) < max_new_tokens:
            if self._cancel.is_set():
                reason = "cancelled"
                break
            tok = sample(logits)
            if tok in eos:
                reason = "eos"
                break
            new.append(tok)
            lp = token_logprobs(logits, tok, logprobs) if logprobs is not None else None
            piece = decoder.push(tok) if decoder is not None else ""
            text += piece
            hit, matched = min(((text.find(s), s) for s in stops if s in text), default=(-1, None))
            if hit >= 0:
                text, reason = text[:hit], "stop"
                yield Token(tok, text[emitted:], lp)
                emitted = len(text)
                break
            # hold back a tail that could still become a stop string
            hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            yield Token(tok, text[emitted: len(text) - hold], lp)
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
                turn["cut"] = True
                break
        if reason != "stop":
            text += decoder.flush() if decoder is not None else ""
            if emitted < len(text):
                yield Token(-1, text[emitted:])     # held-back tail, no new token
        final = stats(final=True)    # the decode's clock stops here, before the history is written
        self.save_usage()
        yield final
        yield Done(reason, stop=matched)
