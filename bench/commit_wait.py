#!/usr/bin/env python
"""What a commit costs when it waits for a replica (`Consumer(replicas=1)`, WAIT).

A primary (AOF, fsync always) and one replica on loopback; the trainer commits batches
of 8 groups, first acknowledged by the primary alone, then by the replica too. Prints
the median and p99 commit latency of each. Over a network the difference grows by one
round trip from the primary to the replica per commit.

    python bench/commit_wait.py [--batches 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.connection import connect  # noqa: E402
from pipeline.consumer import Consumer  # noqa: E402
from bench.report import run_bench  # noqa: E402
from pipeline.queue import Queue  # noqa: E402
from pipeline.redis_server import RedisServer, free_port, wait_replicated  # noqa: E402
from tests.groups import produce  # noqa: E402  (tests/groups.py needs nothing of the test extra)

BATCH = 8


def commits(url: str, ns: str, batches: int, replicas: int) -> list[float]:
    q = Queue(connect(url), ns)
    produce(q, batches * BATCH)
    trainer = Consumer(connect(url), ns, block_s=0.2, replicas=replicas)
    out = []
    for _ in range(batches):
        batch = trainer.next_batch(BATCH, timeout=30)
        t0 = time.perf_counter()
        trainer.commit(batch)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    primary = RedisServer(tempfile.mkdtemp(prefix="bench-wait-"), port=free_port())
    replica = RedisServer(tempfile.mkdtemp(prefix="bench-wait-"), port=free_port(),
                          extra_config=[f"replicaof 127.0.0.1 {primary.port}"])
    primary.start()
    replica.start()
    out = {"batch_groups": BATCH, "commits": a.batches}
    try:
        wait_replicated(connect(primary.url), connect(replica.url))
        for replicas in (0, 1):
            ms = sorted(commits(primary.url, f"wait{replicas}", a.batches, replicas))
            out[f"replicas_{replicas}"] = {"median_ms": round(statistics.median(ms), 3),
                                           "p99_ms": round(ms[int(len(ms) * 0.99)], 3)}
            if not a.json:
                print(f"replicas={replicas}: commit of {BATCH} groups median {statistics.median(ms):.2f} ms, "
                      f"p99 {ms[int(len(ms) * 0.99)]:.2f} ms ({a.batches} commits)")
        return out
    finally:
        primary.kill()
        replica.kill()


if __name__ == "__main__":
    run_bench(main)
