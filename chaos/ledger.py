"""The fault campaign's training ledger: what each trainer process trained, in one file.

One JSON object per line, appended with a single write() to a file opened O_APPEND (so
the lines of two trainers running at once never mix) and fsynced before the trainer
goes on: a trainer killed at any instant leaves every record it wrote. A batch's groups
are written before its commit and the commit after it succeeded, so the ledger shows
both a batch trained and then lost (killed or fenced before the commit) and one
committed; the campaign counts a group as trained once per committed batch holding it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class LedgerEvent(StrEnum):
    START = "start"  # a trainer process started
    TRAIN = "train"  # a batch was delivered and is being trained on: batch, groups
    COMMIT = "commit"  # that batch's commit succeeded: batch
    UPDATE = "update"  # a weight update finished: version, mode, seconds
    FENCED = "fenced"  # a newer session took over; this trainer exits: reason
    FENCED_WRITE = "fenced_write"  # a weight update it tried after that (fenced_trainer): version, outcome
    DRAINED = "drained"  # every pushed group is settled; this trainer exits


@dataclass
class Record:
    event: LedgerEvent
    t: float  # time.time() when written
    pid: int
    fields: dict[str, Any] = field(default_factory=dict)


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, event: LedgerEvent, **fields: Any) -> None:
        line = json.dumps({"event": event.value, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
        os.write(self._fd, line.encode())
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def read_ledger(path: str | Path, offset: int = 0) -> tuple[list[Record], int]:
    """Records from byte `offset` on, and the offset after the last complete line (a line
    being written right now is left for the next read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    records = []
    complete = data.rfind(b"\n") + 1
    for line in data[:complete].splitlines():
        raw = json.loads(line)
        event, t, pid = LedgerEvent(raw.pop("event")), float(raw.pop("t")), int(raw.pop("pid"))
        records.append(Record(event, t, pid, raw))
    return records, offset + complete
