"""pipeline.trainers.torch_adapter: padded tensors from a batch, masks and log-prob alignment,
GRPO advantages, the zero-copy path against the list path, commit-on-next with Redis."""
from __future__ import annotations

import sys

import pytest

import torch  # CI installs torch==2.13.0 (the test extra); a missing torch fails loudly

from pipeline.codec import decode_group, encode_group  
from pipeline.consumer import Consumer  
from pipeline.queue import Place  
from pipeline.trainers.torch_adapter import RolloutIterable, _torch, batch_to_tensors, group_advantages  
from pipeline.types import Group, Status  
from tests.groups import claim, publish

PROMPT = [1, 2, 3]


def finished(gid: str, row: int, lengths: list[int], rewards: list, masks: list | None = None,
             statuses: list[Status] | None = None) -> Group:
    """A finished group: sample i has lengths[i] response tokens 100*row + 10*i + k and
    log-probs -(k+1)/4 (exact in float32)."""
    group = Group.fresh(gid, f"prompt {row}", len(lengths), row=row)
    group.prompt_ids = list(PROMPT)
    for i, (s, n) in enumerate(zip(group.samples, lengths)):
        s.tokens = PROMPT + [100 * row + 10 * i + k for k in range(n)]
        s.response_length = n
        s.rollout_log_probs = [-(k + 1) / 4 for k in range(n)]
        s.weight_versions = ["0"]
        s.reward = rewards[i]
        s.loss_mask = None if masks is None else masks[i]
        s.status = statuses[i] if statuses else Status.COMPLETED
    return group


def two_groups() -> list[Group]:
    return [
        finished("a", 0, [2, 4], [1.0, 0.0], masks=[None, [1, 0, 0, 1]]),
        finished("b", 1, [1, 3], [0.5, 0.25], statuses=[Status.TRUNCATED, Status.COMPLETED]),
    ]


def test_shapes_padding_masks_and_alignment():
    t = batch_to_tensors(two_groups(), pad_token_id=-7)
    assert t["tokens"].shape == (4, 7) and t["tokens"].dtype == torch.int64
    assert t["tokens"].tolist() == [
        [1, 2, 3, 0, 1, -7, -7],
        [1, 2, 3, 10, 11, 12, 13],
        [1, 2, 3, 100, -7, -7, -7],
        [1, 2, 3, 110, 111, 112, -7],
    ]
    assert t["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
    # Response positions only, honouring Sample.loss_mask; prompt and padding 0.
    assert t["loss_mask"].tolist() == [
        [0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0, 1], [0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0]]
    assert t["loss_mask"].dtype == torch.float32
    # log-prob of tokens[i, t] sits at t, on response positions only.
    q = [-0.25, -0.5, -0.75, -1.0]
    assert t["rollout_log_probs"].tolist() == [
        [0, 0, 0, q[0], q[1], 0, 0], [0, 0, 0, *q], [0, 0, 0, q[0], 0, 0, 0], [0, 0, 0, *q[:3], 0]]
    assert t["rewards"].tolist() == [1.0, 0.0, 0.5, 0.25] and t["rewards"].dtype == torch.float32
    assert t["response_lengths"].tolist() == [2, 4, 1, 3]
    assert t["prompt_lengths"].tolist() == [3, 3, 3, 3]
    assert t["group_index"].tolist() == [0, 0, 1, 1]
    assert t["sample_index"].tolist() == [0, 1, 2, 3]
    assert t["truncated"].tolist() == [False, False, True, False]


def test_dict_rewards_need_a_key_and_missing_rewards_fail():
    g = finished("a", 0, [1, 1], [{"score": 1.0, "acc": 0}, {"score": 0.0, "acc": 1}])
    assert batch_to_tensors([g], reward_key="score")["rewards"].tolist() == [1.0, 0.0]
    assert batch_to_tensors([g], reward_key="acc")["rewards"].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="reward_key"):
        batch_to_tensors([g])
    with pytest.raises(KeyError, match="nope"):
        batch_to_tensors([g], reward_key="nope")
    with pytest.raises(ValueError, match="no reward"):
        batch_to_tensors([finished("b", 1, [1], [None])])


def test_inconsistent_lengths_fail_loudly():
    g = finished("a", 0, [2], [1.0])
    g.samples[0].rollout_log_probs = [-0.5]
    with pytest.raises(ValueError, match="1 rollout log-probs for 2 response tokens"):
        batch_to_tensors([g])
    g = finished("a", 0, [2], [1.0], masks=[[1]])
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        batch_to_tensors([g])


def test_packed_path_equals_list_path_without_unpacking():
    groups = two_groups()
    groups.append(finished("c", 2, [0, 5], [0.0, 1.0]))  # an empty response too
    groups[2].samples[0].rollout_log_probs = []
    decoded = [decode_group(encode_group(g)) for g in groups]
    packed = batch_to_tensors(decoded, pad_token_id=5)
    # The zero-copy path read the packed bytes: the samples were never unpacked to lists.
    assert all(s.packed_tokens() is not None and s.packed_log_probs() is not None for g in decoded for s in g.samples)
    lists = batch_to_tensors(decoded, pad_token_id=5, use_packed=False)
    original = batch_to_tensors(groups, pad_token_id=5)
    assert packed.keys() == lists.keys() == original.keys()
    for key in packed:
        assert packed[key].dtype == lists[key].dtype, key
        assert torch.equal(packed[key], lists[key]), key
        assert torch.equal(packed[key], original[key]), key


def test_packed_path_follows_a_replaced_field():
    g = decode_group(encode_group(finished("a", 0, [2], [1.0])))
    g.samples[0].tokens = [9, 9, 9, 8, 7]  # replaced after decoding: the packed bytes are stale
    g.samples[0].rollout_log_probs = [-1.0, -2.0]
    t = batch_to_tensors([g])
    assert t["tokens"].tolist() == [[9, 9, 9, 8, 7]]
    assert t["rollout_log_probs"].tolist() == [[0, 0, 0, -1.0, -2.0]]


def test_samples_without_a_shared_prompt():
    g = finished("a", 0, [2, 1], [1.0, 0.0])
    g.samples[1].tokens = [7, 8, 9, 10, 11]  # not starting with the group's prompt ids
    g.samples[1].response_length = 1
    g.samples[1].rollout_log_probs = [-0.5]
    d = decode_group(encode_group(g))
    assert torch.equal(batch_to_tensors([d])["tokens"], batch_to_tensors([g])["tokens"])
    assert batch_to_tensors([d])["tokens"][1].tolist() == [7, 8, 9, 10, 11]


def test_group_advantages_known_numbers():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups)
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: all equal; group 2: one sample.
    expected = 0.5 / ((1 / 3) ** 0.5 + 1e-6)
    assert torch.allclose(adv, torch.tensor([expected, -expected, expected, -expected, 0, 0, 0]))
    assert torch.equal(group_advantages(rewards, groups, normalize_std=False),
                       torch.tensor([0.5, -0.5, 0.5, -0.5, 0.0, 0.0, 0.0]))
    # Same as slime's reshape-based normalization for equal group sizes.
    r = torch.tensor([3.0, 1.0, 0.0, 4.0, 4.0, 1.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    grid = r.view(2, 3)
    ref = (grid - grid.mean(-1, keepdim=True)) / (grid.std(-1, keepdim=True) + 1e-6)
    assert torch.allclose(group_advantages(r, g), ref.flatten())


def test_missing_torch_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="pip install torch"):
        _torch()


# -- with Redis ----------------------------------------------------------------------------


def publish_results(queue, groups: list[Group]) -> None:
    queue.push_groups([Group.fresh(g.group_id, g.samples[0].prompt, g.n_samples, row=g.row) for g in groups])
    claimed = claim(queue, "w", len(groups))
    assert [c.group_id for c in claimed.groups] == [g.group_id for g in groups]
    for g in groups:
        assert publish(queue, "w", g, Place.RESULTS)


def committed(queue) -> int:
    return queue.stats().get("committed", 0)


def test_iterable_commits_previous_batch_on_next(queue, client, namespace):
    publish_results(queue, [finished(f"g{i}", i, [1 + i % 3, 2], [float(i), 0.0]) for i in range(6)])
    it = RolloutIterable(Consumer(client, namespace), batch_size=2, timeout=5, steps=2)
    first = next(it)
    assert first["tokens"].shape[0] == 4 and first["group_index"].tolist() == [0, 0, 1, 1]
    assert [g.group_id for g in it.batch.groups] == ["g0", "g1"]
    assert committed(queue) == 0
    second = next(it)  # the first step finished
    assert committed(queue) == 2
    assert [g.group_id for g in it.batch.groups] == ["g2", "g3"]
    assert second["rewards"].tolist() == [2.0, 0.0, 3.0, 0.0]
    with pytest.raises(StopIteration):  # the request that ends the loop commits the last batch
        next(it)
    assert committed(queue) == 4
    assert it.commit() == 0


def test_iterable_crash_redelivers_uncommitted_batch(queue, client, namespace):
    publish_results(queue, [finished(f"g{i}", i, [2, 2], [1.0, 0.0]) for i in range(4)])
    it = RolloutIterable(Consumer(client, namespace), batch_size=2, timeout=5)
    before = next(it)
    ids = [g.group_id for g in it.batch.groups]
    # The trainer dies mid-step: no commit. A new session under the same name gets it back.
    again = RolloutIterable(Consumer(client, namespace), batch_size=2, timeout=5)
    redelivered = next(again)
    assert [g.group_id for g in again.batch.groups] == ids
    for key in before:
        assert torch.equal(before[key], redelivered[key]), key
    again.commit()
    assert committed(queue) == 2
    next(again)
    assert [g.group_id for g in again.batch.groups] == ["g2", "g3"]


def test_iterable_for_loop(queue, client, namespace):
    publish_results(queue, [finished(f"g{i}", i, [1], [float(i)]) for i in range(3)])
    seen = [t["rewards"].tolist() for t in RolloutIterable(Consumer(client, namespace), 1, timeout=5, steps=3)]
    assert seen == [[0.0], [1.0], [2.0]]
    assert committed(queue) == 3
