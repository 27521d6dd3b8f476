#!/usr/bin/env python
"""How many engines one Redis can serve.

Client processes drive the full life cycle of groups of 8 samples x 2,048 generated
tokens against one redis-server, through the project's API:

  feeder    keeps the prompt list topped up (Queue.push_groups)
  workers   Queue.claim, then the claim's finished groups in one Queue.publish_many,
            as the worker's publisher sends the groups that finish while a publish is
            out (--publish-one-at-a-time: one Queue.publish per group); an instant
            engine: each worker encodes one finished group once and stamps every
            claimed group's id into a copy of it, so the clients spend their CPU on
            Redis calls, not on the codec
  trainer   Consumer.next_batch(B) + Consumer.commit
  observer  (latency phases only) XREAD BLOCK on the results stream: when a
            published group becomes readable, as it does for the trainer's
            XREADGROUP BLOCK, without waiting for the rest of a batch

The server's own CPU time (INFO cpu, main thread) and INFO commandstats over a
measured window, divided by the groups committed in it, give the server's cost per
group and per generated token. With `appendfsync always` the main thread also waits
in fdatasync before it answers, time that is not CPU: a sampler reads the thread's
state in /proc every millisecond and counts the samples in disk sleep (D). One Redis
core then sustains 1e6 / (CPU µs + fsync-blocked µs per group) groups/s (the server
runs commands on one thread). That, with the output rate of one engine taken from the
calibrated engine profile (engines/profiles.py: 256 requests decoding, the cache
holding their prompts and half their outputs), gives engines per Redis core, at
samples of 256, 1,024 and 2,048 tokens. Unpaced phases add workers until throughput
stops growing (or every core is busy); then paced phases at 50% and 90% of the highest
throughput measured give publish → delivery latency. Everything runs for AOF
`appendfsync always` (the default; the top-level figures) and `everysec`.

    python bench/redis_capacity.py            # ~5 minutes
    python bench/redis_capacity.py --quick    # about two minutes
    python bench/redis_capacity.py --json     # one JSON object on stdout
"""
from __future__ import annotations

import argparse
import json
import threading
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.queue_overhead import N_SAMPLES, PROMPT_TOKENS, RESPONSE_TOKENS, fill, make_content  # noqa: E402
from engines.profiles import CALIBRATED, CALIBRATED_T1_S, engine_profile  # noqa: E402
from pipeline.codec import encode_group  # noqa: E402
from pipeline.connection import connect  # noqa: E402
from pipeline.consumer import Consumer  # noqa: E402
from bench.report import run_bench  # noqa: E402
from pipeline.control import configure  # noqa: E402
from pipeline.queue import Place, Publish, Queue  # noqa: E402
from pipeline.redis_server import Fsync, RedisServer, free_port  # noqa: E402
from pipeline.types import Group  # noqa: E402

NAMESPACE = "capacity"
SAMPLE_TOKENS = (256, 1024, 2048)  # generated tokens per sample, one capacity figure each
ENGINE_BATCH = 256  # requests one RL rollout engine decodes at once
TARGET_ENGINES_PER_CORE = 1000  # at 1,024-token samples, with appendfsync always
FSYNC_SAMPLE_S = 0.001
GID_WIDTH = 12  # group ids are "c" + 12 digits, so a payload's id can be stamped in place
TEMPLATE_GID = "c" + "x" * GID_WIDTH
FEED_CHUNK = 64
log = logging.getLogger("bench.redis_capacity")


def gid(row: int) -> str:
    return f"c{row:0{GID_WIDTH}d}"


def stop_key(namespace: str) -> str:
    return f"{{{namespace}}}:bench:stop"


def engine_tokens_per_s(sample_tokens: int) -> float:
    """Output tokens/s of one engine under the calibrated profile: ENGINE_BATCH requests
    decoding, the cache holding their prompts and, on average, half their outputs."""
    kv = ENGINE_BATCH * (PROMPT_TOKENS + sample_tokens / 2)
    return ENGINE_BATCH / (CALIBRATED_T1_S * engine_profile(CALIBRATED).step_factor(ENGINE_BATCH, round(kv)))


class DiskWaitSampler:
    """Fraction of the time a thread spends in disk sleep (state D in /proc), sampled:
    for redis-server's main thread under appendfsync always, time blocked in fdatasync."""

    def __init__(self, pid: int):
        self.path = f"/proc/{pid}/task/{pid}/stat"
        self.samples = self.blocked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fsync-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(FSYNC_SAMPLE_S):
            try:
                with open(self.path, "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                return
            self.samples += 1
            self.blocked += state == b"D"

    def __enter__(self) -> DiskWaitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def fraction(self) -> float:
        return self.blocked / self.samples if self.samples else 0.0


#: The main thread's system calls counted with `perf stat` (when perf and its tracepoints are
#: usable): fsyncs of the AOF, event-loop passes, socket and AOF reads and writes.
SYSCALLS = ("fdatasync", "epoll_wait", "read", "write")


class SyscallCounter:
    """Counts the SYSCALLS of one thread over a window with `perf stat -t`; `counts` is
    None where perf or its syscall tracepoints are not available (the rest still runs).
    `groups` is what `committed()` grew by while perf ran, to divide the counts by."""

    def __init__(self, pid: int, path: Path, committed):
        self.pid, self.path, self.committed = pid, path, committed
        self.proc: subprocess.Popen | None = None
        self.counts: dict[str, int] | None = None
        self.groups = 0

    def __enter__(self) -> SyscallCounter:
        perf = shutil.which("perf")
        if perf:
            events = ",".join(f"syscalls:sys_enter_{name}" for name in SYSCALLS)
            self.proc = subprocess.Popen([perf, "stat", "-x", ",", "-e", events, "-t", str(self.pid),
                                          "-o", str(self.path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.2)  # perf attaches
            if self.proc.poll() is not None:
                self.proc = None
            self.groups = -self.committed()
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.groups += self.committed()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return
        counts = {}
        for line in self.path.read_text().splitlines():
            parts = line.split(",")
            if len(parts) > 2 and parts[2].startswith("syscalls:sys_enter_") and parts[0].isdigit():
                counts[parts[2].removeprefix("syscalls:sys_enter_")] = int(parts[0])
        self.counts = counts if set(counts) == set(SYSCALLS) else None


# -- the client processes --------------------------------------------------------------------


def feeder(args: argparse.Namespace, queue: Queue, content) -> dict:
    """Keeps at least 4 chunks of prompts queued."""
    row = 0
    while not queue.redis.exists(stop_key(args.namespace)):
        if queue.redis.llen(queue.keys.prompts) < 4 * FEED_CHUNK:
            groups = [Group.fresh(gid(row + i), content.prompt, N_SAMPLES, row=row + i) for i in range(FEED_CHUNK)]
            queue.push_groups(groups)
            row += FEED_CHUNK
        else:
            time.sleep(0.002)
    return {"pushed": row}


def worker(args: argparse.Namespace, queue: Queue, content) -> dict:
    """Claims up to --claim groups at a time and publishes each finished, paced to
    --rate groups/s (0: as fast as it can). Records when each publish started."""
    name = f"w{args.index}-{uuid.uuid4().hex[:6]}"
    template = Group.fresh(TEMPLATE_GID, content.prompt, N_SAMPLES)
    fill(template, content, name)
    payload = encode_group(template, with_response_text=False)
    assert payload.count(TEMPLATE_GID.encode()) == 1, "the group id must appear once in the payload"
    published: dict[str, float] = {}
    interval = 1.0 / args.rate if args.rate else 0.0
    next_at = time.monotonic()
    queue.register(name)
    last_beat = time.monotonic()
    while not queue.redis.exists(stop_key(args.namespace)):
        if time.monotonic() - last_beat > 1.0:
            queue.heartbeat(name, "{}")
            last_beat = time.monotonic()
        claim = queue.claim(name, uuid.uuid4().hex, args.claim)
        if not claim.groups:
            time.sleep(0.001)
            continue
        if not args.publish_one_at_a_time:  # the worker's publisher: finished groups in one call
            items = [Publish(c.group_id, c.token, payload.replace(TEMPLATE_GID.encode(), c.group_id.encode()),
                             Place.RESULTS) for c in claim.groups]
            if interval:
                next_at += interval * len(items)
                time.sleep(max(0.0, next_at - time.monotonic()))
            published.update({c.group_id: time.monotonic() for c in claim.groups})
            queue.publish_many(name, items)
            continue
        for claimed in claim.groups:
            if interval:
                next_at += interval
                time.sleep(max(0.0, next_at - time.monotonic()))
            data = payload.replace(TEMPLATE_GID.encode(), claimed.group_id.encode())
            published[claimed.group_id] = time.monotonic()
            queue.publish(name, claimed.group_id, claimed.token, data, Place.RESULTS)
    queue.leave(name)
    return {"published": published}


def trainer(args: argparse.Namespace, queue: Queue, content) -> dict:
    consumer = Consumer(queue.redis, args.namespace, block_s=0.2)
    batches = 0
    while not queue.redis.exists(stop_key(args.namespace)):
        try:
            batch = consumer.next_batch(args.batch, timeout=0.5)
        except TimeoutError:
            continue
        consumer.commit(batch)
        batches += 1
    return {"batches": batches, "groups": batches * args.batch}


def observer(args: argparse.Namespace, queue: Queue, content) -> dict:
    seen: dict[str, float] = {}
    last = "$"
    while not queue.redis.exists(stop_key(args.namespace)):
        reply = queue.redis.xread({queue.keys.results: last}, count=1000, block=200)
        now = time.monotonic()
        for _stream, rows in reply or []:
            for entry_id, fields in rows:
                seen[fields[b"gid"].decode()] = now
                last = entry_id
    return {"seen": seen}


ROLES = {"feeder": feeder, "worker": worker, "trainer": trainer, "observer": observer}


def count_round_trips() -> list[int]:
    """Counts this process's round trips to Redis (a pipeline or MULTI is one)."""
    import redis.connection

    count = [0]
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self, *a, **kw):
        count[0] += 1
        return send(self, *a, **kw)

    redis.connection.AbstractConnection.send_packed_command = counted
    return count


def run_child(args: argparse.Namespace) -> None:
    round_trips = count_round_trips()
    queue = Queue(connect(args.redis_url), args.namespace)
    content = make_content(0, args.sample_tokens) if args.role in ("feeder", "worker") else None
    result = ROLES[args.role](args, queue, content)
    result["round_trips"] = round_trips[0]
    Path(args.out).write_text(json.dumps(result))


# -- the parent ---------------------------------------------------------------------------------


@dataclass
class ServerSnapshot:
    at: float
    cpu_s: float  # the main thread's user + system CPU
    committed: int
    commands: dict[str, tuple[int, float]]  # command -> (calls, usec)
    stats: dict[str, int]  # INFO stats / persistence counters (STAT_FIELDS)

    @classmethod
    def take(cls, queue: Queue) -> ServerSnapshot:
        r = queue.redis
        cpu = r.info("cpu")
        main = ("used_cpu_user_main_thread", "used_cpu_sys_main_thread")
        keys = main if all(k in cpu for k in main) else ("used_cpu_user", "used_cpu_sys")
        stats = {name.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"]))
                 for name, v in r.info("commandstats").items()}
        committed = int(r.hget(queue.keys.stats, "committed") or 0)
        info = {**r.info("stats"), **r.info("persistence")}
        counters = {k: int(info.get(k, 0)) for k in STAT_FIELDS}
        return cls(time.monotonic(), sum(float(cpu[k]) for k in keys), committed, stats, counters)


#: INFO fields whose change over a window, per group, is reported (aof_current_size falls
#: back when an AOF rewrite finishes in the window: aof_bytes_per_group is None then).
STAT_FIELDS = ("total_commands_processed", "total_net_input_bytes", "total_net_output_bytes",
               "aof_current_size", "aof_base_size")


@dataclass
class Phase:
    workers: int
    rate: float | None  # groups/s offered in total (None: unpaced)
    groups_per_s: float
    server_cpu: float  # fraction of one core the server's main thread used
    server_us_per_group: float  # main-thread CPU
    fsync_blocked_us_per_group: float  # main thread in disk sleep (fdatasync)
    commands_us_per_group: dict[str, float]
    commands_calls_per_group: dict[str, float] = field(default_factory=dict)  # INFO commandstats calls
    # commands processed, bytes in and out of the sockets, bytes appended to the AOF, per group
    counters_per_group: dict[str, float | None] = field(default_factory=dict)
    syscalls_per_group: dict[str, float] | None = None  # the main thread's, by perf (None: no perf)
    # each role's round trips over its whole run / the groups it pushed, published or committed
    round_trips_per_group: dict[str, float] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)  # p50, p99: publish -> readable


@dataclass
class Settings:
    window_s: float = 8.0
    warmup_s: float = 2.0
    max_workers: int = 4
    claim: int = 8  # groups per claim, as a worker with 64 free slots would take
    batch: int = 32  # B
    fsync: tuple[Fsync, ...] = (Fsync.ALWAYS, Fsync.EVERYSEC)  # the first gives the top-level figures
    loads: tuple[float, ...] = (0.5, 0.9)
    sample_tokens: tuple[int, ...] = SAMPLE_TOKENS  # the by-fsync phases use the last
    # Workers publish each claim's groups in one call (publish_many), as the worker's publisher
    # (workers/publisher.py) sends the groups that finish while a publish is out.
    publish_together: bool = True


class Bench:
    def __init__(self, settings: Settings, workdir: Path):
        self.settings = settings
        self.workdir = workdir

    def phase(self, server: RedisServer, workers: int, rate: float | None, sample_tokens: int) -> Phase:
        s = self.settings
        queue = Queue(connect(server.url), NAMESPACE)
        queue.redis.flushall()
        queue.redis.config_resetstat()
        # A backlog of a few batches is all a trainer needs; the default (4,096 groups of
        # ~134 KB) would fill memory while an unpaced trainer falls behind.
        configure(queue.redis, queue.keys, max_ready=4 * s.batch)
        roles = ["feeder", "trainer"] + ["worker"] * workers + (["observer"] if rate else [])
        procs = []
        for index, role in enumerate(roles):
            out = self.workdir / f"{role}-{index}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--redis-url", server.url,
                   "--namespace", NAMESPACE, "--out", str(out), "--index", str(index), "--claim", str(s.claim),
                   "--batch", str(s.batch), "--rate", str(rate / workers if rate else 0),
                   "--sample-tokens", str(sample_tokens)] + ([] if s.publish_together else ["--publish-one-at-a-time"])
            procs.append((role, out, subprocess.Popen(cmd, cwd=REPO)))
        try:
            deadline = time.monotonic() + 60
            while int(queue.redis.hget(queue.keys.stats, "committed") or 0) == 0:
                if time.monotonic() > deadline or any(p.poll() is not None for _, _, p in procs):
                    raise RuntimeError("the clients committed nothing within 60 s (or one exited)")
                time.sleep(0.05)
            time.sleep(s.warmup_s)
            with DiskWaitSampler(server.process.pid) as disk, \
                    SyscallCounter(server.process.pid, self.workdir / "perf.txt",
                                   lambda: int(queue.redis.hget(queue.keys.stats, "committed") or 0)) as syscalls:
                before = ServerSnapshot.take(queue)
                time.sleep(s.window_s)
                after = ServerSnapshot.take(queue)
                while after.committed - before.committed < s.batch and time.monotonic() < deadline + 60:
                    time.sleep(0.1)  # a short window at a low rate: wait for a whole batch
                    after = ServerSnapshot.take(queue)
        finally:
            queue.redis.set(stop_key(NAMESPACE), 1)
            for _, _, p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        results = {role: [] for role in ROLES}
        for role, out, p in procs:
            if p.returncode != 0:
                raise RuntimeError(f"{role} client exited with code {p.returncode}")
            results[role].append(json.loads(out.read_text()))
        groups = after.committed - before.committed
        wall = after.at - before.at
        per_group, calls_per_group = {}, {}
        for name, (calls, usec) in after.commands.items():
            calls0, usec0 = before.commands.get(name, (0, 0.0))
            if calls > calls0:
                per_group[name] = round((usec - usec0) / groups, 2)
                calls_per_group[name] = round((calls - calls0) / groups, 3)
        counters: dict[str, float | None] = {
            name.removeprefix("total_") + "_per_group": round((after.stats[name] - before.stats[name]) / groups, 1)
            for name in ("total_commands_processed", "total_net_input_bytes", "total_net_output_bytes")}
        rewritten = after.stats["aof_base_size"] != before.stats["aof_base_size"]
        counters["aof_bytes_per_group"] = None if rewritten else round(
            (after.stats["aof_current_size"] - before.stats["aof_current_size"]) / groups, 1)
        phase = Phase(workers=workers, rate=rate, groups_per_s=groups / wall,
                      server_cpu=(after.cpu_s - before.cpu_s) / wall,
                      server_us_per_group=1e6 * (after.cpu_s - before.cpu_s) / groups,
                      fsync_blocked_us_per_group=1e6 * disk.fraction * wall / groups,
                      commands_us_per_group=dict(sorted(per_group.items(), key=lambda kv: -kv[1])),
                      commands_calls_per_group=dict(sorted(calls_per_group.items(), key=lambda kv: -kv[1])),
                      counters_per_group=counters,
                      syscalls_per_group=None if syscalls.counts is None else {
                          name: round(n / max(1, syscalls.groups), 2) for name, n in syscalls.counts.items()})
        handled = {"feeder": lambda r: r["pushed"], "worker": lambda r: len(r["published"]),
                   "trainer": lambda r: r["groups"]}
        phase.round_trips_per_group = {
            role: round(sum(r["round_trips"] for r in results[role]) / max(1, sum(map(count, results[role]))), 3)
            for role, count in handled.items()}
        if rate:
            phase.latency_ms = _latency(results, before.at, after.at)
        log.info("%d-token samples, %s workers, rate %s: %.0f groups/s, server %.0f%% of a core, %.0f us/group "
                 "+ %.0f us in fsync %s", sample_tokens, workers, f"{rate:.0f}" if rate else "unpaced",
                 phase.groups_per_s, 100 * phase.server_cpu, phase.server_us_per_group,
                 phase.fsync_blocked_us_per_group, phase.latency_ms)
        return phase

    def ramp(self, server: RedisServer, sample_tokens: int) -> Phase:
        """Unpaced phases with more and more workers until throughput stops growing;
        the phase that pushed the server hardest."""
        unpaced: list[Phase] = []
        workers = 1
        while workers <= self.settings.max_workers:
            unpaced.append(self.phase(server, workers, None, sample_tokens))
            if len(unpaced) > 1 and unpaced[-1].groups_per_s < 1.05 * unpaced[-2].groups_per_s:
                break  # more clients no longer help: the server, or this machine, is saturated
            workers *= 2
        return max(unpaced, key=lambda p: p.groups_per_s)

    def capacity(self, best: Phase, sample_tokens: int) -> dict:
        us = best.server_us_per_group + best.fsync_blocked_us_per_group
        per_core = 1e6 / us
        rate = engine_tokens_per_s(sample_tokens)
        return {
            "server_us_per_group": round(best.server_us_per_group, 1),
            "fsync_blocked_us_per_group": round(best.fsync_blocked_us_per_group, 1),
            "server_us_per_token": round(us / (N_SAMPLES * sample_tokens), 4),
            "groups_per_s_saturated": round(per_core),
            "groups_per_s_measured": round(best.groups_per_s, 1),
            "server_cpu_at_measured": round(best.server_cpu, 3),
            "engine_tokens_per_s": round(rate),
            "engines_per_core": round(per_core * N_SAMPLES * sample_tokens / rate),
            "commands_us_per_group": best.commands_us_per_group,
            "commands_calls_per_group": best.commands_calls_per_group,
            "counters_per_group": best.counters_per_group,
            "syscalls_per_group": best.syscalls_per_group,
            "round_trips_per_group": best.round_trips_per_group,
        }

    def fsync_mode(self, fsync: Fsync) -> dict:
        s = self.settings
        length = s.sample_tokens[-1]
        server = RedisServer(self.workdir / f"redis-{fsync.value}", port=free_port(), fsync=fsync)
        server.start()
        try:
            best = self.ramp(server, length)
            paced = [self.phase(server, best.workers, load * best.groups_per_s, length) for load in s.loads]
        finally:
            server.stop()
        return {
            "fsync": fsync.value,
            "sample_tokens": length,
            **self.capacity(best, length),
            "latency_ms": {f"{int(100 * load)}%": {**p.latency_ms, "groups_per_s": round(p.groups_per_s, 1)}
                           for load, p in zip(s.loads, paced)},
            "phases": [asdict(p) for p in [best] + paced],
        }

    def by_length(self) -> dict[str, dict]:
        """Capacity with appendfsync always at every sample length."""
        server = RedisServer(self.workdir / "redis-lengths", port=free_port(), fsync=Fsync.ALWAYS)
        server.start()
        try:
            return {str(n): self.capacity(self.ramp(server, n), n) for n in self.settings.sample_tokens}
        finally:
            server.stop()

    def run(self) -> dict:
        lengths = self.by_length()
        modes = {fsync.value: self.fsync_mode(fsync) for fsync in self.settings.fsync}
        main = modes[self.settings.fsync[0].value]
        worst_load = f"{int(100 * max(self.settings.loads))}%"
        return {
            **{key: {n: c[key] for n, c in lengths.items()}
               for key in ("server_us_per_group", "fsync_blocked_us_per_group", "engines_per_core",
                           "groups_per_s_saturated", "groups_per_s_measured", "engine_tokens_per_s")},
            "publish_to_delivery_p99_ms": main["latency_ms"][worst_load]["p99"],
            "by_length": lengths,
            "by_fsync": modes,
            "settings": {**asdict(self.settings), "prompt_tokens": PROMPT_TOKENS, "samples_per_group": N_SAMPLES,
                         "engine_profile": CALIBRATED, "engine_batch": ENGINE_BATCH,
                         "target_engines_per_core": TARGET_ENGINES_PER_CORE,
                         "machine": f"{os.uname().machine}, {len(os.sched_getaffinity(0))} cores",
                         "command": " ".join(["python", "bench/redis_capacity.py"] + sys.argv[1:])},
        }


def _latency(results: dict, start: float, end: float) -> dict[str, float]:
    published = {g: t for r in results["worker"] for g, t in r["published"].items() if start <= t <= end}
    seen = results["observer"][0]["seen"]
    delays = sorted(1000 * (seen[g] - t) for g, t in published.items() if g in seen)
    if not delays:
        raise RuntimeError("the observer saw none of the groups published in the window")
    return {"p50": round(statistics.median(delays), 2),
            "p99": round(delays[min(len(delays) - 1, int(0.99 * len(delays)))], 2),
            "groups": len(delays)}


def print_table(result: dict) -> None:
    s = result["settings"]
    print(f"groups of {N_SAMPLES} samples; B = {s['batch']}; claims of {s['claim']}; {s['window_s']:g}s windows; "
          f"engine output from the {s['engine_profile']} profile at {s['engine_batch']} requests; {s['machine']}")
    print()
    print("appendfsync always, by sample length:")
    print()
    print("| tokens per sample | server CPU µs/group | fsync-blocked µs/group | groups/s per Redis core "
          "| measured groups/s (server CPU) | engine tokens/s | engines per core |")
    print("|---|---|---|---|---|---|---|")
    for n, c in result["by_length"].items():
        print(f"| {int(n):,} | {c['server_us_per_group']:.0f} | {c['fsync_blocked_us_per_group']:.0f} "
              f"| {c['groups_per_s_saturated']:,} | {c['groups_per_s_measured']:.0f} ({c['server_cpu_at_measured']:.0%}) "
              f"| {c['engine_tokens_per_s']:,} | {c['engines_per_core']:,} |")
    print()
    print("by AOF fsync mode, at the longest samples:")
    print()
    print("| AOF fsync | server µs/group | fsync-blocked µs/group | groups/s per Redis core | engines per core "
          "| publish→delivery p50/p99 at 50% (groups/s) | at 90% |")
    print("|---|---|---|---|---|---|---|")
    for m in result["by_fsync"].values():
        lat = m["latency_ms"]
        print(f"| {m['fsync']} | {m['server_us_per_group']:.0f} | {m['fsync_blocked_us_per_group']:.0f} "
              f"| {m['groups_per_s_saturated']:,} | {m['engines_per_core']:,} "
              + "".join(f"| {lat[k]['p50']:.1f} / {lat[k]['p99']:.1f} ms ({lat[k]['groups_per_s']:.0f}) "
                        for k in ("50%", "90%")) + "|")
    print()
    for n, c in result["by_length"].items():
        top = list(c["commands_us_per_group"].items())[:6]
        print(f"server µs per group by command at {n} tokens: " + ", ".join(f"{k} {v}" for k, v in top))
    key = "1024" if "1024" in result["engines_per_core"] else next(iter(result["engines_per_core"]))
    print(f"engines_per_core at {key}-token samples = {result['engines_per_core'][key]:,} "
          f"(target >= {TARGET_ENGINES_PER_CORE:,})")


def main(argv: list[str] | None = None) -> dict:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short windows, at most 2 workers (under a minute)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--window", type=float, help=f"measured seconds per phase (default {d.window_s:g}, --quick 3)")
    p.add_argument("--max-workers", type=int, help=f"most worker processes (default {d.max_workers}, --quick 2)")
    p.add_argument("--batch", type=int, default=d.batch, help="groups per trainer batch")
    p.add_argument("--sample-tokens", type=int, default=RESPONSE_TOKENS, help=argparse.SUPPRESS)
    p.add_argument("--publish-one-at-a-time", action="store_true",
                   help="workers publish each finished group in a call of its own, not each claim's groups in one "
                        "call (Queue.publish_many, the default: what the worker's publisher does when Redis is busy)")
    p.add_argument("-v", "--verbose", action="store_true")
    # a client process
    p.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    p.add_argument("--redis-url", help=argparse.SUPPRESS)
    p.add_argument("--namespace", default=NAMESPACE, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--claim", type=int, default=d.claim, help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role:
        run_child(args)
        sys.exit(0)
    settings = Settings(window_s=args.window or (3.0 if args.quick else d.window_s),
                        warmup_s=1.0 if args.quick else d.warmup_s,
                        max_workers=args.max_workers or (2 if args.quick else d.max_workers),
                        batch=args.batch, publish_together=not args.publish_one_at_a_time)
    with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
        result = Bench(settings, Path(tmp)).run()
    if not args.json:
        print_table(result)
    return result


if __name__ == "__main__":
    run_bench(main)
