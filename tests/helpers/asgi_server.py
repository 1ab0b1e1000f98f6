"""Serve an ASGI app (scirl serve's own) from a uvicorn thread on a free port, as its tests talk to it."""

from __future__ import annotations

import threading
import time


class running:
    """``with running(app) as srv:`` serves ``app`` until the block ends; ``srv.url`` ends in /v1."""

    def __init__(self, app):
        import uvicorn

        from scirl.serve import bind_socket

        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "fake server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
