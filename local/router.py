"""The real SGLang router (sglang-router, Rust) as a child process, for the fault campaign
and the tests: `python -m sglang_router.launch_router` on a free port, its output in a
log file. It is ready when GET /workers lists every engine: the router registers
--worker-urls in the background, after /health already answers.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.redis_server import free_port

from .processes import stop_processes

STARTUP_TIMEOUT_S = 30.0


class RouterError(RuntimeError):
    """The router is not installed, exited, or never listed its engines; the message says which."""


def router_engine_urls(router_url: str) -> list[str]:
    """The engine URLs the router lists (empty while it is not up)."""
    try:
        with urllib.request.urlopen(router_url + "/workers", timeout=2) as resp:
            return [w["url"] for w in json.loads(resp.read())["workers"]]
    except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError):
        return []


def require_router() -> None:
    """RouterError, saying how to install it, when sglang-router is not installed."""
    try:
        import sglang_router  # noqa: F401
    except ImportError as exc:
        raise RouterError(f"sglang-router is not installed ({exc}): pip install -e '.[router]' in your clone "
                          "(the router extra)") from None


class RouterProcess:
    def __init__(self, worker_urls: list[str], log_path: str | Path, extra_args: list[str] | tuple = ()):
        require_router()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = str(log_path)
        self._log = open(log_path, "wb")  # noqa: SIM115 - open while the router runs; stop() closes it
        args = [sys.executable, "-m", "sglang_router.launch_router",
                "--worker-urls", *worker_urls,
                "--host", "127.0.0.1", "--port", str(self.port),
                # the metrics exporter defaults to 0.0.0.0:29000: two routers would collide
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--log-level", "warn", *extra_args]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self.startup_s: float | None = None

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def wait_ready(self, expected: list[str], timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RouterError(f"sglang router exited with {self.proc.returncode}:\n{self.log_tail()}")
            if sorted(router_engine_urls(self.url)) == sorted(expected):
                self.startup_s = time.monotonic() - self.started
                return
            time.sleep(0.05)
        raise RouterError(f"sglang router at {self.url} did not list {expected} within {timeout:g}s:\n"
                          f"{self.log_tail()}")

    def stop(self) -> None:
        stop_processes([self.proc], timeout_s=10)  # SIGTERM first: the router waits for in-flight requests
        self._log.close()
