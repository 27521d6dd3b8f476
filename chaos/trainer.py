"""The fault campaign's trainer, a process of its own so that the campaign can kill it:
`python -m chaos.trainer --ledger PATH --engine-url ROUTER ...`, the Redis URL
in ROLLOUT_REDIS_URL (never in argv).

Every step: `next_batch(B)` → the batch's group ids to the ledger (fsynced) → a
simulated training step → `commit` → the commit to the ledger → a weight update through
`Controller`, cycling the pause modes abort, retract, in_place by version. On start it
first pushes the current version's weights to the engines, as a restarted trainer
loads its checkpoint: that also resumes a pipeline a killed trainer left paused.

Redis is behind Sentinel: the consumer waits for the replica (`--replicas`, 1 by default)
before it hands a batch out and before a commit returns, so a failover to a replica that
missed the last writes cannot make it train a batch twice.

A newer session fencing this one (a rolling restart) ends it cleanly: `fenced` in the
ledger, exit code 0. If the campaign left a file `fenced-loop-<pid>` in `--fenced-loop-dir`
(the fenced_trainer fault), it first runs its weight-update loop FENCED_UPDATES more times
with the versions it would have used, as a trainer whose update loop outlives its session
does, recording each in the ledger (`fenced_write`: refused or accepted). Once the drain file exists it takes what is left in smaller
batches and exits with `drained` when every pushed group is settled.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from pipeline.connection import STARTUP_WAIT_S, connect
from pipeline.consumer import BatchTimeout, Consumer, SessionFenced
from pipeline.control import read_control
from pipeline.controller import Controller, WeightUpdateError
from pipeline.queue import Queue
from pipeline.retry import RedisUnavailable, is_transient
from pipeline.types import PauseMode

from workers.engine_errors import EngineError
from workers.engine_set import EngineSet
from .ledger import Ledger, LedgerEvent
from local.processes import REDIS_URL_ENV

log = logging.getLogger("chaos.trainer")

#: The trainer's consumer name; sessions are `chaos-trainer.<generation>`.
CONSUMER = "chaos-trainer"
#: Pause modes by weight version: every mode comes up every three steps.
PAUSE_MODES = (PauseMode.ABORT, PauseMode.RETRACT, PauseMode.IN_PLACE)
#: A next_batch call gives up after this long and the loop looks at the drain file again.
BATCH_WAIT_S = 5.0
#: A weight update failing this long (an engine that never comes back) ends the trainer
#: with exit code 1; the campaign counts it as an unexpected exit.
UPDATE_DEADLINE_S = 120.0
CONTROL_TIMEOUT_S = 30.0
#: One WAIT for the replica blocks this long at most; then it is asked again (of the
#: primary Sentinel names then).
REPLICA_TIMEOUT_S = 1.0
#: Weight updates a fenced trainer still tries when the campaign asks it to (fenced_trainer).
FENCED_UPDATES = 3


@dataclass
class TrainerSettings:
    namespace: str
    engine_url: str  # the router: control calls reach every engine behind it
    ledger: Path
    batch_size: int
    step_s: float  # the simulated training step
    drain_file: Path
    replicas: int = 1  # WAIT for this many replicas before handing a batch out and before a commit returns
    filter: str | None = "dapo"  # DAPO's dynamic sampling: drops groups whose rewards are all equal
    fenced_loop_dir: Path | None = None  # where the fenced_trainer fault leaves fenced-loop-<pid>


def outstanding(queue: Queue) -> int:
    """Pushed groups not settled yet (in the prompt list, in flight, or in a stream),
    from the counters, read atomically."""
    k = queue.keys
    pipe = queue.redis.pipeline(transaction=True)
    pipe.hmget(k.stats, "pushed", "committed", "dropped", "discarded")
    pipe.xlen(k.dead)
    (pushed, committed, dropped, discarded), dead = pipe.execute()
    return int(pushed or 0) - int(committed or 0) - int(dropped or 0) - int(discarded or 0) - dead


class ChaosTrainer:
    def __init__(self, settings: TrainerSettings, redis_url: str):
        self.settings = settings
        client = connect(redis_url, wait_s=STARTUP_WAIT_S)  # started while Redis restarts: waits
        # replicas=1: a batch is handed out, and a commit returns, only once the replica has
        # it, so a failover to a replica that missed the last writes cannot make it train a
        # batch twice (docs/chaos.md, failover).
        self.consumer = Consumer(client, settings.namespace, consumer=CONSUMER, filter=settings.filter,
                                 replicas=settings.replicas, replica_timeout_s=REPLICA_TIMEOUT_S)
        self.queue = self.consumer.queue
        # The same for weight updates (a resume a failover forgot would leave the pipeline
        # paused, with no next update to resume it while the trainer waits for a batch), and
        # fenced by this trainer's session: once a newer trainer took over, this one can
        # neither pause the pipeline nor set its version back.
        self.controller = Controller(self.queue, EngineSet([settings.engine_url], timeout_s=CONTROL_TIMEOUT_S),
                                     writer=self.consumer.writer)
        self.ledger = Ledger(settings.ledger)
        self.loop = asyncio.new_event_loop()
        self.version = 0  # the last weight version this trainer recorded

    def run(self) -> int:
        self.ledger.append(LedgerEvent.START)
        self.update_weights(bump=False)
        try:
            while True:
                n = self.settings.batch_size
                if self.settings.drain_file.exists():
                    left = self.consumer.reconnect.call(outstanding, self.queue)
                    if left <= 0:
                        self.ledger.append(LedgerEvent.DRAINED)
                        log.info("drained: every pushed group is settled")
                        return 0
                    n = min(n, left)
                try:
                    batch = self.consumer.next_batch(n, timeout=BATCH_WAIT_S)
                except (BatchTimeout, RedisUnavailable) as exc:
                    log.info("no batch yet: %s", exc)
                    continue
                self.ledger.append(LedgerEvent.TRAIN, batch=batch.batch_id, groups=[g.group_id for g in batch.groups])
                time.sleep(self.settings.step_s)
                self.consumer.commit(batch)
                self.ledger.append(LedgerEvent.COMMIT, batch=batch.batch_id)
                self.update_weights(bump=True)
        except SessionFenced as exc:
            if self.settings.fenced_loop_dir and (self.settings.fenced_loop_dir / f"fenced-loop-{os.getpid()}").exists():
                self.fenced_updates()
            self.ledger.append(LedgerEvent.FENCED, reason=str(exc))
            log.warning("fenced: %s; exiting", exc)
            return 0
        finally:
            self.loop.run_until_complete(self.controller.engines.close())

    def update_weights(self, bump: bool) -> None:
        """pause → load → resume, retried until it succeeds (an engine restarting, Redis
        restarting); the next version when `bump`, else the current one again."""
        deadline = time.monotonic() + UPDATE_DEADLINE_S
        delay = 0.1
        while True:
            try:
                version = read_control(self.queue.redis, self.queue.keys).weight_version + int(bump)
                mode = PAUSE_MODES[version % len(PAUSE_MODES)]
                started = time.monotonic()
                self.loop.run_until_complete(self.controller.update_weights_from_disk(
                    f"/checkpoints/chaos/step-{version}", version, mode))
                self.ledger.append(LedgerEvent.UPDATE, version=version, mode=mode.value,
                                   seconds=round(time.monotonic() - started, 4))
                self.version = version
                return
            except (WeightUpdateError, EngineError, TimeoutError, redis.RedisError) as exc:
                if isinstance(exc, redis.RedisError) and not is_transient(exc):
                    raise
                if time.monotonic() + delay > deadline:
                    raise RuntimeError(f"weight update failing for {UPDATE_DEADLINE_S:g}s: {exc}") from exc
                log.warning("weight update failed (%s: %s); retrying in %.1fs", type(exc).__name__, exc, delay)
                time.sleep(delay)
                delay = min(2.0, delay * 2)


    def fenced_updates(self) -> None:
        """A newer trainer took over, and this one's update loop runs on (fenced_trainer):
        the next versions by its own count, each recorded as refused (SessionFenced: its
        control writes are fenced by its session) or accepted."""
        for version in range(self.version + 1, self.version + 1 + FENCED_UPDATES):
            try:
                self.loop.run_until_complete(self.controller.update_weights_from_disk(
                    f"/checkpoints/chaos/step-{version}", version, PauseMode.ABORT))
                outcome = "accepted"
            except SessionFenced:
                outcome = "refused"
            except (WeightUpdateError, EngineError, TimeoutError, redis.RedisError) as exc:
                outcome = f"failed: {type(exc).__name__}: {exc}"
            self.ledger.append(LedgerEvent.FENCED_WRITE, version=version, outcome=outcome)


def parse_args(argv: list[str] | None) -> TrainerSettings:
    p = argparse.ArgumentParser(prog="python -m chaos.trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", required=True)
    p.add_argument("--engine-url", required=True, help="the router (control calls reach every engine behind it)")
    p.add_argument("--ledger", type=Path, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--step-s", type=float, default=0.2, help="simulated training step (seconds)")
    p.add_argument("--drain-file", type=Path, required=True, help="once it exists: train what is left, then exit")
    p.add_argument("--replicas", type=int, default=1,
                   help="replicas that must have a batch's delivery and its commit (WAIT); 0: the primary's word")
    p.add_argument("--fenced-loop-dir", type=Path,
                   help="a file fenced-loop-<pid> there: once fenced, run the update loop on a few times first")
    a = p.parse_args(argv)
    return TrainerSettings(a.namespace, a.engine_url, a.ledger, a.batch_size, a.step_s, a.drain_file, a.replicas,
                           fenced_loop_dir=a.fenced_loop_dir)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_args(argv)
    url = os.environ.get(REDIS_URL_ENV)
    if not url:
        print(f"chaos trainer: set {REDIS_URL_ENV} to the Redis URL", file=sys.stderr)
        return 2
    return ChaosTrainer(settings, url).run()


if __name__ == "__main__":
    sys.exit(main())
