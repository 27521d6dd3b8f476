"""slime's train.py loop over the adapter, as a process the tests kill (SIGKILL) at chosen
points: generate rollout r, train it, and every SAVE_INTERVAL rollouts save the model
(here: append the rollouts trained since the last checkpoint to a ledger and record the
checkpoint) and then the data source, as slime does. A restart resumes after the last
checkpoint with `load(start - 1)`.

Environment: REDIS_URL, NAMESPACE, LEDGER_DIR, NUM_ROLLOUT, BATCH, SAVE_INTERVAL, and
KILL_AT="<rollout>:<point>" with point one of trained, model_saved, saved. Optional:
EVAL_FILE and EVAL_INTERVAL (evaluate before training and after every EVAL_INTERVAL
rollouts, as train.py; each pass appends "<rollout> <samples> <failed>" to the ledger's
`evals`), MAX_STALENESS (rollout_max_staleness), RESUME_FROM (resume after this
checkpoint rather than the last: an older one).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

from pipeline.trainers import slime_adapter as sa


def main() -> None:
    env = os.environ
    ledger = Path(env["LEDGER_DIR"])
    checkpoint = ledger / "checkpoint"
    kill_at = env.get("KILL_AT", "")
    num_rollout, save_interval = int(env["NUM_ROLLOUT"]), int(env["SAVE_INTERVAL"])
    args = SimpleNamespace(rollout_batch_size=int(env["BATCH"]), n_samples_per_prompt=2, reward_key=None,
                           rollout_redis_url=env["REDIS_URL"], rollout_namespace=env["NAMESPACE"],
                           save=str(ledger), save_interval=save_interval, rollout_batch_timeout=60,
                           rollout_max_staleness=int(env["MAX_STALENESS"]) if env.get("MAX_STALENESS") else None,
                           eval_prompt_data=["math", env["EVAL_FILE"]] if env.get("EVAL_FILE") else None,
                           n_samples_per_eval_prompt=2, label_key="label")
    eval_interval = int(env.get("EVAL_INTERVAL") or 0)

    def point(rollout_id: int, name: str) -> None:
        if kill_at == f"{rollout_id}:{name}":
            os.kill(os.getpid(), signal.SIGKILL)

    def evaluate(rollout_id: int) -> None:
        out = sa.generate_rollout(args, rollout_id, source, evaluation=True)
        with open(ledger / "evals", "a") as f:
            f.write(f"{rollout_id} {len(out.data['math']['samples'])} {out.metrics['eval/math/failed_groups']}\n")

    if env.get("RESUME_FROM"):
        start = int(env["RESUME_FROM"]) + 1
    else:
        start = int(checkpoint.read_text()) + 1 if checkpoint.exists() else 0
    source = sa.RedisDataSource(args)
    source.load(start - 1)
    if eval_interval and start == 0:
        evaluate(0)  # train.py: an eval before training
    trained: list[str] = []  # "rollout row" lines since the last checkpoint: the model's state
    for rollout_id in range(start, num_rollout):
        out = sa.generate_rollout(args, rollout_id, source)
        trained += [f"{rollout_id} {group[0].group_index}" for group in out.samples]
        point(rollout_id, "trained")
        if (rollout_id + 1) % save_interval == 0 or rollout_id == num_rollout - 1:
            with open(ledger / "trained", "a") as f:  # the model's checkpoint holds these steps
                f.write("".join(line + "\n" for line in trained))
            trained = []
            tmp = ledger / "checkpoint.tmp"
            tmp.write_text(str(rollout_id))
            tmp.replace(checkpoint)
            point(rollout_id, "model_saved")
            source.save(rollout_id)
            point(rollout_id, "saved")
        if eval_interval and (rollout_id + 1) % eval_interval == 0:
            evaluate(rollout_id)


if __name__ == "__main__":
    main()
