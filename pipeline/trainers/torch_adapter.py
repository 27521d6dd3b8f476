"""Batches as PyTorch tensors, for a plain training loop. torch is optional: it is
imported on first use, with a clear error if it is missing.

    it = RolloutIterable(consumer, batch_size=64, timeout=600)
    for t in it:                                   # commits the previous batch first
        adv = group_advantages(t["rewards"], t["group_index"])
        loss = policy_loss(model, t, adv)          # your step
        ...
    # leaving the loop early: it.commit() once the last step succeeded

Token ids and log-probs of decoded samples stay packed (little-endian bytes, see
codec.PackedSample) until read; here they go straight from those bytes into the
padded tensors with `torch.frombuffer`, never through Python lists.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from pipeline import codec
from pipeline.consumer import Batch, Consumer

if TYPE_CHECKING:
    import torch

_LITTLE_ENDIAN = sys.byteorder == "little"


def _torch():
    try:
        import torch
    except ImportError:
        from pipeline.cli_support import TORCH_INSTALL_HINT

        raise ImportError(f"pipeline.trainers.torch_adapter needs PyTorch: {TORCH_INSTALL_HINT}") from None
    return torch


# -- reading samples -----------------------------------------------------------------------


def _frombuffer(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    torch = _torch()
    if not data:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # `bytes` is read-only; the view is only ever copied from, never written.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=dtype)


@dataclass
class _Row:
    """One sample's data as tensors or lists, before padding."""

    prompt: Any  # tensor or list: tokens before the packed tail (or all tokens)
    tail: Any  # tensor or list
    n_tokens: int
    response_length: int
    log_probs: Any  # tensor, list or None
    loss_mask: list[int] | None


def _row(sample: Any, use_packed: bool, prefix_cache: dict[int, Any]) -> _Row:
    torch = _torch()
    r = sample.response_length
    packed = isinstance(sample, codec.PackedSample) and use_packed and _LITTLE_ENDIAN
    packed_tokens = sample.packed_tokens() if packed else None
    packed_log_probs = sample.packed_log_probs() if packed else None
    if packed_tokens is not None:
        prefix, packed_tail = packed_tokens
        key = id(prefix)  # the samples of a group share one prompt list: one tensor per group
        if key not in prefix_cache:
            prefix_cache[key] = (prefix, torch.tensor(prefix, dtype=torch.int64))
        tail = _frombuffer(packed_tail, torch.int32)
        prompt, n = prefix_cache[key][1], len(prefix) + tail.numel()
    else:
        prompt, tail = [], list(sample.tokens)
        n = len(tail)
    if packed_log_probs is not None:
        log_probs = _frombuffer(packed_log_probs, torch.float32)
    else:
        log_probs = sample.rollout_log_probs
    return _Row(prompt, tail, n, r, log_probs, sample.loss_mask)


def _samples(batch: Batch | Sequence[Any]) -> Iterator[tuple[int, Any]]:
    """(group position, sample) for a Batch, a list of Groups or a list of sample lists."""
    groups = batch.groups if isinstance(batch, Batch) else batch
    for gi, group in enumerate(groups):
        for sample in getattr(group, "samples", group):
            yield gi, sample


def _as(values: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor as it is (slice assignment casts while copying), a list converted."""
    torch = _torch()
    return values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)


def _reward(sample: Any, reward_key: str | None) -> float:
    reward = sample.reward
    if isinstance(reward, dict):
        if reward_key is None:
            raise ValueError(f"sample {sample.index}: reward is a dict ({', '.join(map(str, reward))}); "
                             "pass reward_key to pick one")
        if reward_key not in reward:
            raise KeyError(f"sample {sample.index}: reward has no key {reward_key!r} (has {', '.join(map(str, reward))})")
        reward = reward[reward_key]
    if reward is None:
        raise ValueError(f"sample {sample.index}: no reward (status {getattr(sample.status, 'value', sample.status)})")
    return float(reward)


# -- the batch ---------------------------------------------------------------------------------


def batch_to_tensors(batch: Batch | Sequence[Any], pad_token_id: int = 0, reward_key: str | None = None,
                     device: Any = None, use_packed: bool = True) -> dict[str, torch.Tensor]:
    """Right-padded tensors for B groups of n samples (N = B·n rows, L = longest sample):

    - tokens [N, L] int64: prompt + response ids, then `pad_token_id`
    - attention_mask [N, L] int64: 1 on real tokens
    - loss_mask [N, L] float32: 1 on response positions the loss counts (Sample.loss_mask;
      None means all of them), 0 on prompt and padding
    - rollout_log_probs [N, L] float32: the engine's log-prob of tokens[i, t] at response
      positions t, 0 elsewhere. A causal LM's logits at t-1 predict token t: compare with
      `logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])` against `[:, 1:]`.
    - rewards [N] float32 (dict rewards: `reward_key`), response_lengths, prompt_lengths [N] int64
    - group_index [N] int64: position of the sample's group in the batch (0..B-1)
    - sample_index [N] int64: Sample.index (-1 when None); truncated [N] bool

    `use_packed=False` forces the list path (same values; for checking and comparison).
    """
    torch = _torch()
    prefix_cache: dict[int, Any] = {}
    rows, groups, samples = [], [], []
    for gi, sample in _samples(batch):
        rows.append(_row(sample, use_packed, prefix_cache))
        groups.append(gi)
        samples.append(sample)
    n_rows = len(rows)
    width = max((r.n_tokens for r in rows), default=0)
    tokens = torch.full((n_rows, width), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((n_rows, width), dtype=torch.int64)
    loss_mask = torch.zeros((n_rows, width), dtype=torch.float32)
    log_probs = torch.zeros((n_rows, width), dtype=torch.float32)
    for i, (r, sample) in enumerate(zip(rows, samples)):
        p, start = len(r.prompt), r.n_tokens - r.response_length
        if r.response_length < 0 or start < 0:
            raise ValueError(f"sample {sample.index}: response_length {r.response_length} outside 0..{r.n_tokens}")
        if p:
            tokens[i, :p] = r.prompt
        if r.n_tokens > p:
            tokens[i, p:r.n_tokens] = _as(r.tail, torch.int64)
        attention[i, :r.n_tokens] = 1
        if r.loss_mask is None:
            loss_mask[i, start:r.n_tokens] = 1.0
        else:
            if len(r.loss_mask) != r.response_length:
                raise ValueError(f"sample {sample.index}: loss_mask has {len(r.loss_mask)} entries for "
                                 f"{r.response_length} response tokens")
            loss_mask[i, start:r.n_tokens] = _as(r.loss_mask, torch.float32)
        if r.log_probs is not None:
            if len(r.log_probs) != r.response_length:
                raise ValueError(f"sample {sample.index}: {len(r.log_probs)} rollout log-probs for "
                                 f"{r.response_length} response tokens")
            log_probs[i, start:r.n_tokens] = _as(r.log_probs, torch.float32)
    out = {
        "tokens": tokens,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "rollout_log_probs": log_probs,
        "rewards": torch.tensor([_reward(s, reward_key) for s in samples], dtype=torch.float32),
        "response_lengths": torch.tensor([r.response_length for r in rows], dtype=torch.int64),
        "prompt_lengths": torch.tensor([r.n_tokens - r.response_length for r in rows], dtype=torch.int64),
        "group_index": torch.tensor(groups, dtype=torch.int64),
        "sample_index": torch.tensor([-1 if s.index is None else s.index for s in samples], dtype=torch.int64),
        "truncated": torch.tensor([getattr(s.status, "value", s.status) == "truncated" for s in samples],
                                  dtype=torch.bool),
    }
    if device is not None:
        out = {k: v.to(device) for k, v in out.items()}
    return out


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6,
                     normalize_std: bool = True) -> torch.Tensor:
    """GRPO: (reward - group mean) / (group std + eps), per group. The std is the unbiased
    one (torch.std's default, as slime uses); a group of one sample gets advantage 0.
    `normalize_std=False` gives reward minus group mean (Dr. GRPO)."""
    torch = _torch()
    rewards = rewards.to(torch.float32)
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    counts = torch.zeros(n_groups, dtype=torch.float32, device=rewards.device).index_add_(
        0, group_index, torch.ones_like(rewards))
    sums = torch.zeros(n_groups, dtype=torch.float32, device=rewards.device).index_add_(0, group_index, rewards)
    centered = rewards - (sums / counts.clamp(min=1))[group_index]
    if not normalize_std:
        return centered
    sq = torch.zeros(n_groups, dtype=torch.float32, device=rewards.device).index_add_(0, group_index, centered ** 2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()
    return centered / (std[group_index] + eps)


# -- the iterator --------------------------------------------------------------------------------


class RolloutIterable:
    """Yields `batch_to_tensors` of exactly `batch_size` groups per step. Asking for the next
    batch commits the previous one (its step finished); an exception in the loop body
    leaves it uncommitted, so a restarted trainer gets it again first. `steps` stops
    after that many batches (the request that ends the loop commits the last one).

    A plain iterator, deliberately not a DataLoader dataset: commits must happen in the
    training process, not in DataLoader worker processes."""

    def __init__(self, consumer: Consumer, batch_size: int, timeout: float | None = None,
                 pad_token_id: int = 0, reward_key: str | None = None, device: Any = None,
                 steps: int | None = None):
        _torch()  # fail here, not at the first step
        self.consumer = consumer
        self.batch_size = batch_size
        self.timeout = timeout
        self.pad_token_id = pad_token_id
        self.reward_key = reward_key
        self.device = device
        self.steps = steps
        self.step = 0
        self.batch: Batch | None = None  # the batch last yielded: groups, metrics, weight version
        self._pending: Batch | None = None

    def __iter__(self) -> RolloutIterable:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self.commit()
        if self.steps is not None and self.step >= self.steps:
            raise StopIteration
        batch = self.consumer.next_batch(self.batch_size, timeout=self.timeout)
        self.batch = self._pending = batch
        self.step += 1
        return batch_to_tensors(batch, self.pad_token_id, self.reward_key, self.device)

    def commit(self) -> int:
        """Commit the batch last yielded, if not yet; returns how many groups."""
        if self._pending is None:
            return 0
        # Forgotten only once committed: a commit that raised (Redis gone past the outage
        # limit) is tried again by the next call, not left pending for a new session.
        committed = self.consumer.commit(self._pending)
        self._pending = None
        return committed

