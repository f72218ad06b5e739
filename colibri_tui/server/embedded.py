"""The app's server: ``coli serve`` for the model the app has loaded, started and stopped from
its settings (a switch, host, port, key), shown in the tier panel.

One engine, two users: the server's worker and the app's chat share ``lock`` (a
threading.Lock): the worker holds it for each request, the chat for each reply, so they never
generate at the same time -- a chat reply sent while a request decodes waits for it to finish
(the status line says so), and requests arriving during a chat reply wait in the server's
queue (429 past --max-queue, as with ``coli serve``).
"""
from __future__ import annotations

import os
import threading
import time

from core.errors import ColiError

from . import is_loopback, listen, make_server


class EmbeddedServer:
    def __init__(self, engine, host: str = "127.0.0.1", port: int = 8080, api_key: str = "",
                 lock: threading.Lock | None = None, max_queue: int = 8, model_id: str | None = None):
        from ..paths import logger
        from .app import build_app
        key = api_key or os.environ.get("COLI_API_KEY") or None
        if not is_loopback(host) and not key:
            raise ColiError(f"serving on {host} (reachable from other machines) needs an API key")
        self.sock = listen(host, port)
        try:
            self.app = build_app(engine, model_id=model_id, api_key=key, max_queue=max_queue,
                                 log=logger("serve"), lock=lock)
            self.state = self.app.state.serve
            h, p = self.sock.getsockname()[:2]
            self.host, self.port, self.keyed = h, p, bool(key)
            self.url = f"http://{'[' + h + ']' if ':' in h else h}:{p}/v1"
            self.server = make_server(self.app)
            self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                           name="coli-serve", daemon=True)
            self.thread.start()
            t0 = time.monotonic()
            while not self.server.started:
                if not self.thread.is_alive() or time.monotonic() - t0 > 10:
                    raise ColiError(f"the server on {host}:{port} did not start")
                time.sleep(0.01)
        except BaseException:
            self.sock.close()
            raise

    def info(self) -> dict:
        """What the tier panel shows: the address, requests served, the queue."""
        w = self.state.worker
        return {"url": self.url, "served": w.counts["served"], "errors": w.counts["errors"],
                "rejected": w.counts["rejected"], "keyed": self.keyed, **w.queue_state()}

    def stop(self, timeout: float = 10.0) -> None:
        """Stop listening, end the waiting requests (503) and the running one, join the thread."""
        self.server.should_exit = True
        self.state.worker.close(timeout=timeout)
        self.thread.join(timeout)
        self.sock.close()
