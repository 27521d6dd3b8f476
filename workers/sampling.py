"""The sampling settings a worker sends with every /generate, checked at startup.

SGLang checks the same values on every request (`SamplingParams.verify` in
`srt/sampling/sampling_params.py`) and answers 400 to a bad one, so a worker
started with `--top-k 0` would dead-letter every group it claims. `validate()`
applies SGLang's rules once, when the settings are made, and names the setting.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.types import SamplingRecord

#: SGLang (0.5.20, the pinned image, to 0.5.23: MAX_STOP_COUNT) rejects requests with more stop strings.
MAX_STOP_STRINGS = 32
_INT32_MAX = 2**31 - 1


class SamplingError(ValueError):
    """A sampling setting SGLang would reject; the message names it."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingSettings:
    """slime's rollout_* arguments, sent as SGLang sampling_params."""

    max_new_tokens: int = 1024  # rollout_max_response_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True  # SGLang's default; slime's --rollout-skip-special-tokens defaults to False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise SamplingError for a value SGLang would answer 400 to."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be an integer of at least 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise SamplingError(f"top_k must be -1 (no limit) or at least 1, got {self.top_k!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError(f"stop must be a list of non-empty strings, got {self.stop!r:.200}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"at most {MAX_STOP_STRINGS} stop strings (SGLang's limit), got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) and 0 <= t <= _INT32_MAX for t in self.stop_token_ids):
            raise SamplingError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r:.200}")

    def record(self) -> SamplingRecord:
        """What a group stores of these settings (a trainer checks them against its own)."""
        return SamplingRecord(float(self.temperature), float(self.top_p), self.top_k, self.max_new_tokens,
                              tuple(self.stop), tuple(self.stop_token_ids), self.skip_special_tokens)

    def params(self, max_new_tokens: int, sampling_seed: int | None = None) -> dict[str, Any]:
        """The sampling_params of one request; `sampling_seed`: the sample's
        (Group.sampling_seed), so a continued request draws from the same stream."""
        p: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            # As slime: keep stop tokens in the output so tokens and text line up.
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "skip_special_tokens": self.skip_special_tokens,
        }
        if self.stop:
            p["stop"] = self.stop
        if self.stop_token_ids:
            p["stop_token_ids"] = self.stop_token_ids
        if sampling_seed is not None:
            p["sampling_seed"] = sampling_seed
        return p
