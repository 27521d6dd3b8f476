"""Whether a group delivered to the trainer may be trained on as it is: the Consumer's one
judge (`Judge.judge`), for every way a group reaches a session (read, taken over from an
earlier session, handed back, held across a version change), and the batch metrics it counts.

A group admitted in a timeline the trainer left (pipeline/rewind.py), refused by the
trainer's own check (`GroupCheck`: sampled with other settings, on an engine it does not
update), or too stale goes back to its prompt to be generated again, once. Refusals are the
trainer's configuration, not the group's: the Consumer raises `GroupsRefused` once every
refused group in the stream went back.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from .codec import encode_group
from .control import ControlState
from .queue import Settle, StreamEntry
from .rewind import Mark, abandoned
from .types import DeadReason, Group

log = logging.getLogger("pipeline.consumer")  # the trainer's log: its lines read as they always did


@dataclass(frozen=True)
class Refusal:
    """A delivered group a trainer cannot train on as it is: it goes back to be generated
    again (by workers set up right)."""

    kind: str  # short, for the metrics: "sampling", "foreign_engine"
    reason: str  # one line: the group, what is wrong with it, what to change


#: A trainer's own test of the groups delivered to it: a Refusal or None for each.
GroupCheck = Callable[[list[Group]], list["Refusal | None"]]


@dataclass
class BatchMetrics:
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> count
    restarted: int = 0  # too stale, sent back to the prompt list
    dead: int = 0  # malformed, too stale too often, filter raised, delivered too often
    duplicates: int = 0  # second copies of a group, discarded
    ahead: int = 0  # groups with tokens from a weight version newer than the trainer's
    kept_insufficient: int = 0  # rejected by the filter, kept because the batch could not fill
    abandoned: int = 0  # admitted after the version the trainer's clock went back to: regenerated
    refused: dict[str, int] = field(default_factory=dict)  # refusal kind -> groups regenerated
    wait_s: float = 0.0
    staleness: dict[int, int] = field(default_factory=dict)  # lag in versions -> groups

    @property
    def drop_ratio(self) -> float:
        dropped = sum(self.dropped.values())
        return dropped / (dropped + self.kept) if dropped + self.kept else 0.0


class GroupsRefused(ValueError):
    """The trainer's check refused delivered groups. Raised once every refused group left
    in the results stream went back to the prompt list; the groups read with them stay
    with the session, for its next batch."""

    def __init__(self, refusals: list[Refusal], metrics: BatchMetrics):
        more = f" (and {len(refusals) - 1} more groups)" if len(refusals) > 1 else ""
        super().__init__(f"{refusals[0].reason}{more}; those groups went back to the prompt list")
        self.refusals = refusals
        self.metrics = metrics


class Judge:
    """The Consumer's judge of delivered groups; `refused` collects the refusals since the
    last GroupsRefused."""

    def __init__(self, stale_policy: str, max_restarts: int, check: GroupCheck | None):
        if stale_policy not in ("restart", "drop"):
            raise ValueError(f"unknown stale_policy {stale_policy!r}: use restart or drop")
        self.stale_policy = stale_policy
        self.max_restarts = max_restarts
        self.check = check
        self.refused: list[Refusal] = []

    def refusals(self, groups: list[Group]) -> list[Refusal | None]:
        return self.check(groups) if self.check is not None and groups else [None] * len(groups)

    def judge(self, entry: StreamEntry, group: Group, mark: Mark | None, refusal: Refusal | None,
              control: ControlState, metrics: BatchMetrics) -> Settle | None:
        """None: `group` may be trained on as it is. Else how its entry is settled:
        admitted in a timeline the trainer left (`mark`: pipeline/rewind.py), refused by the
        trainer's check (`refusal`), or too stale: generated again from its prompt (a stale
        one up to max_restarts, then dead-lettered; dropped with stale_policy "drop")."""
        if abandoned(group, mark, control):
            log.info("group %s: admitted at version %s, after the %s the trainer went back to; generating it "
                     "again", group.group_id, group.admitted_version,
                     mark.version if mark is not None else control.weight_version)
            metrics.abandoned += 1
            return self.restart(entry, group, "admitted in a timeline the trainer left", stale=False)
        if refusal is not None:
            log.info("group %s: refused (%s); generating it again", group.group_id, refusal.reason)
            self.refused.append(refusal)
            metrics.refused[refusal.kind] = metrics.refused.get(refusal.kind, 0) + 1
            return self.restart(entry, group, f"refused by the trainer: {refusal.kind}", stale=False)
        lag = control.lag(group)
        if lag < 0:
            metrics.ahead += 1
        if control.max_staleness is not None and lag > control.max_staleness:
            return self._stale(entry, group, lag, control, metrics)
        return None

    @staticmethod
    def report(abandoned: int, ahead: int, control: ControlState) -> None:
        """One line for what one screening found across its groups."""
        if abandoned:
            log.warning("%d groups were admitted after the version the trainer went back to (%d: resumed from an "
                        "earlier checkpoint, or a new run): generated by weights it no longer has, they are "
                        "generated again", abandoned, control.weight_version)
        if ahead:
            log.warning("%d groups carry weight versions newer than the trainer's %d: bump the queue's version "
                        "with every weight update (Controller.resume(weight_version=...))", ahead,
                        control.weight_version)

    def _stale(self, entry: StreamEntry, group: Group, lag: int, control: ControlState,
               metrics: BatchMetrics) -> Settle:
        reason = f"stale: {lag} versions behind (max {control.max_staleness})"
        if self.stale_policy == "drop":
            metrics.dropped["stale"] = metrics.dropped.get("stale", 0) + 1
            return Settle("drop", entry.entry_id, group.group_id, reason, token=entry.token)
        if group.restarts >= self.max_restarts:
            log.error("group %s: %s after %d restarts; dead-lettering it", group.group_id, reason, group.restarts)
            metrics.dead += 1
            group.error = f"{reason}; restarted {group.restarts} times"
            return Settle("dead", entry.entry_id, group.group_id, group.error, encode_group(group), entry.token,
                          DeadReason.STALE)
        log.info("group %s: %s; restarting it from its prompt", group.group_id, reason)
        metrics.restarted += 1
        return self.restart(entry, group, "stale restart")

    @staticmethod
    def restart(entry: StreamEntry, group: Group, why: str, stale: bool = True) -> Settle:
        """Back to the prompt list as pushed, admitted anew when claimed (lua/settle.lua
        `regenerate`): paced by the staleness budget like any admission and aged from then,
        so a backlog sent back at once is not stamped with one version and left to go stale
        again. Only staleness counts toward max_restarts: the other reasons (a timeline
        left, a refusal) are not the group's doing."""
        group.reset()
        if stale:
            group.restarts += 1
        group.admitted_version = None
        return Settle("regenerate", entry.entry_id, group.group_id, why, encode_group(group), entry.token)
