"""The SGLang simulator: an engine backend that needs no GPU and no model.

Behind the shared HTTP layer (engines/server.py) it answers like SGLang
0.5.15's native server, so the workers, the demo, the tests and the benchmarks can
run without an engine. What it "generates" (byte tokens, see
`workers.tokenizer.ByteTokenizer`): filler text whose total length is log-normal
(settable median and p99), then EOS. When the prompt asks ``What is A + B?``
(``+ - *``) the response ends with ``The answer is \\boxed{N}``, correct with
probability `SimConfig.skill`, so a response cut by ``max_new_tokens`` loses its
answer. Everything is seeded: the same seed and request give the same output (see
`Engine.sample_key` for what "same" means).

Timing (engines/profiles.py): at most `max_running_requests` run at once, the rest
wait FIFO, and a request that does not fit the KV cache (`max_total_num_tokens`) waits
too. The engine runs steps back to back; each decodes one token for every running
request and prefills a chunk of new prompts, and takes t1·(1 + c·b + d·KV + p·prefill)
with t1 = 1/`decode_tokens_per_s` and the coefficients of `engine_profile` (`flat`:
c = d = 0 and a fixed `prefill_s` per request). When the cache fills, running
requests are retracted as SGLang retracts them (counted in `num_retractions`). No
task runs per request: one timer per engine, and the step clock is read lazily. A step
that ends requests (or does not fit the cache) is the last until the timer has ended
them and admitted the queue; the next begins at its end, however late the timer woke,
so the engine's own schedule (model time) does not depend on the machine's load. With
`model_times` each final answer's meta_info carries ``sim_model_time``: when, on that
schedule, its first and its last token were made (the loop's clock, in seconds).

Lengths: with a `sampling_seed` the whole response (length, text, log-probs) follows
from that seed on every engine, and a request continued after an abort (prompt +
partial output) produces the rest of it. Without one, see `Engine.sample_key`.

Simulator-only endpoints (not SGLang's): ``GET|POST /sim/faults`` reads or sets the
fault-injection knobs (`FAULT_FIELDS`), ``POST /sim/restart`` drops every
connection in flight and answers 503 for ``restart_s`` seconds (weights back to
the startup version, like a real restart), ``GET /sim/stats`` returns counters.
A streamed request that hits an injected 500/503 gets the error status before the
stream starts.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .core import ABORT_RUNNING, Engine, EngineRequest, EngineSettings, Output, State, WeightLoadError, WeightSource
from .server import (EngineServer, ServerHandle, drop, error, error_response, json_reply, read_body,
                            start_in_thread)
from .server import serve as serve_engine
from .generate_request import GenSpec, SchemaError
from .profiles import PROFILES, engine_profile
from .sim_model import Plan, plan_generation, split_continuation
from workers.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

# Fields of SimConfig that `POST /sim/faults` may change at runtime.
FAULT_FIELDS = (
    "error_rate",
    "error_statuses",
    "latency_spike_rate",
    "latency_spike_s",
    "hang_rate",
    "drop_rate",
    "restart_s",
    "weight_update_fail_rate",
    "abort_rate",
    "abort_after_tokens",
)

_CACHE_ENTRIES = 100_000  # bound on the simulated prefix cache
# SGLang admits a request when its prompt plus this share of its max_new_tokens fits
# the cache left after every running request has this share of what it may still
# generate set aside (PrefillAdder's rem_total_tokens; the share is its new_token_ratio,
# which it lowers from 0.7 towards 0.1 while nothing is retracted: a fixed middle value
# here). Without the running requests' share, a full cache admits the requests it just
# retracted and retracts them again.
_NEW_TOKEN_RATIO = 0.3
_CLIP_MAX_NEW_TOKENS = 4096  # SGLang's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
# After a retraction the cache must hold this many more decode steps of the batch
# (SGLang's retract_decode_steps).
_RETRACT_DECODE_STEPS = 20
_WAKE_MAX_S = 0.05  # the step clock is read at least this often while busy (retraction, streaming)


@dataclass
class SimConfig(EngineSettings):
    """Everything the simulator does is set here; all randomness derives from `seed`."""

    model_path: str = "sim/byte-lm"
    # Scheduling and timing (engines/profiles.py). One request decoding alone makes
    # decode_tokens_per_s tokens per second; the profile says how a step slows down with
    # the batch, the KV cache and prefill chunks.
    engine_profile: str = "flat"
    decode_tokens_per_s: float = 2000.0
    prefill_s: float = 0.005  # the flat profile's fixed prefill per request
    stream_interval_s: float = 0.02  # how often a stream emits a chunk while progressing
    weight_update_s: float = 0.0  # time an update_weights_* call takes
    # What it generates.
    length_median: float = 64.0  # total response tokens, EOS included
    length_p99: float = 640.0
    skill: float = 0.5  # probability that an arithmetic answer is right
    skill_gain_per_version: float = 0.0  # added per numeric weight version (demo: rewards rise)
    # Probability that a response to an arithmetic question, at each turn, ends in a
    # calculator call `<tool>A op B</tool>` instead of the answer (examples/calculator_tools.py).
    tool_call_rate: float = 0.0
    # Fault injection (settable at runtime through POST /sim/faults).
    error_rate: float = 0.0  # /generate answered with one of error_statuses
    error_statuses: tuple[int, ...] = (500, 503)
    latency_spike_rate: float = 0.0  # /generate delayed by latency_spike_s first
    latency_spike_s: float = 1.0
    hang_rate: float = 0.0  # /generate never answers (until the client disconnects)
    drop_rate: float = 0.0  # /generate connection closed without any response
    restart_s: float = 2.0  # downtime of POST /sim/restart
    weight_update_fail_rate: float = 0.0  # update_weights_* answer success=false, 400
    # An abort storm: this share of /generate requests end after abort_after_tokens new tokens
    # with finish type abort, as SGLang answers a request aborted while running, although
    # nothing paused the engine (a scheduler bug, a misbehaving controller).
    abort_rate: float = 0.0
    abort_after_tokens: float = 1.0
    # Add meta_info["sim_model_time"] to every final answer (not SGLang's: off by default).
    model_times: bool = False

    def __post_init__(self) -> None:
        self.error_statuses = tuple(self.error_statuses)
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        if self.decode_tokens_per_s <= 0:
            raise ValueError("decode_tokens_per_s must be positive")
        if self.engine_profile not in PROFILES:
            raise ValueError(f"engine_profile must be one of {', '.join(PROFILES)}, got {self.engine_profile!r}")
        if not 0.0 <= self.tool_call_rate <= 1.0:
            raise ValueError("tool_call_rate must be in [0, 1]")
        if not 0 < self.length_median <= self.length_p99:
            raise ValueError("need 0 < length_median <= length_p99")
        if self.context_length < 2:
            raise ValueError("context_length must be at least 2")
        validate_faults({name: getattr(self, name) for name in FAULT_FIELDS})


def validate_faults(values: dict[str, Any]) -> dict[str, Any]:
    """Check fault settings (from SimConfig or /sim/faults); returns them normalized."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in FAULT_FIELDS:
            raise ValueError(f"unknown fault setting {name!r}; known: {', '.join(FAULT_FIELDS)}")
        if name == "error_statuses":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(v, int) and not isinstance(v, bool) and 400 <= v <= 599 for v in value)):
                raise ValueError("error_statuses must be a non-empty list of HTTP error codes (400-599)")
            out[name] = tuple(value)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number")
        if name.endswith("_rate") and not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
        if (name.endswith("_s") or name.endswith("_tokens")) and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        out[name] = float(value)
    return out


# --------------------------------------------------------------------------------------
# The engine: plans and timers
# --------------------------------------------------------------------------------------


def _budget(req: SimRequest) -> int:
    """The output tokens `req` may produce in all, as SGLang's estimate counts them: its
    max_new_tokens, clipped. (Less what it produced: what it may still add to the cache.)"""
    return min(req.spec.max_new_tokens, _CLIP_MAX_NEW_TOKENS)


class SimRequest(EngineRequest):
    """A request whose whole output is planned up front and released step by step."""

    __slots__ = ("plan", "done_tokens", "start_step", "segment", "ready_at", "prefill_left", "kv_tokens",
                 "kv_waited", "first_token_at", "last_token_at")

    def __init__(self, spec: GenSpec, created: float, future: asyncio.Future, seed_material: str,
                 cached_tokens: int, plan: Plan) -> None:
        super().__init__(spec, created, future, seed_material, cached_tokens)
        self.plan = plan
        self.done_tokens = 0  # tokens produced before the current decoding segment
        self.start_step = 0  # the engine step at which the current segment began decoding
        self.segment = 0  # numbers decoding segments, so a stale finish entry is ignored
        self.ready_at = 0.0  # flat profile: loop time its fixed prefill ends
        self.prefill_left = 0  # chunked profiles: prompt tokens still to prefill
        self.kv_tokens = 0  # KV cache held, not counting the current segment's tokens
        self.kv_waited = False  # counted once in stats["kv_waits"]
        self.first_token_at: float | None = None  # model time (the end of the step that made it)
        self.last_token_at: float | None = None  # of the last token of the last segment ended


class SimEngine(Engine):
    """Scheduling from engines/core.py; tokens from a plan, released one per engine step.

    The engine runs steps back to back while it has work. Each step decodes one token
    for every request in `_decoding` and prefills up to a chunk of the requests in
    `_prefilling`; its length comes from the profile (engines/profiles.py). Steps are
    counted lazily: `_advance(now)` completes every step that ended by `now` (pure
    bookkeeping, safe from any hook), and one timer wakes `_on_timer` to end requests
    and retract when the cache is full, the only changes to the core's state. Steps stop
    at a boundary that needs `_on_timer` (`_resume_at`) and go on from it.
    """

    config: SimConfig

    def __init__(self, config: SimConfig, tokenizer: ByteTokenizer) -> None:
        super().__init__(config, tokenizer)
        self.profile = engine_profile(config.engine_profile)
        self._prefix_cache: OrderedDict[bytes, None] = OrderedDict()
        self._fault_rng = random.Random(f"{config.seed}|faults")
        self._abort_rng = random.Random(f"{config.seed}|aborts")  # apart: the other draws stay as they were
        self._step = 0  # steps completed
        self._step_end: float | None = None  # end of the step in progress; None: idle, stopped or held
        self._step_done_at = 0.0  # end of the last step completed (model time)
        self._resume_at: float | None = None  # the boundary steps stopped at for _on_timer; the next begins there
        self._settling = False  # _on_timer is ending requests and admitting: no step begins yet
        self._held = False  # hold(): no step begins
        self._step_first: list[SimRequest] = []  # make their first token in the step in progress
        self._step_prefill: list[tuple[SimRequest, int]] = []  # prefill chunk of the step in progress
        self._step_decoders = 0  # requests decoding in the step in progress
        self._decoding: dict[str, SimRequest] = {}
        self._start_sum = 0  # sum of start_step over _decoding, so the cache's size is O(1)
        self._joining: list[SimRequest] = []  # join the decode batch at the next step
        self._prefilling: deque[SimRequest] = deque()
        self._finishes: list[tuple[int, int, int, SimRequest]] = []  # heap: (finish step, tiebreak, segment, req)
        self._serial = 0
        self._ended: list[SimRequest] = []  # produced everything; ended by the next _on_timer
        self._kv_held = 0
        self._budget_held = 0  # prompt + clipped max_new_tokens of every request holding cache
        self._stalled = False  # the next step does not fit the cache: _on_timer retracts
        self._timer: asyncio.Handle | None = None
        self._soon = False  # _timer is a call_soon

    def skill(self) -> float:
        version = self.weight_version
        steps = int(version) if version.isdigit() else 0
        return min(1.0, max(0.0, self.config.skill + self.config.skill_gain_per_version * steps))

    def _cached_tokens(self, digest: bytes, length: int) -> int:
        """Exact-prompt prefix cache: a repeated prompt reuses all but its last token."""
        hit = digest in self._prefix_cache
        self._prefix_cache[digest] = None
        self._prefix_cache.move_to_end(digest)
        if len(self._prefix_cache) > _CACHE_ENTRIES:
            self._prefix_cache.popitem(last=False)
        return length - 1 if hit else 0

    # -- faults ------------------------------------------------------------------------

    def draw_fault(self) -> tuple[str | None, bool]:
        """One draw per fault kind, in a fixed order, so runs are reproducible."""
        rng, cfg = self._fault_rng, self.config
        hang, drop_, error_, spike = (rng.random() for _ in range(4))
        kind = None
        if hang < cfg.hang_rate:
            kind = "hang"
        elif drop_ < cfg.drop_rate:
            kind = "drop"
        elif error_ < cfg.error_rate:
            kind = "error"
        return kind, spike < cfg.latency_spike_rate

    def error_status(self) -> int:
        return self._fault_rng.choice(self.config.error_statuses)

    # -- the step clock ----------------------------------------------------------------

    @property
    def kv_tokens(self) -> int:
        """Tokens in the KV cache: held by every running or frozen request."""
        return self._kv_held + len(self._decoding) * self._step - self._start_sum

    def step_s(self, decoders: int | None = None, prefill_tokens: int = 0) -> float:
        """Length of a step with this many requests decoding (default: as now)."""
        decoders = len(self._decoding) if decoders is None else decoders
        return self.profile.step_factor(decoders, self.kv_tokens, prefill_tokens) / self.config.decode_tokens_per_s

    def _segment_progress(self, req: SimRequest) -> int:
        return self._step - req.start_step if req.rid in self._decoding else 0

    def _advance(self, now: float) -> None:
        """Complete every step that ended by `now` and start the next ones, up to a
        step that ended requests: the scheduler ends them and admits the queue before
        the next step, which `_kick` then begins at this one's end."""
        while self._step_end is not None and self._step_end <= now:
            end = self._step_end
            self._complete_step(end)
            if self._ended:
                self._step_end, self._step_decoders, self._resume_at = None, 0, end
                break
            self._begin_step(end)
        if self._ended or self._stalled:
            self._wake_soon()

    def _complete_step(self, end: float) -> None:
        self._step += 1
        self._step_done_at = end
        self.stats["decode_tokens"] += self._step_decoders
        for req in self._step_first:
            if self._decoding.get(req.rid) is req:  # not stopped during the step
                req.first_token_at = end
        self._step_first = []
        for req, tokens in self._step_prefill:
            if req.prefill_left == 0 and req in self._prefilling:
                self._prefilling.remove(req)
                self._joining.append(req)
        self._step_prefill = []
        while self._finishes and self._finishes[0][0] <= self._step:
            _, _, segment, req = heapq.heappop(self._finishes)
            if req.segment == segment and req.rid in self._decoding:
                self._end_segment(req)
                self._ended.append(req)

    def _begin_step(self, at: float) -> None:
        """Start a step at `at` if there is work; stall instead if it does not fit the cache."""
        joined = [r for r in self._joining if r.ready_at <= at]
        if joined:
            self._joining = [r for r in self._joining if r.ready_at > at]
            for req in joined:
                req.segment += 1
                req.start_step = self._step
                self._decoding[req.rid] = req
                self._start_sum += self._step
                heapq.heappush(self._finishes, (self._step + len(req.plan.tokens) - req.done_tokens, self._serial,
                                                req.segment, req))
                self._serial += 1
                if req.first_token_at is None:
                    self._step_first.append(req)
        chunk, budget = [], self.profile.chunked_prefill_size
        for req in self._prefilling:
            if budget <= 0:
                break
            take = min(req.prefill_left, budget)
            req.prefill_left -= take
            budget -= take
            chunk.append((req, take))
        decoders = len(self._decoding)
        if not decoders and not chunk:
            self._step_end, self._step_decoders = None, 0
            return
        if self.kv_tokens + decoders > self.config.max_total_num_tokens and decoders > 1:
            for req, take in chunk:  # undone: the step does not run
                req.prefill_left += take
            self._step_end, self._stalled, self._step_decoders, self._resume_at = None, True, 0, at
            return
        self._step_prefill, self._step_decoders = chunk, decoders
        self._step_end = at + self.step_s(decoders, sum(take for _, take in chunk))

    def _end_segment(self, req: SimRequest) -> None:
        """`req` stops decoding: its tokens so far become its own."""
        progress = self._step - req.start_step
        if progress:
            req.last_token_at = self._step_done_at
        req.done_tokens += progress
        req.kv_tokens += progress
        self._kv_held += progress
        self._start_sum -= req.start_step
        del self._decoding[req.rid]

    def _kick(self, now: float) -> None:
        """Start stepping if idle (where steps stopped for `_on_timer`, else now), and
        set the timer for the next thing to end."""
        if self._step_end is None and not (self._stalled or self._settling or self._held):
            at, self._resume_at = self._model_now(now), None
            self._begin_step(at)
        self._schedule(now)

    def _model_now(self, now: float) -> float:
        """Where the engine's schedule stands: the boundary steps stopped at for
        `_on_timer` until the next step begins there, else the loop's clock."""
        return now if self._resume_at is None else self._resume_at

    def hold(self, held: bool = True) -> None:
        """While held no step begins: requests that arrive queue and are admitted, and
        the first step begins at the release, so a harness can queue a whole run
        before it starts, as a benchmark that sends every request at once means to."""
        if held and self._step_end is not None:
            raise ValueError("hold an idle engine: steps are running")
        self._held = held
        if not held:
            self._kick(self.now())

    def _wake_soon(self) -> None:
        if not self._soon:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._soon = self._loop().call_soon(self._on_timer), True

    def _schedule(self, now: float) -> None:
        if self._ended or self._stalled:
            self._wake_soon()
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._soon = None, False
        wake = None
        if self._step_end is not None:
            wake = now + _WAKE_MAX_S
            if self._finishes:
                steps_left = max(0, self._finishes[0][0] - self._step - 1)
                wake = min(wake, self._step_end + steps_left * self.step_s(self._step_decoders))
        if self._joining:  # flat prefill ending while nothing decodes
            wake = min(wake if wake is not None else math.inf, min(r.ready_at for r in self._joining))
        if wake is not None:
            self._timer = self._loop().call_at(max(wake, now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._soon = None, False
        now = self.now()
        self._advance(now)
        self._settling = True  # every end and admission goes into the next step
        try:
            ended, self._ended = self._ended, []
            for req in ended:
                if req.outcome is None and req.state == State.RUNNING:
                    self._finish(req, req.plan.finish)
            if self._stalled:
                self._retract_to_fit()
            self._admit()
        finally:
            self._settling = False
        self._kick(now)

    def _retract_to_fit(self) -> None:
        """The cache cannot take the next step: retract as SGLang does (fewest tokens out
        first, then longest prompt) until it can take several more."""
        self._stalled = False
        need = lambda: self.kv_tokens + len(self._decoding) * _RETRACT_DECODE_STEPS  # noqa: E731
        while len(self._decoding) > 1 and need() > self.config.max_total_num_tokens:
            victim = min(self._decoding.values(),
                         key=lambda r: (r.done_tokens + self._segment_progress(r), -len(r.spec.input_ids)))
            self._retract(victim)

    # -- hooks -------------------------------------------------------------------------

    def _create(self, spec: GenSpec, created: float, digest: bytes, seed_material: str,
                parallel: bool) -> SimRequest:
        if parallel and digest not in self._prefix_cache:
            # SGLang prefills an n > 1 prompt once before its samples: they all hit the cache.
            self._prefix_cache[digest] = None
        skill = self.skill()
        produced = 0
        if spec.sampling_seed is not None:
            # A per-sample seed decides the whole response on every engine, so a request
            # continued after an abort ends where the uninterrupted one would have.
            key = f"sample:{spec.sampling_seed}"
            produced = split_continuation(key, spec.input_ids, self.tokenizer, self.config, skill,
                                          spec.min_new_tokens)
        else:
            key = seed_material
        plan = plan_generation(spec, key, self.tokenizer, self.config, skill, produced)
        if self.config.abort_rate and self._abort_rng.random() < self.config.abort_rate:
            cut = int(self.config.abort_after_tokens)
            if cut < len(plan.tokens):
                self.stats["storm_aborts"] += 1
                plan = Plan(plan.tokens[:cut], plan.logprobs[:cut], dict(ABORT_RUNNING))
        return SimRequest(spec, created, self._loop().create_future(), seed_material,
                          self._cached_tokens(digest, len(spec.input_ids)), plan)

    def _can_admit(self, req: SimRequest) -> bool:
        """SGLang admits a request when its prompt and a share of its output budget fit."""
        if not self.running:
            return True
        self._advance(self.now())
        need = len(req.spec.input_ids) + req.done_tokens + _NEW_TOKEN_RATIO * max(0, _budget(req) - req.done_tokens)
        set_aside = _NEW_TOKEN_RATIO * max(0, self._budget_held - self.kv_tokens)  # the running ones' share
        if self.kv_tokens + set_aside + need <= self.config.max_total_num_tokens:
            return True
        if not req.kv_waited:
            req.kv_waited = True
            self.stats["kv_waits"] += 1
        return False

    def _start(self, req: SimRequest, prefill: bool) -> None:
        now = self.now()
        self._advance(now)
        if prefill:  # new, or retracted: the whole context goes (back) into the cache
            context = len(req.spec.input_ids) + req.done_tokens
            req.kv_tokens = context
            self._kv_held += context
            self._budget_held += len(req.spec.input_ids) + _budget(req)
            if self.profile.chunked:
                req.prefill_left = max(1, context - req.cached_tokens)
                self._prefilling.append(req)
            else:
                req.ready_at = self._model_now(now) + self.config.prefill_s
                self._joining.append(req)
        else:  # continued after an in_place pause: its cache is still there
            req.ready_at = self._model_now(now)
            self._joining.append(req)
        self._kick(now)

    def _stop(self, req: SimRequest) -> None:
        """Stop producing for `req`, keeping what it produced so far."""
        now = self.now()
        self._advance(now)
        if req.rid in self._decoding:
            self._end_segment(req)
        elif req in self._joining:
            self._joining.remove(req)
        elif req in self._prefilling:
            self._prefilling.remove(req)
        req.prefill_left = 0
        self._schedule(now)

    def _evict(self, req: SimRequest) -> None:
        if req.kv_tokens:  # it held cache (prefilled since it last left)
            self._budget_held -= len(req.spec.input_ids) + _budget(req)
        self._kv_held -= req.kv_tokens
        req.kv_tokens = 0

    def produced(self, req: SimRequest) -> int:
        if req.outcome is not None:
            return req.done_tokens
        self._advance(self.now())
        # While running, the last token arrives together with the finish reason.
        return min(req.done_tokens + self._segment_progress(req), len(req.plan.tokens) - 1)

    def output(self, req: SimRequest) -> Output:
        count, spec = self.produced(req), req.spec
        out = Output(tokens=req.plan.tokens[:count], logprobs=req.plan.logprobs[:count])
        if spec.return_logprob and spec.logprob_start_len >= 0:
            prompt_rng = random.Random(req.seed_material + "|input")
            out.input_logprobs = [None if pos == 0 else -abs(prompt_rng.gauss(0.0, 2.0))
                                  for pos in range(min(spec.logprob_start_len, len(spec.input_ids)),
                                                   len(spec.input_ids))]
        if spec.return_logprob and spec.top_logprobs_num > 0:
            out.top_logprobs = [self._top_entries(req, i, spec.top_logprobs_num) for i in range(count)]
        return out

    @staticmethod
    def _top_entries(req: SimRequest, index: int, k: int) -> list[tuple[float, int]]:
        """The sampled token first, then k-1 less likely alternatives (deterministic)."""
        rng = random.Random(f"{req.seed_material}|top|{index}")
        lp, sampled = req.plan.logprobs[index], req.plan.tokens[index]
        entries = [(lp, sampled)]
        for _ in range(k - 1):
            lp -= abs(rng.gauss(0.0, 1.0)) + 0.01
            entries.append((lp, rng.randrange(256)))
        return entries

    async def _load_weights(self, source: WeightSource, model_path: str | None, epoch: asyncio.Future) -> None:
        if self.config.weight_update_s:
            await self.sleep(self.config.weight_update_s, epoch)
        if self._fault_rng.random() < self.config.weight_update_fail_rate:
            raise WeightLoadError("simulated failure (fault injection).")

    def _flush(self) -> None:
        self._prefix_cache.clear()

    def decoding(self) -> int:
        """Requests producing tokens now (running past their prefill, not frozen)."""
        self._advance(self.now())
        return len(self._decoding)

    def throughput(self) -> float:
        decoders = self.decoding()
        return decoders / self.step_s() if decoders else 0.0

    def describe(self) -> dict[str, Any]:
        return {"model_type": "sim-byte-lm", "architectures": ["SimulatedByteLM"], "simulator": True}

    # -- restart -----------------------------------------------------------------------

    def restart(self, downtime: float) -> int:
        """Lose everything in flight; unavailable for `downtime` seconds."""
        dropped = self.drop_all()
        self._ended.clear()
        self._step_end, self._stalled, self._resume_at, self._step_first = None, False, None, []
        self.weight_version = self.config.weight_version  # a restart reloads the startup weights
        self.model_path = self.config.model_path
        self._prefix_cache.clear()
        self.unavailable_until = self.now() + downtime if downtime > 0 else 0.0
        self.stats["restarts"] += 1
        logger.warning("simulated engine restart: %d requests dropped, down for %.2fs", dropped, downtime)
        return dropped


# --------------------------------------------------------------------------------------
# HTTP: the shared server plus fault injection and /sim/*
# --------------------------------------------------------------------------------------


class SimServer(EngineServer):
    engine: SimEngine

    def __init__(self, config: SimConfig | None = None) -> None:
        config = config or SimConfig()
        super().__init__(SimEngine(config, ByteTokenizer()), stream_interval_s=config.stream_interval_s)

    def _render(self, req: SimRequest, stream: bool) -> dict:  # the engine makes SimRequests only
        answer = super()._render(req, stream)
        if self.config.model_times and req.outcome is not None:
            answer["meta_info"]["sim_model_time"] = {"first_token": req.first_token_at,
                                                     "last_token": req.last_token_at}
        return answer

    async def before_submit(self, request: web.Request) -> web.StreamResponse | None:
        engine, cfg = self.engine, self.config
        fault, spike = engine.draw_fault()
        epoch = engine.epoch()
        if spike:
            engine.stats["latency_spikes"] += 1
            await engine.sleep(cfg.latency_spike_s, epoch)
        if fault == "hang":
            engine.stats["hangs"] += 1
            await engine.wait(asyncio.get_running_loop().create_future(), epoch)  # until disconnect or restart
        if fault == "drop":
            engine.stats["drops"] += 1
            return drop(request)
        if fault == "error":
            engine.stats["errors"] += 1
            status = engine.error_status()
            message = ("Simulated engine failure (fault injection)." if status != 503
                       else "Simulated: the engine is overloaded, retry later (fault injection).")
            return error_response(message, status)
        return None

    def faults(self) -> dict[str, Any]:
        return {name: (list(v) if isinstance(v := getattr(self.config, name), tuple) else v)
                for name in FAULT_FIELDS}

    async def sim_faults(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                updates = validate_faults(await read_body(request))
            except (SchemaError, ValueError) as exc:
                return error(str(exc))
            for name, value in updates.items():
                setattr(self.config, name, value)
            logger.info("fault settings changed: %s", updates)
        return json_reply(self.faults())

    async def sim_restart(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request, optional=True)
            downtime = validate_faults({"restart_s": body.get("restart_s", self.config.restart_s)})["restart_s"]
        except (SchemaError, ValueError) as exc:
            return error(str(exc))
        dropped = self.engine.restart(downtime)
        return json_reply({"status": "restarting", "restart_s": downtime, "dropped_requests": dropped})

    async def sim_stats(self, request: web.Request) -> web.Response:
        engine = self.engine
        return json_reply({"stats": dict(engine.stats), "load": engine.load(), "decoding": engine.decoding(),
                           "kv_tokens": engine.kv_tokens, "step_s": engine.step_s(),
                           "engine_profile": engine.profile.name, "paused": engine.paused,
                           "weight_version": engine.weight_version})

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_route("GET", "/sim/faults", self.sim_faults)
        router.add_route("POST", "/sim/faults", self.sim_faults)
        router.add_post("/sim/restart", self.sim_restart)
        router.add_get("/sim/stats", self.sim_stats)


async def serve(config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 30000) -> None:
    """Run a simulator until cancelled."""
    await serve_engine(lambda: SimServer(config), host, port)


def start_simulator(config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> ServerHandle:
    """Start a simulator in a daemon thread; port 0 picks a free port (see `.url`)."""
    return start_in_thread(lambda: SimServer(config), host, port, name="sglang-simulator")
