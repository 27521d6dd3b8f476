#!/usr/bin/env python
"""Pause/resume latency of the weight-update protocol under load.

Setup (all local, all real processes): a redis-server, two SGLang simulators
(`rollout sim-engine`), the real sglang-router in front of them
(`--policy round_robin`), W worker processes generating through the router, a
feeder keeping the prompt list topped up and a trainer thread consuming and
committing batches. Then, for each pause mode (abort, retract, in_place), K times:
let generation run, then

    pause(mode) → update_weights_from_disk on every engine (weight_version v) → resume(v)

and record per update:

  quiesce_s       Controller.pause() → it returned: admission stopped, every engine
                  paused and, in abort mode, every in-flight group requeued
                  (PauseReport.quiesce_s)
  first_claim_s   Controller.resume() reopened admission → the first new claim by any
                  worker (the stats counter `claims` polled here; resume() itself does not wait)
  state_s         pause() called → every worker's in-process state is "paused" (each
                  worker child reports state changes with a timestamp; a worker
                  that never shows it within the window counts as missing)
  info_s          pause() called → every worker's heartbeat (worker_info in Redis,
                  what `rollout status` shows) says "paused"

Every figure is reported as median and max per mode, with the audit at the end.

    python bench/pause.py             # K=10 per mode, 2 workers
    python bench/pause.py --quick     # K=3 per mode, under a minute
    python bench/pause.py --json      # one JSON object on stdout
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.ops.audit import audit  # noqa: E402
from pipeline.connection import connect  # noqa: E402
from pipeline.consumer import BatchTimeout, Consumer  # noqa: E402
from pipeline.control import read_control  # noqa: E402
from bench.report import run_bench  # noqa: E402
from pipeline.controller import Controller  # noqa: E402
from pipeline.queue import Queue  # noqa: E402
from pipeline.redis_server import RedisServer, free_port  # noqa: E402
from pipeline.types import Group  # noqa: E402

MODES = ("abort", "retract", "in_place")
NAMESPACE = "pausebench"
log = logging.getLogger("bench.pause")


# -- the worker child: a real Worker plus a state reporter -------------------------------


def state_key(namespace: str) -> str:
    return f"{{{namespace}}}:bench:states"


def worker_child(args: argparse.Namespace) -> None:
    """Run one Worker; a thread writes (state, wall time) to Redis at every state change,
    so the parent can time what the process itself believes."""
    from workers.worker import SamplingSettings, Worker, WorkerSettings

    settings = WorkerSettings(redis_url=args.redis_url, engine_urls=[args.engine_url], namespace=args.namespace,
                              concurrency_per_engine=args.concurrency, heartbeat_s=args.heartbeat,
                              sampling=SamplingSettings(max_new_tokens=args.max_new_tokens))
    worker = Worker(settings)
    stop = threading.Event()

    def report_states() -> None:
        r = connect(args.redis_url)
        last = None
        while not stop.is_set():
            state = worker.state()  # read from this thread: a snapshot of plain attributes
            if state != last:
                r.rpush(state_key(args.namespace) + ":" + worker.id, json.dumps([state, time.time()]))
                last = state
            time.sleep(0.0005)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, worker.stop)
        await worker.run()

    threading.Thread(target=report_states, daemon=True).start()
    try:
        asyncio.run(main())
    finally:
        stop.set()


# -- the parent ------------------------------------------------------------------------------


def http_json(url: str, body: dict | None = None, timeout: float = 5.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


class Stack:
    """redis-server, 2 simulators, the router and W worker processes."""

    def __init__(self, tmp: Path, n_workers: int, concurrency: int, max_new_tokens: int, heartbeat: float):
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        self.redis = RedisServer(tmp / "redis", port=free_port(), aof=False)
        self.redis.start()
        self.sim_urls = []
        for i in range(2):
            port = free_port()
            self._spawn([sys.executable, "-m", "cli", "sim-engine", "--port", str(port), "--seed", str(i),
                         "--decode-rate", "1500", "--median-tokens", "96", "--p99-tokens", "900"],
                        tmp / f"sim{i}.log")
            self.sim_urls.append(f"http://127.0.0.1:{port}")
        for url in self.sim_urls:
            wait_until(lambda: http_json(url + "/health") is None, 30, f"simulator {url}")
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        self._spawn([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *self.sim_urls,
                     "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                     "--prometheus-port", str(free_port()), "--policy", "round_robin", "--log-level", "warn"],
                    tmp / "router.log")
        wait_until(lambda: sorted(w["url"] for w in http_json(self.router_url + "/workers")["workers"])
                   == sorted(self.sim_urls), 30, "the router to list both engines")
        self.workers = []
        for i in range(n_workers):
            self.workers.append(self._spawn(
                [sys.executable, str(Path(__file__).resolve()), "--worker-child", "--redis-url", self.redis.url,
                 "--namespace", NAMESPACE, "--engine-url", self.router_url, "--concurrency", str(concurrency),
                 "--max-new-tokens", str(max_new_tokens), "--heartbeat", str(heartbeat)], tmp / f"worker{i}.log"))

    def _spawn(self, cmd: list[str], log_path: Path) -> subprocess.Popen:
        f = open(log_path, "wb")
        self.logs.append(f)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in reversed(self.procs):  # workers first: they hand their groups back
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for f in self.logs:
            f.close()
        self.redis.stop()


class Load:
    """A feeder keeping `depth` prompts queued and a trainer committing batches of B."""

    def __init__(self, redis_url: str, depth: int, batch: int, n_samples: int):
        self.queue = Queue(connect(redis_url), NAMESPACE)
        self.consumer = Consumer(connect(redis_url), NAMESPACE, block_s=0.2)
        self.depth, self.batch, self.n_samples = depth, batch, n_samples
        self.pushed = 0
        self.trained: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._feed, daemon=True),
                         threading.Thread(target=self._train, daemon=True)]
        for t in self._threads:
            t.start()

    def _feed(self) -> None:
        while not self._stop.is_set():
            missing = self.depth - self.queue.redis.llen(self.queue.keys.prompts)
            if missing > 0:
                groups = [Group.fresh(f"p{self.pushed + i}", f"What is {(self.pushed + i) % 90 + 2} + 7?",
                                      self.n_samples, label=str((self.pushed + i) % 90 + 9), row=self.pushed + i)
                          for i in range(missing)]
                self.queue.push_groups(groups)
                self.pushed += missing
            time.sleep(0.02)

    def _train(self) -> None:
        while not self._stop.is_set():
            try:
                b = self.consumer.next_batch(self.batch, timeout=0.5)
            except BatchTimeout:
                continue
            self.trained += [g.group_id for g in b.groups]
            self.consumer.commit(b)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)


def worker_ids(queue: Queue) -> list[str]:
    return [w.decode() for w in queue.redis.zrange(queue.keys.workers, 0, -1)]


def paused_times(queue: Queue, workers: list[str], since: float) -> dict[str, float | None]:
    """Seconds from `since` (wall time) to each worker's first in-process 'paused' state after it."""
    out: dict[str, float | None] = {}
    for w in workers:
        rows = [json.loads(x) for x in queue.redis.lrange(state_key(NAMESPACE) + ":" + w, -200, -1)]
        hits = [t for state, t in rows if state == "paused" and t >= since]
        out[w] = (min(hits) - since) if hits else None
    return out


class InfoWatcher:
    """Polls worker_info (the heartbeat) every 5 ms: when does each worker read 'paused'?"""

    def __init__(self, redis_url: str, queue: Queue, workers: list[str], window: float):
        self.redis_url, self.queue, self.workers, self.window = redis_url, queue, workers, window
        self.seen: dict[str, float] = {}
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        r = connect(self.redis_url)
        while time.monotonic() - self.started < self.window and len(self.seen) < len(self.workers):
            for w, raw in zip(self.workers, r.hmget(self.queue.keys.worker_info, self.workers)):
                if w not in self.seen and raw and json.loads(raw).get("state") == "paused":
                    self.seen[w] = time.monotonic() - self.started
            time.sleep(0.005)

    def result(self) -> float | None:
        self.thread.join()
        return max(self.seen.values()) if len(self.seen) == len(self.workers) else None


class TimedEngines:
    """The EngineSet, timing each pause_generation fan-out (router discovery included)."""

    def __init__(self, engines):
        self.engines = engines
        self.last_pause_s: float | None = None

    async def pause_generation(self, mode: str = "abort"):
        started = time.monotonic()
        try:
            return await self.engines.pause_generation(mode)
        finally:
            self.last_pause_s = time.monotonic() - started

    async def continue_generation(self):
        return await self.engines.continue_generation()

    async def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False,
                                       flush_cache=True):
        return await self.engines.update_weights_from_disk(model_path, weight_version, abort_all_requests,
                                                           flush_cache)


def first_claim(queue: Queue, claims_before: int, since: float, timeout_s: float = 5.0) -> float | None:
    """Seconds from `since` to the first claim after it (None: none within the timeout)."""
    while time.monotonic() - since < timeout_s:
        if queue.stats().get("claims", 0) > claims_before:
            return time.monotonic() - since
        time.sleep(0.001)
    return None


def summarize(values: list[float | None]) -> dict:
    got = [v for v in values if v is not None]
    return {"median": round(statistics.median(got), 4) if got else None,
            "max": round(max(got), 4) if got else None,
            "missing": len(values) - len(got)}


def measure(args: argparse.Namespace) -> dict:
    from workers.engine_set import EngineSet

    with tempfile.TemporaryDirectory(prefix="pausebench-") as tmp_dir:
        tmp = Path(tmp_dir)
        stack = Stack(tmp, args.workers, args.concurrency, args.max_new_tokens, args.heartbeat)
        load = None
        loop = asyncio.new_event_loop()
        engines = EngineSet([stack.router_url])
        try:
            queue = Queue(connect(stack.redis.url), NAMESPACE)
            load = Load(stack.redis.url, depth=args.depth, batch=args.batch, n_samples=args.n_samples)
            wait_until(lambda: len(worker_ids(queue)) == args.workers, 60, "workers to register")
            wait_until(lambda: len(load.trained) >= 2 * args.batch, 60, "a first few batches")
            timed = TimedEngines(engines)
            controller = Controller(queue, timed)
            workers = worker_ids(queue)
            version = 0
            per_mode: dict[str, dict] = {}
            for mode in MODES:
                rows = []
                for _ in range(args.updates):
                    time.sleep(args.run_s)  # generation under load between updates
                    version += 1
                    inflight_before = queue.inflight_count()
                    watcher = InfoWatcher(stack.redis.url, queue, workers, window=args.heartbeat * 3 + 1)
                    called = time.time()
                    pause = loop.run_until_complete(controller.pause(mode, timeout_s=args.pause_timeout))
                    loop.run_until_complete(engines.update_weights_from_disk(
                        f"/ckpt/step{version}", weight_version=str(version), flush_cache=mode == "abort"))
                    time.sleep(args.hold_s)  # as if the weight sync took this long
                    claims_before = queue.stats().get("claims", 0)
                    resumed_at = time.monotonic()
                    resume = loop.run_until_complete(controller.resume(version))
                    first_claim_s = first_claim(queue, claims_before, resumed_at)
                    info_s = watcher.result()
                    states = paused_times(queue, workers, called)
                    rows.append({"quiesce_s": pause.quiesce_s, "engines_pause_s": timed.last_pause_s,
                                 "still_inflight": pause.still_inflight, "first_claim_s": first_claim_s,
                                 "state_s": None if None in states.values() else max(states.values()),
                                 "state_per_worker_s": states, "info_s": info_s,
                                 "requeued": pause.requeued, "released": resume.released,
                                 "inflight_at_pause": inflight_before})
                per_mode[mode] = {
                    "quiesce_s": summarize([r["quiesce_s"] for r in rows]),
                    "engines_pause_s": summarize([r["engines_pause_s"] for r in rows]),
                    "first_claim_s": summarize([r["first_claim_s"] for r in rows]),
                    "state_paused_s": summarize([r["state_s"] for r in rows]),
                    "heartbeat_paused_s": summarize([r["info_s"] for r in rows]),
                    "requeued_per_pause": [r["requeued"] for r in rows],
                    "still_inflight_per_pause": [r["still_inflight"] for r in rows],
                    "inflight_at_pause": [r["inflight_at_pause"] for r in rows],
                    "updates": rows,
                }
            load.stop()
            trained = list(load.trained)
            load = None
            for w in stack.workers:
                w.terminate()
            for w in stack.workers:
                w.wait(30)
            report = audit(queue)
            versions = loop.run_until_complete(engines.weight_versions())
            return {
                "command": " ".join([sys.executable, "bench/pause.py"] + sys.argv[1:]),
                "setup": {"workers": args.workers, "engines": 2, "router": "sglang_router round_robin",
                          "updates_per_mode": args.updates, "concurrency_per_engine": args.concurrency,
                          "n_samples": args.n_samples, "max_new_tokens": args.max_new_tokens,
                          "heartbeat_s": args.heartbeat, "hold_s": args.hold_s, "run_s": args.run_s},
                "modes": per_mode,
                "trained_groups": len(trained),
                "trained_unique": len(set(trained)),
                "final_weight_version": read_control(queue.redis, queue.keys).weight_version,
                "engine_versions": versions,
                "audit": {"ok": report.ok, "summary": report.summary()},
            }
        finally:
            if load is not None:
                load.stop()
            loop.run_until_complete(engines.close())
            loop.close()
            stack.stop()


def print_table(result: dict) -> None:
    print(f"pause benchmark: {result['setup']}")
    print(f"{'mode':10} {'metric':20} {'median':>10} {'max':>10} {'missing':>8}")
    for mode, m in result["modes"].items():
        for metric in ("quiesce_s", "engines_pause_s", "first_claim_s", "state_paused_s", "heartbeat_paused_s"):
            s = m[metric]
            fmt = lambda v: "-" if v is None else f"{v * 1000:.1f}ms"  # noqa: E731
            print(f"{mode:10} {metric:20} {fmt(s['median']):>10} {fmt(s['max']):>10} {s['missing']:>8}")
        print(f"{mode:10} in flight at pause {m['inflight_at_pause']}, requeued {m['requeued_per_pause']}, "
              f"still in flight when pause() returned {m['still_inflight_per_pause']}")
    print(f"trained {result['trained_groups']} groups ({result['trained_unique']} unique); "
          f"weight version {result['final_weight_version']}; engines {result['engine_versions']}")
    print(f"audit: {result['audit']['summary']}")


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 updates per mode (under a minute)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--updates", type=int, help="weight updates per mode (default 10, --quick 3)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32, help="samples per engine per worker")
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--depth", type=int, default=64, help="prompts kept queued")
    p.add_argument("--heartbeat", type=float, default=0.5, help="workers' heartbeat period")
    p.add_argument("--run-s", type=float, default=None, help="generation time between updates")
    p.add_argument("--hold-s", type=float, default=0.05, help="paused time, as a weight sync")
    p.add_argument("--pause-timeout", type=float, default=30.0)
    # the worker child
    p.add_argument("--worker-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--redis-url", help=argparse.SUPPRESS)
    p.add_argument("--namespace", default=NAMESPACE, help=argparse.SUPPRESS)
    p.add_argument("--engine-url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_child:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        worker_child(args)
        sys.exit(0)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.updates is None:
        args.updates = 3 if args.quick else 10
    if args.run_s is None:
        args.run_s = 0.7 if args.quick else 1.0
    result = measure(args)
    if not args.json:
        print_table(result)
    return result


if __name__ == "__main__":
    run_bench(main)
