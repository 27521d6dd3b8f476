"""Dynamic sampling filters with slime's signature: `fn(args, samples) -> keep`.

A filter returns slime's `DynamicFilterOutput(keep, reason, keep_when_insufficient)`
(any object with `keep`; the other two are optional) or a bare bool (the legacy form).
A rejected group marked `keep_when_insufficient` is kept after all when the batch
cannot fill without it (slime's `check_reward_nonzero_std_with_fallback`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from .types import Group, Sample

FilterFn = Callable[[Any, list[Sample]], Any]


@dataclass
class DynamicFilterOutput:
    """slime.rollout.filter_hub.base_types.DynamicFilterOutput (slime 0.3.1)."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


@dataclass(frozen=True)
class Verdict:
    keep: bool
    reason: str = ""  # why not kept
    fallback: bool = False  # rejected, but kept when the batch cannot fill without it


def load_object(path: str) -> Any:
    """`package.module.name` or `package.module:name` -> the object."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path like package.module.function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for {path!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None


def keep_varied_rewards(args: Any, samples: list[Sample]) -> DynamicFilterOutput:
    """DAPO's filter: a group whose rewards are all equal carries no advantage signal."""
    rewards = [s.reward.get(getattr(args, "reward_key", None) or "score") if isinstance(s.reward, dict) else s.reward
               for s in samples]
    if len(set(rewards)) <= 1:
        return DynamicFilterOutput(False, "all rewards equal")
    return DynamicFilterOutput(True)


BUILTIN_FILTERS: dict[str, FilterFn] = {"dapo": keep_varied_rewards}


def load_filter(path: str) -> FilterFn:
    fn = BUILTIN_FILTERS.get(path) or load_object(path)
    if not callable(fn):
        raise ValueError(f"filter {path!r} is not callable")
    return fn


def apply_filter(fn: FilterFn, args: Any, group: Group) -> Verdict:
    """The verdict of either filter form."""
    out = fn(args, group.samples)
    if not hasattr(out, "keep"):
        # The legacy bare-bool form; slime's own returned `torch.tensor(...).std() > 0`,
        # a tensor, and numpy comparisons give numpy.bool_: not `bool` instances.
        keep = bool(out)
        return Verdict(keep, "" if keep else "filtered")
    if bool(out.keep):
        return Verdict(True)
    return Verdict(False, getattr(out, "reason", None) or "filtered",
                   bool(getattr(out, "keep_when_insufficient", False)))
