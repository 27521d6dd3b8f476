"""Dead letters: inspect them with their errors, send them back, or discard them.

A dead letter is an entry of the `dead` stream: the group id, the encoded group as
it was when it failed, and the error. Retrying moves it to the head of the prompt
list (settle action `prompt`) with its attempt and restart counts reset and its
error cleared; dropping discards it (settle action `discard`, counted for the
audit). Both go through `Queue.settle`, so an entry settled by someone else
meanwhile is skipped, never duplicated.

A payload that does not decode cannot be retried (there is no group to rebuild).
A bad dataset row never was a generation: retrying it re-reads the row from the
file the dataset was pushed from (see `producer.reread_rows`), so fix the row in
the file, then retry; a row still bad there is refused, naming the line and why.

Entries are read here rather than through `Queue.read_stream`, decoding their text
fields leniently: a foreign entry with a non-UTF-8 group id is listed (and can be
dropped) instead of making every dead-letter command fail.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pipeline.codec import DecodeError, encode_group
from pipeline.producer import reread_rows
from pipeline.queue import Queue, Settle, StreamEntry
from pipeline.types import DeadReason, Group

_ENTRY_ID = re.compile(r"^\d+-\d+$")


class DeadLetterError(ValueError):
    """An id that is not a dead letter, or a dead letter that cannot be retried."""


@dataclass
class DeadLetter:
    entry_id: str
    group_id: str
    error: str
    age_s: float
    reason: str | None = None  # the short category, when the writer gave one (max_claims, missing_label, ...)
    group: Group | None = None
    decode_error: str | None = None
    data: bytes = b""

    @property
    def not_retriable(self) -> str | None:
        """Why this dead letter can never be retried, or None when it can."""
        if self.group is None:
            return f"its payload does not decode ({self.decode_error})"
        if self.group.group_id != self.group_id:
            return f"its payload is for another group ({self.group.group_id!r})"
        return None

    @property
    def category(self) -> str:
        """Its reason (DeadReason), or for a letter written without one, what it is: a bad
        row, an undecodable payload, else "other"."""
        if self.reason:
            return self.reason
        if self.group is None:
            return DeadReason.MALFORMED.value
        return DeadReason.BAD_ROW.value if self.bad_row else "other"

    @property
    def fails_again(self) -> str | None:
        """Why a retry would be dead-lettered again at once (nothing changed what failed it),
        or None. `dead list/show` then say not retriable, `dead retry` warns."""
        g = self.group
        if g is not None and self.reason == DeadReason.MISSING_LABEL and all(s.label is None for s in g.samples):
            return ("its samples still have no label: unless the workers now run a reward that needs none, it is "
                    "dead-lettered again at once (give the row a label in the file and push it again)")
        return None

    @property
    def bad_row(self) -> bool:
        """A dataset row that never was a generation: retrying it re-reads the row."""
        g = self.group
        return g is not None and (not g.samples or not any(s.prompt for s in g.samples))

    def describe(self) -> str:
        return f"dead letter {self.entry_id} (group {self.group_id})"

    def summary(self) -> dict[str, Any]:
        """`rollout dead list --json`: the same keys for every dead letter; what does not
        apply (the group's fields when the payload does not decode) is None."""
        g = self.group
        return {
            "entry_id": self.entry_id,
            "group_id": self.group_id,
            "error": self.error,
            "reason": self.reason,
            "age_s": round(self.age_s, 3),
            "retriable": self.not_retriable is None and self.fails_again is None,
            "not_retriable_because": self.not_retriable or self.fails_again,
            "bad_row": self.bad_row,
            "decode_error": self.decode_error,
            "payload_bytes": len(self.data),
            "dataset": g.dataset if g else None,
            "epoch": g.epoch if g else None,
            "row": g.row if g else None,
            "attempts": g.attempts if g else None,
            "restarts": g.restarts if g else None,
            "worker": g.worker if g else None,
            "n_samples": g.n_samples if g else None,
            "statuses": [s.status.value for s in g.samples] if g else None,
        }

    def details(self, history: list[tuple[int, str, str, str]], now_ms: int) -> dict[str, Any]:
        """`rollout dead show --json`: the summary, the group in full and its history
        (`history` as Queue.history gives it)."""
        d = self.summary()
        g = self.group
        first = g.samples[0] if g and g.samples else None
        raw = first.metadata.get("raw") if first else None
        d.update(
            payload_head=self.data[:64].hex() if g is None else None,
            prompt=first.prompt if first else None,
            label=first.label if first else None,
            admitted_version=g.admitted_version if g else None,
            created_at=g.created_at if g else None,
            claimed_at=g.claimed_at if g else None,
            finished_at=g.finished_at if g else None,
            raw_row=raw or None,
            samples=[{
                "index": s.index, "status": s.status.value, "response_length": s.response_length,
                "reward": s.reward, "weight_versions": s.weight_versions,
                "response": s.response[:200],
            } for s in g.samples] if g else None,
            history=[{"at_ms": ms, "age_s": round(max(0, now_ms - ms) / 1000, 3), "event": event, "who": who,
                      "detail": detail} for ms, event, who, detail in history],
        )
        return d


def _letter(entry: StreamEntry, now_s: float) -> DeadLetter:
    ms = int(entry.entry_id.split("-", 1)[0])
    letter = DeadLetter(entry_id=entry.entry_id, group_id=entry.group_id, error=entry.error or "",
                        age_s=max(0.0, now_s - ms / 1000), reason=entry.reason, data=entry.data)
    try:
        letter.group = entry.decode()
        if not letter.error and letter.group.error:
            letter.error = letter.group.error
    except DecodeError as exc:
        letter.decode_error = str(exc)
    return letter


@dataclass
class DeadSummary:
    """How many groups were dead-lettered and why: letters by category, most first, with
    the first error of each (a demo's Redis is gone when its reader looks)."""

    total: int
    by_reason: dict[str, int]
    example: dict[str, str]  # category -> the error of its oldest letter

    def lines(self) -> list[str]:
        if not self.total:
            return ["dead letters: none"]
        reasons = ", ".join(f"{reason} {n}" for reason, n in self.by_reason.items())
        return [f"dead letters: {self.total} ({reasons})"] + [
            f"  {reason}: {self.example[reason][:300]}" for reason in self.by_reason]

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "by_reason": self.by_reason, "example": self.example}


def summarize(letters: list[DeadLetter]) -> DeadSummary:
    from collections import Counter

    counts = Counter(l.category for l in letters)
    example: dict[str, str] = {}
    for l in letters:
        example.setdefault(l.category, l.error or "-")
    return DeadSummary(len(letters), dict(counts.most_common()), example)


def count(queue: Queue) -> int:
    return int(queue.redis.xlen(queue.keys.dead))


def list_dead(queue: Queue, limit: int | None = None) -> list[DeadLetter]:
    """Dead letters, oldest first (all of them when `limit` is None)."""
    now = queue.now_ms() / 1000
    out: list[DeadLetter] = []
    for entry in queue.iter_stream(queue.keys.dead):
        out.append(_letter(entry, now))
        if limit is not None and len(out) >= limit:
            break
    return out


def find(queue: Queue, ids: list[str]) -> tuple[list[DeadLetter], list[str]]:
    """Dead letters by stream entry id (`1712345678901-0`) or group id. Returns the
    found ones (in the order asked, each once) and the ids not found."""
    now = queue.now_ms() / 1000
    found: dict[str, DeadLetter] = {}
    missing: list[str] = []
    by_group: list[str] = []
    for ident in ids:
        if _ENTRY_ID.match(ident):
            rows = queue.read_stream(queue.keys.dead, 1, ident)
            if rows and rows[0].entry_id == ident:
                found.setdefault(ident, _letter(rows[0], now))
                continue
        by_group.append(ident)
    if by_group:
        wanted = set(by_group)
        hits: dict[str, list[DeadLetter]] = {}
        for entry in queue.iter_stream(queue.keys.dead):
            if entry.group_id in wanted:
                hits.setdefault(entry.group_id, []).append(_letter(entry, now))
        for gid in by_group:
            if gid in hits:
                for letter in hits[gid]:
                    found.setdefault(letter.entry_id, letter)
            else:
                missing.append(gid)
    return list(found.values()), missing


@dataclass
class RetryResult:
    done: list[DeadLetter] = field(default_factory=list)
    skipped: list[tuple[DeadLetter, str]] = field(default_factory=list)  # (letter, why not)
    # Retried, but nothing changed what failed them: (letter, why it may fail the same way).
    doomed: list[tuple[DeadLetter, str]] = field(default_factory=list)
    settled: int = 0  # entries actually moved (others were settled by someone else meanwhile)


def _select(queue: Queue, ids: list[str] | None, all_: bool) -> list[DeadLetter]:
    if all_:
        if ids:
            raise DeadLetterError("give dead-letter ids or --all, not both")
        return list_dead(queue)
    if not ids:
        raise DeadLetterError("give one or more dead-letter ids (entry ids or group ids), or --all")
    letters, missing = find(queue, ids)
    if missing:
        raise DeadLetterError(f"not in the dead-letter stream of {queue.keys.namespace!r}: {', '.join(missing)}")
    return letters


def retry(queue: Queue, ids: list[str] | None = None, all_: bool = False, restart: bool = False) -> RetryResult:
    """Send dead letters back to the head of the prompt list, attempts and restarts
    reset, error cleared (`restart`: also forget any generated output). A bad dataset
    row goes back as the row its file holds now, if that row is good.

    With ids, every one must exist and be retriable, or nothing is done and
    DeadLetterError names the culprits. With `all_`, the ones that cannot be
    retried are skipped and reported in the result."""
    letters = _select(queue, ids, all_)
    result = RetryResult()
    bad: list[tuple[DeadLetter, str]] = []
    groups: dict[str, Group] = {}  # entry id -> the group to send back
    rows = [l for l in letters if l.not_retriable is None and l.bad_row]
    for letter, reread in zip(rows, reread_rows(queue, [l.group for l in rows])):
        if isinstance(reread, str):
            bad.append((letter, f"it is a bad dataset row and {reread}"))
        else:
            groups[letter.entry_id] = reread
    for letter in letters:
        why = letter.not_retriable
        if why is not None:
            bad.append((letter, why))
        elif not letter.bad_row:
            groups[letter.entry_id] = letter.group
    if bad and not all_:
        raise DeadLetterError("; ".join(f"{l.describe()} cannot be retried: {why}" for l, why in bad))
    result.skipped = bad
    items = []
    for letter in letters:
        group = groups.get(letter.entry_id)
        if group is None:
            continue
        result.done.append(letter)
        if letter.fails_again:
            result.doomed.append((letter, letter.fails_again))
        if restart:
            group.reset()
        group.attempts = 0
        group.restarts = 0
        group.error = None
        group.worker = None
        items.append(Settle("prompt", letter.entry_id, letter.group_id, "dead retry", encode_group(group)))
    # Each goes to the head of the prompt list: reversed, so the oldest ends up first.
    result.settled = queue.settle(queue.keys.dead, items[::-1])[0]
    return result


def drop(queue: Queue, ids: list[str] | None = None, all_: bool = False) -> tuple[list[DeadLetter], int]:
    """Discard dead letters (counted as `discarded` by the audit). Returns the letters
    and how many entries were actually removed."""
    letters = _select(queue, ids, all_)
    items = [Settle("discard", l.entry_id, l.group_id) for l in letters]
    return letters, queue.settle(queue.keys.dead, items)[0]
