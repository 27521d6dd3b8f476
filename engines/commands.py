"""`rollout sim-engine` (engines/simulator.py) and `rollout torch-engine`
(engines/torch_engine.py): servers that answer like SGLang."""
from __future__ import annotations

import asyncio

import click

from engines.profiles import PROFILES
from pipeline.cli_support import TORCH_INSTALL_HINT, FiniteFloat, Seconds, check_port_free, stop_on_sigterm


@click.command("sim-engine")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--seed", default=0, show_default=True)
@click.option("--max-running", default=256, show_default=True, help="Requests decoding at once; more wait.")
@click.option("--decode-rate", default=2000.0, show_default=True,
              help="Tokens per second of one request decoding alone (1 / the step time at batch 1).")
@click.option("--engine-profile", default="flat", show_default=True, type=click.Choice(list(PROFILES)),
              help="How a step slows with the batch, the KV cache and prefill (engines/profiles.py); "
                   "flat: never.")
@click.option("--kv-tokens", default=1_000_000, show_default=True, type=click.IntRange(min=1),
              help="KV cache capacity in tokens: beyond it requests wait and running ones are retracted.")
@click.option("--median-tokens", default=64, show_default=True, help="Median output length.")
@click.option("--p99-tokens", default=640, show_default=True, help="p99 output length (long tail).")
@click.option("--skill", default=0.5, show_default=True, type=FiniteFloat(0, 1),
              help="Chance an arithmetic question is answered right.")
@click.option("--error-rate", default=0.0, show_default=True, type=FiniteFloat(0, 1),
              help="Fault injection: fraction of /generate answered 500/503.")
@click.option("--tool-call-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Probability that a response to an arithmetic question, at each turn, calls the calculator "
                   "(`<tool>A op B</tool>`; examples/calculator_tools.py).")
@click.option("--stream-interval", default=1, show_default=True, type=click.IntRange(min=1),
              help="Tokens between the chunks of a streamed answer, as SGLang's --stream-interval (a request's "
                   "sampling_params.stream_interval overrides it).")
@click.option("--incremental-streaming-output", is_flag=True,
              help="Streamed chunks carry only their new tokens (SGLang's flag); by default each carries all so far.")
def sim_engine(host, port, seed, max_running, decode_rate, engine_profile, kv_tokens, median_tokens, p99_tokens,
               skill, error_rate, tool_call_rate, stream_interval, incremental_streaming_output) -> None:
    """Run the SGLang-compatible simulator (no GPU needed).

    It answers SGLang's native HTTP API (/generate, /abort_request,
    /pause_generation, /update_weights_from_disk, ...) with long-tailed latencies
    and optional faults; more faults via POST /sim/faults. GET /sim/stats
    answers what it did and is doing: counters (requests submitted, finished
    by outcome, weight updates, injected faults), its load (running and
    waiting requests, tokens in use), whether it is paused, its weight version.

    \b
    Example:
      rollout sim-engine --port 30000 --median-tokens 128 --p99-tokens 1280
      rollout sim-engine --port 30000 --stream-interval 16 --incremental-streaming-output
    """
    from engines.simulator import SimConfig, serve

    try:
        config = SimConfig(seed=seed, max_running_requests=max_running, decode_tokens_per_s=decode_rate,
                           engine_profile=engine_profile, max_total_num_tokens=kv_tokens, length_median=median_tokens, length_p99=p99_tokens, skill=skill, error_rate=error_rate,
                           tool_call_rate=tool_call_rate, stream_interval=stream_interval,
                           incremental_streaming_output=incremental_streaming_output)
    except ValueError as exc:
        raise click.ClickException(f"bad simulator settings: {exc}") from None
    check_port_free(host, port, "--port")
    click.echo(f"SGLang simulator on http://{host}:{port}", err=True)
    with stop_on_sigterm():
        asyncio.run(serve(config, host, port))


@click.command("torch-engine")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True)
@click.option("--seed", default=0, show_default=True, help="Initial weights (without --model-path) and sampling seed.")
@click.option("--model-path", type=click.Path(exists=True, dir_okay=False),
              help="Checkpoint to start from (written by the trainer). Default: a fresh model from the options below.")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False),
              help="Serve this Hugging Face folder (a Llama-family model, e.g. from `rollout prepare-model`) with "
                   "its own tokenizer, instead of the byte-level model.")
@click.option("--layers", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--width", default=128, show_default=True, type=click.IntRange(min=8), help="d_model.")
@click.option("--heads", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--context-length", type=click.IntRange(min=2),
              help="Tokens per request (prompt + response). Default: 256 (byte-level), 2048 (--model; at most "
                   "the model's own).")
@click.option("--max-running", type=click.IntRange(min=1),
              help="Requests decoding at once (KV cache slots); more wait. Default: 64 (byte-level), 16 (--model).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1), help="torch CPU threads.")
@click.option("--step-time", default=0.0, show_default=True, type=Seconds(min=0),
              help="Minimum seconds per decode step (sleeps the rest, CPU free): emulate a GPU's pace.")
def torch_engine(host, port, seed, model_path, model_dir, layers, width, heads, context_length, max_running, device,
                 threads, step_time) -> None:
    """Run a real PyTorch model behind the SGLang-compatible server.

    A small byte-level causal LM (the workers' default tokenizer works with it), with
    continuous batching over a KV cache, return_logprob, every pause mode and
    /update_weights_from_disk for checkpoints the trainer writes. Needs torch
    (pip install -e '.[torch]' in your clone; without a GPU, first its CPU build:
    pip install torch --index-url https://download.pytorch.org/whl/cpu).

    With --model DIR it serves a real Llama-family model from a Hugging Face folder
    (the project's own forward, the folder's tokenizer, chat template and EOS ids;
    /update_weights_from_disk takes another folder of the same architecture). Needs
    the llm extra (pip install -e '.[llm]' in your clone; without a GPU, first the CPU
    build as above: pip install torch --index-url https://download.pytorch.org/whl/cpu).

    \b
    Example:
      rollout torch-engine --port 30000 --layers 2 --width 128 --max-running 64
      rollout torch-engine --port 30000 --model models/smollm2 --threads 2
    """
    try:
        from engines.byte_lm import ModelConfig
        from engines.torch_engine import TorchEngineConfig, serve
    except ImportError as exc:
        raise click.ClickException(f"the torch engine needs PyTorch ({exc}): {TORCH_INSTALL_HINT}")
    if model_dir is not None and model_path is not None:
        raise click.UsageError("--model (an HF folder) and --model-path (a byte-level checkpoint) exclude each other")
    try:
        if model_dir is not None:
            config = TorchEngineConfig(seed=seed, model_dir=model_dir, max_running_requests=max_running or 16,
                                       context_length=context_length or 2048, device=device, threads=threads,
                                       min_step_s=step_time)
        else:
            config = TorchEngineConfig(seed=seed, model_path=model_path, max_running_requests=max_running or 64,
                                       device=device, threads=threads, min_step_s=step_time,
                                       model=ModelConfig(n_layers=layers, d_model=width, n_heads=heads,
                                                         context_length=context_length or 256))
    except ValueError as exc:
        raise click.ClickException(f"bad torch engine settings: {exc}") from None
    click.echo(f"torch engine on http://{host}:{port}", err=True)
    try:
        asyncio.run(serve(config, host, port))
    except ValueError as exc:  # an unreadable --model-path or --model folder
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass
