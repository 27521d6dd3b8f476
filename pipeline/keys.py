"""Redis key names of one pipeline namespace.

Every key shares the hash tag `{namespace}` so all of a pipeline's keys live in one
Redis Cluster slot and every multi-key script works there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_NAMESPACE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

# The trainer's consumer group on the results stream.
CONSUMER_GROUP = "trainer"


def check_namespace(namespace: str) -> str:
    if not _NAMESPACE.match(namespace):
        raise ValueError(
            f"namespace {namespace!r} is invalid: use 1-64 letters, digits, '_', '.' or '-'"
        )
    return namespace


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
    def admitted(self) -> str:  # HASH group id -> weight version at first claim, until settled
        return self._key("admitted")

    @property
    def workers(self) -> str:  # ZSET worker -> last heartbeat (Redis server ms)
        return self._key("workers")

    @property
    def worker_info(self) -> str:  # HASH worker -> JSON of its engines, state, capacity
        return self._key("worker_info")

    def inflight(self, worker: str) -> str:  # SET of group ids one worker holds
        return self._key(f"inflight:{worker}")

    @property
    def inflight_pattern(self) -> str:
        return self._key("inflight:*")

    @property
    def results(self) -> str:  # STREAM of finished group ids (payloads in result keys), for the trainer
        return self._key("results")

    def result(self, group_id: str) -> str:  # STRING: the encoded group of one results entry
        return self._key(f"result:{group_id}")

    @property
    def result_pattern(self) -> str:
        return self._key("result:*")

    def staged(self, worker: str, group_id: str) -> str:  # STRING: a result on its way in (expires)
        return self._key(f"staged:{worker}:{group_id}")

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
            self.prompts, self.payloads, self.admitted, self.workers, self.worker_info,
            self.results, self.requeue, self.dead, self.dropped, self.committed,
            self.control, self.stats, self.dataset,
        ]
