#!/usr/bin/env python
"""Queue overhead: the pipeline's rate against a bare redis-py loop, and bytes stored
per generated token while a group waits in the results stream.

Both loops run in the same process, against the same `redis-server` (started here,
AOF on as in production unless --no-aof), in alternating rounds so drift on the
machine hits both alike. Each step of both loops moves B groups (8 samples x 2,048
generated tokens, a 256-token prompt, response text, rewards, log-probs) through:

  push        pipeline: Queue.push_groups (encodes fresh groups; MULTI HSET+RPUSH)
              bare:     pipelined HSET+RPUSH of a pre-encoded fresh group
  claim       pipeline: Queue.claim (claim.lua; decodes the claimed groups)
              bare:     LPOP COUNT, then pipelined SADD + HMGET of the payloads
  fill        the instant in-process "engine" writes the samples (pipeline only;
              timed, but NOT counted in either rate)
  encode      pipeline: encode_group of the finished group (the worker's job; counted)
              bare:     the same encode_group inside its publish step (any queue must
                        serialize what it carries); a third loop, "pre-encoded", sends
                        one payload as is and never decodes, for comparison
  publish     pipeline: Queue.publish (one MULTI: SET of the staged payload and publish.lua:
                        ownership check, RENAME into the result key, XADD of the id)
              bare:     pipelined SET result key + SREM + HDEL + XADD id, one round trip
  next_batch  pipeline: Consumer.next_batch(B) (XREADGROUP + MGET of the payloads,
                        control reads, dedupe, decode)
              bare:     XREADGROUP COUNT B-have until B entries, MGET (no decode)
  commit      pipeline: Consumer.commit (settle.lua)   bare: pipelined XACK + XDEL + DEL

ratio = pipeline groups/s / bare groups/s, from wall time of the counted phases
(target >= 0.5); ratio_vs_preencoded = pipeline / pre-encoded loop. cpu_ratio is the same from CPU time (this process + redis-server's
INFO cpu): less sensitive to other load on the machine.

Bytes per token: K groups published into a fresh results stream, left undelivered;
MEMORY USAGE of the stream and of the K result payload keys / (K x 8 x 2048), as
published by default (no response text) and with --keep-response-text. Target <= 9.

    python bench/queue_overhead.py            # full run, a short table
    python bench/queue_overhead.py --quick    # under a minute
    python bench/queue_overhead.py --json     # one JSON object on stdout
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import pstats
import random
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import redis

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/<name>.py` from a clone
    sys.path.insert(0, str(REPO))

from pipeline.codec import decode_group, encode_group
from pipeline.connection import PROTOCOL, connect
from pipeline.consumer import Consumer
from bench.report import run_bench
from pipeline.keys import CONSUMER_GROUP, Keys
from pipeline.queue import Place, Published, Queue
from pipeline.redis_server import RedisServer, free_port
from pipeline.types import Group, Status

N_SAMPLES = 8
RESPONSE_TOKENS = 2048
PROMPT_TOKENS = 256
VOCAB_SIZE = 151_936  # Qwen2.5's; ids are random below it
POOL = 16  # distinct generated samples the "engine" cycles through
TARGET_RATIO = 0.5
TARGET_BYTES_PER_TOKEN = 9.0

PHASES = ("push", "claim", "fill", "encode", "publish", "next_batch", "commit")
COUNTED = ("push", "claim", "encode", "publish", "next_batch", "commit")  # fill is the engine's


# -- synthetic but realistic content ---------------------------------------------------

def _vocabulary(rng: random.Random, size: int = 1000) -> tuple[list[str], list[float]]:
    """Word-like pieces with Zipf weights: with the leading space about 3.9 characters
    per token, as BPE gives on English text, and about 1.8 bytes per token after zlib
    level 1 (English prose measures 1.6-1.8 at 4 characters per token)."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "th", "st", "w", "pr"]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou"]
    codas = ["", "", "n", "s", "t", "r", "l", "nd", "ng", "st"]
    words: set[str] = set()
    while len(words) < size:
        syllables = 1 if rng.random() < 0.9 else 2
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables)))
    ordered = sorted(words)
    rng.shuffle(ordered)
    ordered[:12] = [",", ".", "=", "+", "the", "of", "to", "is", "we", "x", "\n", "so"]
    ordered += [str(d) for d in range(10)]
    weights = [1.0 / (rank + 1) for rank in range(len(ordered))]
    return ordered, weights


@dataclass
class Generated:
    ids: list[int]
    log_probs: list[float]
    text: str


@dataclass
class Content:
    prompt: str
    prompt_ids: list[int]
    pool: list[Generated]
    chars_per_token: float
    text_zlib_bytes_per_token: float


def make_content(seed: int = 0, response_tokens: int = RESPONSE_TOKENS) -> Content:
    """Prompt and a pool of generated samples of `response_tokens` tokens each."""
    rng = random.Random(seed)
    words, weights = _vocabulary(rng)

    def text(n_tokens: int) -> str:
        pieces = rng.choices(words, weights, k=n_tokens)
        return "".join(p if p in (",", ".", "\n") else " " + p for p in pieces).strip()

    prompt = "Solve the problem and put the final answer in \\boxed{}. " + text(PROMPT_TOKENS - 14)
    pool = [
        Generated(
            ids=[rng.randrange(VOCAB_SIZE) for _ in range(response_tokens)],
            log_probs=[-rng.expovariate(3.0) for _ in range(response_tokens)],
            text=text(response_tokens),
        )
        for _ in range(POOL)
    ]
    chars = sum(len(g.text) for g in pool) / (POOL * response_tokens)
    zbytes = sum(len(zlib.compress(g.text.encode(), 1)) for g in pool) / (POOL * response_tokens)
    return Content(prompt, [rng.randrange(VOCAB_SIZE) for _ in range(PROMPT_TOKENS)], pool, chars, zbytes)


def fresh_group(content: Content, ns: str, row: int) -> Group:
    """What the producer pushes for dataset row `row`."""
    return Group.fresh(f"bench-{ns}:0:{row}", content.prompt, N_SAMPLES, label=str(row % 97),
                       metadata={"source": "bench", "row": row}, dataset=f"bench-{ns}", epoch=0, row=row)


def fill(group: Group, content: Content, worker: str, with_text: bool = True) -> None:
    """The instant engine, writing what workers/worker.py writes after one /generate
    call per sample and a reward."""
    group.worker = worker
    group.claimed_at = time.time()
    group.prompt_ids = list(content.prompt_ids)
    for i, s in enumerate(group.samples):
        g = content.pool[(group.row * N_SAMPLES + i) % POOL]
        if not s.tokens:
            s.tokens = list(group.prompt_ids)
        s.tokens += g.ids
        s.response_length += len(g.ids)
        s.response += g.text if with_text else ""
        s.rollout_log_probs = (s.rollout_log_probs or []) + g.log_probs
        s.weight_versions.append("0")
        s.metadata.setdefault("rollout_segments", []).append(len(g.ids))
        s.status = Status.TRUNCATED if i % 3 == 0 else Status.COMPLETED
        s.reward = 1.0 if i % 2 else 0.0
    group.finished_at = time.time()


# -- the two loops ---------------------------------------------------------------------

@dataclass
class Timer:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    groups: int = 0
    client_cpu: float = 0.0  # this process, engine fill excluded
    server_cpu: float = 0.0  # redis-server (INFO cpu), all its threads
    fill_cpu: float = 0.0
    round_rates: list[float] = field(default_factory=list)

    def cpu_ms_per_group(self) -> float:
        return 1000 * (self.client_cpu + self.server_cpu) / self.groups if self.groups else 0.0

    def counted(self) -> float:
        return sum(self.seconds[p] for p in COUNTED)

    def rate(self) -> float:
        return self.groups / self.counted() if self.groups else 0.0

    def per_group_ms(self) -> dict[str, float]:
        return {p: 1000 * s / self.groups for p, s in self.seconds.items()} if self.groups else {}


class PipelineLoop:
    """The project's API end to end."""

    def __init__(self, url: str, ns: str, content: Content, batch: int):
        self.client = connect(url)
        self.ns, self.content, self.batch = ns, content, batch
        self.queue = Queue(self.client, ns)
        self.consumer = Consumer(self.client, ns, consumer="bench-trainer", block_s=1.0)
        self.worker = "bench-worker"
        self.lease_s = self.queue.register(self.worker)
        self.last_beat = time.monotonic()
        self.claims = 0
        self.row = 0

    def step(self, n: int, t: Timer) -> None:
        pc = time.perf_counter
        s = t.seconds
        t0 = pc()
        groups = [fresh_group(self.content, self.ns, self.row + i) for i in range(n)]
        self.row += n
        self.queue.push_groups(groups)
        if time.monotonic() - self.last_beat > self.lease_s / 4:  # as a worker does, or its lease runs out
            self.queue.heartbeat(self.worker, "{}")
            self.last_beat = time.monotonic()
        t1 = pc()
        s["push"] += t1 - t0
        claimed = []
        while len(claimed) < n:
            self.claims += 1
            claim = self.queue.claim(self.worker, f"{self.worker}:{self.claims}", n - len(claimed))
            if claim.status not in ("ok", "empty"):
                raise RuntimeError(f"claim refused: {claim.status}")
            claimed += [c for c in claim.groups if c.group is not None]
            if claim.status == "empty" and len(claimed) < n:
                raise RuntimeError(f"prompts ran out after {len(claimed)} of {n} groups")
        t2 = pc()
        s["claim"] += t2 - t1
        c0 = time.process_time()
        for c in claimed:
            fill(c.group, self.content, self.worker)
        t.fill_cpu += time.process_time() - c0
        t3 = pc()
        s["fill"] += t3 - t2
        # Queue.publish_group is exactly encode_group (results: without the response
        # text) + Queue.publish; called apart here so the encoding (the worker's cost)
        # shows as its own column.
        encoded = 0.0
        for c in claimed:
            e0 = pc()
            data = encode_group(c.group, with_response_text=False)
            encoded += pc() - e0
            if self.queue.publish(self.worker, c.group_id, c.token, data, Place.RESULTS) != Published.OK:
                raise RuntimeError(f"publish of {c.group_id} refused")
        t4 = pc()
        s["encode"] += encoded
        s["publish"] += t4 - t3 - encoded
        batch = self.consumer.next_batch(n, timeout=30)
        t5 = pc()
        s["next_batch"] += t5 - t4
        if self.consumer.commit(batch) != n:
            raise RuntimeError("commit settled fewer entries than the batch holds")
        s["commit"] += pc() - t5
        t.groups += n

    def close(self) -> None:
        self.client.close()


class BareLoop:
    """The same Redis operations and payloads, no pipeline logic (no scripts, no
    ownership checks, no bookkeeping). With `serialize`, it turns the same groups into
    the same bytes and back with the same codec (any queue must serialize what it
    carries); without, it sends one pre-encoded payload and never decodes."""

    def __init__(self, url: str, ns: str, content: Content, batch: int, serialize: bool):
        self.r = redis.Redis.from_url(url, protocol=PROTOCOL, socket_timeout=30)
        self.k = Keys(ns)
        self.batch = batch
        self.serialize = serialize
        self.content, self.ns = content, ns
        self.inflight = self.k.inflight("bare-worker")
        self.prompt_payload = encode_group(fresh_group(content, ns, 0))
        self.done = fresh_group(content, ns, 0)
        fill(self.done, content, "bare-worker")
        self.result_payload = encode_group(self.done, with_response_text=False)
        self.row = 0
        try:
            self.r.xgroup_create(self.k.results, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def step(self, n: int, t: Timer) -> None:
        pc = time.perf_counter
        s, k, r = t.seconds, self.k, self.r
        t0 = pc()
        pipe = r.pipeline(transaction=False)
        for i in range(self.row, self.row + n):
            gid = f"bare:0:{i}"
            pipe.hset(k.payloads, gid, encode_group(fresh_group(self.content, self.ns, i))
                      if self.serialize else self.prompt_payload)
            pipe.rpush(k.prompts, gid)
        pipe.execute()
        self.row += n
        t1 = pc()
        s["push"] += t1 - t0
        gids: list[bytes] = []
        while len(gids) < n:
            got = r.lpop(k.prompts, n - len(gids)) or []
            if not got:
                raise RuntimeError("bare: prompts ran out")
            pipe = r.pipeline(transaction=False)
            pipe.sadd(self.inflight, *got)
            pipe.hmget(k.payloads, got)
            _, payloads = pipe.execute()
            if not all(payloads):
                raise RuntimeError("bare: missing payload")
            if self.serialize:
                for data in payloads:
                    decode_group(data)
            gids += got
        t2 = pc()
        s["claim"] += t2 - t1
        for gid in gids:
            pipe = r.pipeline(transaction=False)
            pipe.set(k.result(gid.decode(), "t"), encode_group(self.done, with_response_text=False)
                     if self.serialize else self.result_payload)
            pipe.srem(self.inflight, gid)
            pipe.hdel(k.payloads, gid)
            pipe.xadd(k.results, {"gid": gid})
            pipe.execute()
        t3 = pc()
        s["publish"] += t3 - t2
        ids: list[bytes] = []
        result_keys: list[str] = []
        while len(ids) < n:
            reply = r.xreadgroup(CONSUMER_GROUP, "bare-trainer", {k.results: ">"}, count=n - len(ids), block=1000)
            if reply:
                rows = [(eid, fields) for eid, fields in reply[0][1] if fields]
                keys = [k.result(fields[b"gid"].decode(), "t") for _, fields in rows]
                payloads = r.mget(keys)
                if not all(payloads):
                    raise RuntimeError("bare: missing result payload")
                if self.serialize:
                    for data in payloads:
                        decode_group(data)
                ids += [eid for eid, _ in rows]
                result_keys += keys
        t4 = pc()
        s["next_batch"] += t4 - t3
        pipe = r.pipeline(transaction=False)
        pipe.xack(k.results, CONSUMER_GROUP, *ids)
        pipe.xdel(k.results, *ids)
        pipe.delete(*result_keys)
        acked, deleted, _ = pipe.execute()
        if acked != n or deleted != n:
            raise RuntimeError("bare: commit short")
        s["commit"] += pc() - t4
        t.groups += n

    def close(self) -> None:
        self.r.close()


def run(loop, groups: int, batch: int, timer: Timer) -> None:
    done = 0
    while done < groups:
        n = min(batch, groups - done)
        loop.step(n, timer)
        done += n


def codec_cost(content: Content, reps: int) -> dict[str, float]:
    """encode_group / decode_group of one finished group, alone (CPU ms, best of 3)."""
    group = fresh_group(content, "codec", 0)
    fill(group, content, "codec-worker")
    data = encode_group(group, with_response_text=False)  # as results are published
    out = {}
    for name, fn in (("encode", lambda: encode_group(group, with_response_text=False)),
                     ("decode", lambda: decode_group(data))):
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            for _ in range(reps):
                fn()
            best = min(best, (time.process_time() - t0) / reps)
        out[name] = 1000 * best
    return out


def payload_breakdown(data: bytes) -> dict[str, float]:
    """Bytes per generated token of one encoded finished group, by field."""
    m = msgpack.unpackb(data, raw=False)
    tokens = N_SAMPLES * RESPONSE_TOKENS
    parts = {
        "token_ids": sum(len(s["t"]) for s in m["s"]),
        "log_probs": sum(len(s["lp"] or b"") for s in m["s"]),
        "response_text": sum(len(s["r"]) for s in m["s"]),
        "prompt_text": sum(len(msgpack.packb(s["p"])) for s in m["s"]),
        "prompt_ids": len(m["pid"]),
    }
    parts["rest"] = len(data) - sum(parts.values())
    return {k: v / tokens for k, v in parts.items()}


# -- bytes per token -------------------------------------------------------------------

def stream_bytes(url: str, ns: str, content: Content, k_groups: int, with_text: bool) -> dict:
    """Publish K groups into a fresh results stream (undelivered) and weigh it."""
    client = connect(url)
    try:
        queue = Queue(client, ns)
        client.xgroup_create(queue.keys.results, CONSUMER_GROUP, id="0", mkstream=True)  # as the trainer makes it
        queue.push_groups([fresh_group(content, ns, i) for i in range(k_groups)])
        claimed = []
        queue.register("mem-worker")
        while len(claimed) < k_groups:
            claim = queue.claim("mem-worker", f"mem-worker:{len(claimed)}", k_groups - len(claimed))
            claimed += claim.groups
            if claim.status != "ok":
                break
        payload = 0
        for c in claimed:
            fill(c.group, content, "mem-worker")
            data = encode_group(c.group, with_response_text=with_text)
            payload += len(data)
            queue.publish("mem-worker", c.group_id, c.token, data, Place.RESULTS)
        if client.xlen(queue.keys.results) != k_groups:
            raise RuntimeError("bytes-per-token stream does not hold K groups")
        result_keys = [queue.keys.result(c.group_id, c.token) for c in claimed]
        used = client.memory_usage(queue.keys.results, samples=0) + sum(
            client.memory_usage(key, samples=0) for key in result_keys)
        tokens = k_groups * N_SAMPLES * RESPONSE_TOKENS
        client.delete(*queue.keys.all_fixed(), *result_keys)
        return {
            "groups": k_groups,
            "memory_usage_bytes": used,
            "bytes_per_token": used / tokens,
            "payload_bytes_per_group": payload / k_groups,
            "payload_bytes_per_token": payload / tokens,
        }
    finally:
        client.close()


# -- driver ----------------------------------------------------------------------------

def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def redis_version(url: str) -> str:
    c = redis.Redis.from_url(url)
    try:
        return c.info("server")["redis_version"]
    finally:
        c.close()


def measure(args: argparse.Namespace) -> dict:
    content = make_content(args.seed)
    codec = codec_cost(content, 10 if args.quick else 30)
    with tempfile.TemporaryDirectory(prefix="queue-overhead-") as tmp:
        server = RedisServer(Path(tmp), port=free_port(), aof=not args.no_aof)
        server.start()
        try:
            url = server.url
            version = redis_version(url)
            monitor = redis.Redis.from_url(url)
            pipe_loop = PipelineLoop(url, "bench-pipe", content, args.batch_size)
            bare_loop = BareLoop(url, "bench-bare", content, args.batch_size, serialize=True)
            raw_loop = BareLoop(url, "bench-raw", content, args.batch_size, serialize=False)
            try:
                # Warm-up: scripts loaded, consumer recovered, connections open.
                run(pipe_loop, args.batch_size, args.batch_size, Timer())
                run(bare_loop, args.batch_size, args.batch_size, Timer())
                run(raw_loop, args.batch_size, args.batch_size, Timer())
                pipe_t, bare_t, raw_t = Timer(), Timer(), Timer()
                rounds = max(1, min(args.rounds, args.groups // args.batch_size or 1))
                per_round = [args.groups // rounds + (1 if i < args.groups % rounds else 0) for i in range(rounds)]
                started = time.perf_counter()
                for i, n in enumerate(per_round):
                    order = ((bare_loop, bare_t), (pipe_loop, pipe_t), (raw_loop, raw_t))
                    for loop, timer in (order if i % 2 == 0 else order[::-1]):
                        gc.collect()
                        counted, fill_cpu = timer.counted(), timer.fill_cpu
                        cpu0, srv0 = time.process_time(), server_cpu(monitor)
                        run(loop, n, args.batch_size, timer)
                        timer.server_cpu += server_cpu(monitor) - srv0
                        timer.client_cpu += time.process_time() - cpu0 - (timer.fill_cpu - fill_cpu)
                        timer.round_rates.append(n / (timer.counted() - counted))
                wall = time.perf_counter() - started
                profile_text = None
                if args.profile:
                    prof = cProfile.Profile()
                    prof.enable()
                    run(pipe_loop, args.profile_groups, args.batch_size, Timer())
                    prof.disable()
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile_top)
                    profile_text = out.getvalue()
                result_bytes = bare_loop.result_payload
                result_payload = len(result_bytes)
                prompt_payload = len(bare_loop.prompt_payload)
            finally:
                pipe_loop.close()
                bare_loop.close()
                raw_loop.close()
                monitor.close()
            # As published by default (no response text), and with --keep-response-text.
            mem = stream_bytes(url, "bench-mem", content, args.k_groups, with_text=False)
            mem_text = stream_bytes(url, "bench-mem-text", content, args.k_groups, with_text=True)
        finally:
            server.stop()

    ratio = pipe_t.rate() / bare_t.rate() if bare_t.rate() else 0.0
    tokens_per_group = N_SAMPLES * RESPONSE_TOKENS
    result = {
        "ratio": ratio,
        # Against a bare loop that sends one pre-encoded payload and never decodes:
        # what the codec costs on top of the queue logic.
        "ratio_vs_preencoded": pipe_t.rate() / raw_t.rate() if raw_t.rate() else 0.0,
        "preencoded_groups_per_s": raw_t.rate(),
        "bytes_per_token": mem["bytes_per_token"],
        "bytes_per_token_with_text": mem_text["bytes_per_token"],
        "pipeline_groups_per_s": pipe_t.rate(),
        "bare_groups_per_s": bare_t.rate(),
        "pipeline_groups": pipe_t.groups,
        "bare_groups": bare_t.groups,
        "pipeline_seconds": pipe_t.counted(),
        "bare_seconds": bare_t.counted(),
        "engine_fill_seconds": pipe_t.seconds["fill"],
        "round_ratios": [p / b for p, b in zip(pipe_t.round_rates, bare_t.round_rates)],
        "cpu_ms_per_group": {
            "pipeline": {"client": 1000 * pipe_t.client_cpu / pipe_t.groups,
                         "redis": 1000 * pipe_t.server_cpu / pipe_t.groups},
            "bare": {"client": 1000 * bare_t.client_cpu / bare_t.groups,
                     "redis": 1000 * bare_t.server_cpu / bare_t.groups},
        },
        "cpu_ratio": bare_t.cpu_ms_per_group() / pipe_t.cpu_ms_per_group() if pipe_t.cpu_ms_per_group() else 0.0,
        "wall_seconds": wall,
        "rounds": len(per_round),
        "batch_size": args.batch_size,
        "samples_per_group": N_SAMPLES,
        "response_tokens_per_sample": RESPONSE_TOKENS,
        "prompt_tokens": PROMPT_TOKENS,
        "generated_tokens_per_group": tokens_per_group,
        "pipeline_generated_tokens_per_s": pipe_t.rate() * tokens_per_group,
        "result_payload_bytes": result_payload,
        "result_payload_bytes_per_token": payload_breakdown(result_bytes),
        "prompt_payload_bytes": prompt_payload,
        "response_chars_per_token": content.chars_per_token,
        "response_text_zlib_bytes_per_token": content.text_zlib_bytes_per_token,
        "bare_payload": "bare: the same groups through the same codec (encode_group/decode_group); "
                        "pre-encoded: one payload of the same bytes, sent as is, never decoded",
        "per_group_ms": {"pipeline": pipe_t.per_group_ms(), "bare": bare_t.per_group_ms()},
        "codec_ms_per_group": codec,
        "memory": {"default": mem, "with_text": mem_text},
        "k_groups": args.k_groups,
        "redis_version": version,
        "aof": not args.no_aof,
        "quick": args.quick,
        "python": sys.version.split()[0],
        "redis_py": redis.__version__,
        "targets": {
            "ratio_min": TARGET_RATIO,
            "bytes_per_token_max": TARGET_BYTES_PER_TOKEN,
            "ratio_ok": ratio >= TARGET_RATIO,
            "bytes_per_token_ok": mem["bytes_per_token"] <= TARGET_BYTES_PER_TOKEN,

        },
    }
    if profile_text is not None:
        result["profile"] = profile_text
    return result


def human(r: dict) -> str:
    ok = lambda b: "ok" if b else "MISSED"  # noqa: E731
    t = r["targets"]
    pg, bg = r["per_group_ms"]["pipeline"], r["per_group_ms"]["bare"]
    cpu = r["cpu_ms_per_group"]
    lines = [
        f"queue overhead: groups of {r['samples_per_group']} x {r['response_tokens_per_sample']} tokens "
        f"(+{r['prompt_tokens']} prompt), batch {r['batch_size']}, redis {r['redis_version']}, "
        f"AOF {'on (fsync always)' if r['aof'] else 'off'}, {r['rounds']} alternating rounds",
        f"result payload {r['result_payload_bytes'] / 1024:.1f} KiB/group, prompt payload "
        f"{r['prompt_payload_bytes'] / 1024:.1f} KiB; bare serializes with the same codec",
        "",
        f"{'':<10}{'groups':>8}{'seconds':>9}{'groups/s':>10}   ms/group: "
        + " ".join(f"{p:>8}" for p in COUNTED) + f" {'(fill)':>8}",
    ]
    for name, key, per in (("bare", "bare", bg), ("pipeline", "pipeline", pg)):
        lines.append(
            f"{name:<10}{r[key + '_groups']:>8}{r[key + '_seconds']:>9.2f}{r[key + '_groups_per_s']:>10.1f}"
            "             " + " ".join(f"{per[p]:>8.3f}" for p in COUNTED)
            + (f" {per['fill']:>8.3f}" if name == "pipeline" else ""))
    lines += [
        "",
        f"ratio pipeline/bare          {r['ratio']:.3f}   (target >= {t['ratio_min']}: {ok(t['ratio_ok'])})",
        f"ratio pipeline/pre-encoded   {r['ratio_vs_preencoded']:.3f}   (bare loop sending one pre-encoded "
        f"payload, never decoding: {r['preencoded_groups_per_s']:.1f} groups/s)",
        "  per round: " + ", ".join(f"{x:.3f}" for x in r["round_ratios"])
        + f"; CPU (client + redis) per group: bare {cpu['bare']['client']:.2f} + {cpu['bare']['redis']:.2f} ms, "
        f"pipeline {cpu['pipeline']['client']:.2f} + {cpu['pipeline']['redis']:.2f} ms -> CPU ratio "
        f"{r['cpu_ratio']:.3f}",
        f"bytes/token as published     {r['bytes_per_token']:.3f}   (target <= {t['bytes_per_token_max']:g}: "
        f"{ok(t['bytes_per_token_ok'])}; {r['k_groups']} groups in the results stream; id + log-prob are 8)",
        f"bytes/token with text        {r['bytes_per_token_with_text']:.3f}   "
        "(worker --keep-response-text)",
        f"codec alone (CPU): encode_group {r['codec_ms_per_group']['encode']:.2f} ms, decode_group "
        f"{r['codec_ms_per_group']['decode']:.2f} ms per finished group",
        "stored entry, bytes/token: " + ", ".join(f"{k} {v:.2f}" for k, v in r["result_payload_bytes_per_token"].items()),
        f"response text: {r['response_chars_per_token']:.2f} chars/token, "
        f"{r['response_text_zlib_bytes_per_token']:.2f} bytes/token after zlib level 1",
    ]
    if "profile" in r:
        lines += ["", "cProfile of the pipeline loop (tottime):", r["profile"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer groups: finishes in well under a minute")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--groups", type=int, help="groups per loop (default 3000, quick 600)")
    p.add_argument("--batch-size", type=int, default=32, help="groups per push/claim/next_batch (default 32)")
    p.add_argument("--rounds", type=int, help="alternating bare/pipeline rounds (default 6, quick 3)")
    p.add_argument("--k-groups", type=int, help="groups in the stream for bytes/token (default 64, quick 32)")
    p.add_argument("--no-aof", action="store_true", help="run redis-server without AOF")
    p.add_argument("--profile", action="store_true", help="also cProfile the pipeline loop and print the top")
    p.add_argument("--profile-groups", type=int, default=320)
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.groups is None:
        args.groups = 600 if args.quick else 3000
    if args.rounds is None:
        args.rounds = 3 if args.quick else 6
    if args.k_groups is None:
        args.k_groups = 32 if args.quick else 64
    if args.groups < 1 or args.batch_size < 1 or args.k_groups < 1:
        p.error("--groups, --batch-size and --k-groups must be positive")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = measure(args)
    if not args.json:
        print(human(result))
    return result


if __name__ == "__main__":
    run_bench(main)
