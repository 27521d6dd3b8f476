"""README.md's Python blocks run, in order and in one namespace, against a real local
pipeline: a redis-server, the SGLang simulator and a generation worker, with the bundled
dataset pushed to namespace `rollout`. The names a block leaves to the reader (the
training loop's condition, the training step, the trainer's model) come from the small
harness below; nothing else is patched. A block that cannot run here is marked on the
line before its fence with `<!-- readme: not run (why) -->`, and such blocks are counted."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from engines.simulator import SimConfig, start_simulator
from pipeline.connection import connect
from pipeline.ops.audit import audit
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Queue
from pipeline.types import Group
from tests.helpers import WorkerThread
from workers.settings import WorkerSettings

README = Path(__file__).resolve().parent.parent / "README.md"
DATASET = Path(__file__).resolve().parent.parent / "local" / "data" / "arithmetic.jsonl"
NOT_RUN = re.compile(r"<!-- readme: not run \((.+)\) -->")
#: Blocks marked not run: kept to a minimum (a block that cannot run is a block that may be wrong).
MAX_NOT_RUN = 0
#: Training steps the README's loop runs here.
STEPS = 2


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, why not run or None) of every ```python block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            marker = NOT_RUN.search(lines[start - 2]) if start >= 2 else None
            blocks.append((start, "\n".join(body) + "\n", marker.group(1) if marker else None))
        i += 1
    return blocks


def test_python_blocks_are_found_and_few_are_marked_not_run():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 2  # the trainer loop and reading a group
    assert sum(why is not None for _, _, why in blocks) <= MAX_NOT_RUN
    sample = "text\n<!-- readme: not run (needs a GPU) -->\n```python\nx = 1\n```\n"
    assert python_blocks(sample) == [(3, "x = 1\n", "needs a GPU")]


class Steps:
    """`while training:`: true for `n` steps."""

    def __init__(self, n: int):
        self.left = n

    def __bool__(self) -> bool:
        self.left -= 1
        return self.left >= 0


class StepFailed(Exception):
    """The README's trainer's own failure."""


@pytest.fixture
def pipeline(redis_factory, monkeypatch):
    server = redis_factory("readme")
    queue = Queue(connect(server.url), "rollout")
    push_dataset(queue, DATASET, PushOptions(n_samples_per_prompt=4, epochs=2, shuffle=True, seed=0))
    sim = start_simulator(SimConfig(seed=0, skill=0.5, decode_tokens_per_s=20000.0, length_median=16.0,
                                    length_p99=64.0))
    worker = WorkerThread(WorkerSettings(redis_url=server.url, engine_urls=[sim.url], namespace="rollout",
                                         heartbeat_s=1.0, progress_s=0))
    monkeypatch.setenv("ROLLOUT_REDIS_URL", server.url)
    try:
        yield queue
    finally:
        worker.stop()
        sim.stop()


def test_the_readme_python_blocks_run_against_a_local_pipeline(pipeline):
    trained: list[list] = []

    def train_step(groups):
        assert all(isinstance(g, Group) and len(g.samples) == 4 for g in groups)
        trained.append(groups)

    names = {"__name__": "readme", "training": Steps(STEPS), "train_step": train_step, "StepFailed": StepFailed,
             "MODEL_PATH": "byte"}  # the simulator's model reads UTF-8 bytes as token ids
    ran = 0
    for line, code, why in python_blocks(README.read_text()):
        if why is None:
            exec(compile(code, f"README.md:{line}", "exec"), names)  # the README is ours, not data
            ran += 1
    assert ran >= 2
    assert [len(groups) for groups in trained] == [64] * STEPS
    # The second block read the last batch: texts decoded from the tokens (no --keep-response-text).
    assert isinstance(names["text"], str) and names["text"] and names["logprobs"]
    report = audit(pipeline)
    assert report.ok and report.committed == 64 * STEPS
