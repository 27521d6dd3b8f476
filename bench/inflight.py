#!/usr/bin/env python
"""In-flight capacity: one `rollout worker` process against SGLang simulators.

The target (issue 3): ONE worker process keeps at least 4,096 requests in flight
against simulators on this machine; report the figure and the worker's CPU per
1,000 requests per second.

What runs (all started here, all stopped on exit, Ctrl-C and errors included):

  redis-server      embedded (pipeline.redis_server.RedisServer, AOF on as in production)
  S simulators      `rollout sim-engine` subprocesses on free ports; max-running high enough
                    that nothing waits in their queue, long outputs at a modest decode rate
                    so every request stays in flight for seconds
  1 worker          `rollout worker --engine-url <each simulator> --concurrency C`:
                    capacity C x S samples
  this process      feeder (keeps the prompt list topped up with groups of 8), trainer
                    (Consumer.next_batch + commit, so the results backlog never stops
                    admission) and a sampler (every 0.5 s)

Phases: ramp (prompts are fed at a steady rate up to the worker's capacity, so the
generations start staggered instead of all at t=0), settle, then the measurement
window. Only the window is reported.

Figures (over the window):

  inflight          requests on the engines: sum over simulators of num_running_reqs +
                    num_waiting_reqs from GET /sim/stats (the simulator-only endpoint),
                    sampled every 0.5 s; min / mean / max / p5
  worker_slots      the worker's own count of samples it holds (heartbeat
                    `inflight_samples`): a group of 8 holds 8 slots until its SLOWEST
                    sample is done, so slots >= requests
  requests_per_s    completed /generate requests per second: growth of the simulators'
                    `finished` counters
  worker_cpu_cores  CPU seconds (user+sys, /proc/<pid>/stat) of the worker process per
                    wall second; worker_cpu_per_1k_rps = cores / (requests_per_s / 1000),
                    i.e. cores needed per 1,000 requests/s; worker_cpu_us_per_token = its CPU
                    per token the simulators generated (their `decode_tokens`), to compare
                    reading answers whole with reading them as streams (--worker-arg=--stream)
  *_cpu_cores       the same for the simulators, redis-server and this process, and the
                    machine's total from /proc/stat, so you can see where the cores went

    python bench/inflight.py              # full run (about 4.5 minutes), a short table
    python bench/inflight.py --quick      # under a minute
    python bench/inflight.py --json       # one JSON object on stdout
    python bench/inflight.py --worker-arg=--stream   # the worker reads answers as streams
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/<name>.py` from a clone
    sys.path.insert(0, str(REPO))

from bench.report import run_bench
from pipeline.connection import connect
from pipeline.consumer import BatchTimeout, Consumer
from pipeline.control import configure
from pipeline.keys import Keys
from pipeline.queue import Queue
from pipeline.redis_server import RedisServer, free_port
from pipeline.types import Group
from local.processes import stop_processes

log = logging.getLogger("bench.inflight")

TARGET_INFLIGHT = 4096
N_SAMPLES = 8
NAMESPACE = "bench-inflight"
CLK_TCK = os.sysconf("SC_CLK_TCK")
SAMPLE_EVERY_S = 0.5
# On a loaded machine one sample can take longer than the whole quick window: the window
# is then extended (by up to its own length, at least a minute) until it holds this many.
MIN_WINDOW_SAMPLES = 3


# -- processes -----------------------------------------------------------------------

def _die_with_parent() -> None:
    """Children get SIGTERM if this process dies, even by kill -9 (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    with log_path.open("w") as out:
        # Own session: Ctrl-C reaches only this process, which stops children in order.
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                preexec_fn=_die_with_parent)


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process (its threads included), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over cores."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already in user
    return (total - idle) / CLK_TCK, total / CLK_TCK


def _get_json(url: str, timeout: float = 60.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


# -- the run -------------------------------------------------------------------------

@dataclass
class Sample:
    t: float  # seconds since the ramp started
    phase: str
    inflight: int  # running + waiting over all simulators
    running: int
    waiting: int
    finished: int  # cumulative over all simulators
    submitted: int
    decode_tokens: int  # tokens generated, cumulative over all simulators
    worker_slots: int | None
    worker_groups: int | None
    worker_state: str | None
    worker_cpu: float
    worker_rss_mb: float | None
    sim_cpu: float
    redis_cpu: float
    bench_cpu: float
    machine_busy: float
    machine_total: float
    prompts: int
    results: int
    committed_groups: int


@dataclass
class Trainer:
    """The trainer's side, so the results backlog never blocks admission."""

    url: str
    batch_size: int
    stop: threading.Event = field(default_factory=threading.Event)
    committed_groups: int = 0
    committed_samples: int = 0
    error: BaseException | None = None

    def run(self) -> None:
        try:
            consumer = Consumer(connect(self.url), NAMESPACE, consumer="bench-trainer", block_s=0.2)
            while not self.stop.is_set():
                try:
                    batch = consumer.next_batch(self.batch_size, timeout=0.5)
                except BatchTimeout:
                    continue
                consumer.commit(batch)
                self.committed_groups += len(batch.groups)
                self.committed_samples += sum(g.n_samples for g in batch.groups)
        except BaseException as exc:  # reported by the main thread
            self.error = exc


def _groups(start: int, count: int, rng: random.Random) -> list[Group]:
    out = []
    for i in range(start, start + count):
        a, b = rng.randrange(1000), rng.randrange(1000)
        out.append(Group.fresh(f"bench:{i}", f"Question {i}. What is {a} + {b}? Put the answer in \\boxed{{}}.",
                               N_SAMPLES, label=str(a + b), dataset="bench", row=i))
    return out


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-inflight-"))
        self.server: RedisServer | None = None
        self.sims: list[subprocess.Popen] = []
        self.sim_urls: list[str] = []
        self.worker: subprocess.Popen | None = None
        self.trainer: Trainer | None = None
        self.trainer_thread: threading.Thread | None = None
        self.pushed = 0
        self.rng = random.Random(args.seed)
        self.samples: list[Sample] = []
        self.missed = 0  # readings skipped (see _sample)
        self.worker_stop_s: float | None = None
        self.worker_stop_clean: bool | None = None

    # -- setup / teardown ------------------------------------------------------------

    def start(self) -> None:
        a = self.args
        self.server = RedisServer(self.tmp / "redis", port=free_port())
        self.url = self.server.start()
        self.redis = connect(self.url)
        self.queue = Queue(self.redis, NAMESPACE)
        self.keys = Keys(NAMESPACE)
        configure(self.redis, self.keys, max_ready=a.max_ready)
        for i in range(a.engines):
            port = free_port()
            self.sims.append(_spawn([
                sys.executable, "-m", "cli", "sim-engine", "--port", str(port), "--seed", str(a.seed + i),
                "--max-running", str(a.max_running), "--decode-rate", str(a.decode_rate),
                "--median-tokens", str(a.median_tokens), "--p99-tokens", str(a.p99_tokens),
            ], self.tmp / f"sim-{i}.log"))
            self.sim_urls.append(f"http://127.0.0.1:{port}")
        self._wait_for_simulators()
        self.worker = _spawn(self.worker_command(), self.tmp / "worker.log")
        self._wait_for_worker()
        self.trainer = Trainer(self.url, a.train_batch)
        self.trainer_thread = threading.Thread(target=self.trainer.run, name="trainer", daemon=True)
        self.trainer_thread.start()

    def worker_command(self) -> list[str]:
        cmd = [sys.executable, "-m", "cli", "--redis-url", self.url, "--namespace", NAMESPACE, "-v", "worker",
               "--concurrency", str(self.args.concurrency), "--max-new-tokens", str(self.args.max_new_tokens)]
        for u in self.sim_urls:
            cmd += ["--engine-url", u]
        return cmd + list(self.args.worker_arg)

    def _wait_for_simulators(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for i, (proc, url) in enumerate(zip(self.sims, self.sim_urls)):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"simulator {i} exited ({proc.returncode}):\n{_tail(self.tmp / f'sim-{i}.log')}")
                try:
                    urllib.request.urlopen(url + "/health", timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"simulator {url} did not answer /health within {timeout_s:g}s") from None
                    time.sleep(0.1)

    def _wait_for_worker(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if self._worker_info() is not None:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the worker did not heartbeat within {timeout_s:g}s:\n{_tail(self.tmp / 'worker.log')}")

    def _worker_info(self) -> dict | None:
        for raw in self.redis.hvals(self.keys.worker_info):
            info = json.loads(raw)
            if info.get("pid") == self.worker.pid:
                return info
        return None

    def _check_alive(self) -> None:
        if self.worker is not None and self.worker.poll() is not None:
            raise RuntimeError(f"the worker exited ({self.worker.returncode}):\n{_tail(self.tmp / 'worker.log')}")
        for i, p in enumerate(self.sims):
            if p.poll() is not None:
                raise RuntimeError(f"simulator {i} exited ({p.returncode}):\n{_tail(self.tmp / f'sim-{i}.log')}")
        if self.trainer is not None and self.trainer.error is not None:
            raise RuntimeError(f"the trainer thread failed: {self.trainer.error!r}")

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.stop.set()
        # The worker first: on SIGTERM it hands its groups back to the prompt list. The
        # Redis data is thrown away, so a worker slow to stop is killed after the grace.
        if self.worker is not None:
            t = time.monotonic()
            self.worker_stop_clean = stop_processes([self.worker], timeout_s=self.args.stop_grace)
            self.worker_stop_s = time.monotonic() - t
        if self.trainer_thread is not None:
            self.trainer_thread.join(timeout=5)
        stop_processes(self.sims, timeout_s=5)
        if self.server is not None:
            self.server.kill()  # nothing to keep
        if not self.args.keep:
            import shutil

            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- running ---------------------------------------------------------------------

    def _feed(self, want_total: int) -> None:
        """Push so that `want_total` groups have been pushed; top the list up to `backlog`."""
        depth = self.redis.llen(self.keys.prompts)
        want = max(want_total - self.pushed, self.args.backlog - depth)
        while want > 0:
            chunk = min(want, 500)
            self.queue.push_groups(_groups(self.pushed, chunk, self.rng))
            self.pushed += chunk
            want -= chunk

    def _sample(self, t: float, phase: str) -> Sample | None:
        """One reading of everything, or None (counted in `missed`) when a simulator or
        Redis did not answer in time: a busy machine skips a sample, not the run."""
        try:
            return self._read(t, phase)
        except (OSError, redis.ConnectionError, redis.TimeoutError) as exc:  # slow or cut, HTTP or Redis
            self.missed += 1
            log.warning("t=%.1fs: sample skipped (%s: %s)", t, type(exc).__name__, exc)
            return None

    def _read(self, t: float, phase: str) -> Sample:
        running = waiting = finished = submitted = decode_tokens = 0
        for url in self.sim_urls:
            s = _get_json(url + "/sim/stats")
            running += s["load"]["num_running_reqs"]
            waiting += s["load"]["num_waiting_reqs"]
            finished += s["stats"].get("finished", 0)
            submitted += s["stats"].get("submitted", 0)
            decode_tokens += s["stats"].get("decode_tokens", 0)
        info = self._worker_info() or {}
        busy, total = machine_cpu()
        return Sample(
            t=t, phase=phase, inflight=running + waiting, running=running, waiting=waiting, finished=finished,
            submitted=submitted, decode_tokens=decode_tokens, worker_slots=info.get("inflight_samples"), worker_groups=info.get("inflight_groups"),
            worker_state=info.get("state"), worker_cpu=cpu_seconds(self.worker.pid) or 0.0,
            worker_rss_mb=rss_mb(self.worker.pid),
            sim_cpu=sum(cpu_seconds(p.pid) or 0.0 for p in self.sims),
            redis_cpu=cpu_seconds(self.server.process.pid) or 0.0, bench_cpu=cpu_seconds(os.getpid()) or 0.0,
            machine_busy=busy, machine_total=total, prompts=self.redis.llen(self.keys.prompts),
            results=self.redis.xlen(self.keys.results), committed_groups=self.trainer.committed_groups,
        )

    def run(self) -> None:
        a = self.args
        capacity = a.concurrency * a.engines
        groups_at_capacity = math.ceil(capacity / N_SAMPLES)
        phases = (("ramp", a.ramp_s), ("settle", a.settle_s), ("measure", a.measure_s))
        t0 = time.monotonic()
        next_tick = t0
        end_of = {}
        acc = 0.0
        for name, seconds in phases:
            acc += seconds
            end_of[name] = acc
        total_s = acc
        extend_s = max(a.measure_s, 60.0)
        last_report = -1
        while True:
            t = time.monotonic() - t0
            measured = sum(1 for s in self.samples if s.phase == "measure")
            if t >= total_s and (measured >= MIN_WINDOW_SAMPLES or t >= total_s + extend_s):
                break
            phase = next((name for name, _ in phases if t < end_of[name]), "measure")
            ramp_fraction = min(1.0, t / a.ramp_s) if a.ramp_s > 0 else 1.0
            self._feed(math.ceil(groups_at_capacity * ramp_fraction))
            self._check_alive()
            s = self._sample(t, phase)
            if s is None:
                continue
            self.samples.append(s)
            if a.verbose or (not a.json and int(t) // 10 != last_report):
                last_report = int(t) // 10
                print(f"  t={t:5.1f}s {phase:<7} in flight {s.inflight:>6} (waiting {s.waiting})  worker slots "
                      f"{s.worker_slots} ({s.worker_state})  finished {s.finished}  prompts {s.prompts}  "
                      f"results {s.results}  committed {s.committed_groups}  worker cpu {s.worker_cpu:.1f}s",
                      file=sys.stderr)
            next_tick += SAMPLE_EVERY_S
            time.sleep(max(0.0, next_tick - time.monotonic()))

    # -- results ---------------------------------------------------------------------

    def result(self) -> dict:
        a = self.args
        window = [s for s in self.samples if s.phase == "measure"]
        if len(window) < 2:
            raise RuntimeError(f"the measurement window holds {len(window)} samples, 2 needed: {self.missed} "
                               f"readings went unanswered (every {SAMPLE_EVERY_S:g}s, {a.measure_s:g}s window "
                               f"extended by up to {max(a.measure_s, 60.0):g}s)")
        first, last = window[0], window[-1]
        dt = last.t - first.t
        inflight = sorted(s.inflight for s in window)
        slots = [s.worker_slots for s in window if s.worker_slots is not None]
        rps = (last.finished - first.finished) / dt
        tokens_per_s = (last.decode_tokens - first.decode_tokens) / dt
        cores = lambda attr: (getattr(last, attr) - getattr(first, attr)) / dt  # noqa: E731
        worker_cores = cores("worker_cpu")
        ticks = (last.machine_total - first.machine_total) / os.cpu_count()
        machine_cores = (last.machine_busy - first.machine_busy) / ticks if ticks else 0.0
        info = self._worker_info() or {}
        counters = info.get("counters", {})
        depths = self.queue.depths()
        per_1k = lambda c: c / (rps / 1000) if rps else None  # noqa: E731
        p5 = inflight[max(0, math.ceil(0.05 * len(inflight)) - 1)]
        return {
            "max_inflight": inflight[-1],
            "mean_inflight": statistics.fmean(inflight),
            "min_inflight": inflight[0],
            "p5_inflight": p5,
            "target_inflight": TARGET_INFLIGHT,
            "target_met": inflight[0] >= TARGET_INFLIGHT,
            "requests_per_s": rps,
            "tokens_per_s": tokens_per_s,
            "worker_cpu_cores": worker_cores,
            "worker_cpu_per_1k_rps": per_1k(worker_cores),
            "worker_cpu_us_per_token": worker_cores / tokens_per_s * 1e6 if tokens_per_s else None,
            "simulators_cpu_cores": cores("sim_cpu"),
            "simulators_cpu_per_1k_rps": per_1k(cores("sim_cpu")),
            "redis_cpu_cores": cores("redis_cpu"),
            "bench_cpu_cores": cores("bench_cpu"),
            "machine_cpu_cores": machine_cores,
            "machine_cores": os.cpu_count(),
            "worker_rss_mb_max": max((s.worker_rss_mb or 0.0) for s in window),
            "mean_running": statistics.fmean(s.running for s in window),
            "mean_waiting": statistics.fmean(s.waiting for s in window),
            "worker_capacity_samples": info.get("capacity"),
            "mean_worker_slots": statistics.fmean(slots) if slots else None,
            "max_worker_slots": max(slots) if slots else None,
            # None when the worker held no slot at any reading (a tiny run between groups)
            "slot_utilization": statistics.fmean(inflight) / statistics.fmean(slots) if any(slots) else None,
            "worker_states": sorted({s.worker_state for s in window if s.worker_state}),
            "groups_per_s": (last.committed_groups - first.committed_groups) / dt,
            "window_s": dt,
            "window_samples": len(window),
            "missed_samples": self.missed,  # readings skipped: a simulator or Redis did not answer in time
            "mean_prompts_queued": statistics.fmean(s.prompts for s in window),
            "mean_results_backlog": statistics.fmean(s.results for s in window),
            "worker_counters": counters,
            "dead_letters": depths["dead"],
            "requeued": depths["requeue"],
            "groups_pushed": self.pushed,
            "groups_committed": self.trainer.committed_groups,
            "settings": {
                "quick": a.quick, "engines": a.engines, "concurrency_per_engine": a.concurrency,
                "capacity_samples": a.concurrency * a.engines, "samples_per_group": N_SAMPLES,
                "sim_max_running": a.max_running, "decode_tokens_per_s": a.decode_rate,
                "median_tokens": a.median_tokens, "p99_tokens": a.p99_tokens, "max_new_tokens": a.max_new_tokens,
                "ramp_s": a.ramp_s, "settle_s": a.settle_s, "measure_s": a.measure_s, "seed": a.seed,
                "max_ready": a.max_ready, "train_batch": a.train_batch, "worker_args": list(a.worker_arg),
            },
            "timeline": [{"t": round(s.t, 1), "phase": s.phase, "inflight": s.inflight,
                          "worker_slots": s.worker_slots, "finished": s.finished,
                          "worker_cpu_s": round(s.worker_cpu, 2)} for s in self.samples[::2]],
            "python": sys.version.split()[0],
        }


def human(r: dict) -> str:
    st = r["settings"]
    f = lambda v, spec=".2f": "n/a" if v is None else format(v, spec)  # noqa: E731
    return "\n".join([
        f"in-flight benchmark: 1 worker, {st['engines']} simulators, capacity {st['capacity_samples']:,} samples "
        f"({st['concurrency_per_engine']:,}/engine, groups of {st['samples_per_group']}); outputs median "
        f"{st['median_tokens']} / p99 {st['p99_tokens']} tokens (max {st['max_new_tokens']}) at "
        f"{st['decode_tokens_per_s']:g} tok/s; window {r['window_s']:.0f}s after {st['ramp_s'] + st['settle_s']:g}s "
        f"ramp+settle",
        "",
        f"requests in flight on the engines  min {r['min_inflight']:,}  mean {r['mean_inflight']:,.0f}  "
        f"max {r['max_inflight']:,}   (target >= {r['target_inflight']:,} at every sample: "
        f"{'ok' if r['target_met'] else 'MISSED'})",
        f"worker slots held (samples)        mean {f(r['mean_worker_slots'], ',.0f')}  max "
        f"{f(r['max_worker_slots'], ',')}  (requests/slots {f(r['slot_utilization'])}: a slot is freed when its "
        f"request ends; groups waiting on a slow sample hold one)",
        f"completed requests/s               {r['requests_per_s']:,.1f}  ({r['groups_per_s']:.1f} groups/s "
        f"committed by the trainer)",
        "",
        f"CPU (cores)  worker {r['worker_cpu_cores']:.3f}   simulators {r['simulators_cpu_cores']:.3f}   "
        f"redis {r['redis_cpu_cores']:.3f}   bench (feeder+trainer+sampler) {r['bench_cpu_cores']:.3f}   "
        f"machine {r['machine_cpu_cores']:.2f} of {r['machine_cores']}",
        f"worker CPU per 1,000 requests/s    {f(r['worker_cpu_per_1k_rps'], '.3f')} cores   "
        f"(simulators {f(r['simulators_cpu_per_1k_rps'], '.3f')}); per generated token "
        f"{f(r['worker_cpu_us_per_token'], '.2f')} us ({r['tokens_per_s']:,.0f} tokens/s)",
        f"worker RSS max {f(r['worker_rss_mb_max'], '.0f')} MB; dead letters {r['dead_letters']}, requeued "
        f"{r['requeued']}, worker engine errors {r['worker_counters'].get('engine_errors', 'n/a')}",
    ] + ([
        "",
        "--quick: the window opens before the long tail reaches steady state (groups take ~70 s at 8 tok/s), so",
        "in-flight reads high and CPU per request low; quote the full run.",
    ] if st["quick"] else []))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter phases: finishes in under a minute")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--engines", type=int, default=2, help="simulator processes (default 2)")
    p.add_argument("--concurrency", type=int,
                   help="worker --concurrency, samples per engine (default: 14,336 samples in total)")
    p.add_argument("--max-running", type=int, help="simulator --max-running (default: the worker's capacity)")
    p.add_argument("--decode-rate", type=float, default=8.0, help="tokens/s per request (default 8)")
    p.add_argument("--median-tokens", type=int, default=128, help="median output length (default 128)")
    p.add_argument("--p99-tokens", type=int, default=1280, help="p99 output length (default 1280)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="worker --max-new-tokens (default 1024)")
    p.add_argument("--ramp", dest="ramp_s", type=float, help="seconds to feed up to capacity (default 30, quick 10)")
    p.add_argument("--settle", dest="settle_s", type=float, help="seconds before measuring (default 60, quick 14)")
    p.add_argument("--measure", dest="measure_s", type=float, help="measurement window (default 150, quick 18)")
    p.add_argument("--backlog", type=int, default=256, help="groups kept queued in the prompt list (default 256)")
    p.add_argument("--train-batch", type=int, default=16, help="trainer batch size in groups (default 16)")
    p.add_argument("--max-ready", type=int, default=4096, help="results backlog limit (control max_ready)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `rollout worker` (repeat; e.g. --worker-arg=--lease --worker-arg=60)")
    p.add_argument("--stop-grace", type=float, default=5.0,
                   help="seconds the worker gets to stop on SIGTERM before SIGKILL (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the logs directory (printed on stderr)")
    p.add_argument("--verbose", action="store_true", help="print every sample on stderr")
    args = p.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = math.ceil(14336 / args.engines)
    if args.max_running is None:
        args.max_running = args.concurrency * args.engines
    for name, quick, full in (("ramp_s", 10.0, 30.0), ("settle_s", 14.0, 60.0), ("measure_s", 18.0, 150.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.engines < 1 or args.concurrency < 1 or args.measure_s <= 0:
        p.error("--engines, --concurrency and --measure must be positive")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def terminate(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    bench = Bench(args)
    started = time.monotonic()
    try:
        if not args.json:
            print(f"starting redis, {args.engines} simulators and 1 worker (logs in {bench.tmp})", file=sys.stderr)
        bench.start()
        bench.run()
        result = bench.result()
    finally:  # everything stops, on errors and Ctrl-C too (bench/report.py says why in one line)
        bench.close()
        wall = time.monotonic() - started
        if args.keep:
            print(f"logs kept in {bench.tmp}", file=sys.stderr)
    result["wall_s"] = wall
    result["worker_stop_s"] = bench.worker_stop_s
    result["worker_stopped_cleanly"] = bench.worker_stop_clean
    if not args.json:
        print(human(result))
    return result


if __name__ == "__main__":
    run_bench(main)
