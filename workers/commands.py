"""`rollout worker` (a generation worker, workers/worker.py) and `rollout reward-worker`
(the rq reward offload, workers/reward_queue.py)."""
from __future__ import annotations

import asyncio
import json
import logging

import click

from pipeline.cli_support import (ENGINE_API_KEY_OPTION, ENGINE_URLS_ENV, METRICS_HOST_OPTION, Context, FiniteFloat,
                                  Seconds, check_port_free, given_engine_urls, stop_on_sigterm)
from pipeline.connection import ConnectionFailed, connect
from pipeline.control import DEFAULT_HEARTBEAT_S
from workers.settings import WorkerSettings

class JsonObject(click.ParamType):
    """A JSON object given on the command line."""

    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            self.fail(f"not JSON: {exc}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"expected a JSON object, got {type(parsed).__name__}", param, ctx)
        return parsed


#: One default for each worker knob, whether the worker runs alone, under `up` or in
#: docker-compose.yml (tests/test_first_hour.py checks the compose file says the same).
DEFAULT_CONCURRENCY = 256  # samples in flight per engine, per worker
DEFAULT_MAX_NEW_TOKENS = 1024


@click.command()
@click.option("--engine-url", "engine_urls", multiple=True, required=True, envvar=ENGINE_URLS_ENV,
              help="SGLang engine or router URL; repeat for several (env ROLLOUT_ENGINE_URLS, space-separated).")
@ENGINE_API_KEY_OPTION
@click.option("--concurrency", default=DEFAULT_CONCURRENCY, show_default=True, type=click.IntRange(min=1),
              help="Samples in flight per engine (slime's sglang_server_concurrency).")
@click.option("--tokenizer", help="Hugging Face tokenizer name or path, or `byte`. Default: the model the engines "
              "serve (/get_model_info); bytes for the simulator.")
@click.option("--allow-byte-tokenizer", is_flag=True,
              help="Allow --tokenizer byte against engines that are not the simulator.")
@click.option("--apply-chat-template/--no-apply-chat-template", default=None,
              help="Render each prompt with the model's chat template into sample.prompt, as slime's Dataset does "
                   "(a string as one user message), or keep it as pushed (string prompts sent as text). Default: "
                   "the template when the model has one (instruct models) and no --generate-function (slime's "
                   "default for functions: off); a template is never invented.")
@click.option("--apply-chat-template-kwargs", "apply_chat_template_kwargs", type=JsonObject(),
              help="slime's --apply-chat-template-kwargs: a JSON object of keyword arguments for the chat template. "
                   "Example: '{\"enable_thinking\": false}'.")
@click.option("--reward", default="math_boxed", show_default=True,
              help="Built-in (exact_match, math_boxed, remote_rm) or dotted path to `async def rm(args, sample)`.")
@click.option("--group-reward", is_flag=True, help="The reward scores a whole group: rm(args, samples).")
@click.option("--reward-key", help="The key of a dict reward that is trained on (slime's --reward-key): its value must be "
                                   "a finite number, the dict's other values may be any JSON.")
@click.option("--rm-url", help="URL for the remote_rm reward.")
@click.option("--rm-type", help="slime's --rm-type, for a reward that reads it (slime.rollout.rm_hub.async_rm).")
@click.option("--no-eval", "serve_eval", flag_value=False, default=True,
              help="Do not serve eval passes (<namespace>.eval); by default they come before training.")
@click.option("--reward-queue", help="Score in rq workers listening on this queue (slow judges).")
@click.option("--max-new-tokens", default=DEFAULT_MAX_NEW_TOKENS, show_default=True, type=click.IntRange(min=1),
              help="rollout_max_response_len.")
@click.option("--temperature", default=1.0, show_default=True, type=FiniteFloat(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=FiniteFloat(0, 1, min_open=True))
@click.option("--top-k", default=-1, show_default=True)
@click.option("--stop", multiple=True, help="Stop string; repeat for several.")
@click.option("--stop-token-id", "stop_token_ids", multiple=True, type=int, help="Stop token id; repeat.")
@click.option("--skip-special-tokens/--keep-special-tokens", default=True, show_default=True,
              help="Response text without special tokens (SGLang's default); slime's "
                   "--rollout-skip-special-tokens is off by default: --keep-special-tokens matches it.")
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(min=1),
              help="Engine or reward failures per group before it is dead-lettered.")
@click.option("--max-preemptions", default=WorkerSettings.max_preemptions, show_default=True,
              type=click.IntRange(min=0),
              help="Aborts per sample that no pause, rolling update or weight update explains before each counts as "
                   "an engine failure (slime's rollout-end abort_all is one). E.g. --max-preemptions 16.")
@click.option("--preemption-budget", "preemption_budget_s", default=WorkerSettings.preemption_budget_s,
              show_default=True, type=Seconds(min=0),
              help="Seconds from a sample's first unexplained abort within which further ones are still free.")
@click.option("--heartbeat", "heartbeat_s", default=DEFAULT_HEARTBEAT_S, show_default=True,
              type=Seconds(min=0.05),
              help="Seconds between heartbeats. The lease (a namespace setting, `rollout configure --lease`) "
                   "must cover three.")
@click.option("--request-timeout", "request_timeout_s", default=600.0, show_default=True,
              type=Seconds(min=0, min_open=True),
              help="Seconds one /generate call may take; then it is aborted on the engine and retried.")
@click.option("--reward-timeout", "reward_timeout_s", default=300.0, show_default=True,
              type=Seconds(min=0, min_open=True),
              help="Seconds one group's reward may take; then it is abandoned and the group retried.")
@click.option("--reward-threads", default=WorkerSettings.reward_threads, show_default=True,
              type=click.IntRange(min=1),
              help="Synchronous reward calls running at once. A call past --reward-timeout gives its place back; "
                   "with twice this many calls still stuck the worker stops (the reward function hangs).")
@click.option("--mask-offpolicy-prefix", is_flag=True,
              help="loss_mask 0 for tokens generated under an older weight version.")
@click.option("--partial-rollout", is_flag=True,
              help="slime's --partial-rollout, for --generate-function: a sample a weight update aborted mid-call is "
                   "handed back to the function as it left it (args.partial_rollout is True). Off (slime's default), "
                   "it starts again from its prompt, counted as `restarted` (slime's examples refuse partial samples).")
@click.option("--generate-function", envvar="ROLLOUT_GENERATE_FUNCTION",
              help="slime's --custom-generate-function-path, `package.module:fn`: `async def generate(args, sample, "
                   "sampling_params[, evaluation])` makes each sample's engine calls (multi-turn, tools) and holds "
                   "one --concurrency slot from its first turn to its last (env ROLLOUT_GENERATE_FUNCTION).")
@click.option("--sample-timeout", "sample_timeout_s", default=WorkerSettings.sample_timeout_s, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Seconds one --generate-function call may take; then its group is dead-lettered.")
@click.option("--max-context-len", type=click.IntRange(min=1),
              help="slime's rollout_max_context_len, handed to --generate-function (prompt + all turns).")
@click.option("--metrics-port", type=click.IntRange(1, 65535),
              help="Serve Prometheus metrics on this port (/metrics), and /health from the start: 503 with what the "
                   "worker waits for (an engine loading its model, Redis) until it registers, then 200 with its "
                   "state, as JSON {ready, state}.")
@METRICS_HOST_OPTION
@click.option("--progress-every", "progress_s", default=60.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds between progress lines in the log (claimed, published, samples/s, in flight, engines "
                   "up, what it waits on); 0: none.")
@click.option("--keep-response-text", is_flag=True,
              help="Publish response texts with the results (tokens always are; text adds about 20 percent per group).")
@click.option("--stream/--no-stream", default=WorkerSettings.stream, show_default=True,
              help="Read /generate answers as streams (stream: true), every chunk checked as it comes. The ground "
                   "for in-flight checkpoints; costs worker CPU per chunk (docs/performance.md).")
@click.option("--stream-interval", default=WorkerSettings.stream_interval, show_default=True,
              type=click.IntRange(min=1),
              help="With --stream: tokens per chunk asked of the engines (sampling_params.stream_interval). "
                   "sglang-router drops it: behind a router, start the engines with --stream-interval N.")
@click.pass_obj
def worker(obj: Context, engine_urls, api_key, concurrency, tokenizer, allow_byte_tokenizer, apply_chat_template, reward,
           apply_chat_template_kwargs, group_reward, reward_key, rm_url, rm_type, serve_eval, reward_queue, max_new_tokens,
           temperature, top_p, top_k, stop, stop_token_ids, skip_special_tokens, max_attempts, max_preemptions,
           preemption_budget_s, heartbeat_s, request_timeout_s, reward_timeout_s, reward_threads, mask_offpolicy_prefix,
           partial_rollout, generate_function, sample_timeout_s, max_context_len, metrics_port, metrics_host, progress_s,
           keep_response_text, stream, stream_interval) -> None:
    """Run one generation worker until Ctrl-C / SIGTERM.

    It first waits for the engines to say which model they serve and loads that
    model's tokenizer (a real model needs `pip install -e '.[hf]'` in your clone; the
    simulator takes bytes). Then it claims prompt groups, generates every sample
    through SGLang's /generate, scores them and publishes finished groups; on
    shutdown it hands back what it holds. Run as many as you like, on any host.
    Given a router URL, it finds the engines behind it, and looks again every
    30 s (and while engines are down): its capacity is --concurrency per engine
    found. If Redis restarts, it waits for it and carries on; if it was presumed
    dead meanwhile (its lease ran out), it drops its work and registers anew.

    \b
    Examples:
      rollout worker --engine-url http://router:30000 --reward math_boxed
      # slime's examples/retool, unchanged (its directory on PYTHONPATH, slime installed):
      rollout worker --engine-url http://router:30000 --apply-chat-template \\
        --generate-function generate_with_retool.generate \\
        --reward generate_with_retool.reward_func --reward-key score --max-context-len 9216
      rollout worker --engine-url http://engine:30000 --stream --stream-interval 64
    """
    from workers.engine_errors import EngineError
    from workers.sampling import SamplingError, SamplingSettings
    from workers.tokenizer import TokenizerChoiceError, TokenizerError, worker_tokenizer
    from pipeline import metrics
    from workers.worker import Starting, WorkerConfigError, run_worker

    urls = given_engine_urls(engine_urls)
    starting = Starting("asking the engines which model they serve")
    if metrics_port:  # from the start: /health says what the worker waits for (a model loading, ...)
        check_port_free(metrics_host, metrics_port, "--metrics-port")
        metrics.serve_metrics(metrics_port, metrics_host, health=starting)
    try:
        sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    top_k=top_k, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                    skip_special_tokens=skip_special_tokens)
    except SamplingError as exc:
        raise click.ClickException(f"bad sampling settings: {exc}") from None
    if generate_function:
        from workers.generate_function import GenerateFunction

        try:  # before the engines are asked anything: a wrong path is the first thing to hear of
            GenerateFunction.from_path(generate_function)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--generate-function") from None
    redis_url = obj.url()
    # A long-running worker's start line, progress lines and the reason it waits show
    # without -v (the rest of the program logs warnings only).
    worker_log = logging.getLogger("workers.worker")
    if worker_log.getEffectiveLevel() > logging.INFO:
        worker_log.setLevel(logging.INFO)
    with stop_on_sigterm():
        try:
            tokenizer = asyncio.run(worker_tokenizer(urls, tokenizer, allow_byte_tokenizer, apply_chat_template,
                                                     api_key=api_key, on_wait=starting.say))
        except (TokenizerChoiceError, TokenizerError, EngineError) as exc:
            raise click.ClickException(obj.scrub(str(exc))) from None
    if apply_chat_template is None and generate_function:
        apply_chat_template = False  # slime's default: the function gets the prompt as pushed
    if apply_chat_template is None:  # the model's own template when it has one
        from workers.tokenizer import load_tokenizer

        apply_chat_template = load_tokenizer(tokenizer).templates_by_default
    settings = WorkerSettings(
        redis_url=redis_url, engine_urls=urls, namespace=obj.namespace, concurrency_per_engine=concurrency,
        tokenizer=tokenizer, engine_api_key=api_key, apply_chat_template=apply_chat_template,
        apply_chat_template_kwargs=apply_chat_template_kwargs or {}, reward=reward,
        group_reward=group_reward,
        reward_key=reward_key, rm_url=rm_url, rm_type=rm_type, serve_eval=serve_eval, reward_queue=reward_queue,
        max_attempts=max_attempts, max_preemptions=max_preemptions, preemption_budget_s=preemption_budget_s,
        heartbeat_s=heartbeat_s, request_timeout_s=request_timeout_s, reward_timeout_s=reward_timeout_s,
        reward_threads=reward_threads, mask_offpolicy_prefix=mask_offpolicy_prefix, partial_rollout=partial_rollout,
        metrics_port=metrics_port, metrics_host=metrics_host,
        keep_response_text=keep_response_text, sampling=sampling, generate_function=generate_function,
        sample_timeout_s=sample_timeout_s, max_context_len=max_context_len, progress_s=progress_s,
        stream=stream, stream_interval=stream_interval,
    )
    starting.say("connecting to Redis")
    try:
        asyncio.run(run_worker(settings))
    except (ConnectionFailed, TokenizerError, ValueError, WorkerConfigError) as exc:
        raise click.ClickException(obj.scrub(str(exc))) from None


@click.command("reward-worker")
@click.option("--allow", "allowed", multiple=True, required=True,
              help="A reward this worker may score, as the generation workers' --reward names it; repeat for several.")
@click.option("--queue", "queue_names", multiple=True,
              help="rq queue to serve (the generation workers' --reward-queue); repeat for several. "
                   "Default: rollout-rewards.")
@click.option("--burst", is_flag=True, help="Exit once the queues are empty.")
@click.pass_obj
def reward_worker(obj: Context, allowed, queue_names, burst) -> None:
    """Score groups for generation workers started with --reward-queue.

    An rq worker that runs only the project's scoring job, and only with an
    allowed reward: any other job (another function, another reward, job
    callbacks) fails in rq's failed-job registry with the reason, and nothing it
    names is imported. Jobs travel as JSON, never pickle. Run as many as you like.

    \b
    Example:
      rollout reward-worker --allow math_boxed --allow my_judges.verify:rm
    """
    from workers.reward_queue import run_reward_worker

    queues = {"queue_names": list(queue_names)} if queue_names else {}
    try:
        run_reward_worker(connect(obj.url()), list(allowed), burst=burst, **queues)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
