"""pipeline.slime_adapter: slime's rollout function and data source over the queue,
with the stand-in types (slime not installed) and with a fake `slime` package
injected into sys.modules, against a real redis-server."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field, fields
from enum import Enum
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline import slime_adapter as sa
from pipeline.audit import audit
from pipeline.codec import decode_group
from pipeline.consumer import BatchMetrics
from pipeline.filters import DynamicFilterOutput
from pipeline.queue import Place
from pipeline.types import Group, Sample, Status
from tests.groups import claim, publish

N = 2  # samples per group
PROMPT = [1, 2, 3]


# -- a fake slime: the real classes' field names, from_dict/to_dict and enum ------------


@dataclass
class FakeSlimeSample:
    """Like slime/utils/types.py: nested Status enum, extra fields ours lacks."""

    group_index: int | None = None
    index: int | None = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)

    def to_dict(self):
        value = self.__dict__.copy()
        value["status"] = self.status.value
        return value

    @staticmethod
    def from_dict(data: dict):
        data = dict(data)
        data["status"] = FakeSlimeSample.Status(data["status"])
        names = {f.name for f in fields(FakeSlimeSample)}
        sample = FakeSlimeSample(**{k: v for k, v in data.items() if k in names})
        for k, v in data.items():
            if k not in names:
                setattr(sample, k, v)
        return sample

    def get_reward_value(self, args):
        return self.reward if not args.reward_key else self.reward[args.reward_key]


@dataclass
class FakeTrainOutput:
    samples: list
    metrics: dict = None


@dataclass
class FakeEvalOutput:
    data: dict
    metrics: dict = None


@pytest.fixture
def fake_slime(monkeypatch):
    modules = {name: types.ModuleType(name) for name in
               ("slime", "slime.utils", "slime.utils.types", "slime.rollout", "slime.rollout.base_types")}
    modules["slime.utils.types"].Sample = FakeSlimeSample
    modules["slime.rollout.base_types"].RolloutFnTrainOutput = FakeTrainOutput
    modules["slime.rollout.base_types"].RolloutFnEvalOutput = FakeEvalOutput
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    sa.slime_types.cache_clear()
    yield
    sa.slime_types.cache_clear()


@pytest.fixture(autouse=True)
def clean_state():
    sa.slime_types.cache_clear()
    sa.reset_default_sources()
    yield
    sa.reset_default_sources()
    sa.slime_types.cache_clear()


# -- helpers ------------------------------------------------------------------------------


def finished(row: int, rewards: list | None = None, version: int = 0) -> Group:
    """Group `g<row>`: sample i has 1 + i + row % 3 response tokens 100*row + 10*i + k."""
    group = Group.fresh(f"g{row}", f"prompt {row}", N, label=str(row), row=row)
    group.prompt_ids = list(PROMPT)
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


def publish_results(queue, rows: list[int], **kwargs) -> list[Group]:
    """Push, claim and publish finished groups, in the order given."""
    groups = [finished(r, **kwargs) for r in rows]
    queue.push_groups([Group.fresh(g.group_id, g.samples[0].prompt, N, row=g.row) for g in groups])
    claimed = claim(queue, "w", len(groups))
    assert [c.group_id for c in claimed.groups] == [g.group_id for g in groups]
    for g in groups:
        assert publish(queue, "w", g, Place.RESULTS)
    return groups


def make_args(redis_url: str, namespace: str, **kwargs) -> SimpleNamespace:
    return SimpleNamespace(rollout_batch_size=2, n_samples_per_prompt=N, rollout_redis_url=redis_url,
                           rollout_namespace=namespace, reward_key=None, **kwargs)


def rows_of(groups: list[list]) -> list[int]:
    return [g[0].group_index for g in groups]


def committed(queue) -> int:
    return queue.stats().get("committed", 0)


# -- types --------------------------------------------------------------------------------


def test_fallback_types_without_slime(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)  # not importable, even if installed
    sa.slime_types.cache_clear()
    t = sa.slime_types()
    assert not t.real
    assert (t.sample, t.train_output, t.eval_output) == (Sample, sa.RolloutFnTrainOutput, sa.RolloutFnEvalOutput)
    assert [f.name for f in fields(sa.RolloutFnTrainOutput)] == ["samples", "metrics"]
    assert [f.name for f in fields(sa.RolloutFnEvalOutput)] == ["data", "metrics"]
    assert sa.RolloutFnTrainOutput(samples=[]).metrics is None
    s = finished(1).samples[0]
    assert sa.to_slime_sample(s) is s


def test_fake_slime_types_are_used(fake_slime):
    t = sa.slime_types()
    assert t.real and t.sample is FakeSlimeSample and t.train_output is FakeTrainOutput
    ours = finished(4).samples[1]
    theirs = sa.to_slime_sample(ours)
    assert isinstance(theirs, FakeSlimeSample)
    assert theirs.status is FakeSlimeSample.Status.TRUNCATED
    for name in ("group_index", "index", "prompt", "label", "tokens", "response_length", "response",
                 "reward", "loss_mask", "rollout_log_probs", "weight_versions", "metadata"):
        assert getattr(theirs, name) == getattr(ours, name), name
    back = sa.from_slime_sample(theirs)
    assert back == ours and back.status is Status.TRUNCATED


def test_metrics_have_slime_style_keys():
    m = BatchMetrics(kept=6, dropped={"all rewards equal": 3, "stale": 1}, restarted=2, dead=1, duplicates=0,
                     wait_s=1.5, staleness={0: 4, 2: 2})
    out = sa.slime_metrics(m, weight_version=7)
    assert out["rollout/queue/kept"] == 6 and out["rollout/queue/dropped"] == 4
    assert out["rollout/queue/drop_ratio"] == pytest.approx(0.4)
    assert out["rollout/dynamic_filter/drop_all_rewards_equal"] == 3
    assert out["rollout/queue/drop_stale"] == 1
    assert out["rollout/queue/restarted"] == 2 and out["rollout/queue/dead"] == 1
    assert out["rollout/queue/wait_time"] == 1.5 and out["rollout/queue/weight_version"] == 7
    assert out["rollout/queue/staleness/0"] == 4 and out["rollout/queue/staleness/2"] == 2
    assert out["rollout/queue/staleness_mean"] == pytest.approx(4 / 6) and out["rollout/queue/staleness_max"] == 2


def test_settings_from_args_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLOUT_REDIS_URL", "redis://env-host:6379")
    monkeypatch.setenv("ROLLOUT_NAMESPACE", "envns")
    s = sa.QueueSettings.from_args(SimpleNamespace())
    assert (s.redis_url, s.namespace, s.consumer, s.timeout, s.commit_lag) == (
        "redis://env-host:6379", "envns", "trainer", None, 1)
    s = sa.QueueSettings.from_args(SimpleNamespace(rollout_redis_url="redis://args:1", rollout_namespace="a",
                                                   rollout_consumer="t2", rollout_batch_timeout=5,
                                                   rollout_commit_lag=2))
    assert (s.redis_url, s.namespace, s.consumer, s.timeout, s.commit_lag) == ("redis://args:1", "a", "t2", 5, 2)
    monkeypatch.delenv("ROLLOUT_REDIS_URL")
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path))  # no local stack registered there
    with pytest.raises(ValueError, match="ROLLOUT_REDIS_URL"):
        sa.QueueSettings.from_args(SimpleNamespace())


# -- the rollout function --------------------------------------------------------------------


def test_generate_rollout_with_fake_slime(fake_slime, queue, redis_url, namespace):
    published = {g.row: g for g in publish_results(queue, [3, 1, 4, 0, 5])}
    args = make_args(redis_url, namespace)

    out = sa.generate_rollout(args, 0, data_source=None)
    assert isinstance(out, FakeTrainOutput)
    assert len(out.samples) == 2 and all(len(g) == N for g in out.samples)
    assert rows_of(out.samples) == [1, 3]  # stream order was 3, 1: sorted by index
    assert [s.index for g in out.samples for s in g] == [2, 3, 6, 7]
    for group in out.samples:
        ours = published[group[0].group_index]
        for theirs, mine in zip(group, ours.samples):
            assert isinstance(theirs, FakeSlimeSample)
            assert theirs.tokens == mine.tokens and theirs.tokens[:3] == PROMPT
            assert theirs.response_length == mine.response_length == len(theirs.tokens) - 3
            assert theirs.rollout_log_probs == mine.rollout_log_probs
            assert theirs.loss_mask == mine.loss_mask
            assert theirs.reward == mine.reward
            assert theirs.weight_versions == ["0"]
            assert theirs.prompt == mine.prompt and theirs.label == mine.label
            assert theirs.response == ""  # results leave response text out by default
        assert [s.status for s in group] == [FakeSlimeSample.Status.COMPLETED, FakeSlimeSample.Status.TRUNCATED]
    assert out.metrics["rollout/queue/kept"] == 2 and out.metrics["rollout/queue/staleness/0"] == 2
    assert committed(queue) == 0

    out2 = sa.generate_rollout(args, 1, data_source=None)
    assert rows_of(out2.samples) == [0, 4]
    assert committed(queue) == 2  # the first batch, when the second was requested
    ids = {e.group_id for e in queue.read_stream(queue.keys.results)}
    assert ids == {"g0", "g4", "g5"}  # g1, g3 deleted; g0, g4 pending; g5 undelivered

    # The trainer dies mid-step 1: nothing committed. A restarted trainer gets 0, 4 again first.
    sa.reset_default_sources()
    out3 = sa.generate_rollout(args, 1, data_source=None)
    assert rows_of(out3.samples) == [0, 4]
    assert [s.tokens for g in out3.samples for s in g] == [s.tokens for g in out2.samples for s in g]
    assert committed(queue) == 2
    assert queue.redis.xlen(queue.keys.results) == 3
    assert audit(queue).ok, audit(queue).summary()


def test_generate_rollout_fallback_types(queue, redis_url, namespace, monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)
    publish_results(queue, [2, 1])
    out = sa.generate_rollout(make_args(redis_url, namespace), 0, data_source=None)
    assert isinstance(out, sa.RolloutFnTrainOutput)
    assert rows_of(out.samples) == [1, 2]
    sample = out.samples[0][1]
    assert isinstance(sample, Sample) and sample.status == "truncated" and sample.status is Status.TRUNCATED
    assert sample.tokens == finished(1).samples[1].tokens


def test_generate_rollout_uses_a_redis_data_source(queue, redis_url, namespace):
    publish_results(queue, [0, 1, 2, 3])
    args = make_args(redis_url, namespace)
    source = sa.RedisDataSource(args)
    assert rows_of(sa.generate_rollout(args, 0, source).samples) == [0, 1]
    assert rows_of(sa.generate_rollout(args, 1, source).samples) == [2, 3]
    assert committed(queue) == 2 and source.pending_batches == 1
    assert sa._SOURCES == {}  # no default source was built
    assert source.commit_pending() == 2 and committed(queue) == 4


def test_commit_lag_two_for_train_async(queue, redis_url, namespace):
    publish_results(queue, list(range(6)))
    args = make_args(redis_url, namespace, rollout_commit_lag=2)
    for rollout_id, expected_committed in [(0, 0), (1, 0), (2, 2)]:
        sa.generate_rollout(args, rollout_id, None)
        assert committed(queue) == expected_committed
    # train_async.py saves after training rollout k while rollout k+1 is delivered: keep it.
    sa.default_source(args).save(1)
    assert committed(queue) == 4


def test_evaluation_is_not_served_from_the_queue(redis_url, namespace):
    with pytest.raises(NotImplementedError, match="--eval-function-path slime.rollout.sglang_rollout"):
        sa.generate_rollout(make_args(redis_url, namespace), 0, None, evaluation=True)


def test_wrong_group_size_is_refused(queue, redis_url, namespace):
    publish_results(queue, [0, 1])
    args = make_args(redis_url, namespace)
    args.n_samples_per_prompt = 4
    with pytest.raises(ValueError, match="n_samples_per_prompt=4"):
        sa.generate_rollout(args, 0, None)


def test_timeout_says_why(redis_url, namespace):
    args = make_args(redis_url, namespace, rollout_batch_timeout=0.3)
    with pytest.raises(TimeoutError, match="next_batch\\(2\\) timed out.*prompt list is empty"):
        sa.generate_rollout(args, 0, None)


def nonzero_std(args, samples, **kwargs):
    """A slime-style filter: calls slime's Sample method, returns slime's output type."""
    rewards = [s.get_reward_value(args) for s in samples]
    keep = len(set(rewards)) > 1
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{rewards[0]}")


def test_slime_dynamic_filter_gets_slime_samples(fake_slime, queue, redis_url, namespace):
    publish_results(queue, [0, 1], rewards=[1.0, 1.0])
    publish_results(queue, [2, 3, 4])
    args = make_args(redis_url, namespace, dynamic_sampling_filter_path=f"{__name__}.nonzero_std")
    out = sa.generate_rollout(args, 0, None)
    assert rows_of(out.samples) == [2, 3]
    assert out.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == 2
    assert out.metrics["rollout/queue/dropped"] == 2
    assert out.metrics["rollout/queue/drop_ratio"] == pytest.approx(0.5)


# -- the data source ---------------------------------------------------------------------------


def test_data_source_interface(fake_slime, queue, redis_url, namespace):
    publish_results(queue, [0, 1, 2, 3, 4])
    args = make_args(redis_url, namespace)
    source = sa.RedisDataSource(args)
    assert len(source) == 5
    assert source.load() is None and source.load(3) is None

    first = source.get_samples(3)
    assert rows_of(first) == [0, 1, 2] and len(source) == 2
    # slime gives two back (e.g. its over-sampling surplus): they stay uncommitted...
    source.add_samples([first[2], first[0]])
    assert len(source) == 4
    second = source.get_samples(3)
    assert committed(queue) == 1  # ...only group 1 of the first delivery was committed
    assert rows_of(second) == [0, 2, 3]  # given-back groups first, then the next in the stream
    assert second[0][0] is first[0][0]
    assert len(source) == 1

    source.save(1)  # after the step: commits (commit_lag 1 keeps nothing back)
    assert committed(queue) == 4 and source.pending_batches == 0
    assert rows_of(source.get_samples(1)) == [4]
    assert source.commit_pending() == 1 and committed(queue) == 5
    assert len(source) == 0
    assert audit(queue).ok, audit(queue).summary()


def test_given_back_groups_survive_a_crash(queue, redis_url, namespace):
    publish_results(queue, [0, 1])
    args = make_args(redis_url, namespace)
    source = sa.RedisDataSource(args)
    groups = source.get_samples(2)
    source.add_samples([groups[1]])
    source.commit_pending()
    assert committed(queue) == 1
    # Crash before the given-back group was served again: a new session gets it first.
    restarted = sa.RedisDataSource(args)
    assert rows_of(restarted.get_samples(1)) == [1]


def test_foreign_groups_are_pushed_as_prompts(fake_slime, queue, redis_url, namespace):
    args = make_args(redis_url, namespace)
    source = sa.RedisDataSource(args)
    partial = [FakeSlimeSample(group_index=9, index=18 + i, prompt="p9", label="9", tokens=[1, 2, 3, 40 + i],
                               response_length=1, rollout_log_probs=[-0.5], weight_versions=["3"],
                               status=FakeSlimeSample.Status.ABORTED) for i in range(N)]
    source.add_samples([partial])
    assert queue.redis.llen(queue.keys.prompts) == 1
    gid = queue.redis.lindex(queue.keys.prompts, 0).decode()
    assert gid.startswith("slime:")
    group = decode_group(queue.redis.hget(queue.keys.payloads, gid))
    assert [s.tokens for s in group.samples] == [[1, 2, 3, 40], [1, 2, 3, 41]]
    assert [s.status for s in group.samples] == [Status.ABORTED, Status.ABORTED]
    assert group.samples[0].weight_versions == ["3"] and group.samples[1].index == 19
    with pytest.raises(ValueError, match="n_samples_per_prompt=2"):
        source.add_samples([partial[:1]])
    assert audit(queue).ok, audit(queue).summary()


def test_given_back_group_too_stale_is_dropped(queue, redis_url, namespace):
    from pipeline.control import configure, set_weight_version

    publish_results(queue, [0, 1, 2])
    configure(queue.redis, queue.keys, max_staleness=0)
    source = sa.RedisDataSource(make_args(redis_url, namespace))
    groups = source.get_samples(2)
    source.add_samples([groups[1]])
    set_weight_version(queue.redis, queue.keys, 1)  # a weight update: version-0 groups are too stale now
    with pytest.raises(TimeoutError):
        source.settings.timeout = 0.2
        source.get_samples(1)  # group 2 is too stale too: the Consumer restarts it
    dropped = [(e["gid"], e["reason"]) for _, e in
               ((i, {k.decode(): v.decode() for k, v in f.items()}) for i, f in queue.redis.xrange(queue.keys.dropped))]
    assert dropped == [("g1", "stale: given back, then 1 versions behind (max 0)")]
    assert committed(queue) == 1  # group 0, trained in the step before
    assert queue.stats()["dropped"] == 1
    assert audit(queue).ok, audit(queue).summary()
