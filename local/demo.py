"""`rollout demo`: the whole pipeline on one machine, on embedded defaults.

Embedded Redis (AOF on, unix socket) → SGLang simulator → bundled arithmetic
dataset → worker processes → a minimal trainer loop taking exact batches. Ends with
the audit: every pushed group accounted for, none trained twice.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.ops import deadletters
from pipeline.ops.audit import audit
from pipeline.wording import counted
from pipeline.connection import connect
from pipeline.consumer import BatchTimeout, Consumer
from pipeline.control import configure
from pipeline.controller import Controller
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Queue
from pipeline.redis_server import RedisServer, register_local, unregister_local

from workers.engine_set import EngineSet
from .processes import start_worker_process, stop_processes
from engines.simulator import SimConfig, start_simulator

log = logging.getLogger(__name__)

DATASET = Path(__file__).with_name("data") / "arithmetic.jsonl"
NAMESPACE = "demo"


@dataclass
class DemoOptions:
    steps: int = 5
    batch_size: int = 8
    n_samples: int = 4
    workers: int = 2
    max_new_tokens: int = 512
    step_timeout_s: float = 60.0
    seed: int = 0
    update_weights: bool = True  # a weight update after every step (pause → load → resume)
    max_staleness: int = 1  # η: admission pacing and the check at consumption
    task: str = "arithmetic"  # or "tools": examples/calculator_tools.py, several engine calls per sample


#: `--task tools`: the workers' generate function and reward, and how often the simulated
#: model calls the calculator at each turn.
TOOLS_WORKER_ARGS = ["--generate-function", "examples.calculator_tools:generate",
                     "--reward", "examples.calculator_tools:reward"]
TOOL_CALL_RATE = 0.5


def _numeric(reward) -> float | None:
    return float(reward) if isinstance(reward, (int, float)) else None


def run_demo(opts: DemoOptions, echo: Callable[[str], None] | None = print) -> dict:
    say = echo or (lambda _msg: None)
    workdir = Path(tempfile.mkdtemp(prefix="rollout-demo-"))
    server = RedisServer(workdir / "redis")
    sim = loop = engines = None
    procs: list[subprocess.Popen] = []
    steps: list[dict] = []
    trained: list[str] = []
    try:
        url = server.start()
        register_local(server)
        # The simulated model answers better with each weight version, so rewards rise.
        tools = opts.task == "tools"
        sim = start_simulator(SimConfig(seed=opts.seed, skill=0.3, skill_gain_per_version=0.1,
                                        decode_tokens_per_s=1000.0, tool_call_rate=TOOL_CALL_RATE if tools else 0.0))
        queue = Queue(connect(url), NAMESPACE)
        # Keep a modest backlog so workers pause instead of racing through the dataset,
        # and bound staleness: admission is paced to (η + version + 1) · B groups.
        configure(queue.redis, queue.keys, max_ready=4 * opts.batch_size, max_staleness=opts.max_staleness,
                  batch_size=opts.batch_size, lease_s=10.0)
        engines = EngineSet([sim.url])
        loop = asyncio.new_event_loop()  # one loop for the engine client's HTTP session
        rows = sum(1 for line in DATASET.open() if line.strip())
        epochs = max(1, math.ceil(opts.steps * opts.batch_size / rows))
        report = push_dataset(queue, DATASET, PushOptions(n_samples_per_prompt=opts.n_samples, epochs=epochs,
                                                          shuffle=True, seed=opts.seed))
        say(f"redis {url} | simulator {sim.url} | pushed {report.pushed} groups of {opts.n_samples} "
            f"| {counted(opts.workers, 'worker')}" + (" | task tools (examples/calculator_tools.py)" if tools else ""))
        for i in range(opts.workers):
            procs.append(start_worker_process(url, NAMESPACE, [sim.url], workdir / f"worker-{i}.log",
                                              ["--max-new-tokens", str(opts.max_new_tokens)]
                                              + (TOOLS_WORKER_ARGS if tools else [])))
        consumer = Consumer(queue.redis, NAMESPACE)
        controller = Controller(queue, engines, writer=consumer.writer)  # its writes fenced by the trainer's session
        say(f"{'step':>4} {'wait s':>7} {'groups':>6} {'samples':>7} {'reward':>7} {'truncated':>9} "
            f"{'staleness':>9} {'update s':>8} {'requeued':>8}" + (f" {'turns':>5} {'tool tok':>8}" if tools else ""))
        for step in range(opts.steps):
            batch = consumer.next_batch(opts.batch_size, timeout=opts.step_timeout_s)
            samples = [s for g in batch.groups for s in g.samples]
            rewards = [r for r in (_numeric(s.reward) for s in samples) if r is not None]
            row = {
                "step": step,
                "wait_s": round(batch.metrics.wait_s, 3),
                "groups": len(batch),
                "samples": len(samples),
                "mean_reward": round(statistics.fmean(rewards), 4) if rewards else None,
                "truncated": sum(s.status.value == "truncated" for s in samples),
                # --task tools: engine calls per sample, and tool-output tokens (loss mask 0)
                "mean_turns": round(statistics.fmean(s.metadata.get("tool_turns", 0) for s in samples), 3)
                if tools and samples else None,
                "tool_tokens": sum((s.loss_mask or []).count(0) for s in samples) if tools else None,
                "max_staleness": max(batch.metrics.staleness, default=0),
                "group_ids": [g.group_id for g in batch.groups],
                "update_s": None,  # without weight updates
                "requeued": None,
            }
            trained += row["group_ids"]
            consumer.commit(batch)
            if opts.update_weights:
                # What a trainer does after its step: pause (in-flight requests abort and
                # their groups are requeued with partial output), load the new weights on
                # every engine, resume (the partial groups continue under them).
                started = time.monotonic()
                pause, _resume = loop.run_until_complete(controller.update_weights_from_disk(
                    f"/checkpoints/step-{step + 1}", step + 1, mode="abort"))
                row["update_s"] = round(time.monotonic() - started, 3)
                row["requeued"] = pause.requeued
            steps.append(row)
            say(f"{step:>4} {row['wait_s']:>7.3f} {row['groups']:>6} {row['samples']:>7} "
                f"{row['mean_reward'] if row['mean_reward'] is not None else '-':>7} {row['truncated']:>9} "
                f"{row['max_staleness']:>9} {_or_dash(row['update_s']):>8} {_or_dash(row['requeued']):>8}"
                + (f" {row['mean_turns']:>5} {row['tool_tokens']:>8}" if tools else ""))
        stop_processes(procs)
        result = audit(queue)
        duplicates = len(trained) - len(set(trained))
        ok = result.ok and duplicates == 0
        all_rewards = [r for s in steps if s["mean_reward"] is not None for r in [s["mean_reward"]]]
        say(f"trained {len(trained)} groups in {len(steps)} steps, mean reward "
            f"{statistics.fmean(all_rewards):.3f}, {duplicates} trained twice" if all_rewards else "no rewards")
        say(f"audit: {result.summary()}")
        dead = _dead_letters(queue, say)
        return {
            "ok": ok,
            "error": None,
            "steps": steps,
            "groups_trained": len(trained),
            "trained_twice": duplicates,
            "mean_reward": round(statistics.fmean(all_rewards), 4) if all_rewards else None,
            "audit": result.to_dict(),
            "dead_letters": dead.to_dict(),
        }
    except BatchTimeout as exc:
        say(f"demo failed: {exc}")
        dead = _dead_letters(queue, say)  # often why no batch came
        for i, p in enumerate(procs):
            tail = (workdir / f"worker-{i}.log").read_text()[-2000:]
            say(f"--- worker {i} log (last lines) ---\n{tail}")
        return {"ok": False, "error": str(exc), "steps": steps, "groups_trained": len(trained),
                "trained_twice": len(trained) - len(set(trained)), "mean_reward": None, "audit": None,
                "dead_letters": dead.to_dict()}
    finally:
        stop_processes(procs)
        if loop is not None:
            loop.run_until_complete(engines.close())
            loop.close()
        if sim is not None:
            sim.stop()
        unregister_local(server)
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _dead_letters(queue: Queue, say: Callable[[str], None]) -> deadletters.DeadSummary:
    """How many groups were dead-lettered and why, said now: the demo's Redis goes with it."""
    dead = deadletters.summarize(deadletters.list_dead(queue))
    for line in dead.lines():
        say(line)
    return dead


def _or_dash(value) -> str:
    return "-" if value is None else str(value)
