#!/usr/bin/env python
"""How long `rollout audit` holds the server on a namespace of 1,000,000 queued groups.

A redis-server of its own (no persistence) gets N queued groups (pushed through the
push script in chunks, as `rollout push` does), a few groups in flight, finished and
dead-lettered; then the audit runs with SLOWLOG recording every command slower than
0.2 ms. Prints the slowest server step of the audit (SLOWLOG's figure: time inside
Redis, not the round trip), how many steps took over 1 ms and 50 ms, the audit's wall
time and its verdict. Issue 21 (o7): the audit used to be one script holding the server
for ~7 us per queued group (~1.3 s per 200k), past the 5 s busy threshold at ~0.7 M.

    python bench/audit_slowlog.py                 # 1,000,000 queued groups (a few minutes)
    python bench/audit_slowlog.py --groups 100000
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.connection import connect  # noqa: E402
from bench.report import run_bench  # noqa: E402
from pipeline.ops.audit import audit  # noqa: E402
from pipeline.queue import Place, Queue  # noqa: E402
from pipeline.redis_server import RedisServer, free_port  # noqa: E402
from pipeline.types import Group, Status  # noqa: E402

CHUNK = 5000


def fill(q: Queue, n: int) -> None:
    # A little of everything else first: in flight, finished, dead.
    q.push_groups([Group.fresh(f"w{i}", "p", 2, row=i) for i in range(40)])
    q.register("w")
    claimed = q.claim("w", "w:1", 40).groups
    for i, c in enumerate(claimed[:20]):
        g = c.group
        for s in g.samples:
            s.tokens, s.response_length, s.status, s.reward = [1, 2], 1, Status.COMPLETED, 1.0
        q.publish_group("w", g, c.token, Place.RESULTS if i % 2 else Place.DEAD, None if i % 2 else "bench")
    for start in range(0, n, CHUNK):
        q.push_groups([Group.fresh(f"ds:0:{i}", "What is 1 + 1?", 4, row=i)
                       for i in range(start, min(n, start + CHUNK))])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=1_000_000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    server = RedisServer(tempfile.mkdtemp(prefix="bench-audit-"), port=free_port(), aof=False)
    server.start()
    try:
        client = connect(server.url, socket_timeout=60)
        q = Queue(client, "bench")
        t0 = time.monotonic()
        fill(q, a.groups)
        fill_s = time.monotonic() - t0
        client.config_set("slowlog-log-slower-than", 200)  # microseconds (a script's own calls stay below)
        client.config_set("slowlog-max-len", 100000)
        client.slowlog_reset()
        t0 = time.monotonic()
        report = audit(q)
        audit_s = time.monotonic() - t0
        slow = [e for e in client.slowlog_get(100000) if not e["command"].startswith((b"SLOWLOG", b"CONFIG"))]
        worst = max(slow, key=lambda e: e["duration"], default=None)
        durations = sorted(e["duration"] / 1000 for e in slow)
        out = {
            "queued_groups": report.prompts, "fill_s": round(fill_s, 1), "audit_s": round(audit_s, 2),
            "audit_ok": report.ok, "steps_over_0.2ms": len(slow),
            "steps_over_1ms": sum(1 for d in durations if d > 1),
            "median_step_ms": round(durations[len(durations) // 2], 2) if durations else "< 0.2",
            "p99_step_ms": round(durations[int(len(durations) * 0.99)], 2) if durations else "< 0.2",
            "steps_over_50ms": sum(1 for e in slow if e["duration"] > 50_000),
            "slowest_step_ms": round(worst["duration"] / 1000, 2) if worst else "< 1",
            "slowest_step": " ".join(str(x)[:40] for x in worst["command"].split()[:2]) if worst else "",
            "redis": client.info("server")["redis_version"],
        }
        if not a.json:
            for key, value in out.items():
                print(f"{key:>16}: {value}")
            print(report.summary())
        return out
    finally:
        server.kill()


if __name__ == "__main__":
    run_bench(main)
