"""Shared pieces of the slime adapter's tests (tests/test_slime_*.py): finished groups
published as a worker would, slime-style args, the stand-in `slime` package installed
(tests/fake_slime.py), a simulator engine. Test modules import the fixtures they use;
`clean_state` (autouse) must be imported by each of them."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from pipeline.queue import Place
from pipeline.trainers import slime_adapter as sa
from pipeline.trainers import slime_types as st
from pipeline.types import Group, SamplingRecord, Status
from tests import fake_slime
from tests.groups import claim, publish

N = 2  # samples per group
PROMPT = [1, 2, 3]
SAMPLING = SamplingRecord(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=64)


@pytest.fixture
def fake_slime_installed(monkeypatch):
    fake_slime.install(monkeypatch)
    st.slime_types.cache_clear()
    yield
    st.slime_types.cache_clear()


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)  # not importable unless a test installs the stand-in
    st.slime_types.cache_clear()
    sa.reset_default_sources()
    yield
    sa.reset_default_sources()
    st.slime_types.cache_clear()


# -- helpers ------------------------------------------------------------------------------


def finished(row: int, rewards: list | None = None, version: int = 0, sampling: SamplingRecord | None = SAMPLING,
             prefix: str = "g") -> Group:
    """Group `g<row>`: sample i has 1 + i + row % 3 response tokens 100*row + 10*i + k."""
    group = Group.fresh(f"{prefix}{row}", f"prompt {row}", N, label=str(row), row=row)
    group.prompt_ids = list(PROMPT)
    group.sampling, group.worker = sampling, "w"
    for i, s in enumerate(group.samples):
        n = 1 + i + row % 3
        s.tokens = PROMPT + [100 * row + 10 * i + k for k in range(n)]
        s.response_length = n
        s.response = "x" * n
        s.rollout_log_probs = [-(k + 1) / 4 for k in range(n)]
        s.loss_mask = [1] * n
        s.weight_versions = [str(version)]
        s.reward = (rewards or [float(i)] * N)[i]
        s.status = Status.TRUNCATED if i == N - 1 else Status.COMPLETED
    return group


def publish_results(queue, rows: list[int], keep_response_text: bool = False, **kwargs) -> list[Group]:
    """Push, claim and publish finished groups, in the order given."""
    groups = [finished(r, **kwargs) for r in rows]
    queue.push_groups([Group.fresh(g.group_id, g.samples[0].prompt, N, row=g.row) for g in groups])
    claimed = claim(queue, "w", len(groups))
    assert [c.group_id for c in claimed.groups] == [g.group_id for g in groups]
    for c, g in zip(claimed.groups, groups):
        g.admitted_version = c.group.admitted_version
        assert publish(queue, "w", g, Place.RESULTS, keep_response_text=keep_response_text)
    return groups


def make_args(redis_url: str, namespace: str, **kwargs) -> SimpleNamespace:
    return SimpleNamespace(rollout_batch_size=2, n_samples_per_prompt=N, rollout_redis_url=redis_url,
                           rollout_namespace=namespace, reward_key=None, **kwargs)


def rows_of(groups: list[list]) -> list[int]:
    return [g[0].group_index for g in groups]


def committed(queue) -> int:
    return queue.stats().get("committed", 0)


def read_records(queue) -> int:
    """Entries the adapter recorded as read and not committed (not the checkpoint records)."""
    checkpoint = sa.CHECKPOINT_FIELD.encode()
    return sum(1 for k in queue.redis.hkeys(queue.keys.slime_rollouts) if not k.startswith(checkpoint))



@pytest.fixture
def sim():
    from engines.simulator import SimConfig, start_simulator

    handle = start_simulator(SimConfig(seed=1, decode_tokens_per_s=20000.0, length_median=24, length_p99=240,
                                       prefill_s=0.001))
    yield handle
    handle.stop()
