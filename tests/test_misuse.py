"""Misuse of the command line (issue 26): values that are numbers only in name, sizes with
an extra zero, a list in the wrong format, a push stopped half way. Each gets a clear
error (or exit status) before anything is written."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.consumer import Consumer
from pipeline.ops.inspect import locate
from tests.groups import assert_audit_ok, produce
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parent.parent


def write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("args, says", [
    (("configure", "--lease", "inf"), "inf is not in the range 6.0<=x<=604800.0"),
    (("configure", "--lease", "1e308"), "1e+308 is not in the range"),
    (("status", "--sample", "inf"), "inf is not in the range 0<=x<=604800.0"),
    (("status", "--sample", "1e308"), "1e+308 is not in the range"),
    (("consume", "--batch-size", "1", "--timeout", "nan"), "'nan' is not a finite number"),
    (("push", "rows.jsonl", "--n-samples", "100000000"), "100000000 is not in the range 1<=x<=4096"),
])
def test_a_number_out_of_reason_is_a_usage_error_and_nothing_is_written(args, says, run, queue, tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_rows(tmp_path / "rows.jsonl", 3)
    result = run(*args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert says in result.output, result.output
    assert list(queue.redis.scan_iter(match=f"{{{queue.keys.namespace}}}:*")) == []
    if args[0] == "push":  # no fingerprint was recorded: the corrected push goes through
        fixed = run("push", "rows.jsonl", "--n-samples", "2")
        assert fixed.exit_code == 0 and "pushed 3 groups of 2" in fixed.output, fixed.output


def test_engine_urls_separated_by_commas_are_refused_at_once(run, queue, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINE_URLS", "http://127.0.0.1:1,http://127.0.0.1:2")
    result = run("worker")
    assert result.exit_code == 2 and "holds a comma: separate several engine URLs with spaces" in result.output
    assert queue.redis.zcard(queue.keys.workers) == 0


def test_an_engine_url_password_is_not_echoed_in_its_error(run, monkeypatch):
    result = run("worker", "--engine-url", "http://op:hunter22@127.0.0.1:1,x")
    assert result.exit_code == 2 and "hunter22" not in result.output and "holds a comma" in result.output


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_push_exits_non_zero(signum, redis_url, queue, tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", 10)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(ROLLOUT_HOME=str(tmp_path / "home"), ROLLOUT_REDIS_URL=redis_url, PYTHONPATH=str(REPO))
    # A feeder that may queue one group: it pushes one, then waits for room until stopped.
    proc = subprocess.Popen([sys.executable, "-m", "cli", "--namespace", queue.keys.namespace, "push", str(rows),
                             "--max-queued", "1"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: queue.redis.llen(queue.keys.prompts) == 1, timeout=60, what="the first group pushed")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "push stopped; pushing the same dataset again resumes from its cursor" in err


@pytest.mark.parametrize("reshape", [lambda gs: gs.reverse(), lambda gs: gs.sort(key=lambda g: g.group_id[::-1]),
                                     lambda gs: gs.pop(0), lambda gs: gs.clear()],
                         ids=["reversed", "sorted", "filtered", "emptied"])
def test_commit_settles_the_batchs_own_entries_whatever_the_trainer_did_to_its_groups(reshape, queue):
    gids = produce(queue, 6)
    consumer = Consumer(queue.redis, queue.keys.namespace, block_s=0.2)
    batch = consumer.next_batch(4, timeout=5)
    reshape(batch.groups)
    assert consumer.commit(batch) == 4
    report = assert_audit_ok(queue)
    assert report.committed == 4 and queue.redis.xlen(queue.keys.results) == 2
    for gid in gids[:4]:  # each group's own history names the batch that trained it
        assert locate(queue, gid).where[0].batch == batch.batch_id
