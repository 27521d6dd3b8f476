"""Groups for tests, and the worker's side of the queue in a line or two: register,
claim, finish, publish (as a real worker does, with a claim id per claim)."""
from __future__ import annotations

import itertools

from pipeline.checkpoints import CheckpointLog, CheckpointOutcome
from pipeline.ops.audit import AuditReport, audit
from pipeline.queue import Claim, ClaimedGroup, Place, Published, Queue
from pipeline.types import SEGMENTS_KEY, Group, Status

_claim_ids = itertools.count()


def fresh(n: int, prefix: str = "g", samples: int = 2) -> list[Group]:
    return [Group.fresh(f"{prefix}{i}", f"prompt {i}", samples, label=str(i), row=i) for i in range(n)]


def finish(group: Group, version: int | None = 0, status: Status = Status.COMPLETED, n_tokens: int = 3,
           rewards: list | None = None) -> Group:
    """As a worker leaves a group: every sample generated (n_tokens each) and scored."""
    group.prompt_ids = [1, 2]
    for i, s in enumerate(group.samples):
        s.tokens = [1, 2] + [100 + i] * n_tokens
        s.response_length = n_tokens
        s.response = "r" * n_tokens
        s.rollout_log_probs = [-0.5] * n_tokens
        s.weight_versions = [] if version is None else [str(version)]
        s.reward = float(i) if rewards is None else rewards[i]
        s.status = status
    return group


_tokens: dict[tuple[str, str, str], str] = {}  # (namespace, worker, group id) -> its claim's token


def claim(q: Queue, worker: str, n: int) -> Claim:
    """Claim as `worker`, registering it first if it is not."""
    if q.redis.zscore(q.keys.workers, worker) is None:
        q.register(worker)
    c = q.claim(worker, f"{worker}:{next(_claim_ids)}", n)
    for x in c.groups:
        _tokens[(q.keys.namespace, worker, x.group_id)] = x.token
    return c


def publish(q: Queue, worker: str, item: ClaimedGroup | Group, place: Place = Place.RESULTS,
            group: Group | None = None, error: str | None = None, keep_response_text: bool = False) -> Published:
    """Publish a claimed group (or a group `worker` claimed through `claim`) as `worker`."""
    if isinstance(item, ClaimedGroup):
        token, group = item.token, group or item.group
    else:
        token, group = _tokens.get((q.keys.namespace, worker, item.group_id), "never-claimed"), group or item
    return q.publish_group(worker, group, token, place, error, keep_response_text)


def produce(q: Queue, n: int, prefix: str = "g", worker: str = "w", version: int | None = 0,
            rewards: list | None = None, samples: int = 2) -> list[str]:
    """Push n groups, claim and finish them: n entries in the results stream."""
    q.push_groups(fresh(n, prefix, samples))
    out = []
    for c in claim(q, worker, n).groups:
        assert publish(q, worker, c, group=finish(c.group, version, rewards=rewards)) == Published.OK
        out.append(c.group_id)
    return out


def generate(group: Group, n_tokens: int, version: str = "0") -> Group:
    """As a worker leaves a group mid-generation: `n_tokens` more on every sample, each sample
    unfinished (aborted: it continues), one engine call's segment per call."""
    if not group.prompt_ids:
        group.prompt_ids = [1, 2]
    for i, s in enumerate(group.samples):
        if not s.tokens:
            s.tokens = list(group.prompt_ids)
        s.tokens += [100 + i + k for k in range(s.response_length, s.response_length + n_tokens)]
        s.rollout_log_probs = (s.rollout_log_probs or []) + [-0.25] * n_tokens
        s.response_length += n_tokens
        s.weight_versions.append(version)
        s.metadata.setdefault(SEGMENTS_KEY, []).append(n_tokens)
        s.status = Status.ABORTED
    return group


def write_checkpoint(q: Queue, worker: str, claimed: ClaimedGroup, tokens: int = 3,
                     log: CheckpointLog | None = None) -> CheckpointOutcome:
    """As a worker saves a claimed group's progress: `tokens` more on every sample, written
    through `log` (a new one: a full write) under the claim's token."""
    log = log or CheckpointLog(claimed.group_id, claimed.token, claimed.checkpoint)
    write = log.next_write(generate(claimed.group, tokens))
    [outcome] = q.checkpoint(worker, [write])
    log.settle(write, outcome)
    return outcome


def expire(q: Queue, worker: str) -> None:
    """Force a worker's lease deadline into the past (no sleeping past a lease)."""
    q.redis.zadd(q.keys.workers, {worker: 0}, xx=True)


def die_holding(q: Queue, worker: str, n: int = 1) -> list[str]:
    """`worker` claims n groups and dies holding them: its lease runs out, it is reaped.
    Returns the ids of the groups it held."""
    held = [c.group_id for c in claim(q, worker, n).groups]
    expire(q, worker)
    assert q.reap(worker) == len(held)
    return held


def prompts(q: Queue) -> list[str]:
    return [g.decode() for g in q.redis.lrange(q.keys.prompts, 0, -1)]


def inflight(q: Queue, worker: str) -> set[str]:
    return set(q.held(worker))


def assert_audit_ok(q: Queue) -> AuditReport:
    report = audit(q)
    assert report.ok, report.summary()
    return report
