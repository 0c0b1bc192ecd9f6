"""Helpers for the HTTP server tests: run an aiohttp app on 127.0.0.1 in a background thread,
make small synchronous HTTP calls, parse Prometheus text."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from typing import Any

from aiohttp import web


class ServerThread:
    """Serves `app` on 127.0.0.1 (an ephemeral port) from its own event loop in a daemon thread.

    `on_stop` coroutines run in that loop before the runner is cleaned up (e.g. closing an engine).
    """

    def __init__(self, app: web.Application, *, handler_cancellation: bool = True, start_timeout: float = 30.0):
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._handler_cancellation = handler_cancellation
        self._thread = threading.Thread(target=self._serve, name="test-http-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise TimeoutError("the test server did not start")
        if self._error is not None:
            raise RuntimeError("the test server failed to start") from self._error

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as e:  # report to the constructor instead of dying silently
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, handler_cancellation=self._handler_cancellation, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]  # the ephemeral port the OS chose

    def run(self, coro, timeout: float | None = None) -> Any:
        """Run `coro` in the server's loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self._runner is not None:
            self.run(self._runner.cleanup(), timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


def request(port: int, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            timeout: float = 60.0) -> tuple[int, str, Any]:
    """One HTTP request to 127.0.0.1:port: (status, content type, parsed JSON body or text).

    `body` is sent as JSON; `raw` is sent as is (for malformed bodies).
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode("utf-8")
        ctype = resp.getheader("Content-Type", "")
        return resp.status, ctype, json.loads(text) if ctype.startswith("application/json") else text
    finally:
        conn.close()


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition: {'name{labels}': value}; comments skipped."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples

