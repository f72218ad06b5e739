"""One generation at a time, on a worker thread, behind a bounded queue.

The HTTP side (an asyncio event loop) submits a ``Job``; the worker thread runs
``engine.generate`` for one job after another and hands each event to the job's asyncio queue
through ``loop.call_soon_threadsafe`` (the event loop never waits on the engine, so ``/health``
answers while a prompt is prefilled). ``cancel(job)`` takes a waiting job out of the queue, or
stops the running one: the job's own cancel flag, which its ``engine.generate(cancel=...)``
watches (between layers, expert batches and attention blocks of a prefill, and before each token;
no other job's generation sees it), and the worker closing the generator at the next event, so
at most the token being computed is finished after a cancel.

The engine keeps the caches of finished requests (prompt-prefix reuse, ``core.prefix_cache``):
a request whose prompt starts like an earlier one (a conversation's next turn, a shared system
prompt) prefills only the rest; the final Stats say how many were cached (``cached_tokens``).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass, field

from core.errors import ColiError
from core.events import Done, Stats, Token


class QueueFull(Exception):
    """The queue holds max_queue waiting jobs already; ``retry_after`` is a guess in seconds."""

    def __init__(self, retry_after: int):
        super().__init__("queue full")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


# what the worker hands to a job's queue: ("token", Token) | ("stats", Stats) | ("done", reason)
# | ("error", (status, message)); the last item is always ("end", None)
END = ("end", None)

_ids = itertools.count(1)


@dataclass
class Job:
    ids: list[int]
    sampling: object
    stop: list[str]
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None      # None, or the alternatives each Token's logprobs carry
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    number: int = field(default_factory=lambda: next(_ids))
    state: str = "queued"            # queued | running | done
    cancelled: bool = False
    cancel_flag: threading.Event = field(default_factory=threading.Event)   # its generation's own
    matched: str | None = None       # the stop string that ended the reply (Done.stop)
    tokens: int = 0                  # new tokens so far
    tokens_at_cancel: int | None = None
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None


class Worker:
    """``max_queue``: jobs that may wait behind the one decoding (0: none)."""

    def __init__(self, engine, max_queue: int = 8, log=None, lock=None):
        self.engine, self.max_queue, self.log = engine, max_queue, log
        # the app's engine lock (its chat generates on the same engine): held per request
        self.lock = lock
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self.current: Job | None = None
        self._closing = False
        self._durations: collections.deque[float] = collections.deque(maxlen=16)
        self.counts = collections.Counter()     # served, cancelled, errors, prompt/completion tokens
        self.totals = collections.Counter()     # store: hits, misses, bytes_read; seconds decoding
        self.last_stats: dict = {}
        self.finished: collections.deque[Job] = collections.deque(maxlen=64)    # recent jobs
        self._thread = threading.Thread(target=self._run, name="coli-serve-worker", daemon=True)
        self._thread.start()

    # --- the HTTP side ----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise ShuttingDown()
            busy = self.current is not None or self._waiting
            if busy and len(self._waiting) >= self.max_queue:
                self.counts["rejected"] += 1
                raise QueueFull(self.retry_after())
            self._waiting.append(job)
            self._cond.notify()

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the mean of recent jobs' durations times the
        jobs ahead (at least 1, at most 60)."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return int(min(60, max(1, math.ceil(mean * (len(self._waiting) + 1)))))

    def cancel(self, job: Job) -> None:
        with self._cond:
            if job.state == "queued":
                try:
                    self._waiting.remove(job)
                except ValueError:
                    pass
                job.state = "done"
                self.counts["cancelled"] += 1
                self._push(job, ("done", "cancelled"))      # whoever still waits on it ends
                self._push(job, END)
            elif job.state == "running" and not job.cancelled:
                job.cancelled = True
                job.tokens_at_cancel = job.tokens
                job.cancel_flag.set()        # this job's generation only, whenever it looks

    def queue_state(self) -> dict:
        with self._cond:
            return {"decoding": self.current is not None, "waiting": len(self._waiting),
                    "max_queue": self.max_queue}

    def close(self, timeout: float = 5.0) -> None:
        """Refuse new jobs, end the waiting ones, cancel the running one, stop the thread."""
        with self._cond:
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            for job in waiting:
                job.state = "done"
                self._push(job, ("error", (503, "the server is shutting down")))
                self._push(job, END)
            if self.current is not None and not self.current.cancelled:
                self.current.cancelled = True
                self.current.cancel_flag.set()
            self._cond.notify_all()
        self._thread.join(timeout)

    # --- the worker thread ----------------------------------------------------------------------
    @staticmethod
    def _push(job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.queue.put_nowait, item)
        except RuntimeError:         # the event loop is closed: nobody is listening
            pass

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                job = self._waiting.popleft()
                job.state, job.started = "running", time.monotonic()
                self.current = job
            try:
                if self.lock is None:
                    self._generate(job)
                else:
                    with self.lock:          # the app's chat is not generating meanwhile
                        if not job.cancelled:
                            self._generate(job)
                        else:
                            self.counts["cancelled"] += 1
                            self._push(job, ("done", "cancelled"))
            finally:
                with self._cond:
                    self.current = None
                    job.state, job.finished = "done", time.monotonic()
                    self._durations.append(job.finished - job.started)
                    self.finished.append(job)
                self._push(job, END)

    def _generate(self, job: Job) -> None:
        gen = None
        reason = None
        try:
            gen = self.engine.generate(job.ids, job.sampling, stop=job.stop, max_new_tokens=job.max_new_tokens,
                                       cancel=job.cancel_flag,
                                       **({"logprobs": job.logprobs} if job.logprobs is not None else {}))
            for ev in gen:
                if isinstance(ev, Token):
                    job.tokens += ev.id >= 0
                    self._push(job, ("token", ev))
                elif isinstance(ev, Stats):
                    if ev.extra.get("final"):
                        self._account(ev)
                        self._push(job, ("stats", ev))
                elif isinstance(ev, Done):
                    reason, job.matched = ev.reason, ev.stop
                    self._push(job, ("done", ev.reason))
                if job.cancelled and reason is None:
                    break            # the client is gone: not one token more
            if job.cancelled or reason == "cancelled":
                self.counts["cancelled"] += 1
                if reason is None:
                    self._push(job, ("done", "cancelled"))
            else:
                self.counts["served"] += 1
        except ColiError as e:           # e.g. a token id out of range: the request's fault
            self.counts["errors"] += 1
            self._push(job, ("error", (400, str(e))))
        except Exception as e:           # a bug: logged with its traceback, one line to the client
            self.counts["errors"] += 1
            if self.log is not None:
                self.log.exception("generation failed")
            self._push(job, ("error", (500, f"internal error: {e.__class__.__name__}: {e}")))
        finally:
            if gen is not None:
                gen.close()

    def _account(self, st: Stats) -> None:
        d = st.as_dict()
        self.last_stats = {k: v for k, v in d.items() if k not in ("ids", "text", "routed")}
        self.counts["prompt_tokens"] += st.prompt_tokens
        self.counts["cached_tokens"] += st.cached_tokens
        self.counts["completion_tokens"] += st.new_tokens
        for k in ("hits", "misses"):
            self.totals[k] += int(d.get(k) or 0)
        self.totals["bytes_read"] += st.bytes_read
        self.totals["prefill_s"] += st.ttft_s
        if st.decode_tok_s > 0 and st.new_tokens > 1:
            self.totals["decode_s"] += (st.new_tokens - 1) / st.decode_tok_s
