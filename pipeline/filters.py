"""Dynamic sampling filters with slime's signature: `fn(args, samples) -> keep`.

A filter returns slime's `DynamicFilterOutput(keep, reason)` (any object with
`keep` and `reason`) or a bare bool (the legacy form).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from .types import Group, Sample

FilterFn = Callable[[Any, list[Sample]], Any]


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None


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


def apply_filter(fn: FilterFn, args: Any, group: Group) -> tuple[bool, str]:
    """(keep, reason) from either filter form."""
    out = fn(args, group.samples)
    if not hasattr(out, "keep"):
        # The legacy bare-bool form; slime's own returned `torch.tensor(...).std() > 0`,
        # a tensor, and numpy comparisons give numpy.bool_: not `bool` instances.
        keep = bool(out)
        return keep, "" if keep else "filtered"
    keep = bool(out.keep)
    return keep, "" if keep else (getattr(out, "reason", None) or "filtered")
