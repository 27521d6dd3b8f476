"""The processes of a fault campaign (`rollout chaos`), each one a real process the
campaign can kill: Redis behind Sentinel (a primary and a replica, each with its AOF, and
three Sentinels: pipeline/redis_sentinel.py), `rollout sim-engine` simulators behind the
real sglang-router, `rollout worker` processes, a feeder (`rollout push --max-queued`)
and trainer processes (`python -m chaos.trainer`).

The feeder, the trainer and worker 0 reach Redis through its `redis+sentinel://` URL; the
other workers reach Redis and the router through fault proxies (chaos/fault_proxy.py),
whose Redis side asks Sentinel for the primary on each new connection. `supervise()`
replaces what died by itself and records it: a process that dies unasked is an incident.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.connection import connect
from pipeline.control import configure
from pipeline.queue import Queue
from pipeline.redis_server import Fsync, free_port
from pipeline.redis_sentinel import SentinelDeployment

from .fault_proxy import FaultProxy, ProxyThread
from local.processes import REDIS_URL_ENV, start_worker_process, stop_processes, wait_healthy
from local.router import RouterProcess

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "chaos"
DATASET = "chaos"  # the feeder's dataset name: group ids are chaos:<epoch>:<row>
DATASET_ROWS = 2000
#: Epochs sized so the feeder never runs dry: this many groups per second at most.
MAX_GROUPS_PER_S = 100
#: Sentinel's down-after-milliseconds: longer than a redis_kill's restart takes to listen
#: again (Sentinel counts a LOADING reply as up), so a restart is never a failover; a
#: failover or a long_outage lasts longer.
SENTINEL_DOWN_AFTER_MS = 5000
#: Workers that reach Redis through its Sentinel URL; the rest go through the fault proxy.
DIRECT_WORKERS = 1
#: The workers' preemption budget per sample (`--max-preemptions`): low, so an abort storm
#: spends some and the workers count its aborts as engine failures.
MAX_PREEMPTIONS = 4


@dataclass
class FleetSettings:
    seed: int = 0
    fsync: Fsync = Fsync.ALWAYS
    workers: int = 3
    simulators: int = 2
    batch_size: int = 8
    n_samples: int = 4
    step_s: float = 0.2  # the trainer's simulated step: long enough to be killed inside it
    lease_s: float = 6.0  # short, so a stopped worker is reaped within seconds
    heartbeat_s: float = 1.0
    request_timeout_s: float = 3.0  # an engine hang is cut off after this long
    concurrency: int = 8  # samples per engine per worker
    max_ready: int = 32  # results waiting for the trainer: keeps the drain short
    max_queued: int = 64  # the feeder keeps the prompt list this full
    minutes: float = 1.0  # sizes the dataset


@dataclass(eq=False)
class Proc:
    role: str
    popen: subprocess.Popen
    log_path: Path
    started: float
    busy: bool = False  # a fault is working on it
    stopped: bool = False  # SIGSTOPped
    killed: bool = False  # by the campaign: its end is no incident

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """kill -9, as a crash would."""
        self.killed = True
        self.signal(signal.SIGKILL)
        self.popen.wait()
        self.stopped = False

    def last_line(self) -> str:
        try:
            lines = [l for l in self.log_path.read_text(errors="replace").splitlines() if l.strip()]
        except OSError:
            return "(no log)"
        return lines[-1][-300:] if lines else "(empty log)"


def write_dataset(path: Path, rows: int, seed: int) -> None:
    """Arithmetic prompts the simulator answers (right with its skill), so rewards vary."""
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            f.write(json.dumps({"input": f"What is {a} + {b}?", "label": str(a + b)}) + "\n")


class Fleet:
    def __init__(self, settings: FleetSettings, run_dir: Path):
        self.s = settings
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.ledger_path = run_dir / "ledger.jsonl"
        self.drain_file = run_dir / "drain"
        self.dataset_path = run_dir / "prompts.jsonl"
        self.epochs = 1 + int(MAX_GROUPS_PER_S * settings.minutes * 60) // DATASET_ROWS
        self.redis = SentinelDeployment(run_dir / "redis", aof=True, fsync=settings.fsync,
                                        down_after_ms=SENTINEL_DOWN_AFTER_MS)
        self.redis_busy = False  # a fault holds data nodes down or moves the primary: one at a time
        self.redis_fault_ended = 0.0  # time.time() when the last such fault ended
        # A server every writer refuses (the eviction fault): a process started now would exit
        # at once (a refusal at start is a configuration error), so no fault starts one.
        self.refusing_writers = False
        self.run_dir = run_dir
        self.proxies = ProxyThread()
        self.queue: Queue | None = None
        self.sim_ports: list[int] = []
        self.sims: list[Proc] = []
        self.router: RouterProcess | None = None
        self.redis_proxy: FaultProxy | None = None
        self.router_proxy: FaultProxy | None = None
        self.workers: list[Proc] = []
        self.trainers: list[Proc] = []  # running, newest last
        self.feeder: Proc | None = None
        self.feeder_done = False
        self.incidents: list[str] = []
        self.sentinels_gone: set[int] = set()
        self.spawned: Counter = Counter()  # role -> processes started

    # -- URLs ------------------------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        return self.redis.url

    @property
    def sim_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.sim_ports]

    @property
    def current_trainer(self) -> Proc | None:
        return self.trainers[-1] if self.trainers else None

    # -- starting ----------------------------------------------------------------------------

    def start(self) -> None:
        self.redis.start()
        self.queue = Queue(connect(self.redis_url), NAMESPACE)
        configure(self.queue.redis, self.queue.keys, lease_s=self.s.lease_s, max_ready=self.s.max_ready)
        for i in range(self.s.simulators):
            self.sim_ports.append(free_port())
            self.sims.append(self._spawn_sim(i))
        for sim, url in zip(self.sims, self.sim_urls):
            wait_healthy(url, sim.popen, sim.log_path)
        # The router holds an engine out for 60 s after its circuit breaker opened, by
        # default: one 3-second burst of 5xx would stall generation for a minute.
        self.router = RouterProcess(self.sim_urls, self.logs / "router.log", ["--cb-timeout-duration-secs", "5"])
        self.router.wait_ready(self.sim_urls)
        self.redis_proxy = self.proxies.start("redis", seed=self.s.seed, resolve=self.redis.primary_address)
        self.router_proxy = self.proxies.start("router", "127.0.0.1", self.router.port, self.s.seed)
        write_dataset(self.dataset_path, DATASET_ROWS, self.s.seed)
        self.feeder = self._spawn_feeder()
        self.workers = [self._spawn_worker(i) for i in range(self.s.workers)]
        self.trainers.append(self._spawn_trainer())

    def _log_path(self, role: str) -> Path:
        self.spawned[role] += 1
        return self.logs / f"{role.replace(' ', '-')}.{self.spawned[role]}.log"

    def _popen(self, role: str, args: list[str]) -> Proc:
        path = self._log_path(role)
        env = dict(os.environ, **{REDIS_URL_ENV: self.redis_url})
        with path.open("w") as out:
            popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                     stdin=subprocess.DEVNULL)
        return Proc(role, popen, path, time.time())

    def _spawn_sim(self, i: int) -> Proc:
        return self._popen(f"sim {i}", [
            sys.executable, "-m", "cli", "sim-engine", "--port", str(self.sim_ports[i]),
            "--seed", str(self.s.seed + i), "--max-running", "64", "--decode-rate", "400",
            "--median-tokens", "24", "--p99-tokens", "240"])

    def _spawn_worker(self, i: int) -> Proc:
        role = f"worker {i}"
        path = self._log_path(role)
        url = self.redis_url if i < DIRECT_WORKERS else f"redis://{self.redis_proxy.address}"
        popen = start_worker_process(
            url, NAMESPACE, [f"http://{self.router_proxy.address}"], path,
            ["--concurrency", str(self.s.concurrency), "--max-new-tokens", "256",
             "--heartbeat", str(self.s.heartbeat_s), "--request-timeout", str(self.s.request_timeout_s),
             "--max-attempts", "5", "--max-preemptions", str(MAX_PREEMPTIONS)])
        return Proc(role, popen, path, time.time())

    def _spawn_trainer(self) -> Proc:
        return self._popen("trainer", [
            sys.executable, "-m", "chaos.trainer", "--namespace", NAMESPACE,
            "--engine-url", self.router.url, "--ledger", str(self.ledger_path),
            "--batch-size", str(self.s.batch_size), "--step-s", str(self.s.step_s),
            "--drain-file", str(self.drain_file), "--fenced-loop-dir", str(self.run_dir)])

    def _spawn_feeder(self) -> Proc:
        return self._popen("feeder", [
            sys.executable, "-m", "cli", "--namespace", NAMESPACE, "push", str(self.dataset_path),
            "--dataset-name", DATASET, "--n-samples", str(self.s.n_samples), "--epochs", str(self.epochs),
            "--max-queued", str(self.s.max_queued)])

    # -- replacing ---------------------------------------------------------------------------

    def respawn_worker(self, i: int) -> Proc:
        self.workers[i] = self._spawn_worker(i)
        return self.workers[i]

    def respawn_sim(self, i: int) -> Proc:
        """On the same port: the router knows the engine by its URL."""
        self.sims[i] = self._spawn_sim(i)
        return self.sims[i]

    def spawn_trainer(self) -> Proc:
        trainer = self._spawn_trainer()
        self.trainers.append(trainer)
        return trainer

    def stop_redis(self) -> None:
        """kill -9 of every data node (a long outage), left down until start_redis(): the
        supervisor does not restart them meanwhile (the caller holds redis_busy)."""
        for node in self.redis.nodes:
            node.kill()

    def start_redis(self) -> None:
        """The primary Sentinel still names first, from its AOF, then the other node as its
        replica."""
        primary = self.redis.primary_node()
        self.redis.start_node(primary)
        self.redis.start_node(self.redis.other(primary))

    def restart_redis(self) -> tuple[int, float]:
        """kill -9 of the primary, then the same server again from its AOF, still the
        primary (Sentinel's down-after is longer); returns its port and the seconds until
        it answered."""
        node = self.redis.primary_node()
        node.kill()
        started = time.monotonic()
        self.redis.start_node(node)
        return node.port, time.monotonic() - started

    def supervise(self, ledger: Callable[[], tuple[set[int], bool]]) -> list[str]:
        """Replace processes that died unasked; returns what happened, one line each.
        `ledger()` reads the ledger and returns the trainer pids that recorded `fenced` or
        `drained`, and whether a trainer finished the drain (no trainer is needed any more).
        It is read after a trainer was seen gone: it wrote its last record before it exited."""
        events = []
        for i, w in enumerate(self.workers):
            if w.alive or w.killed:
                continue
            # A worker started while Redis is down or failing over waits for it
            # (connect(wait_s=STARTUP_WAIT_S)): any exit is an incident.
            self._incident(events, w)
            self.respawn_worker(i)
        for i, sim in enumerate(self.sims):
            if not sim.alive and not sim.busy:
                self._incident(events, sim)
                self.respawn_sim(i)
        gone = [t for t in self.trainers if not t.alive]
        ended_cleanly, drained = ledger()
        for t in gone:
            self.trainers.remove(t)
            if not (t.popen.returncode == 0 and t.pid in ended_cleanly) and not t.killed:
                self._incident(events, t)
        if not self.trainers and not drained:
            self.spawn_trainer()
        if self.feeder is not None and not self.feeder.alive and not self.feeder_done:
            if self.feeder.popen.returncode == 0:
                self.feeder_done = True
                events.append("the feeder pushed the whole dataset")
            else:  # a feeder rides out Redis restarts: its exit is an incident
                self._incident(events, self.feeder)
                self.feeder = self._spawn_feeder()
        for node in self.redis.nodes:
            if not self.redis_busy and node.process is not None and node.process.poll() is not None:
                self.incidents.append(f"redis-server 127.0.0.1:{node.port} exited by itself with code "
                                      f"{node.process.returncode}")
                events.append(self.incidents[-1] + "; restarting it")
                self.redis.start_node(node)
        for i, sentinel in enumerate(self.redis.sentinels):
            if sentinel.poll() is not None and i not in self.sentinels_gone:
                self.sentinels_gone.add(i)
                self.incidents.append(f"Sentinel {i} exited by itself with code {sentinel.returncode}")
                events.append(self.incidents[-1])
        if self.router is not None and self.router.proc.poll() is not None:
            self.incidents.append(f"the router exited with code {self.router.proc.returncode}")
            events.append(self.incidents[-1])
            self.router = None
        return events

    def _incident(self, events: list[str], proc: Proc) -> None:
        self.incidents.append(f"{proc.role} (pid {proc.pid}) exited by itself with code {proc.popen.returncode}: "
                              f"{proc.last_line()}")
        events.append(self.incidents[-1] + "; replaced")

    # -- stopping ----------------------------------------------------------------------------

    def stop_feeder(self) -> None:
        if self.feeder is not None:
            self.feeder_done = True
            stop_processes([self.feeder.popen])

    def stop_processes(self) -> None:
        """Everything but Redis: workers hand their groups back on SIGTERM."""
        clients = self.workers + self.trainers + ([self.feeder] if self.feeder else [])
        for p in clients:
            if p.stopped:  # a stopped process acts on SIGTERM only once continued
                p.signal(signal.SIGCONT)
        self.feeder_done = True
        stop_processes([p.popen for p in clients])
        stop_processes([s.popen for s in self.sims])
        if self.router is not None:
            self.router.stop()
            self.router = None

    def close(self) -> None:
        try:
            self.stop_processes()
        finally:
            self.proxies.close()
            if self.queue is not None:
                self.queue.redis.close()
            self.redis.stop()
