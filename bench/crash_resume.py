#!/usr/bin/env python
"""What in-flight checkpoints cost (issue 33): Redis time and bytes per checkpointed token.

One worker's share of a rollout, driven through the project's API against one embedded
redis-server (AOF on, `appendfsync always` as in production): it claims G groups of n
samples, and every checkpoint interval each sample gains T tokens (with their log-probs
and the weight version of the engine call), then the worker writes the checkpoints of
all its groups in one call (Queue.checkpoint: one script call, as the worker batches
them), until every sample has L tokens; then it publishes the groups (whose checkpoints
go with them). The same run without checkpoints is the baseline of the publish.

Figures, per checkpointed token (a token is counted once, when first saved):

  redis_us_per_token      the server's main-thread CPU (INFO cpu) over the checkpoint writes
  aof_bytes_per_token     bytes appended to the AOF by them (what replication also carries)
  memory_bytes_per_token  MEMORY USAGE of the checkpoint keys at their largest, per token held
  client_us_per_token     the writer's CPU making the records (CheckpointLog + codec)
  publish_extra_us        server CPU a publish costs more when its group has a checkpoint

The variants differ in tokens per write: 128 (a sample decoding ~30 tokens/s, written every
~4 s: 16 records per sample) and 16 (a record per 16 tokens: the 32-record bound is reached
and the checkpoint rewritten whole, the worst case of appends).

Streams: the client's CPU per generated token reading answers whole and as streams
(EngineSet with stream on), both SGLang chunk styles, stream_interval 64 (the default) and
1 (the simulator looks at a stream every 20 ms at most, so at 400 tokens/s a chunk holds ~8
tokens: about SGLang's default behind a router), against a `rollout sim-engine` process (C
requests at once): `stream_client_us_per_token`.
The worker's own figure under load is bench/inflight.py's worker_cpu_us_per_token.

The crash-recovery figures (regenerated fraction after a worker or engine kill, throughput
with checkpoints on and off) come with the worker's checkpointing (issue 33, phase 2).

    python bench/crash_resume.py            # ~2 minutes
    python bench/crash_resume.py --quick    # ~30 s
    python bench/crash_resume.py --json     # one JSON object on stdout
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/<name>.py` from a clone
    sys.path.insert(0, str(REPO))

from local.processes import stop_processes  # noqa: E402
from pipeline.checkpoints import CheckpointLog, CheckpointOutcome  # noqa: E402
from pipeline.connection import connect  # noqa: E402
from pipeline.queue import Place, Queue  # noqa: E402
from pipeline.redis_server import Fsync, RedisServer, free_port  # noqa: E402
from pipeline.types import SEGMENTS_KEY, Group, Status  # noqa: E402
from workers.engine_set import EngineSet  # noqa: E402
from bench.report import run_bench  # noqa: E402

PROMPT_TOKENS = 256


def server_cpu_s(client) -> float:
    cpu = client.info("cpu")
    keys = ("used_cpu_user_main_thread", "used_cpu_sys_main_thread")
    keys = keys if all(k in cpu for k in keys) else ("used_cpu_user", "used_cpu_sys")
    return sum(float(cpu[k]) for k in keys)


def aof_size(client) -> int:
    return int(client.info("persistence").get("aof_current_size", 0))


def grow(group: Group, tokens: int, step: int) -> None:
    """One engine interval: `tokens` more on every sample, as a stream brings them."""
    for i, s in enumerate(group.samples):
        if not s.tokens:
            s.tokens = list(group.prompt_ids)
            s.rollout_log_probs = []
        s.tokens += [(7 * step + i + k) % 50_000 for k in range(tokens)]
        s.rollout_log_probs += [-0.5] * tokens
        s.response_length += tokens
        if not s.weight_versions:
            s.weight_versions.append("3")
            s.metadata[SEGMENTS_KEY] = [0]
        s.metadata[SEGMENTS_KEY][-1] += tokens
        s.status = Status.ABORTED


def run_variant(url: str, groups: int, samples: int, length: int, per_write: int, checkpoints: bool) -> dict:
    client = connect(url)
    namespace = f"cost-{per_write}-{int(checkpoints)}-{time.monotonic_ns()}"
    queue = Queue(client, namespace)
    queue.push_groups([Group.fresh(f"g{i}", "p", samples, dataset="bench", row=i) for i in range(groups)])
    queue.register("w")
    claim = queue.claim("w", "w:1", groups)
    held = claim.groups
    for c in held:
        c.group.prompt_ids = list(range(PROMPT_TOKENS))
    logs = {c.group_id: CheckpointLog(c.group_id, c.token) for c in held}
    cpu0, aof0 = server_cpu_s(client), aof_size(client)
    client_s, calls, peak_memory, step = 0.0, 0, 0, 0
    while held[0].group.samples[0].response_length < length:
        step += 1
        for c in held:
            grow(c.group, per_write, step)
        if not checkpoints:
            continue
        t = time.process_time()
        writes = [logs[c.group_id].next_write(c.group) for c in held]
        client_s += time.process_time() - t
        outcomes = queue.checkpoint("w", writes)
        calls += 1
        assert set(outcomes) == {CheckpointOutcome.OK}, outcomes
        t = time.process_time()
        for w, o in zip(writes, outcomes):
            logs[w.group_id].settle(w, o)
        client_s += time.process_time() - t
        if step % 8 == 0 or held[0].group.samples[0].response_length >= length:
            peak_memory = max(peak_memory, sum(client.memory_usage(k, samples=0) or 0
                                               for k in (queue.keys.checkpoints, queue.keys.checkpoint_records)))
    cpu1, aof1 = server_cpu_s(client), aof_size(client)
    for c in held:  # finished: scored and published (its checkpoint goes with it)
        for s in c.group.samples:
            s.status, s.reward = Status.COMPLETED, 1.0
    cpu2 = server_cpu_s(client)
    for c in held:
        queue.publish_group("w", c.group, c.token, Place.RESULTS)
    cpu3 = server_cpu_s(client)
    assert client.hlen(queue.keys.checkpoints) == 0
    tokens = groups * samples * length
    out = {"groups": groups, "samples": samples, "tokens_per_sample": length, "tokens_per_write": per_write,
           "checkpoint_calls": calls, "publish_us_per_group": (cpu3 - cpu2) / groups * 1e6}
    if checkpoints:
        out.update(redis_us_per_token=(cpu1 - cpu0) / tokens * 1e6, aof_bytes_per_token=(aof1 - aof0) / tokens,
                   memory_bytes_per_token=peak_memory / tokens, client_us_per_token=client_s / tokens * 1e6,
                   redis_ms_per_call=(cpu1 - cpu0) / calls * 1e3)
    client.delete(*queue.keys.all_fixed())
    client.close()
    return out


async def _generate_all(url: str, stream: bool, interval: int | None, requests: int, concurrency: int) -> int:
    engines = EngineSet([url], stream=stream, stream_interval=interval)
    slots = asyncio.Semaphore(concurrency)
    prompt = list(b"What is 12 + 30? Think step by step.")

    async def one(i: int) -> int:
        async with slots:
            result = await engines.generate(prompt, {"max_new_tokens": 1024, "sampling_seed": i}, rid=f"r{i}")
            return len(result.output_ids)

    try:
        return sum(await asyncio.gather(*(one(i) for i in range(requests))))
    finally:
        await engines.close()


def stream_cost(tmp: Path, requests: int, concurrency: int) -> dict:
    """The client's CPU per generated token, answers read whole and as streams."""
    out = {}
    for incremental in (False, True):
        port = free_port()
        args = [sys.executable, "-m", "cli", "sim-engine", "--port", str(port), "--max-running", str(concurrency),
                "--decode-rate", "400", "--median-tokens", "256", "--p99-tokens", "1024"]
        if incremental:
            args.append("--incremental-streaming-output")
        with (tmp / f"sim-{port}.log").open("w") as log:
            sim = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    urllib.request.urlopen(url + "/health", timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or sim.poll() is not None:
                        raise RuntimeError(f"the simulator did not start: {(tmp / f'sim-{port}.log').read_text()}")
                    time.sleep(0.1)
            runs = [("whole", False, None)] if not incremental else []
            style = "incremental" if incremental else "cumulative"
            runs += [(f"{style}_interval_64", True, 64), (f"{style}_interval_1", True, 1)]
            for name, stream, interval in runs:
                cpu = time.process_time()
                tokens = asyncio.run(_generate_all(url, stream, interval, requests, concurrency))
                out[name] = (time.process_time() - cpu) / tokens * 1e6
        finally:
            stop_processes([sim], timeout_s=5)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer groups and shorter samples (~15 s)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--fsync", default=Fsync.ALWAYS.value, choices=[f.value for f in Fsync])
    args = p.parse_args(argv)
    groups, samples, length = (16, 8, 1024) if args.quick else (64, 8, 2048)
    requests, concurrency = (200, 100) if args.quick else (1000, 250)
    tmp = Path(tempfile.mkdtemp(prefix="bench-crash-resume-"))
    server = RedisServer(tmp / "redis", port=None, fsync=Fsync(args.fsync))
    try:
        url = server.start()
        variants = {}
        for per_write in (128, 16):
            with_cp = run_variant(url, groups, samples, length, per_write, True)
            without = run_variant(url, groups, samples, length, per_write, False)
            with_cp["publish_extra_us"] = with_cp["publish_us_per_group"] - without["publish_us_per_group"]
            variants[str(per_write)] = with_cp
            if not args.json:
                print(f"{per_write:>4} tokens a write: Redis {with_cp['redis_us_per_token']:.3f} us/token "
                      f"({with_cp['redis_ms_per_call']:.2f} ms per call of {groups} groups), AOF "
                      f"{with_cp['aof_bytes_per_token']:.2f} B/token, memory {with_cp['memory_bytes_per_token']:.2f}"
                      f" B/token held, writer {with_cp['client_us_per_token']:.3f} us/token; a publish "
                      f"{with_cp['publish_extra_us']:+.0f} us with its checkpoint", file=sys.stderr)
        streams = stream_cost(tmp, requests, concurrency)
        if not args.json:
            print("client CPU per generated token: " + ", ".join(f"{k} {v:.2f} us" for k, v in streams.items()),
                  file=sys.stderr)
    finally:
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"checkpoint_redis_us_per_token": variants["128"]["redis_us_per_token"],
              "checkpoint_aof_bytes_per_token": variants["128"]["aof_bytes_per_token"],
              "checkpoint_memory_bytes_per_token": variants["128"]["memory_bytes_per_token"],
              "stream_client_us_per_token": streams, "variants": variants, "fsync": args.fsync,
              "quick": args.quick}
    if not args.json:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    run_bench(main)
