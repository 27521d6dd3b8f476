"""Starting and stopping local worker and engine processes (used by `rollout demo` and `rollout up`)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent

#: Where `rollout` reads the Redis URL from when --redis-url is not given.
REDIS_URL_ENV = "ROLLOUT_REDIS_URL"


def start_worker_process(redis_url: str, namespace: str, engine_urls: list[str], log_path: Path,
                         extra_args: list[str] | None = None) -> subprocess.Popen:
    """`rollout worker` as a child process, its output in `log_path`. The Redis URL,
    which may hold a password, goes through the environment: any user can read a
    process's arguments (`ps`), only its owner its environment."""
    args = [sys.executable, "-m", "cli", "--namespace", namespace, "-v", "worker"]
    for url in engine_urls:
        args += ["--engine-url", url]
    env = dict(os.environ, **{REDIS_URL_ENV: redis_url})
    with log_path.open("w") as log_file:
        return subprocess.Popen(args + (extra_args or []), stdout=log_file, stderr=subprocess.STDOUT, cwd=_REPO,
                                env=env)


def start_torch_engine_process(port: int, log_path: Path, extra_args: list[str] | None = None) -> subprocess.Popen:
    """`rollout torch-engine` as a child process on `port`, its output in `log_path`."""
    args = [sys.executable, "-m", "cli", "torch-engine", "--port", str(port)]
    with log_path.open("w") as log_file:
        return subprocess.Popen(args + (extra_args or []), stdout=log_file, stderr=subprocess.STDOUT, cwd=_REPO)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 60.0) -> None:
    """Until GET url/health answers 200; a clear error with the log's tail if the
    process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout_s:g}s: {log_path.read_text()[-2000:]}")


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 15.0) -> bool:
    """SIGTERM (a worker hands its in-flight groups back, then exits); SIGKILL after the
    timeout. True when every process exited by itself."""
    clean = True
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            clean = False
    return clean
