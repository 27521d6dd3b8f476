#!/usr/bin/env python
"""How many engines one Redis can serve.

Client processes drive the full life cycle of groups of 8 samples x 2,048 generated
tokens against one redis-server, through the project's API:

  feeder    keeps the prompt list topped up (Queue.push_groups)
  workers   Queue.claim, then Queue.publish of the finished group for each (an
            instant engine: each worker encodes one finished group once and stamps
            every claimed group's id into a copy of it, so the clients spend their
            CPU on Redis calls, not on the codec)
  trainer   Consumer.next_batch(B) + Consumer.commit
  observer  (latency phases only) XREAD BLOCK on the results stream: when a
            published group becomes readable, as it does for the trainer's
            XREADGROUP BLOCK, without waiting for the rest of a batch

The server's own CPU time (INFO cpu, main thread) and INFO commandstats over a
measured window, divided by the groups committed in it, give the server's cost per
group and per generated token; one Redis core then sustains 1e6 / µs-per-group groups/s
(the server runs commands on one thread). That, with an assumed output rate per
engine, gives engines per Redis core. Unpaced phases add workers until throughput
stops growing (or every core is busy); then paced phases at 50% and 90% of the highest
throughput measured give publish → delivery latency. Everything runs for AOF
`appendfsync always` (the default; the top-level figures) and `everysec`.

    python bench/redis_capacity.py            # ~3 minutes
    python bench/redis_capacity.py --quick    # under a minute
    python bench/redis_capacity.py --json     # one JSON object on stdout
"""
from __future__ import annotations

import argparse
import json
import logging
import os
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

from bench.queue_overhead import N_SAMPLES, RESPONSE_TOKENS, fill, make_content  # noqa: E402
from pipeline.codec import encode_group  # noqa: E402
from pipeline.connection import connect  # noqa: E402
from pipeline.consumer import Consumer  # noqa: E402
from pipeline.control import configure  # noqa: E402
from pipeline.queue import Place, Queue  # noqa: E402
from pipeline.redis_server import Fsync, RedisServer, free_port  # noqa: E402
from pipeline.types import Group  # noqa: E402

NAMESPACE = "capacity"
TOKENS_PER_GROUP = N_SAMPLES * RESPONSE_TOKENS
# Output tokens/s of one engine. Llama-3.1-8B in BF16 on SGLang 0.5.6 generates 3,161
# tokens/s on one A100-40GB (AccelMark, github.com/FreedomIntelligence/AccelMark/issues/39);
# an H100 has about twice the memory bandwidth that decoding is bound by, so 5,000 for
# an H100 serving a 7B model is a middle estimate. --engine-tokens-per-s changes it.
ENGINE_TOKENS_PER_S = 5000.0
TARGET_ENGINES_PER_CORE = 1000
GID_WIDTH = 12  # group ids are "c" + 12 digits, so a payload's id can be stamped in place
TEMPLATE_GID = "c" + "x" * GID_WIDTH
FEED_CHUNK = 64
log = logging.getLogger("bench.redis_capacity")


def gid(row: int) -> str:
    return f"c{row:0{GID_WIDTH}d}"


def stop_key(namespace: str) -> str:
    return f"{{{namespace}}}:bench:stop"


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
    return {"batches": batches}


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


def run_child(args: argparse.Namespace) -> None:
    queue = Queue(connect(args.redis_url), args.namespace)
    content = make_content(0) if args.role in ("feeder", "worker") else None
    result = ROLES[args.role](args, queue, content)
    Path(args.out).write_text(json.dumps(result))


# -- the parent ---------------------------------------------------------------------------------


@dataclass
class ServerSnapshot:
    at: float
    cpu_s: float  # the main thread's user + system CPU
    committed: int
    commands: dict[str, tuple[int, float]]  # command -> (calls, usec)

    @classmethod
    def take(cls, queue: Queue) -> ServerSnapshot:
        r = queue.redis
        cpu = r.info("cpu")
        main = ("used_cpu_user_main_thread", "used_cpu_sys_main_thread")
        keys = main if all(k in cpu for k in main) else ("used_cpu_user", "used_cpu_sys")
        stats = {name.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"]))
                 for name, v in r.info("commandstats").items()}
        committed = int(r.hget(queue.keys.stats, "committed") or 0)
        return cls(time.monotonic(), sum(float(cpu[k]) for k in keys), committed, stats)


@dataclass
class Phase:
    workers: int
    rate: float | None  # groups/s offered in total (None: unpaced)
    groups_per_s: float
    server_cpu: float  # fraction of one core the server's main thread used
    server_us_per_group: float
    commands_us_per_group: dict[str, float]
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
    engine_tokens_per_s: float = ENGINE_TOKENS_PER_S


class Bench:
    def __init__(self, settings: Settings, workdir: Path):
        self.settings = settings
        self.workdir = workdir

    def phase(self, server: RedisServer, workers: int, rate: float | None) -> Phase:
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
                   "--batch", str(s.batch), "--rate", str(rate / workers if rate else 0)]
            procs.append((role, out, subprocess.Popen(cmd, cwd=REPO)))
        try:
            deadline = time.monotonic() + 60
            while int(queue.redis.hget(queue.keys.stats, "committed") or 0) == 0:
                if time.monotonic() > deadline or any(p.poll() is not None for _, _, p in procs):
                    raise RuntimeError("the clients committed nothing within 60 s (or one exited)")
                time.sleep(0.05)
            time.sleep(s.warmup_s)
            before = ServerSnapshot.take(queue)
            time.sleep(s.window_s)
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
        per_group = {}
        for name, (calls, usec) in after.commands.items():
            calls0, usec0 = before.commands.get(name, (0, 0.0))
            if calls > calls0:
                per_group[name] = round((usec - usec0) / groups, 2)
        phase = Phase(workers=workers, rate=rate, groups_per_s=groups / wall,
                      server_cpu=(after.cpu_s - before.cpu_s) / wall,
                      server_us_per_group=1e6 * (after.cpu_s - before.cpu_s) / groups,
                      commands_us_per_group=dict(sorted(per_group.items(), key=lambda kv: -kv[1])))
        if rate:
            phase.latency_ms = _latency(results, before.at, after.at)
        log.info("%s workers, rate %s: %.0f groups/s, server %.0f%% of a core, %.0f us/group %s", workers,
                 f"{rate:.0f}" if rate else "unpaced", phase.groups_per_s, 100 * phase.server_cpu,
                 phase.server_us_per_group, phase.latency_ms)
        return phase

    def fsync_mode(self, fsync: Fsync) -> dict:
        s = self.settings
        server = RedisServer(self.workdir / f"redis-{fsync.value}", port=free_port(), fsync=fsync)
        server.start()
        try:
            unpaced: list[Phase] = []
            workers = 1
            while workers <= s.max_workers:
                unpaced.append(self.phase(server, workers, None))
                if len(unpaced) > 1 and unpaced[-1].groups_per_s < 1.05 * unpaced[-2].groups_per_s:
                    break  # more clients no longer help: the server, or this machine, is saturated
                workers *= 2
            best = max(unpaced, key=lambda p: p.groups_per_s)
            paced = [self.phase(server, best.workers, load * best.groups_per_s) for load in s.loads]
        finally:
            server.stop()
        # Cost per group from the phase that pushed the server hardest.
        us = best.server_us_per_group
        per_core = 1e6 / us
        return {
            "fsync": fsync.value,
            "server_us_per_group": round(us, 1),
            "server_us_per_token": round(us / TOKENS_PER_GROUP, 4),
            "groups_per_s_saturated": round(per_core),
            "groups_per_s_measured": round(best.groups_per_s, 1),
            "server_cpu_at_measured": round(best.server_cpu, 3),
            "engines_per_core": round(per_core * TOKENS_PER_GROUP / s.engine_tokens_per_s),
            "latency_ms": {f"{int(100 * load)}%": {**p.latency_ms, "groups_per_s": round(p.groups_per_s, 1)}
                           for load, p in zip(s.loads, paced)},
            "phases": [asdict(p) for p in unpaced + paced],
        }

    def run(self) -> dict:
        modes = {fsync.value: self.fsync_mode(fsync) for fsync in self.settings.fsync}
        main = modes[self.settings.fsync[0].value]
        worst_load = f"{int(100 * max(self.settings.loads))}%"
        return {
            "server_us_per_group": main["server_us_per_group"],
            "groups_per_s_saturated": main["groups_per_s_saturated"],
            "engines_per_core": main["engines_per_core"],
            "publish_to_delivery_p99_ms": main["latency_ms"][worst_load]["p99"],
            "by_fsync": modes,
            "settings": {**asdict(self.settings), "tokens_per_group": TOKENS_PER_GROUP,
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
    print(f"groups of {TOKENS_PER_GROUP} generated tokens; B = {s['batch']}; claims of {s['claim']}; "
          f"{s['window_s']:g}s windows; engines at {s['engine_tokens_per_s']:g} output tokens/s; {s['machine']}")
    print()
    print("| AOF fsync | server µs/group | µs/token | groups/s per Redis core | measured groups/s "
          "(server CPU) | engines per core | publish→delivery p50/p99 at 50% (groups/s) | at 90% |")
    print("|---|---|---|---|---|---|---|---|")
    for m in result["by_fsync"].values():
        lat = m["latency_ms"]
        print(f"| {m['fsync']} | {m['server_us_per_group']:.0f} | {m['server_us_per_token']:.4f} "
              f"| {m['groups_per_s_saturated']:,} | {m['groups_per_s_measured']:.0f} "
              f"({m['server_cpu_at_measured']:.0%}) | {m['engines_per_core']:,} "
              + "".join(f"| {lat[k]['p50']:.1f} / {lat[k]['p99']:.1f} ms ({lat[k]['groups_per_s']:.0f}) "
                        for k in ("50%", "90%")) + "|")
    print()
    top = result["by_fsync"][next(iter(result["by_fsync"]))]["phases"][0]["commands_us_per_group"]
    print("server µs per group by command (first phase): " + ", ".join(f"{k} {v}" for k, v in list(top.items())[:8]))
    print(f"engines_per_core = {result['engines_per_core']:,} (target >= {TARGET_ENGINES_PER_CORE:,})")


def main(argv: list[str] | None = None) -> None:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short windows, at most 2 workers (under a minute)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--window", type=float, help=f"measured seconds per phase (default {d.window_s:g}, --quick 3)")
    p.add_argument("--max-workers", type=int, help=f"most worker processes (default {d.max_workers}, --quick 2)")
    p.add_argument("--batch", type=int, default=d.batch, help="groups per trainer batch")
    p.add_argument("--engine-tokens-per-s", type=float, default=d.engine_tokens_per_s)
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
        return
    settings = Settings(window_s=args.window or (3.0 if args.quick else d.window_s),
                        warmup_s=1.0 if args.quick else d.warmup_s,
                        max_workers=args.max_workers or (2 if args.quick else d.max_workers),
                        batch=args.batch, engine_tokens_per_s=args.engine_tokens_per_s)
    with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
        result = Bench(settings, Path(tmp)).run()
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
