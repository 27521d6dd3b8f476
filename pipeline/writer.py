"""The one way the trainer's side writes to Redis (DESIGN invariant 10; docs/architecture.md,
"Promises and the primitive that owns each").

The trainer acts outside Redis on what it writes: it trains the batch it was delivered,
skips what it committed, runs the weight version it recorded. Two promises hold for every
such write, and both live here, not at the call sites, so a new settle action, control
write or adapter record has them by construction (tests/test_trainer_writes.py checks that
the trainer-side modules have no other way to write):

- Fenced. Every write is a script that checks the writer's trainer session before its first
  write (`fence_error` in lua/_prelude.lua): once a newer session started, it is refused
  with SessionFenced. Reads, deliveries and commits always were; control state (pause,
  resume, weight version, settings) and the adapters' records are too. A writer without a
  session (an operator's command, a trainer before its first batch) is not fenced; its
  control writes are recorded.
- Durable. With `replicas=N`, the scripts, a mark and WAIT go in one pipeline on one
  connection, so the WAIT confirms this very write on the primary that made it. A failover
  that forgets the write fails the pipeline or the WAIT (NotReplicated), and the whole
  pipeline is sent again to the new primary: each script is idempotent to its own session
  (a commit finds its entries committed and counts them `already`, a control write sets the
  same fields, a session start finds its own id). No read-back and no parsing of what a
  script recorded: the script's own reply, from the primary the WAIT ran on, confirms it.

Retries go through the caller's Reconnect: capped exponential backoff, bounded by the
call's deadline and the outage limit.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import redis

from . import scripts
from .keys import CONSUMER_GROUP, Keys
from .retry import Durability, Reconnect

#: Recent committed ids remembered for deduplication (~16 MB); settle.lua trims to this.
COMMITTED_IDS_KEPT = 200_000

#: A fenced script's refusal, as a script call or inside a pipeline's error text.
_FENCED = re.compile(r"(?:^|caused error: )FENCED (.*)", re.DOTALL)


class SessionFenced(RuntimeError):
    """A newer trainer session took over; this one may no longer read, commit or write."""


@dataclass
class TrainerSession:
    consumer: str  # its consumer name in the results stream's consumer group: "<base>.<generation>-<id>"
    generation: int  # sessions started so far, for people; a lost write can hand it out twice
    id: str  # random, never reissued: the fence every trainer script checks

    @staticmethod
    def new_id() -> str:
        return secrets.token_hex(6)


@dataclass
class ScriptCall:
    """One call of one of the pipeline's scripts (a scripts.PipelineScript) for Writer.write."""

    script: Any
    keys: list[str]
    args: list


def settle_arguments(keys: Keys, stream: str, items: list, session: TrainerSession | None) -> tuple[list, list]:
    """lua/settle.lua's KEYS and ARGV for settling `items` (queue.Settle) of `stream`: on the
    results stream, only entries delivered to `session`; elsewhere, fenced by it if given."""
    if stream == keys.results and session is None:
        raise ValueError("settling results entries needs the trainer session they were delivered to")
    group = CONSUMER_GROUP if stream == keys.results else ""
    args: list = [group, *((session.consumer, session.id) if session else ("", "")), COMMITTED_IDS_KEPT]
    for it in items:
        args += [it.action, it.entry_id, it.group_id, it.text, it.payload, it.reason]
    names = [stream, keys.prompts, keys.payloads, keys.dead, keys.dropped, keys.committed, keys.stats, keys.admitted,
             keys.claims, keys.history, keys.trainer]
    if stream == keys.results:
        names += [keys.result(it.group_id, it.token) for it in items]
    return names, args


def fenced(exc: redis.ResponseError) -> SessionFenced | None:
    """The SessionFenced a fenced script's refusal means, or None for another error."""
    found = _FENCED.search(str(exc))
    return SessionFenced(found.group(1)) if found else None


class Writer:
    """Every write of one trainer (or of one operator's command): fenced by `session` once it
    has one, on `durability.replicas` replicas before it returns, retried through `reconnect`."""

    def __init__(self, client: redis.Redis, keys: Keys, durability: Durability | None = None,
                 reconnect: Reconnect | None = None, who: str = "operator"):
        self.client = client
        self.keys = keys
        self.durability = durability or Durability()
        self.reconnect = reconnect
        self.who = who  # named in the record of an unfenced control write
        self.session: TrainerSession | None = None  # set when this writer's trainer session starts
        self._scripts = scripts.load(client, "settle", "control", "records")

    @property
    def fence(self) -> tuple[str, str]:
        """(session id, consumer name) the scripts check; ('', who) without a session."""
        return (self.session.id, self.session.consumer) if self.session else ("", self.who)

    def write(self, what: str, calls: list[ScriptCall], deadline: float | None = None) -> list:
        """Run `calls` as one write (`what` names it in errors); their replies. Raises
        SessionFenced when a newer session took over."""
        try:
            if self.reconnect is None:
                return self._attempt(what, calls)
            return self.reconnect.call(self._attempt, what, calls, deadline=deadline)
        except redis.ResponseError as exc:
            refusal = fenced(exc)
            if refusal is not None:
                raise refusal from None
            raise

    def _attempt(self, what: str, calls: list[ScriptCall]) -> list:
        if not self.durability.replicas:
            return [c.script(keys=c.keys, args=c.args) for c in calls]
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            for c in calls:
                c.script.queue(pipe, c.keys, c.args)
            # A write of this connection whatever the scripts did (one that found its work done
            # wrote nothing): WAIT then covers every earlier write of this primary, theirs too.
            pipe.hset(self.keys.trainer, "last_write", what)
            self.durability.queue_wait(pipe)
            try:
                replies = pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                for c in calls:  # a restarted or flushed server forgot them: nothing ran, send again
                    c.script.load()
                continue
            self.durability.check(replies[-1], what)
            return replies[:len(calls)]
        raise AssertionError("unreachable")

    # -- what trainers write ---------------------------------------------------------------

    def settle(self, stream: str, items: list, deadline: float | None = None) -> tuple[int, int]:
        """Settle stream entries (lua/settle.lua; items are queue.Settle): on the results stream
        those delivered to this writer's session. Returns (settled, already committed)."""
        if not items:
            return 0, 0
        names, args = settle_arguments(self.keys, stream, items, self.session)
        what = f"{items[0].action} of {len(items)} entries" + (f" ({items[0].text})" if items[0].text else "")
        settled, already = self.write(what, [ScriptCall(self._scripts["settle"], names, args)], deadline)[0]
        return int(settled), int(already)

    def control(self, what: str, fields: dict[str, int | str] | None = None, remove: list[str] | None = None, *,
                rollback: bool = False, restart_budget: bool = False) -> int:
        """Set and remove fields of the control hash (lua/control.lua); the weight version
        recorded after it. A weight version behind the recorded one is refused (a ResponseError
        starting BEHIND) unless `rollback`."""
        session_id, who = self.fence
        args: list = [session_id, who, what, "rollback" if rollback else "forward", int(restart_budget),
                      len(fields or {})]
        for name, value in (fields or {}).items():
            args += [name, value]
        args += remove or []
        call = ScriptCall(self._scripts["control"], [self.keys.control, self.keys.trainer, self.keys.stats], args)
        return int(self.write(what, [call])[0])

    def records(self, key: str, set_fields: dict[str, str] | None = None, delete: list[str] | None = None,
                what: str = "records") -> None:
        """Set and delete fields of an adapter's records hash (lua/records.lua)."""
        if not set_fields and not delete:
            return
        session_id, who = self.fence
        args: list = [session_id, who, len(set_fields or {})]
        for name, value in (set_fields or {}).items():
            args += [name, value]
        args += delete or []
        self.write(what, [ScriptCall(self._scripts["records"], [self.keys.trainer, key], args)])
