"""Redis key names of one pipeline namespace.

Every key shares the hash tag `{namespace}` so all of a pipeline's keys live in one
Redis Cluster slot and every multi-key script works there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

#: fullmatch, never `$`: that also matches before a final newline ("exp1\n").
_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
#: A name a process goes by in Redis (a trainer's consumer name): part of its session's
#: name and of every group's history line, whose fields are separated by spaces.
_NAME = re.compile(r"[A-Za-z0-9._\-:@#]{1,64}")
NAME_CHARACTERS = "letters, digits and . _ - : @ #"

# The trainer's consumer group on the results stream.
CONSUMER_GROUP = "trainer"
# The companion namespace of evaluation passes (pipeline/trainers/eval.py): `<ns>.eval`.
EVAL_SUFFIX = ".eval"


class CompanionNamespace(str):
    """A namespace made by `eval_namespace`: the only way a name ending in EVAL_SUFFIX
    is valid. A namespace a user names `exp1.eval` would be `exp1`'s eval companion,
    whose workers and ACL users would take its groups."""


def eval_namespace(namespace: str) -> CompanionNamespace:
    return CompanionNamespace(check_namespace(namespace) + EVAL_SUFFIX)


def check_namespace(namespace: str) -> str:
    base = namespace.removesuffix(EVAL_SUFFIX) if isinstance(namespace, CompanionNamespace) else namespace
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(base):
        raise ValueError(
            f"namespace {namespace!r} is invalid: use 1-64 letters, digits, '_', '.' or '-'"
        )
    if namespace.endswith(EVAL_SUFFIX) and not isinstance(namespace, CompanionNamespace):
        raise ValueError(f"namespace {namespace!r} is invalid: a name ending in {EVAL_SUFFIX!r} is the evaluation "
                         f"companion of namespace {namespace.removesuffix(EVAL_SUFFIX)!r} (its workers serve both)")
    return namespace


def check_name(what: str, name: str) -> str:
    """`name`, or ValueError naming what is wrong with it and what is allowed."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r} is invalid: use 1-64 characters, {NAME_CHARACTERS} (it is part of the "
                         f"names Redis records and splits on spaces)")
    return name


@dataclass(frozen=True)
class Keys:
    namespace: str

    def __post_init__(self) -> None:
        check_namespace(self.namespace)

    def _key(self, name: str) -> str:
        return f"{{{self.namespace}}}:{name}"

    @property
    def prompts(self) -> str:  # LIST of group ids; head = next to claim
        return self._key("prompts")

    @property
    def payloads(self) -> str:  # HASH group id -> encoded group, for queued and in-flight groups
        return self._key("payloads")

    @property
    def checkpoints(self) -> str:  # HASH group id -> the header of its in-flight checkpoint (lua/_prelude.lua),
        # for queued and in-flight groups only: it goes with the payload
        return self._key("checkpoints")

    @property
    def checkpoint_records(self) -> str:  # HASH "<group id>\n<k>" -> the k-th record of its checkpoint (codec)
        return self._key("checkpoint_records")

    @property
    def admitted(self) -> str:  # HASH group id -> weight version at first claim, until settled
        return self._key("admitted")

    @property
    def workers(self) -> str:  # ZSET registered worker -> lease deadline (Redis server ms)
        return self._key("workers")

    @property
    def worker_info(self) -> str:  # HASH worker -> JSON of its engines, state, capacity
        return self._key("worker_info")

    def inflight(self, worker: str) -> str:  # HASH group id -> claim token, for what one worker holds
        return self._key(f"inflight:{worker}")

    @property
    def holders(self) -> str:  # SET of workers that claimed and were not reaped since: their in-flight hashes,
        # found without SCAN (claim adds, reap removes)
        return self._key("holders")

    @property
    def beats(self) -> str:  # HASH the lease clock: seen_ms, server, clock_back_ms (lua/_prelude.lua lease_clock)
        return self._key("beats")

    @property
    def last_claim(self) -> str:  # HASH worker -> "<claim id> <gid> <gid>...": its last claim, for retries
        return self._key("last_claim")

    @property
    def isolated(self) -> str:  # HASH worker -> the suspect group it runs alone
        return self._key("isolated")

    @property
    def claims(self) -> str:  # HASH group id -> claims since it last finished (reaps count, hand-backs not)
        return self._key("claims")

    @property
    def history(self) -> str:  # HASH group id -> its recent events, one "ms event who detail" line each
        return self._key("history")

    @property
    def reaped(self) -> str:  # LIST of JSON records of recently reaped / departed workers, newest first
        return self._key("reaped")

    @property
    def slime_rollouts(self) -> str:  # HASH entry id -> "<run> <slime rollout id>" it was read in, until committed;
        # and "checkpoint <rollout id>" -> the run that saved that checkpoint
        return self._key("slime_rollouts")

    @property
    def abandoned(self) -> str:  # HASH group id -> the version the queue's clock went back to while it was
        # admitted (pipeline/rewind.py), until the Consumer judges its next delivery
        return self._key("abandoned")

    @property
    def trainer(self) -> str:  # HASH generation, session, info: the current trainer session
        return self._key("trainer")

    @property
    def inflight_pattern(self) -> str:
        return self._key("inflight:*")

    @property
    def results(self) -> str:  # STREAM of finished group ids (payloads in result keys), for the trainer
        return self._key("results")

    def result(self, group_id: str, token: str) -> str:
        """STRING: the encoded group of one results entry. Keyed by the claim token too,
        so settling one copy of a group can never delete another copy's payload."""
        return self._key(f"result:{group_id}:{token}")

    @property
    def result_pattern(self) -> str:
        return self._key("result:*")

    def staged(self, group_id: str, token: str) -> str:  # STRING: a result on its way in (expires)
        return self._key(f"staged:{group_id}:{token}")

    @property
    def requeue(self) -> str:  # STREAM of aborted groups with their partial output
        return self._key("requeue")

    @property
    def dead(self) -> str:  # STREAM of dead letters: group, error
        return self._key("dead")

    @property
    def dropped(self) -> str:  # STREAM log of groups dropped on purpose (filter, staleness)
        return self._key("dropped")

    @property
    def committed(self) -> str:  # ZSET group id -> commit time, recent ids for deduplication
        return self._key("committed")

    @property
    def control(self) -> str:  # HASH paused, weight_version, max_staleness, batch_size, max_ready, admitted
        return self._key("control")

    @property
    def stats(self) -> str:  # HASH counters: pushed, committed, dropped, dead, ...
        return self._key("stats")

    @property
    def dataset(self) -> str:  # HASH "<dataset>:<epoch>" -> next position to push
        return self._key("dataset")

    @property
    def events(self) -> str:  # pub/sub channel: control changes (pause, resume)
        return self._key("events")

    def all_fixed(self) -> list[str]:
        return [
            self.prompts, self.payloads, self.admitted, self.workers, self.worker_info, self.last_claim, self.isolated,
            self.claims, self.history, self.reaped, self.trainer, self.results, self.requeue, self.dead,
            self.dropped, self.committed, self.control, self.stats, self.dataset, self.holders, self.beats,
            self.checkpoints, self.checkpoint_records,
            self.abandoned,
        ]
