"""`rollout up`: a local stack in the foreground with a live dashboard.

Embedded Redis (AOF on, registered as the local Redis so every other `rollout`
command finds it without --redis-url), SGLang simulators (unless engine URLs are
given), N worker processes, and a dashboard refreshing the status snapshot. Ctrl-C
(or SIGTERM) stops the workers (they hand their groups back), the simulators and
Redis, in that order. The Redis data directory is kept, so the next `rollout up`
continues where this one stopped.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.connection import connect, redact
from pipeline.control import configure, read_control
from pipeline.keys import Keys
from pipeline.queue import Queue
from pipeline.redis_server import (Fsync, RedisServer, RedisServerError, local_redis_url, register_local,
                                   rollout_home, unregister_local)
from pipeline.ops.status import RateTracker, snapshot
from pipeline.ops.status_render import one_line, render

from .processes import start_worker_process, stop_processes

log = logging.getLogger(__name__)

CRASH_LOOP_S = 10.0  # a worker that exits sooner than this after starting is not restarted


class StackError(RuntimeError):
    """The stack could not start; the message says why and what to do."""


@dataclass
class StackOptions:
    namespace: str = "rollout"
    workers: int = 2
    simulators: int = 1  # ignored when engine_urls are given
    engine_urls: list[str] = field(default_factory=list)
    data_dir: Path | None = None  # default: $ROLLOUT_HOME/stack
    redis_port: int | None = None  # None: a unix socket in the data directory
    fsync: Fsync = Fsync.ALWAYS  # when Redis's AOF reaches the disk
    worker_args: list[str] = field(default_factory=list)  # extra `rollout worker` options
    lease_s: float | None = None  # the namespace's worker lease (None: leave it as configured)
    sim_config: dict[str, Any] = field(default_factory=dict)  # SimConfig fields
    refresh_s: float = 1.0
    duration_s: float | None = None  # stop by itself after this long (scripted runs)


@dataclass
class WorkerProcess:
    index: int
    log_path: Path
    proc: subprocess.Popen
    started: float
    restarts: int = 0
    failed: str | None = None  # gave up restarting: last log line


class Stack:
    def __init__(self, opts: StackOptions):
        self.opts = opts
        self.data_dir = Path(opts.data_dir or rollout_home() / "stack")
        self.log_dir = self.data_dir / "logs"
        self.server: RedisServer | None = None
        self.sims: list = []
        self.engine_urls: list[str] = []
        self.workers: list[WorkerProcess] = []
        self.url: str | None = None
        self.client = None  # the stack's own connection to its Redis
        self._registered = False

    # -- lifecycle -----------------------------------------------------------------

    def start(self, say=lambda _msg: None) -> None:
        existing = local_redis_url()
        if existing:
            raise StackError(f"a local Redis is already running at {existing} (from another `rollout up` or "
                             "`rollout demo`): use it, or stop that one first")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server = RedisServer(self.data_dir / "redis", port=self.opts.redis_port, fsync=self.opts.fsync)
        try:
            self.url = self.server.start()
        except RedisServerError as exc:
            raise StackError(f"cannot start the embedded Redis: {exc}") from None
        register_local(self.server)
        self._registered = True
        say(f"redis {self.url} (data in {self.server.data_dir}, AOF on, fsync {self.opts.fsync.value})")
        self.client = connect(self.url)
        if self.opts.lease_s is not None:
            configure(self.client, Keys(self.opts.namespace), lease_s=self.opts.lease_s)
        if self.opts.engine_urls:
            self.engine_urls = list(self.opts.engine_urls)
        else:
            from engines.simulator import SimConfig, start_simulator

            base = dict(self.opts.sim_config)
            seed = int(base.pop("seed", 0))
            for i in range(max(1, self.opts.simulators)):
                sim = start_simulator(SimConfig(seed=seed + i, **base))
                self.sims.append(sim)
                self.engine_urls.append(sim.url)
            say(f"simulators {' '.join(self.engine_urls)}")
        for i in range(self.opts.workers):
            self.workers.append(self._spawn(i))
        say(f"{self.opts.workers} workers on namespace {self.opts.namespace!r}, logs in {self.log_dir}")

    def _spawn(self, index: int, restarts: int = 0) -> WorkerProcess:
        path = self.log_dir / f"worker-{index}.log"
        if restarts:  # keep the log of the run that died
            path.replace(path.with_suffix(f".log.{restarts}"))
        proc = start_worker_process(self.url, self.opts.namespace, self.engine_urls, path, self.opts.worker_args)
        return WorkerProcess(index, path, proc, time.monotonic(), restarts)

    def supervise(self) -> list[str]:
        """Restart workers that exited (they are stateless); give up on a crash loop; set
        --lease again if the namespace lost it (a purge deletes its settings with its keys).
        Returns what happened, one line per event."""
        events = []
        if self.opts.lease_s is not None:
            keys = Keys(self.opts.namespace)
            lease_s = read_control(self.client, keys).lease_s
            if lease_s != self.opts.lease_s:
                configure(self.client, keys, lease_s=self.opts.lease_s)
                events.append(f"the namespace's lease was {lease_s:g}s, not --lease {self.opts.lease_s:g} (its "
                              "settings were deleted, by a purge?): set it again")
        for i, w in enumerate(self.workers):
            code = w.proc.poll()
            if code is None or w.failed:
                continue
            if time.monotonic() - w.started < CRASH_LOOP_S:
                w.failed = f"exited with code {code} after {time.monotonic() - w.started:.1f}s: {_last_line(w.log_path)}"
                events.append(f"worker {i} {w.failed} (not restarted; log {w.log_path})")
                continue
            events.append(f"worker {i} exited with code {code}; restarting it")
            self.workers[i] = self._spawn(i, w.restarts + 1)
        return events

    def stop(self) -> None:
        stop_processes([w.proc for w in self.workers])
        for sim in self.sims:
            try:
                sim.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest
                log.warning("simulator stop failed: %s", exc)
        if self.server is not None:
            if self._registered:
                unregister_local(self.server)
            if self.client is not None:
                self.client.close()
            self.server.stop()

    # -- dashboard -----------------------------------------------------------------

    def header(self):
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(overflow="fold")
        grid.add_row("redis", redact(self.url or "-"))
        engines = ", ".join(u.replace("http://", "") for u in self.engine_urls)
        grid.add_row("engines", engines + (" (simulated)" if self.sims else ""))
        procs = []
        for w in self.workers:
            if w.failed:
                procs.append(f"{w.index}:failed")
            elif w.proc.poll() is None:
                procs.append(f"{w.index}:pid {w.proc.pid}" + (f" ({w.restarts} restarts)" if w.restarts else ""))
            else:
                procs.append(f"{w.index}:exited {w.proc.returncode}")
        grid.add_row("processes", ", ".join(procs))
        grid.add_row("logs", str(self.log_dir))
        return grid


    def not_registered(self, snap) -> list[str]:
        """Worker processes running but not (yet) in Redis, with the last line of their log:
        a worker waits for its engines to answer before it registers, and `workers 0` alone
        does not say so."""
        registered = {w.pid for w in snap.workers if w.alive}
        return [f"worker {w.index} (pid {w.proc.pid}) not registered yet: {_last_line(w.log_path)}"
                for w in self.workers if w.proc.poll() is None and not w.failed and w.proc.pid not in registered]


def _last_line(path: Path) -> str:
    try:
        lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][-200:] if lines else "(empty log)"


def run_stack(opts: StackOptions, console) -> None:
    """Start the stack, show the dashboard until Ctrl-C / SIGTERM / duration, stop it."""
    from rich.console import Group as RichGroup
    from rich.live import Live
    from rich.text import Text

    stack = Stack(opts)
    tracker = RateTracker()
    events: list[str] = []

    def on_term(_signum, _frame):
        raise KeyboardInterrupt

    def say(msg: str, style: str | None = None) -> None:
        console.print(msg, markup=False, highlight=False, soft_wrap=True, style=style)

    previous = signal.signal(signal.SIGTERM, on_term)
    hint = Text(f"add prompts: rollout --namespace {opts.namespace} push FILE    Ctrl-C: stop all", style="dim")
    try:
        stack.start(say=say)
        queue = Queue(connect(stack.url), opts.namespace)
        deadline = None if opts.duration_s is None else time.monotonic() + opts.duration_s

        def frame():
            snap = snapshot(queue, tracker)
            waiting = [Text(w, style="yellow") for w in stack.not_registered(snap)]
            extra = [Text("! " + e, style="red") for e in events[-3:]]
            return snap, RichGroup(stack.header(), render(snap, title=f"rollout up | {opts.namespace}"), *waiting,
                                   *extra, hint)

        if console.is_terminal:
            with Live(frame()[1], console=console, refresh_per_second=4, transient=False) as live:
                while deadline is None or time.monotonic() < deadline:
                    time.sleep(opts.refresh_s)
                    events.extend(stack.supervise())
                    live.update(frame()[1])
        else:
            # Not a terminal (a log file, CI, a pipe): one line per refresh, events as they happen.
            said_waiting: list[str] = []
            while deadline is None or time.monotonic() < deadline:
                for e in stack.supervise():
                    say("! " + e)
                snap = frame()[0]
                say(one_line(snap))
                waiting = stack.not_registered(snap)
                if waiting != said_waiting:  # said when it changes, not every refresh
                    for w in waiting:
                        say(w)
                    said_waiting = waiting
                time.sleep(opts.refresh_s)
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C must not leave processes behind: stop uninterrupted (it has timeouts).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            started = stack.url is not None  # Redis answered: there is something to stop and keep
            if started:
                say("stopping: workers hand their groups back, then simulators and Redis ...")
            stack.stop()
            if started:
                say(f"stopped; Redis data kept in {stack.data_dir / 'redis'} "
                    "(the next `rollout up` continues from it)")
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)
