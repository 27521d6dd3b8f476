"""The worker's settings: one dataclass, read by the worker and by every collaborator it owns."""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from pipeline import metrics
from pipeline.control import DEFAULT_HEARTBEAT_S

from .engine_stream import DEFAULT_STREAM_INTERVAL
from .rewards import DEFAULT_REWARD_THREADS
from .sample_budget import DEFAULT_MAX_PREEMPTIONS, DEFAULT_PREEMPTION_S
from .sampling import SamplingSettings


@dataclass
class WorkerSettings:
    redis_url: str
    engine_urls: list[str]
    namespace: str = "rollout"
    concurrency_per_engine: int = 256  # samples, as slime's sglang_server_concurrency; `rollout worker`'s default
    tokenizer: str | None = None  # None: the byte-level tokenizer; else a HF path
    # The engines' (and routers') SGLang --api-key, sent with every request; kept out of repr (logs).
    engine_api_key: str | None = field(default=None, repr=False)
    # slime's --apply-chat-template: each prompt rendered with the chat template into
    # sample.prompt before generation (slime's Dataset call, with these keyword arguments).
    apply_chat_template: bool = False
    apply_chat_template_kwargs: dict = field(default_factory=dict)  # slime's --apply-chat-template-kwargs
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    reward: str = "math_boxed"  # built-in name or dotted path
    group_reward: bool = False  # slime's --group-rm
    reward_key: str | None = None
    rm_url: str | None = None  # for the remote_rm built-in
    rm_type: str | None = None  # slime's --rm-type, for a reward that reads it (slime's async_rm)
    reward_queue: str | None = None  # rq queue name: score in rq workers instead of here
    reward_timeout_s: float = 300.0  # a reward call running longer is abandoned and retried
    reward_threads: int = DEFAULT_REWARD_THREADS  # synchronous reward calls at once (--reward-threads)
    max_attempts: int = 3  # engine or reward failures per group before dead-lettering
    backoff_s: float = 0.5  # first retry delay; doubles up to backoff_max_s
    backoff_max_s: float = 30.0
    engine_down_after: int = 5  # consecutive engine failures that stop claiming
    # Aborts no pause, drain or weight update explains, per sample, before each is an engine
    # failure: at most this many, within this long of the first (workers/sample_budget.py).
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    preemption_budget_s: float = DEFAULT_PREEMPTION_S
    request_timeout_s: float = 600.0
    # Read answers as streams (workers/engine_stream.py), asking for a chunk every stream_interval tokens.
    stream: bool = False
    stream_interval: int = DEFAULT_STREAM_INTERVAL
    heartbeat_s: float = DEFAULT_HEARTBEAT_S  # the namespace's lease must cover three
    progress_s: float = 60.0  # seconds between progress lines in the log (0: none)
    # slime's --custom-generate-function-path ("package.module:fn"): it makes the engine calls
    # of each sample (multi-turn, tools); None: one /generate per sample, made here.
    generate_function: str | None = None
    sample_timeout_s: float = 1800.0  # one generate-function call running longer dead-letters its group
    max_context_len: int | None = None  # slime's rollout_max_context_len, for generate functions
    mask_offpolicy_prefix: bool = False  # slime's --mask-offpolicy-in-partial-rollout
    # slime's --partial-rollout: a sample a weight update aborted mid-call is handed back to
    # the generate function as it left it; off, it starts again from its prompt.
    partial_rollout: bool = False
    metrics_port: int | None = None  # serve Prometheus metrics here
    metrics_host: str = metrics.DEFAULT_HOST  # the address metrics_port listens on
    keep_response_text: bool = False  # include response texts in results (tokens are always there)
    serve_eval: bool = True  # also serve `<namespace>.eval` (pipeline/trainers/eval.py), ahead of training
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
