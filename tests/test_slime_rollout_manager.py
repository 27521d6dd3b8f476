"""slime's own RolloutManager and default rollout (tests/fake_slime_rollout.py, step by step
as slime's code runs them) over RedisDataSource, driven as slime's train_async.py drives them:
the flags slime's rollout ignores there."""
from __future__ import annotations

import re

import pytest

from pipeline.ops.audit import audit
from pipeline.trainers import slime_adapter as sa
from pipeline.types import SamplingRecord
from tests.fake_slime_rollout import RolloutManager, slime_args
from tests.groups import claim, publish
from tests.slime_helpers import N, SAMPLING, committed, finished, publish_results
from tests.slime_helpers import clean_state, fake_slime_installed  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("fake_slime_installed")

DATA_SOURCE = "pipeline.trainers.slime_adapter.RedisDataSource"


def rollout_args(redis_url: str, namespace: str, **kwargs) -> object:
    """slime's args for its default rollout over RedisDataSource, checkpoints every rollout. The
    workers keep the response texts (slime's rollout reads them; the test tokens are no text)."""
    return slime_args(**{"rollout_batch_size": 2, "n_samples_per_prompt": N, "rollout_redis_url": redis_url,
                         "rollout_namespace": namespace, "data_source_path": DATA_SOURCE,
                         "rollout_max_response_len": SAMPLING.max_new_tokens, "save": "/ckpt", "save_interval": 1,
                         "rollout_batch_timeout": 5, **kwargs})


def rows_trained(train_data: dict) -> list[int]:
    return sorted({s.group_index for s in train_data["samples"]})


def generate_again(queue, worker: str = "w2", sampling: SamplingRecord = SAMPLING, version: int = 0) -> list[str]:
    """Workers with the right settings generate every group waiting in the prompt list."""
    out = []
    while True:
        c = claim(queue, worker, 8)
        for x in c.groups:
            g = finished(int(x.group_id[1:]), version=version, sampling=sampling)
            g.admitted_version, g.worker = x.group.admitted_version, worker
            publish(queue, worker, x, group=g, keep_response_text=True)
            out.append(x.group_id)
        if not c.groups:
            return out


# -- flags slime's rollout ignores over the data source (failure 8) ---------------------------------


async def user_rm(args, sample):
    return 1.0


async def user_group_rm(args, samples):
    return [1.0] * len(samples)


async def user_generate(args, sample, sampling_params):
    raise AssertionError("slime never calls the generate function on a finished sample")


def user_hook(args, sample):
    raise AssertionError("slime never runs sample hooks on a finished sample")


def user_buffer_filter(args, rollout_id, buffer, num_samples):
    raise AssertionError("RedisDataSource has no buffer: slime's RolloutDataSourceWithBuffer calls this")


@pytest.mark.parametrize("flag, value", [
    ("custom_rm_path", f"{__name__}.user_rm"),
    ("rm_type", "math"),
    ("custom_generate_function_path", f"{__name__}.user_generate"),
    ("rollout_sample_hook_path", [f"{__name__}.user_hook"]),
    ("buffer_filter_path", f"{__name__}.user_buffer_filter"),
])
def test_flags_slimes_rollout_ignores_over_the_data_source_are_refused(queue, redis_url, namespace, flag, value):
    """Issue 30 (8): slime's generate_and_rm returns a finished sample that carries a reward
    before it would call the generate function, the hooks or the rm (sglang_rollout.py), and
    buffer_filter_path is read only by slime's own buffer: slime trained the workers' reward
    0.0 where the user's rm gives 1.0. RolloutManager's data source refuses them."""
    publish_results(queue, [0, 1], rewards=[0.0, 0.0], keep_response_text=True)
    cli_flag = "--" + flag.replace("_", "-")
    with pytest.raises(sa.SlimeConfigError, match=f"{re.escape(cli_flag)}: .*rollout worker"):
        RolloutManager(rollout_args(redis_url, namespace, **{flag: value}))
    assert audit(queue).ok


@pytest.mark.parametrize("rm", [{"custom_rm_path": f"{__name__}.user_group_rm"}, {"rm_type": "math"}])
def test_with_group_rm_slime_scores_again_and_the_rm_flags_are_allowed(queue, redis_url, namespace, rm):
    """With --group-rm slime scores every group again (generate_and_rm_group calls
    batched_async_rm): the rm flags do what they say, and slime trains its own scores."""
    publish_results(queue, [0, 1], rewards=[0.0, 0.0], keep_response_text=True)
    manager = RolloutManager(rollout_args(redis_url, namespace, group_rm=True, **rm))
    manager.load(-1)
    out = manager.generate(0)
    expected = [1.0] * 4 if "custom_rm_path" in rm else [int(s.response == s.label) for s in out["samples"]]
    assert out["raw_reward"] == expected and all(s.response for s in out["samples"])
    manager.save(0)
    assert committed(queue) == 2 and audit(queue).ok
