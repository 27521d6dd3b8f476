"""Where every generated token went: the benchmark's waterfall.

A token counts as generated when an engine's answer brings it to the system (the
pipeline's worker or the in-memory loop). Each one then meets exactly one fate, each
counted where it happens, not inferred:

  trained      in a batch the trainer took
  stale        its group was too stale when the trainer took it (restarted from the
               prompt, or dead-lettered after too many restarts): by the group's lag in
               versions, by the sample's response length, and how many of those samples
               had been interrupted by a pause and continued
  aborted      interrupted by a pause and not continued (released with the `restart`
               or `drop` policy)
  left         still held when the run ended (queued, in flight, finished but not taken)
  crashed      lost with a worker that was reaped (presumed dead) and generated again

`check()` raises if the fates do not add up to what was generated: a token that went
somewhere no counter sees is a finding, not a rounding error. The pipeline cannot count
what a reaped worker held (its memory is gone), so when Redis counted reaps or refused
publishes, `crashed` is what the other fates leave (`crashed_inferred` says so); without
one the sum must hold exactly.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipeline.types import Group

#: Upper bounds of the response-length bins of stale tokens (the last bin is open).
LENGTH_BINS = (128, 256, 512, 1024)
FATES = ("trained", "stale", "aborted", "left", "crashed")


def length_bin(length: int) -> str:
    lower = 0
    for upper in LENGTH_BINS:
        if length < upper:
            return f"{lower}-{upper - 1}"
        lower = upper
    return f"{lower}+"


def _by_bin(item: tuple[str, int]) -> int:
    """Sort key of a (length_bin, tokens) pair: the bin's lower bound."""
    return int(item[0].split("-")[0].rstrip("+"))


def group_tokens(group: Group) -> int:
    """Generated tokens a group holds."""
    return sum(s.response_length for s in group.samples)


@dataclass
class Waterfall:
    generated: int = 0
    trained: int = 0
    stale: int = 0
    stale_by_lag: Counter = field(default_factory=Counter)  # versions behind -> tokens
    stale_by_length: Counter = field(default_factory=Counter)  # length_bin(sample response) -> tokens
    stale_interrupted: int = 0  # of `stale`: samples a pause had interrupted and that were continued
    aborted: int = 0
    left: int = 0
    crashed: int = 0
    crashed_inferred: bool = False

    def discard_stale(self, group: Group, lag: int) -> None:
        """`group` is thrown away `lag` versions behind: its tokens, by lag and length."""
        for sample in group.samples:
            n = sample.response_length
            if not n:
                continue
            self.stale += n
            self.stale_by_lag[lag] += n
            self.stale_by_length[length_bin(n)] += n
            if len(sample.weight_versions) > 1:  # several engine calls: a pause split it
                self.stale_interrupted += n

    @property
    def accounted(self) -> int:
        return sum(getattr(self, fate) for fate in FATES)

    def infer_crashed(self) -> None:
        """Workers were reaped: what no other fate holds was lost with them."""
        self.crashed = self.generated - self.accounted + self.crashed
        self.crashed_inferred = True

    def check(self, what: str) -> None:
        if self.accounted != self.generated or min(getattr(self, f) for f in FATES) < 0:
            fates = ", ".join(f"{f} {getattr(self, f)}" for f in FATES)
            raise AssertionError(f"{what}: the generated tokens do not add up: generated {self.generated}, {fates} "
                                 f"(unaccounted {self.generated - self.accounted})")

    def as_dict(self) -> dict:
        return {"generated": self.generated, **{f: getattr(self, f) for f in FATES},
                "stale_by_lag": {str(k): v for k, v in sorted(self.stale_by_lag.items())},
                "stale_by_length": dict(sorted(self.stale_by_length.items(), key=_by_bin)),
                "stale_interrupted": self.stale_interrupted, "crashed_inferred": self.crashed_inferred}


def add_waterfalls(waterfalls: list[dict]) -> dict:
    """The sum of several as_dict() results (the seeds of a row), with each fate's share."""
    total: dict = {"generated": 0, **{f: 0 for f in FATES}, "stale_by_lag": Counter(), "stale_by_length": Counter(),
                   "stale_interrupted": 0, "crashed_inferred": False}
    for w in waterfalls:
        for key in ("generated", *FATES, "stale_interrupted"):
            total[key] += w[key]
        total["stale_by_lag"].update(w["stale_by_lag"])
        total["stale_by_length"].update(w["stale_by_length"])
        total["crashed_inferred"] |= w["crashed_inferred"]
    total["stale_by_lag"] = dict(sorted(total["stale_by_lag"].items(), key=lambda kv: int(kv[0])))
    total["stale_by_length"] = dict(sorted(total["stale_by_length"].items(), key=_by_bin))
    total["shares"] = {f: round(total[f] / total["generated"], 4) if total["generated"] else 0.0 for f in FATES}
    return total
