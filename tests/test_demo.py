"""`rollout demo`, the main job, as a user runs it: a real subprocess, --json summary."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_json_schemas import DEMO_SIM, check

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_trains_exact_batches_with_weight_updates_and_a_clean_audit(tmp_path):
    env = dict(os.environ, ROLLOUT_HOME=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "cli", "demo", "--steps", "4", "--batch-size", "6",
                           "--n-samples", "3", "--workers", "2", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    check(summary, DEMO_SIM)  # the documented --json object (docs/cli.md)
    assert summary["ok"] and summary["trained_twice"] == 0
    assert [s["groups"] for s in summary["steps"]] == [6] * 4
    assert [s["samples"] for s in summary["steps"]] == [18] * 4
    assert summary["groups_trained"] == 24
    # A weight update after every step; staleness never passes the demo's bound of 1.
    assert all(s["update_s"] is not None for s in summary["steps"])
    assert all(s["max_staleness"] <= 1 for s in summary["steps"])
    audit = summary["audit"]
    assert audit["ok"] and audit["committed"] == 24 and (audit["lost"], audit["extra"]) == (0, 0)
    assert not (tmp_path / "local-redis.json").exists()  # unregistered on the way out


@pytest.mark.slow
def test_demo_task_tools_runs_the_calculator_example_in_the_workers(tmp_path):
    env = dict(os.environ, ROLLOUT_HOME=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "cli", "demo", "--task", "tools", "--steps", "2", "--batch-size", "6",
                           "--n-samples", "3", "--workers", "1", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    check(summary, DEMO_SIM)
    assert summary["ok"] and summary["groups_trained"] == 12 and summary["audit"]["ok"]
    # several engine calls per sample on average, tool output masked out of the loss
    assert all(s["mean_turns"] > 1 and s["tool_tokens"] > 0 for s in summary["steps"])


@pytest.mark.slow
def test_the_demo_says_how_many_groups_were_dead_lettered_and_why(tmp_path, monkeypatch):
    """The audit counts dead letters as accounted for (OK); the demo says them, by reason,
    with an example error, before its Redis is gone."""
    from local import demo

    rows = (REPO / "local" / "data" / "arithmetic.jsonl").read_text().splitlines()[:32]
    unlabeled = [json.dumps({"input": json.loads(r)["input"]}) if i % 4 == 0 else r for i, r in enumerate(rows)]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(unlabeled) + "\n")
    monkeypatch.setattr(demo, "DATASET", data)
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))
    said: list[str] = []
    summary = demo.run_demo(demo.DemoOptions(steps=2, batch_size=4, n_samples=2, workers=1), echo=said.append)
    check(summary, DEMO_SIM)
    assert summary["ok"] and summary["audit"]["ok"]
    dead = summary["dead_letters"]
    assert dead["total"] == summary["audit"]["dead"] >= 1
    assert dead["by_reason"] == {"missing_label": dead["total"]}
    assert "needs a label" in dead["example"]["missing_label"]
    text = "\n".join(said)
    assert f"dead letters: {dead['total']} (missing_label {dead['total']})" in text
    assert text.index("audit: ") < text.index("dead letters: ")
