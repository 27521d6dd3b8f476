"""What the slime adapter keeps slime from training on: staleness on the queue's clock,
refused settings and groups, and slime's dynamic filters applied by the Consumer."""
from __future__ import annotations

import re
import threading

import pytest

from pipeline.codec import decode_group
from pipeline.control import read_control
from pipeline.filters import DynamicFilterOutput
from pipeline.ops.audit import audit
from pipeline.queue import ClaimStatus
from pipeline.trainers import slime_adapter as sa
from pipeline.trainers.slime_checks import SamplingMismatch, SlimeConfigError
from pipeline.types import Group, SamplingRecord
from tests.groups import claim, publish
from tests.slime_helpers import (  # noqa: F401 (fixtures)
    N,
    clean_state,
    fake_slime_installed,
    finished,
    make_args,
    publish_results,
    rows_of,
)

# -- staleness (item 1) ---------------------------------------------------------------------------


class SlimeEngines:
    """Workers generating against engines whose weights slime updates: slime's updater
    numbers the weights of every run from 1 (π_r is "r + 1" in a run started at 0)."""

    def __init__(self, queue, namespace: str):
        self.queue, self.version, self.rows = queue, 1, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.queue.push_groups([Group.fresh(f"p{self.rows + i}", "p", N, row=self.rows + i) for i in range(2)])
            self.rows += 2
            c = claim(self.queue, "w", 2)
            for x in c.groups:
                g = finished(int(x.group_id[1:]), version=self.version, prefix="p")
                g.admitted_version = x.group.admitted_version
                publish(self.queue, "w", x, group=g)
            if c.status in (ClaimStatus.BUDGET, ClaimStatus.BACKLOG):
                self.stop.wait(0.005)


def test_staleness_follows_slime_for_20_rollouts(fake_slime_installed, queue, redis_url, namespace):
    """η = 1 under slime's train.py loop: generate r, train, update the engines' weights.
    Never blocks, never delivers a group whose tokens come from weights older than π_{r-1}."""
    args = make_args(redis_url, namespace, rollout_max_staleness=1, rollout_batch_timeout=20)
    engines = SlimeEngines(queue, namespace)
    engines.thread.start()
    try:
        source = sa.RedisDataSource(args)
        control = read_control(queue.redis, queue.keys)
        assert (control.max_staleness, control.batch_size) == (1, 2)
        lags = []
        for r in range(20):
            out = sa.generate_rollout(args, r, source)
            generated = [int(s.weight_versions[0]) - 1 for g in out.samples for s in g]  # π index
            lags += [r - pi for pi in generated]
            assert min(out.metrics[k] for k in out.metrics if k.startswith("rollout/queue/staleness/")) >= 0
            engines.version += 1  # update_weights after the step: π_{r+1}
    finally:
        engines.stop.set()
        engines.thread.join()
    assert max(lags) <= 1 and min(lags) >= 0, lags
    assert read_control(queue.redis, queue.keys).weight_version == 19


# -- what slime must not train on (items 3, 5, 9) ---------------------------------------------------


@pytest.mark.parametrize("slime, recorded, flag", [
    ({"rollout_stop": ["</answer>"]}, {}, "--stop '</answer>'"),
    ({"rollout_stop_token_ids": [7, 9]}, {"stop_token_ids": (9,)}, "--stop-token-id 7 --stop-token-id 9"),
    ({"rollout_skip_special_tokens": False}, {"skip_special_tokens": True}, "--keep-special-tokens"),
])
def test_stop_strings_stop_ids_and_special_tokens_are_compared_with_slimes(queue, redis_url, namespace, slime,
                                                                             recorded, flag):
    """Issue 27: stop strings, stop token ids and skip_special_tokens shape what a sample
    is (where it ends, the text its reward reads), and were not compared."""
    publish_results(queue, [0, 1], sampling=SamplingRecord(1.0, 1.0, -1, 64, **recorded))
    with pytest.raises(sa.SamplingMismatch, match=f"start the workers with {re.escape(flag)}"):
        sa.generate_rollout(make_args(redis_url, namespace, **slime), 0, None)


def test_stop_settings_that_match_are_accepted_in_any_order(queue, redis_url, namespace):
    publish_results(queue, [0, 1], sampling=SamplingRecord(1.0, 1.0, -1, 64, ("b", "a"), (9, 7), False))
    args = make_args(redis_url, namespace, rollout_stop=["a", "b"], rollout_stop_token_ids=[7, 9],
                     rollout_skip_special_tokens=False)
    assert len(sa.generate_rollout(args, 0, None).samples) == 2


def test_top_p_other_than_one_is_refused(redis_url, namespace):
    with pytest.raises(SlimeConfigError, match="--rollout-top-p 0.9.*rollout_top_p_token_ids"):
        sa.RedisDataSource(make_args(redis_url, namespace, rollout_top_p=0.9))


def test_over_sampling_with_slimes_rollout_is_refused(redis_url, namespace):
    args = make_args(redis_url, namespace, rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
                     over_sampling_batch_size=6)
    with pytest.raises(SlimeConfigError, match="--over-sampling-batch-size 6 != --rollout-batch-size 2"):
        sa.RedisDataSource(args)
    args.over_sampling_batch_size = 2
    source = sa.RedisDataSource(args)
    with pytest.raises(SlimeConfigError, match="get_samples\\(6\\) but --rollout-batch-size is 2"):
        source.get_samples(6)


@pytest.mark.parametrize("flag, value, advice", [
    ("custom_rm_path", "my.rm", "rollout worker --reward my.rm"),
    ("rm_type", "math", "--reward slime.rollout.rm_hub.async_rm --rm-type math"),
    ("group_rm", True, "--group-reward"),
    ("custom_generate_function_path", "my.gen", "rollout worker --generate-function my.gen"),
    ("rollout_sample_hook_path", ["my.hook"], "--generate-function or --reward"),
    ("rollout_sample_filter_path", "my.filter", "--dynamic-sampling-filter-path"),
    ("rollout_all_samples_process_path", "my.process", "--reward"),
    ("buffer_filter_path", "my.buffer", "--dynamic-sampling-filter-path"),
    ("mask_offpolicy_in_partial_rollout", True, "rollout worker --mask-offpolicy-prefix"),
    ("over_sampling_batch_size", 6, "reads exactly --rollout-batch-size 2"),
])
def test_slime_flags_the_queues_rollout_would_ignore_are_refused_with_what_to_do(redis_url, namespace, flag,
                                                                                 value, advice):
    """Issue 27: accepted and silently ignored under the queue's rollout function."""
    cli_flag = "--" + flag.replace("_", "-")
    with pytest.raises(SlimeConfigError, match=f"{cli_flag}: .*{re.escape(advice)}"):
        sa.RedisDataSource(make_args(redis_url, namespace, **{flag: value}))
    # slime's defaults pass
    sa.RedisDataSource(make_args(redis_url, namespace, rollout_sample_hook_path=[], group_rm=False,
                                 over_sampling_batch_size=2, partial_rollout=True))


def test_offpolicy_masking_by_slimes_rollout_over_the_data_source_is_refused(redis_url, namespace):
    """slime's rollout masks the previous off-policy output of samples it continues; over
    RedisDataSource every sample is finished, and every loss mask came out zero."""
    args = make_args(redis_url, namespace, rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
                     partial_rollout=True, mask_offpolicy_in_partial_rollout=True, hf_checkpoint="bytes")
    with pytest.raises(SlimeConfigError, match="would zero every loss mask.*--mask-offpolicy-prefix"):
        sa.RedisDataSource(args)


def test_fully_async_rollout_is_refused(redis_url, namespace):
    args = make_args(redis_url, namespace,
                     rollout_function_path="slime.rollout.fully_async_rollout.generate_rollout_fully_async")
    with pytest.raises(SlimeConfigError, match="get_samples\\(1\\) per group from a thread"):
        sa.RedisDataSource(args)


def test_groups_sampled_otherwise_are_refused_and_regenerated(queue, redis_url, namespace):
    publish_results(queue, [0], sampling=SamplingRecord(0.7, 1.0, -1, 64))
    publish_results(queue, [1])
    args = make_args(redis_url, namespace, rollout_temperature=1.0, rollout_max_response_len=64)
    with pytest.raises(SamplingMismatch, match="g0 was sampled by worker w with temperature 0.7, slime trains "
                                               "with --rollout-temperature 1.0: start the workers with "
                                               "--temperature 1.0"):
        sa.generate_rollout(args, 0, None)
    assert queue.redis.lrange(queue.keys.prompts, 0, -1) == [b"g0"]  # to be generated again
    assert decode_group(queue.redis.hget(queue.keys.payloads, "g0")).samples[0].tokens == []
    publish_results(queue, [0])  # a worker with the right settings generates it again
    assert rows_of(sa.generate_rollout(args, 0, None).samples) == [0, 1]  # g1 came back first
    publish_results(queue, [2], sampling=None)
    publish_results(queue, [3])
    with pytest.raises(SamplingMismatch, match="g2 carries no sampling settings"):
        sa.generate_rollout(args, 1, None)
    publish_results(queue, [2])
    assert rows_of(sa.generate_rollout(args, 1, None).samples) == [2, 3]
    assert audit(queue).ok, audit(queue).summary()


# -- filters (item 7) --------------------------------------------------------------------------------


def nonzero_std(args, samples, **kwargs):
    """A slime-style filter: calls slime's Sample method, returns slime's output type."""
    rewards = [s.get_reward_value(args) for s in samples]
    keep = len(set(rewards)) > 1
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{rewards[0]}")


def test_slime_dynamic_filter_gets_slime_samples(fake_slime_installed, queue, redis_url, namespace):
    publish_results(queue, [0, 1], rewards=[1.0, 1.0])
    publish_results(queue, [2, 3, 4])
    args = make_args(redis_url, namespace, dynamic_sampling_filter_path=f"{__name__}.nonzero_std")
    out = sa.generate_rollout(args, 0, None)
    assert rows_of(out.samples) == [2, 3]
    assert out.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == 2
    assert out.metrics["rollout/queue/dropped"] == 2 and out.metrics["rollout/queue/drop_ratio"] == pytest.approx(0.5)


def text_filter(args, samples):
    """A slime filter that reads the response text."""
    assert all(s.response for s in samples), [s.response for s in samples]
    return True


def test_a_slime_filter_sees_the_response_text(fake_slime_installed, queue, redis_url, namespace):
    """Issue 27: results carry tokens, not text; a filter reading Sample.response saw ""."""
    publish_results(queue, [0, 1])
    args = make_args(redis_url, namespace, dynamic_sampling_filter_path=f"{__name__}.text_filter",
                     hf_checkpoint="bytes", rollout_batch_timeout=5)
    out = sa.generate_rollout(args, 0, None)
    assert rows_of(out.samples) == [0, 1] and all(s.response for g in out.samples for s in g)


def test_keep_when_insufficient_groups_are_kept_at_once_as_slime_does(fake_slime_installed, queue, redis_url,
                                                                       namespace):
    """Issue 27: slime keeps them as soon as what it read cannot fill the batch; the
    adapter waited 30 s per batch (here the batch would have timed out first)."""
    path = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
    publish_results(queue, [0, 1, 2], rewards=[1.0, 1.0])
    publish_results(queue, [3])
    args = make_args(redis_url, namespace, dynamic_sampling_filter_path=path, rollout_batch_timeout=5)
    out = sa.generate_rollout(args, 0, None)
    assert rows_of(out.samples) == [0, 3] and out.metrics["rollout/queue/kept_when_insufficient"] == 1


def test_keep_when_insufficient_fills_a_batch_that_cannot_fill(fake_slime_installed, queue, redis_url, namespace):
    path = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
    publish_results(queue, [0, 1, 2], rewards=[1.0, 1.0])
    publish_results(queue, [3])
    args = make_args(redis_url, namespace, dynamic_sampling_filter_path=path, rollout_filter_fallback_wait=0.3)
    out = sa.generate_rollout(args, 0, None)
    assert rows_of(out.samples) == [0, 3]  # one passed; the oldest rejected group filled the batch
    assert out.metrics["rollout/queue/kept_when_insufficient"] == 1
    assert out.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == 2  # the others, once the batch was full
    publish_results(queue, [4, 5, 6], rewards=[0.0, 1.0])
    publish_results(queue, [7], rewards=[1.0, 1.0])
    out = sa.generate_rollout(args, 1, None)
    assert rows_of(out.samples) == [4, 5] and out.metrics["rollout/queue/kept_when_insufficient"] == 0
    assert audit(queue).ok, audit(queue).summary()
