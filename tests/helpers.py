"""Test helpers: run a real Worker on its own event loop in a thread."""
from __future__ import annotations

import asyncio
import threading
import time

from workers.worker import Worker, WorkerSettings


class WorkerThread:
    """A real worker (real HTTP to the engines, real Redis) in a background thread."""

    def __init__(self, settings: WorkerSettings, reward=None):
        self.settings = settings
        self.worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(reward,), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("worker thread did not start")
        if self.error:
            raise self.error

    def _run(self, reward) -> None:
        async def main():
            self.worker = Worker(self.settings, reward=reward)
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            await self.worker.run()

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by stop()
            self.error = exc
            self._ready.set()

    def stop(self, timeout: float = 30) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.worker.stop)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "worker did not stop"
        if self.error:
            raise self.error


def wait_for(predicate, timeout: float = 30, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
