"""`python -m cli ...` as real processes: exit codes, one-line errors on stderr, the
whole pipeline through the CLI, `status --watch` and `rollout up` stopped by Ctrl-C,
every long-running command stopped by SIGTERM, the worker's tokenizer choice."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pipeline.keys import Keys
from pipeline.redis_server import free_port
from tests.helpers import FakeModelEngine, http_json
from workers.tokenizer import encode_prompt, load_tokenizer

REPO = Path(__file__).resolve().parent.parent
DATASET = REPO / "local" / "data" / "arithmetic.jsonl"


@pytest.fixture
def env(tmp_path):
    e = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    e["ROLLOUT_HOME"] = str(tmp_path / "home")
    e["PYTHONUNBUFFERED"] = "1"
    return e


def rollout(*args, env, timeout=60, check=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if check is not None:
        assert proc.returncode == check, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def spawn(*args, env, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, stdout=out,
                            stderr=subprocess.STDOUT if log else subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen, sig=signal.SIGINT, timeout=30) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"process {proc.args} did not stop on {sig!r}")


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: ") and "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_errors_are_one_line_with_nonzero_exit(env, redis_url, namespace, tmp_path):
    secret = "hunter2-secret"
    cases = [
        (["--redis-url", "redis://127.0.0.1:1", "status"], ["cannot reach Redis at redis://127.0.0.1:1"]),
        (["--redis-url", "http://x", "audit"], ["unsupported Redis URL 'http://x'"]),
        (["--redis-url", f"redis://admin:{secret}@127.0.0.1:1/0", "status"], ["redis://***@127.0.0.1:1"]),
        (["--redis-url", redis_url, "--namespace", namespace, "status"], [f"namespace '{namespace}' is empty"]),
        (["--redis-url", redis_url, "--namespace", namespace, "push", str(tmp_path / "nope.jsonl")],
         ["no such file"]),
        (["status"], ["rollout up"]),  # no URL, no local Redis
    ]
    # Started together: each is a fresh interpreter, and they do not interact.
    procs = [subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args, _ in cases]
    for (args, needles), p in zip(cases, procs):
        out, err = p.communicate(timeout=60)
        proc = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        assert proc.returncode == 1, (args, proc.stderr)
        line = assert_one_line_error(proc, *needles)
        assert secret not in line
    usage = rollout("--namespace", "no/slashes", "status", env=env)
    assert usage.returncode == 2 and "namespace" in usage.stderr


def test_pipeline_through_the_cli(env, redis_url, namespace, tmp_path):
    """sim-engine + worker processes, push, consume, status, audit, dead, purge: all via `python -m cli`."""
    port = free_port()
    env = dict(env, ROLLOUT_REDIS_URL=redis_url, ROLLOUT_NAMESPACE=namespace)
    sim = spawn("sim-engine", "--port", str(port), "--median-tokens", "8", "--p99-tokens", "32", env=env,
                log=tmp_path / "sim.log")
    worker = None
    try:
        data = tmp_path / "data.jsonl"
        data.write_text("".join(l for l in DATASET.read_text().splitlines(keepends=True)[:12]))
        proc = rollout("push", str(data), "--n-samples", "2", env=env, check=0)
        assert "pushed 12 groups of 2" in proc.stdout
        status = json.loads(rollout("status", "--json", "--sample", "0", env=env, check=0).stdout)
        assert status["prompts"] == 12 and status["workers_alive"] == 0

        def sim_up():
            import urllib.request

            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200
            except OSError:
                return False

        wait_for(sim_up, what="the simulator")
        worker = spawn("worker", "--engine-url", f"http://127.0.0.1:{port}", "--max-new-tokens", "32",
                       "--concurrency", "8", "--heartbeat", "1", env=env, log=tmp_path / "worker.log")
        proc = rollout("consume", "--batch-size", "4", "--steps", "2", "--json", "--timeout", "30", env=env)
        assert proc.returncode == 0, proc.stderr + (tmp_path / "worker.log").read_text()[-3000:]
        batches = [json.loads(l) for l in proc.stdout.splitlines()]
        assert [len(b["groups"]) for b in batches] == [4, 4]
        assert all(len(g["statuses"]) == 2 and g["weight_versions"] for b in batches for g in b["groups"])

        status = json.loads(rollout("status", "--json", "--sample", "0", env=env, check=0).stdout)
        assert status["workers_alive"] == 1 and status["throughput"]["committed"] == 8
        assert status["workers"][0]["engines"] == [f"http://127.0.0.1:{port}"]

        # pause/resume find the engine through the worker's heartbeat
        proc = rollout("pause", env=env, check=0)
        assert "1 engine reported by the live workers" in proc.stdout
        assert json.loads(rollout("status", "--json", "--sample", "0", env=env, check=0).stdout)["paused"]
        proc = rollout("resume", "--weight-version", "1", env=env, check=0)
        assert "resumed at weight version 1" in proc.stdout and "continued" in proc.stdout
        last = json.loads(rollout("consume", "--batch-size", "4", "--json", "--timeout", "30", env=env,
                                  check=0).stdout)
        assert last["weight_version"] == 1 and len(last["groups"]) == 4

        assert stop(worker, signal.SIGTERM) == 0  # hands its groups back
        audit = rollout("audit", "--json", env=env)
        assert audit.returncode == 0, audit.stdout
        report = json.loads(audit.stdout)
        assert report["ok"] and report["committed"] == 12 and report["pushed"] == 12
        assert "purged namespace" in rollout("purge", "--yes", env=env, check=0).stdout
        assert_one_line_error(rollout("audit", env=env), "is empty")
    finally:
        if worker is not None:
            stop(worker, signal.SIGTERM)
        stop(sim, signal.SIGINT)


def test_status_watch_stops_cleanly_on_ctrl_c(env, redis_url, namespace, queue):
    from pipeline.types import Group

    queue.push_groups([Group.fresh("g0", "What is 1 + 1?", 2)])
    proc = spawn("--redis-url", redis_url, "--namespace", namespace, "status", "--watch", "--json",
                 "--interval", "0.2", env=env)
    try:
        first = json.loads(proc.stdout.readline())
        queue.push_groups([Group.fresh("g1", "What is 2 + 1?", 2)])
        deadline = time.monotonic() + 10
        while json.loads(proc.stdout.readline())["prompts"] != 2:
            assert time.monotonic() < deadline
        assert first["prompts"] == 1
    finally:
        rc = stop(proc, signal.SIGINT)
    assert rc == 0 and "Traceback" not in proc.stderr.read()


def _registered(home: Path) -> dict | None:
    try:
        return json.loads((home / "local-redis.json").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_up_runs_a_stack_and_ctrl_c_stops_everything(env, tmp_path):
    home = Path(env["ROLLOUT_HOME"])
    log = tmp_path / "up.log"
    up = spawn("--namespace", "stack", "up", "--workers", "2", "--refresh", "0.5", "--sim-median-tokens", "8",
               "--sim-p99-tokens", "32", "--max-new-tokens", "32", "--concurrency", "16",
               "--data-dir", str(tmp_path / "stack"),
               env=env, log=log)
    try:
        state = wait_for(lambda: _registered(home), what="the local Redis of `rollout up`")
        assert state["url"].startswith("unix://")
        # A second stack refuses: one line, non-zero.
        assert_one_line_error(rollout("up", env=env), "already running")
        # Other commands find the local Redis without --redis-url.
        data = tmp_path / "data.jsonl"
        data.write_text("".join(DATASET.read_text().splitlines(keepends=True)[:24]))
        proc = rollout("--namespace", "stack", "push", str(data), "--n-samples", "2", env=env, check=0)
        assert "pushed 24 groups" in proc.stdout
        proc = rollout("--namespace", "stack", "consume", "--batch-size", "8", "--steps", "2", "--json",
                       "--timeout", "30", env=env)
        assert proc.returncode == 0, proc.stderr + log.read_text()[-3000:]
        assert len(proc.stdout.splitlines()) == 2
        status = json.loads(rollout("--namespace", "stack", "status", "--json", "--sample", "0", env=env,
                                    check=0).stdout)
        assert status["workers_alive"] == 2
        wait_for(lambda: "workers 2" in log.read_text(), what="the dashboard line")
        worker_pids = [w["pid"] for w in status["workers"]]
    finally:
        rc = stop(up, signal.SIGINT, timeout=40)
    output = log.read_text()
    assert rc == 0, output
    assert "stopped; Redis data kept" in output and "Traceback" not in output
    assert _registered(home) is None
    assert not _alive(state["pid"])
    assert not any(_alive(p) for p in worker_pids)
    aof = tmp_path / "stack" / "redis"
    assert (aof / "appendonlydir").exists() or (aof / "appendonly.aof").exists()  # kept for the next run
    assert_one_line_error(rollout("status", env=env), "no local one running", "rollout up")


def test_long_running_commands_stop_cleanly_on_sigterm(env, redis_url, namespace, client, tmp_path):
    """`docker compose stop` sends SIGTERM; as PID 1 a process without a handler would ignore it.
    Outside a container an unhandled SIGTERM kills with -15: exit code 0 shows the handler."""
    env = dict(env, ROLLOUT_REDIS_URL=redis_url, ROLLOUT_NAMESPACE=namespace)
    keys = Keys(namespace)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DATASET.read_text().splitlines(keepends=True)[:12]))
    port = free_port()
    procs = {
        "sim-engine": spawn("sim-engine", "--port", str(port), env=env),
        # 4 of the 12 rows are pushed, then the feeder waits for room.
        "push": spawn("push", str(data), "--epochs", "2", "--max-queued", "4", env=env),
    }

    def answers(url):
        try:
            http_json(url)
            return True
        except OSError:
            return False

    try:
        wait_for(lambda: answers(f"http://127.0.0.1:{port}/health"), what="the simulator")
        wait_for(lambda: client.llen(keys.prompts) == 4, what="the feeder waiting at --max-queued")
        # (consume would wait for the first push; started after it, it blocks on the results stream at once)
        procs["consume"] = spawn("consume", "--batch-size", "2", "--timeout", "600", env=env)
        procs["status"] = spawn("status", "--watch", "--json", "--interval", "0.2", env=env)
        def consumer_blocked():
            try:
                return any(g["consumers"] for g in client.xinfo_groups(keys.results))
            except redis.ResponseError:  # the stream does not exist yet
                return False

        wait_for(consumer_blocked,
                 what="the consumer blocked on the results stream")
        assert json.loads(procs["status"].stdout.readline())["prompts"] >= 0
    finally:
        codes = {name: stop(proc, signal.SIGTERM) for name, proc in procs.items()}
    errors = {name: proc.stderr.read() for name, proc in procs.items()}
    # An interrupted push exits 130 (it stopped before its work was done); the others were asked to stop.
    assert codes == dict.fromkeys(procs, 0) | {"push": 130}, errors
    assert not any("Traceback" in e for e in errors.values()), errors
    assert "push stopped; pushing the same dataset again resumes from its cursor" in errors["push"]
    assert "stopped after 0 of 1 batches" in errors["consume"]
    # Nothing was lost: the next push continues from the cursor.
    assert "pushed 20 groups of 1, 0 bad rows dead-lettered, 4 already pushed before" in \
        rollout("push", str(data), "--epochs", "2", env=env, check=0).stdout


def test_up_stops_cleanly_on_sigterm(env, tmp_path):
    home = Path(env["ROLLOUT_HOME"])
    log = tmp_path / "up.log"
    up = spawn("up", "--workers", "1", "--refresh", "0.5", "--data-dir", str(tmp_path / "stack"), env=env, log=log)
    try:
        wait_for(lambda: "workers 1" in log.read_text(), what="the dashboard with its worker")
    finally:
        rc = stop(up, signal.SIGTERM, timeout=40)
    assert rc == 0 and "stopped; Redis data kept" in log.read_text(), log.read_text()
    assert _registered(home) is None


def test_worker_tokenizes_with_the_served_models_tokenizer(env, redis_url, namespace, tmp_path, tokenizer_json):
    env = dict(env, ROLLOUT_REDIS_URL=redis_url, ROLLOUT_NAMESPACE=namespace)
    engine = FakeModelEngine(tokenizer_json)
    worker = None
    try:
        # Prompts as UTF-8 bytes would be garbage to this model: refused, in one line.
        assert_one_line_error(rollout("worker", "--engine-url", engine.url, "--tokenizer", "byte", env=env),
                              "Qwen/Qwen2.5-0.5B-Instruct", "--allow-byte-tokenizer")
        row = DATASET.read_text().splitlines()[0]
        data = tmp_path / "one.jsonl"
        data.write_text(row + "\n")
        rollout("push", str(data), env=env, check=0)
        # This model has no chat template: asking for one is refused, never invented.
        assert_one_line_error(rollout("worker", "--engine-url", engine.url, "--apply-chat-template", env=env),
                              "--apply-chat-template, but tokenizer", "has no chat template")
        worker = spawn("worker", "--engine-url", engine.url, "--max-new-tokens", "8",
                       env=env, log=tmp_path / "worker.log")
        wait_for(lambda: engine.requests, what=f"a /generate request\n{(tmp_path / 'worker.log').read_text()}")
        prompt = json.loads(row)["input"]
        expected = encode_prompt(load_tokenizer(tokenizer_json), prompt, apply_chat_template=False)  # as text
        assert engine.requests[0]["input_ids"] == expected
        assert expected[:8] != list(prompt.encode())[:8]  # the model's ids, not bytes
        assert stop(worker, signal.SIGTERM) == 0
    finally:
        engine.close()
        if worker is not None:
            stop(worker, signal.SIGTERM)
