#!/usr/bin/env python
"""Where Redis spends its time per group: each command and each script, one by one.

One process drives the life cycle of bench/redis_capacity.py sequentially (push 64,
claim 8 and publish each as the bench's worker does, next_batch(32) + commit) through
the project's API against a fresh redis-server, with every command in SLOWLOG
(`slowlog-log-slower-than 0`) and AOF rewrites off, so it can name what each group
costs: server µs per script (claim, publish, read, settle, ...) and per plain command,
calls and round trips per group by role, bytes appended to the AOF, and (with `perf`)
the main thread's fsyncs and event-loop passes. Sequential: every round trip is an
event-loop pass of its own, so fsyncs per group here = write round trips per group (the
capacity bench, with many clients, shares some).

    python bench/redis_profile.py                    # 2,048-token samples, 256 groups
    python bench/redis_profile.py --sample-tokens 256 --json
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import uuid
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.queue_overhead import N_SAMPLES, fill, make_content  # noqa: E402
from bench.redis_capacity import (FEED_CHUNK, TEMPLATE_GID, SyscallCounter, count_round_trips,  # noqa: E402
                                  gid)
from pipeline import scripts  # noqa: E402
from pipeline.codec import encode_group  # noqa: E402
from pipeline.connection import connect  # noqa: E402
from pipeline.consumer import Consumer  # noqa: E402
from bench.report import run_bench  # noqa: E402
from pipeline.control import configure  # noqa: E402
from pipeline.queue import Place, Queue  # noqa: E402
from pipeline.redis_server import Fsync, RedisServer, free_port  # noqa: E402
from pipeline.types import Group  # noqa: E402

NAMESPACE = "profile"


def script_names() -> dict[str, str]:
    """EVALSHA digest or FCALL function name -> script name."""
    out = {hashlib.sha1(scripts.source(n).encode()).hexdigest(): n for n in scripts.names()}
    out.update({f"{scripts.LIBRARY}_{n}": n for n in scripts.names()})
    return out


def run(sample_tokens: int, groups: int, claim: int, batch: int, workdir: Path) -> dict:
    server = RedisServer(workdir / "redis", port=free_port(), fsync=Fsync.ALWAYS,
                         extra_config=["auto-aof-rewrite-percentage 0", "slowlog-log-slower-than 0",
                                       "slowlog-max-len 1000000"])
    server.start()
    try:
        round_trips = count_round_trips()
        feeder_q, worker_q = Queue(connect(server.url), NAMESPACE), Queue(connect(server.url), NAMESPACE)
        admin = connect(server.url)
        configure(admin, feeder_q.keys, max_ready=4 * batch)
        content = make_content(0, sample_tokens)
        template = Group.fresh(TEMPLATE_GID, content.prompt, N_SAMPLES)
        fill(template, content, "w")
        payload = encode_group(template, with_response_text=False)
        consumer = Consumer(connect(server.url), NAMESPACE, block_s=0.2)
        name = f"w-{uuid.uuid4().hex[:6]}"
        worker_q.register(name)
        trips: dict[str, int] = defaultdict(int)
        row = 0

        def cycle(n_batches: int) -> None:
            nonlocal row
            for _ in range(n_batches):
                published = 0
                while published < batch:
                    if admin.llen(feeder_q.keys.prompts) < claim:
                        start = round_trips[0]
                        feeder_q.push_groups([Group.fresh(gid(row + i), content.prompt, N_SAMPLES, row=row + i)
                                              for i in range(FEED_CHUNK)])
                        row += FEED_CHUNK
                        trips["feeder"] += round_trips[0] - start
                    start = round_trips[0]
                    got = worker_q.claim(name, uuid.uuid4().hex, claim)
                    for claimed in got.groups:
                        data = payload.replace(TEMPLATE_GID.encode(), claimed.group_id.encode())
                        worker_q.publish(name, claimed.group_id, claimed.token, data, Place.RESULTS)
                    published += len(got.groups)
                    trips["worker"] += round_trips[0] - start
                start = round_trips[0]
                consumer.commit(consumer.next_batch(batch, timeout=10))
                trips["trainer"] += round_trips[0] - start

        cycle(2)  # warm-up: scripts loaded, the trainer's session started
        for t in trips:
            trips[t] = 0
        admin.slowlog_reset()
        info0 = {**admin.info("cpu"), **admin.info("persistence"), **admin.info("stats")}
        committed0 = int(admin.hget(feeder_q.keys.stats, "committed"))
        with SyscallCounter(server.process.pid, workdir / "perf.txt",
                            lambda: int(admin.hget(feeder_q.keys.stats, "committed"))) as syscalls:
            cycle(groups // batch)
        info1 = {**admin.info("cpu"), **admin.info("persistence"), **admin.info("stats")}
        done = int(admin.hget(feeder_q.keys.stats, "committed")) - committed0
        log = admin.slowlog_get(1_000_000)
    finally:
        server.stop()
    names = script_names()
    by: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for entry in log:
        args = [a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in entry["command"].split()] \
            if isinstance(entry["command"], (bytes, str)) else [str(a) for a in entry["command"]]
        cmd = args[0].lower()
        if cmd in ("slowlog", "info"):
            continue
        if cmd in ("evalsha", "fcall") and len(args) > 1:
            cmd = f"{cmd} {names.get(args[1], args[1][:12])}"
        by[cmd][0] += 1
        by[cmd][1] += entry["duration"]
    main = ("used_cpu_user_main_thread", "used_cpu_sys_main_thread")
    cpu_keys = main if all(k in info1 for k in main) else ("used_cpu_user", "used_cpu_sys")
    cpu_us = 1e6 * sum(float(info1[k]) - float(info0[k]) for k in cpu_keys)
    commands_us = sum(us for _, us in by.values())
    return {
        "sample_tokens": sample_tokens,
        "groups": done,
        "server_cpu_us_per_group": round(cpu_us / done, 1),
        "commands_us_per_group": round(commands_us / done, 1),
        "outside_commands_us_per_group": round((cpu_us - commands_us) / done, 1),
        "by_command": {cmd: {"calls_per_group": round(calls / done, 3), "us_per_group": round(us / done, 1),
                             "us_per_call": round(us / calls, 1)}
                       for cmd, (calls, us) in sorted(by.items(), key=lambda kv: -kv[1][1])},
        "round_trips_per_group": {role: round(n / done, 3) for role, n in trips.items()},
        "commands_per_group": round((info1["total_commands_processed"] - info0["total_commands_processed"]) / done, 1),
        "aof_bytes_per_group": round((info1["aof_current_size"] - info0["aof_current_size"]) / done),
        "net_input_bytes_per_group": round((info1["total_net_input_bytes"] - info0["total_net_input_bytes"]) / done),
        "syscalls_per_group": None if syscalls.counts is None else {
            k: round(v / max(1, syscalls.groups), 2) for k, v in syscalls.counts.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sample-tokens", type=int, default=2048)
    p.add_argument("--groups", type=int, default=256)
    p.add_argument("--claim", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        out = run(args.sample_tokens, args.groups, args.claim, args.batch, Path(tmp))
    if args.json:
        return out
    print(f"{out['sample_tokens']}-token samples, {out['groups']} groups: server CPU {out['server_cpu_us_per_group']} "
          f"µs/group = commands {out['commands_us_per_group']} + outside commands "
          f"{out['outside_commands_us_per_group']}")
    print(f"round trips per group {out['round_trips_per_group']}; commands {out['commands_per_group']}; "
          f"AOF {out['aof_bytes_per_group']:,} B; syscalls {out['syscalls_per_group']}")
    print("| command | calls/group | µs/group | µs/call |\n|---|---|---|---|")
    for cmd, c in out["by_command"].items():
        print(f"| {cmd} | {c['calls_per_group']} | {c['us_per_group']} | {c['us_per_call']} |")
    return out


if __name__ == "__main__":
    run_bench(main)
