"""A complete GRPO run through the real pipeline: `examples/grpo_tiny.py`,
`rollout demo --engine torch` and, on a real model, `examples/grpo_smollm2.py` and
`rollout demo --engine llm --model DIR`.

Embedded Redis → the toy task's prompts (local/case_task.py) pushed as groups →
`rollout torch-engine` processes starting from the trainer's initial checkpoint →
`rollout worker` processes (reward: the case task) → this process as the trainer:
exact batches from `Consumer`, one `local.grpo.Trainer` step each, the new weights
saved and loaded by every engine through `Controller.update_weights_from_disk` (abort
mode, so interrupted samples continue under the new weights as a new segment), with
η = 1 (admission paced to (η + version + 1) · B groups, staleness checked at
consumption). After every update each engine must report the new version. Ends with
the conservation audit.

With `model_dir` (an HF folder of a Llama-family model, `rollout prepare-model`) the
engines serve it (`rollout torch-engine --model`), the workers take its tokenizer and
chat template from the engines' /get_model_info, the task is local/capital_task.py
(chat prompts, a reward on decoded text) and the trainer is transformers'
`LlamaForCausalLM`; its checkpoints are HF folders.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pipeline.ops import deadletters
from pipeline.ops.audit import audit
from pipeline.connection import connect
from pipeline.consumer import Consumer
from pipeline.control import configure
from pipeline.controller import Controller
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Queue
from pipeline.redis_server import RedisServer, free_port
from pipeline.types import parse_version

from local import capital_task, case_task
from workers.engine_set import EngineSet
from .grpo import AgreementError, StepReport, Trainer, TrainerSettings
from .processes import start_torch_engine_process, start_worker_process, stop_processes, wait_healthy

log = logging.getLogger(__name__)

NAMESPACE = "grpo"


@dataclass
class GRPOOptions:
    steps: int = 60
    batch_size: int = 8  # B: groups per step
    n_samples: int = 8  # samples per prompt (the group size)
    max_new_tokens: int = 8
    engines: int = 1
    workers: int = 1
    engine_max_running: int = 64
    # Minimum decode step time of the engines (`rollout torch-engine --step-time`): a GPU's
    # pace, so generation overlaps training and weight updates land mid-generation as in a
    # real asynchronous run (on 2 CPU cores an unpaced engine finishes first).
    engine_step_s: float = 0.02
    mask_offpolicy_prefix: bool = True  # the workers zero the loss mask of tokens from older versions
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    step_timeout_s: float = 60.0
    curve_png: Path | None = None  # saved when matplotlib is installed
    context_length: int = 512  # per request, with model_dir (the engines' KV cache)
    engine_start_s: float = 60.0  # until an engine answers /health


def llm_options(model_dir: Path, **given) -> GRPOOptions:
    """A short GRPO on a real model that fits a few minutes on 2 CPU cores: 4 steps of
    2 groups of 4 samples, 12 response tokens, Adam at 2e-5 (measured: docs/grpo.md)."""
    opts = GRPOOptions(**{"steps": 4, "batch_size": 2, "n_samples": 4, "max_new_tokens": 12,
                          "engine_max_running": 8, "engine_step_s": 0.0, "step_timeout_s": 600.0,
                          "engine_start_s": 300.0, **given})
    opts.trainer = TrainerSettings(model_dir=Path(model_dir), lr=2e-5, temperature=1.0,
                                   max_staleness=opts.trainer.max_staleness)
    return opts


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


class EngineVersionError(RuntimeError):
    """An engine did not report the version the trainer just loaded into it."""


def _engine_args(opts: GRPOOptions, checkpoint: Path, seed: int) -> list[str]:
    if opts.trainer.model_dir is not None:
        return ["--model", str(checkpoint), "--seed", str(seed), "--max-running", str(opts.engine_max_running),
                "--step-time", str(opts.engine_step_s), "--threads", "1",
                "--context-length", str(opts.context_length)]
    m = opts.trainer.model
    return ["--model-path", str(checkpoint), "--seed", str(seed), "--max-running", str(opts.engine_max_running),
            "--step-time", str(opts.engine_step_s), "--threads", "1", "--layers", str(m.n_layers),
            "--width", str(m.d_model), "--heads", str(m.n_heads), "--context-length", str(m.context_length)]


def _worker_args(opts: GRPOOptions) -> list[str]:
    args = ["--max-new-tokens", str(opts.max_new_tokens), "--temperature", str(opts.trainer.temperature),
            "--reward", _task(opts).REWARD_PATH]
    if opts.trainer.model_dir is not None:
        args.append("--apply-chat-template")  # an instruct model: string prompts would get the template too
    return args + (["--mask-offpolicy-prefix"] if opts.mask_offpolicy_prefix else [])


def _task(opts: GRPOOptions):
    return capital_task if opts.trainer.model_dir is not None else case_task


def _served_model(url: str) -> dict:
    """What the engine says it serves (the workers choose their tokenizer from the same answer)."""
    with urllib.request.urlopen(url + "/get_model_info", timeout=10) as resp:
        info = json.loads(resp.read())
    return {"model": info.get("model_path"), "tokenizer": info.get("tokenizer_path"),
            "model_type": info.get("model_type"), "architectures": info.get("architectures")}


def curve_header() -> str:
    return (f"{'step':>4} {'wait s':>6} {'reward':>6} {'loss':>7} {'versions':>9} {'cont.':>5} "
            f"{'|Δlp| max':>9} {'update s':>8} {'requeued':>8}")


def curve_line(r: dict) -> str:
    return (f"{r['step']:>4} {r['wait_s']:>6.2f} {r['reward']:>6.3f} {r['loss']:>7.3f} "
            f"{','.join(r['versions']):>9} {r['continued']:>5} {r['logprob_max_abs_diff']:>9.2e} "
            f"{r['update_s']:>8.3f} {r['requeued']:>8}")


def save_curve_png(rows: list[dict], path: Path, title: str = "GRPO on the case task (byte-level LM, CPU)") -> bool:
    """The reward curve as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["reward"] for r in rows], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def run_grpo(opts: GRPOOptions, echo: Callable[[str], None] | None = print) -> dict:
    """Train for `opts.steps` steps; returns the summary (`ok`, reward_first/last, the
    curve, agreement, versions, audit). Never raises for a failed run: `ok` is False
    and `error` says why."""
    say = echo or (lambda _msg: None)
    started = time.monotonic()
    torch.set_num_threads(1)  # the engines, the workers and Redis share the machine
    workdir = Path(tempfile.mkdtemp(prefix="rollout-grpo-"))
    server = RedisServer(workdir / "redis")
    procs: list[subprocess.Popen] = []
    engines_proc: list[subprocess.Popen] = []
    loop = asyncio.new_event_loop()
    engine_set: EngineSet | None = None
    rows: list[dict] = []
    error: str | None = None
    engine_versions_ok = True
    queue = None
    served: dict | None = None
    try:
        trainer = Trainer(opts.trainer)
        checkpoints = workdir / "checkpoints"
        checkpoints.mkdir()
        # A real model's engines start from its own folder, whose tokenizer they serve from then on;
        # the trainer's checkpoints hold only weights and config.
        initial = path = trainer.save(checkpoints) if opts.trainer.model_dir is None else opts.trainer.model_dir
        urls = []
        for i in range(opts.engines):
            port = free_port()
            log_path = workdir / f"engine-{i}.log"
            engines_proc.append(start_torch_engine_process(port, log_path,
                                                           _engine_args(opts, initial, opts.trainer.seed + i)))
            urls.append(f"http://127.0.0.1:{port}")
        url = server.start()
        queue = Queue(connect(url), NAMESPACE)
        configure(queue.redis, queue.keys, max_staleness=opts.trainer.max_staleness, batch_size=opts.batch_size,
                  max_ready=4 * opts.batch_size, lease_s=10.0)
        # Enough prompts for every step and the surplus admission allows, never more than that per version.
        rows_needed = (opts.steps + opts.trainer.max_staleness + 2) * opts.batch_size
        dataset = _task(opts).write_dataset(workdir / "prompts.jsonl", rows_needed, opts.trainer.seed)
        report = push_dataset(queue, dataset, PushOptions(n_samples_per_prompt=opts.n_samples))
        for i, (proc, engine_url) in enumerate(zip(engines_proc, urls)):
            wait_healthy(engine_url, proc, workdir / f"engine-{i}.log", timeout_s=opts.engine_start_s)
        if opts.trainer.model_dir is not None:
            served = _served_model(urls[0])
        for i in range(opts.workers):
            procs.append(start_worker_process(url, NAMESPACE, urls, workdir / f"worker-{i}.log", _worker_args(opts)))
        engine_set = EngineSet(urls)
        consumer = Consumer(queue.redis, NAMESPACE)
        controller = Controller(queue, engine_set, writer=consumer.writer)  # its writes fenced by the trainer's session
        m = opts.trainer.model
        model = (f"{served['architectures']} from {opts.trainer.model_dir}" if served
                 else f"{m.n_layers} layers x {m.d_model}")
        say(f"redis {url} | {opts.engines} torch engine(s) {' '.join(urls)} | {model} "
            f"| {opts.workers} worker(s) | pushed {report.pushed} groups of {opts.n_samples} | B={opts.batch_size} "
            f"| η={opts.trainer.max_staleness}")
        say(curve_header())
        for step in range(opts.steps):
            batch = consumer.next_batch(opts.batch_size, timeout=opts.step_timeout_s)
            result: StepReport = trainer.step(batch)
            consumer.commit(batch)
            previous, path = path, trainer.save(checkpoints)
            update_started = time.monotonic()
            pause, _ = loop.run_until_complete(
                controller.update_weights_from_disk(str(path), trainer.version, mode="abort"))
            update_s = time.monotonic() - update_started
            reported = loop.run_until_complete(engine_set.weight_versions())
            wrong = {u: v for u, v in reported.items() if v != str(trainer.version)}
            if wrong:
                engine_versions_ok = False
                raise EngineVersionError(f"after loading version {trainer.version}: engines report {wrong}")
            rows.append({"step": step, "wait_s": round(batch.metrics.wait_s, 3), **asdict(result),
                         "update_s": round(update_s, 3), "requeued": pause.requeued})
            say(curve_line(rows[-1]))
            # Old checkpoints are not read again: the engines hold the new weights.
            if previous.parent == checkpoints:
                trainer.discard(previous)
    except (AgreementError, EngineVersionError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        say(f"FAILED: {error}")
    except Exception as exc:  # a timeout, an engine that died: the run reports instead of raising
        log.exception("GRPO run failed")
        error = f"{type(exc).__name__}: {exc}"
        say(f"FAILED: {error}")
        for path in sorted(workdir.glob("*.log")):
            say(f"--- {path.name} (last lines) ---\n{path.read_text()[-1500:]}")
    finally:
        stop_processes(procs)
        alive = queue is not None and server.process is not None
        audit_report = audit(queue) if alive else None
        dead = deadletters.summarize(deadletters.list_dead(queue)) if alive else None
        stop_processes(engines_proc)
        if engine_set is not None:
            loop.run_until_complete(engine_set.close())
        loop.close()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    summary = _summary(opts, rows, error, engine_versions_ok, audit_report, dead, time.monotonic() - started, say)
    if opts.trainer.model_dir is not None:
        summary["model"] = (served or {}).get("model") or str(opts.trainer.model_dir)
        summary["tokenizer"] = (served or {}).get("tokenizer")
    return summary


def _summary(opts: GRPOOptions, rows: list[dict], error: str | None, engine_versions_ok: bool, audit_report,
             dead: deadletters.DeadSummary | None, seconds: float, say: Callable[[str], None]) -> dict:
    window = max(1, min(5, len(rows) // 4))  # steps averaged at each end of the curve
    rewards = [r["reward"] for r in rows]
    seen = sorted({v for r in rows for v in r["versions"]}, key=parse_version)
    audit_ok = audit_report is not None and audit_report.ok
    summary = {
        "ok": error is None and audit_ok and len(rows) == opts.steps,
        "error": error,
        "steps": len(rows),
        "reward_first": _mean(rewards[:window]),
        "reward_last": _mean(rewards[-window:]),
        "reward_window": window,
        "logprob_max_abs_diff": max((r["logprob_max_abs_diff"] for r in rows), default=None),
        "logprob_mean_abs_diff": statistics.fmean(r["logprob_mean_abs_diff"] for r in rows) if rows else None,
        "weight_versions_seen": seen,
        "engine_versions_ok": engine_versions_ok,
        "samples_continued": sum(r["continued"] for r in rows),
        "audit_ok": audit_ok,
        "audit": audit_report.to_dict() if audit_report is not None else None,
        "dead_letters": dead.to_dict() if dead is not None else None,
        "seconds": round(seconds, 1),
        "curve": rows,
    }
    if rows:
        say(f"reward {summary['reward_first']} (first {window} steps) -> {summary['reward_last']} (last {window}); "
            f"train-inference |Δ log-prob| max {summary['logprob_max_abs_diff']:.2e}, mean "
            f"{summary['logprob_mean_abs_diff']:.2e}; {summary['samples_continued']} samples continued across "
            f"a weight update; {len(seen)} weight versions seen; {summary['seconds']}s")
    if audit_report is not None:
        say(f"audit: {audit_report.summary()}")
    for line in dead.lines() if dead is not None else []:  # what the audit counts as dead, and why
        say(line)
    if opts.curve_png is not None and rows:
        title = (f"GRPO on the capital task ({opts.trainer.model_dir.name}, CPU)" if opts.trainer.model_dir is not None
                 else "GRPO on the case task (byte-level LM, CPU)")
        if save_curve_png(rows, opts.curve_png, title):
            say(f"curve saved to {opts.curve_png}")
        else:
            say("matplotlib is not installed: no PNG (the table above is the curve; pip install -e '.[plot]')")
    return summary
