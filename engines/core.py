"""The request life cycle every engine backend shares, as SGLang's scheduler runs it.

Requests wait FIFO and at most `max_running_requests` run at once. Pause in `abort`,
`retract` or `in_place` mode, continue, abort by rid prefix; new /generate calls are
held at an admission gate while paused or while weights load (SGLang's
model_update_lock); every answer carries the weight version current when its request
ended. A backend (engines/simulator.py, engines/torch_engine.py) subclasses `Engine`
and says how tokens are produced through a few hooks:

- `_create(spec, ...)` builds its request object; `_start(req, prefill)` makes it
  produce tokens; `_stop(req)` freezes it (keeping its cache); `_evict(req)` drops its
  cache (retracted or ended); `_finish(req, finish)` is what the backend calls when a
  request ends by itself.
- `output(req)` answers "what has this request produced so far", the only thing the
  HTTP layer (engines/server.py) reads from a request besides its bookkeeping.
- `_load_weights(source, path)` loads new weights.

All methods run on the server's event loop.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable

from pipeline.types import PauseMode, choices

from .generate_request import GenSpec
from workers.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

_SEED_ENTRIES = 100_000  # bound on the per-prompt draw counters (see Engine.sample_key)
ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


class State(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FROZEN = "frozen"  # paused in place, keeping its slot and cache
    DONE = "done"


class Outcome(str, Enum):
    FINISHED = "finished"
    ABORTED = "aborted"
    DROPPED = "dropped"  # lost to a restart or shutdown: the connection is dropped


class WeightSource(str, Enum):
    """Which update_weights_* endpoint asked."""

    DISK = "disk"
    TENSOR = "tensor"
    DISTRIBUTED = "distributed"


@dataclass
class EngineSettings:
    """What every backend has; SimConfig and TorchEngineConfig extend it."""

    seed: int = 0
    model_path: str = "byte-lm"
    served_model_name: str | None = None  # defaults to model_path
    weight_version: str = "default"
    context_length: int = 32768
    max_total_num_tokens: int = 1_000_000  # KV capacity in tokens (/v1/loads; the simulator enforces it)
    max_running_requests: int = 256
    startup_s: float = 0.0  # /health answers 503 this long after start
    # Streams (engines/server.py), as SGLang's --stream-interval (tokens between chunks; a
    # request's sampling_params.stream_interval overrides it) and --incremental-streaming-output
    # (each chunk carries its new tokens only; by default every chunk carries all so far).
    stream_interval: int = 1
    incremental_streaming_output: bool = False


@dataclass
class Output:
    """What a request has produced so far."""

    tokens: list[int]
    logprobs: list[float]  # of each token, from the distribution it was sampled from
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)  # per token, when asked
    input_logprobs: list[float | None] = field(default_factory=list)  # prompt from logprob_start_len, when asked


class EngineRequest:
    """One sub-request inside the engine; backends add their own state."""

    __slots__ = ("spec", "created", "future", "state", "outcome", "finish", "finished_at", "weight_version",
                 "in_queue_abort", "retractions", "cached_tokens", "seed_material")

    def __init__(self, spec: GenSpec, created: float, future: asyncio.Future, seed_material: str,
                 cached_tokens: int = 0) -> None:
        self.spec = spec
        self.created = created
        self.future = future
        self.state = State.WAITING
        self.outcome: Outcome | None = None
        self.finish: dict | None = None
        self.finished_at = 0.0
        self.weight_version = ""  # the server's version when the request ended
        self.in_queue_abort = False
        self.retractions = 0
        self.cached_tokens = cached_tokens
        self.seed_material = seed_material

    @property
    def rid(self) -> str:
        return self.spec.rid


class Restarted(Exception):
    """The engine restarted (or shut down) while a call was waiting."""


class WeightLoadError(Exception):
    """Loading weights failed; the message says why (the HTTP answer is success=false)."""


#: SGLang 0.5.23's answer when the weights loaded but the cache could not be flushed
#: (scheduler_components/weight_updater.py, flush_cache_after_weight_update). 0.5.15 and
#: 0.5.20 (the image compose pins) assert instead, which kills the scheduler.
CACHE_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                     "queued. Retract or finish them, then call /flush_cache.")


class CacheNotFlushed(WeightLoadError):
    """The new weights are loaded, but a flush was asked for while requests are live (a
    pause in retract or in_place mode): SGLang fails the call and, since it failed,
    records neither the new model path nor the new version."""


class Engine:
    """The scheduler state machine; subclasses implement the hooks below."""

    def __init__(self, config: EngineSettings, tokenizer: ByteTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.weight_version = config.weight_version
        self.model_path = config.model_path
        # SGLang's tokenizer_path: what the server was started with, unchanged by weight updates.
        self.tokenizer_path = config.model_path
        self.vocab_size: int = tokenizer.vocab_size  # ids /generate accepts; a backend may serve more
        self.paused = False
        self.requests: dict[str, EngineRequest] = {}  # every live request, by rid
        self.running: dict[str, EngineRequest] = {}  # running or frozen (in_place pause)
        self.waiting: deque[EngineRequest] = deque()
        self.unavailable_until = 0.0  # loop time; 503 before it (startup, restart)
        self.stats: Counter[str] = Counter()
        self._writers = 0  # weight updates holding SGLang's model_update_lock
        self._gate: asyncio.Future | None = None  # resolved when admission reopens
        self._epoch: asyncio.Future | None = None  # resolved on restart / shutdown
        self._idle: asyncio.Future | None = None  # resolved when no request is live
        self._occurrences: OrderedDict[bytes, int] = OrderedDict()

    # -- hooks -------------------------------------------------------------------------

    def _create(self, spec: GenSpec, created: float, digest: bytes, seed_material: str,
                parallel: bool) -> EngineRequest:
        raise NotImplementedError

    def check(self, specs: list[GenSpec]) -> None:
        """Raise ValueError (a 400 naming the parameter) for what this backend cannot do."""

    def _start(self, req: EngineRequest, prefill: bool) -> None:
        """`req` is running: produce its tokens. `prefill`: it is new or was retracted."""
        raise NotImplementedError

    def _stop(self, req: EngineRequest) -> None:
        """Stop producing for `req`, keeping what it produced and its cache."""

    def _evict(self, req: EngineRequest) -> None:
        """Drop `req`'s cache: it ended or was retracted."""

    def _can_admit(self, req: EngineRequest) -> bool:
        """Whether the waiting `req` fits now (the KV cache); it waits at the head otherwise."""
        return True

    def output(self, req: EngineRequest) -> Output:
        """What `req` has produced so far (everything, once it ended)."""
        raise NotImplementedError

    def produced(self, req: EngineRequest) -> int:
        """How many tokens `req` has produced so far."""
        return len(self.output(req).tokens)

    async def _load_weights(self, source: WeightSource, model_path: str | None, epoch: asyncio.Future) -> None:
        """Load new weights; raise WeightLoadError with the reason on failure."""

    def _flush(self) -> None:
        """Drop cached prefixes (nothing is running)."""

    def throughput(self) -> float:
        """Generated tokens per second right now, for /v1/loads."""
        return 0.0

    def describe(self) -> dict[str, Any]:
        """Backend facts for /get_model_info and /get_server_info."""
        return {"model_type": "byte-lm", "architectures": ["ByteLM"]}

    async def start(self) -> None:
        """Called on the server's loop before it answers."""
        if self.config.startup_s > 0:
            self.unavailable_until = self.now() + self.config.startup_s

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def now(self) -> float:
        return self._loop().time()

    def unavailable(self) -> bool:
        return self.unavailable_until > 0 and self.now() < self.unavailable_until

    def epoch(self) -> asyncio.Future:
        if self._epoch is None or self._epoch.done():
            self._epoch = self._loop().create_future()
        return self._epoch

    async def wait(self, fut: asyncio.Future, epoch: asyncio.Future) -> None:
        """Wait for `fut`; raise Restarted if the engine restarts first."""
        await asyncio.wait((fut, epoch), return_when=asyncio.FIRST_COMPLETED)
        if epoch.done():
            raise Restarted()

    async def sleep(self, seconds: float, epoch: asyncio.Future) -> None:
        """asyncio.sleep that raises Restarted if the engine restarts meanwhile."""
        task = asyncio.ensure_future(asyncio.sleep(seconds))
        try:
            await self.wait(task, epoch)
        finally:
            task.cancel()

    async def wait_admission(self) -> None:
        """SGLang blocks new /generate calls while paused or during a weight update."""
        epoch = self.epoch()
        while self.paused or self._writers:
            if self._gate is None or self._gate.done():
                self._gate = self._loop().create_future()
            await self.wait(self._gate, epoch)

    def _open_gate(self) -> None:
        if not self.paused and not self._writers and self._gate is not None and not self._gate.done():
            self._gate.set_result(None)

    def sample_key(self, spec: GenSpec, digest: bytes) -> str:
        """What makes two samples of one prompt differ, reproducibly:
        greedy → nothing; `sampling_seed` → that seed; a client-chosen rid → the rid;
        otherwise the k-th request for this exact prompt on this server gets draw k."""
        if spec.greedy:
            return "greedy"
        if spec.sampling_seed is not None:
            return f"seed:{spec.sampling_seed}"
        if spec.client_rid:
            return f"rid:{spec.rid}"
        count = self._occurrences.pop(digest, 0)
        self._occurrences[digest] = count + 1
        if len(self._occurrences) > _SEED_ENTRIES:
            self._occurrences.popitem(last=False)
        return f"draw:{count}"

    # -- submission and scheduling -------------------------------------------------------

    def submit(self, specs: list[GenSpec], created: float, parallel: bool = False) -> list[EngineRequest]:
        """Queue sub-requests; `parallel` marks the samples of n > 1 prompts."""
        duplicate = next((s.rid for s in specs if s.rid in self.requests), None)
        if duplicate is not None:
            raise ValueError(f"Duplicate request ID detected: {duplicate}")
        reqs = []
        for spec in specs:
            digest = hashlib.blake2b(array("i", spec.input_ids).tobytes(), digest_size=16).digest()
            seed_material = f"{self.config.seed}|{digest.hex()}|{self.sample_key(spec, digest)}"
            req = self._create(spec, created, digest, seed_material, parallel)
            self.requests[spec.rid] = req
            self.waiting.append(req)
            reqs.append(req)
        self.stats["submitted"] += len(reqs)
        self._admit()
        return reqs

    def _admit(self) -> None:
        while (not self.paused and self.waiting and len(self.running) < self.config.max_running_requests
               and self._can_admit(self.waiting[0])):
            self._run(self.waiting.popleft(), prefill=True)

    def _run(self, req: EngineRequest, prefill: bool) -> None:
        req.state = State.RUNNING
        self.running[req.rid] = req
        self._start(req, prefill)

    def _finish(self, req: EngineRequest, finish: dict) -> None:
        """A running request ended by itself (stop or length)."""
        self.running.pop(req.rid, None)
        self._evict(req)
        self._complete(req, Outcome.FINISHED, finish)
        self._admit()

    def _retract(self, req: EngineRequest) -> None:
        """Send a running request back to the head of the queue; its KV is recomputed
        when it runs again (SGLang's retraction, on a full cache or a retract pause)."""
        self._stop(req)
        self._evict(req)
        req.state = State.WAITING
        req.retractions += 1
        self.stats["retractions"] += 1
        self.running.pop(req.rid, None)
        self.waiting.appendleft(req)

    def _complete(self, req: EngineRequest, outcome: Outcome, finish: dict | None) -> None:
        req.state = State.DONE
        req.outcome, req.finish = outcome, finish
        req.finished_at = self.now()
        req.weight_version = self.weight_version
        self.requests.pop(req.rid, None)
        self.stats[outcome.value] += 1
        if not req.future.done():
            req.future.set_result(outcome)
        if not self.requests and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    # -- abort, pause, continue ----------------------------------------------------------

    def _abort(self, req: EngineRequest) -> None:
        if req.state == State.WAITING:
            self.waiting.remove(req)
            req.in_queue_abort = True  # a retracted request keeps its partial output
            self._complete(req, Outcome.ABORTED, dict(ABORT_WAITING))
        else:
            self._stop(req)
            self.running.pop(req.rid, None)
            self._evict(req)
            self._complete(req, Outcome.ABORTED, dict(ABORT_RUNNING))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang's semantics: the rid must be a live request's exact id (else
        nothing happens); then every live rid starting with it is aborted."""
        if abort_all:
            targets = list(self.requests.values())
        elif not rid or rid not in self.requests:
            return 0
        else:
            targets = [r for key, r in self.requests.items() if key.startswith(rid)]
        for req in targets:
            self._abort(req)
        self._admit()
        return len(targets)

    def cancel(self, reqs: Iterable[EngineRequest]) -> None:
        """The client went away: free the slots (SGLang aborts on disconnect)."""
        for req in reqs:
            if req.outcome is None:
                self._abort(req)
        self._admit()

    def pause(self, mode: str) -> None:
        if mode not in choices(PauseMode):
            raise ValueError(f"mode must be one of {', '.join(map(repr, choices(PauseMode)))}, got {mode!r}")
        self.paused = True
        if mode == "abort":
            for req in list(self.requests.values()):
                self._abort(req)
        elif mode == "retract":
            for req in reversed(list(self.running.values())):  # reversed: they keep their order
                self._retract(req)
        else:  # in_place: requests keep their slot and KV, and continue on resume
            for req in self.running.values():
                if req.state == State.RUNNING:
                    self._stop(req)
                    req.state = State.FROZEN
        logger.info("generation paused (mode=%s): %d running, %d waiting", mode,
                    len(self.running), len(self.waiting))

    def resume(self) -> None:
        self.paused = False
        for req in list(self.running.values()):
            if req.state == State.FROZEN:
                self._run(req, prefill=False)
        self._admit()
        self._open_gate()
        logger.info("generation continued")

    # -- weights and cache ---------------------------------------------------------------

    def flush_cache(self) -> bool:
        if self.requests:
            return False
        self._flush()
        return True

    async def update_weights(self, source: WeightSource, model_path: str | None, version: str | None,
                             abort_all: bool = False, flush: bool = True) -> None:
        """Take SGLang's model_update_lock as writer: unless paused, wait for every live
        request to finish while new ones are held back; then load. Raises
        WeightLoadError (nothing changed), CacheNotFlushed (loaded, not recorded) or Restarted."""
        epoch = self.epoch()
        if abort_all:
            self.abort_request(abort_all=True)
        if self.paused:
            await self._checked_load(source, model_path, epoch)
        else:
            self._writers += 1
            try:
                while self.requests:
                    if self._idle is None or self._idle.done():
                        self._idle = self._loop().create_future()
                    await self.wait(self._idle, epoch)
                await self._checked_load(source, model_path, epoch)
            finally:
                self._writers -= 1
                self._open_gate()
        self.stats["weight_updates"] += 1
        if flush and self.requests and source == WeightSource.DISK:
            logger.error("weights loaded from %s, but the cache was not flushed: %d requests live",
                         model_path, len(self.requests))
            raise CacheNotFlushed(CACHE_NOT_FLUSHED)
        if flush and not self.requests:
            self._flush()
        if source == WeightSource.DISK:
            self.model_path = model_path
        if version is not None:
            self.weight_version = version
        logger.info("weights updated (%s), version=%s", source.value, self.weight_version)

    async def _checked_load(self, source: WeightSource, model_path: str | None, epoch: asyncio.Future) -> None:
        if source == WeightSource.DISK and not model_path:
            raise WeightLoadError("model_path is empty.")
        await self._load_weights(source, model_path, epoch)

    def set_weight_version(self, version: str, abort_all: bool = True) -> None:
        """/update_weight_version: a new label for the weights already loaded."""
        if abort_all:
            self.abort_request(abort_all=True)
        self.weight_version = version

    # -- shutdown and load ---------------------------------------------------------------

    def _fail(self, reqs: list[EngineRequest], message: str) -> None:
        """End requests with an internal error: SGLang answers these with HTTP 500."""
        for req in reqs:
            if req.state == State.WAITING:
                self.waiting.remove(req)
            else:
                self._stop(req)
                self.running.pop(req.rid, None)
                self._evict(req)
            self._complete(req, Outcome.ABORTED, {"type": "abort", "message": message, "status_code": 500,
                                                  "err_type": "InternalServerError"})
        self._admit()

    def close(self) -> None:
        """The server is shutting down."""
        self.drop_all()

    def drop_all(self) -> int:
        """Lose every request and wake every waiting handler, which then drops its
        connection (used by restart and by server shutdown)."""
        dropped = list(self.requests.values())
        for req in dropped:
            if req.state in (State.RUNNING, State.FROZEN):
                self._stop(req)
                self._evict(req)
            self._complete(req, Outcome.DROPPED, None)
        self.running.clear()
        self.waiting.clear()
        self.paused = False
        if self._epoch is not None and not self._epoch.done():
            self._epoch.set_result(None)
        self._epoch = None
        self._open_gate()
        return len(dropped)

    def load(self) -> dict[str, Any]:
        used = sum(len(r.spec.input_ids) + self.produced(r) for r in self.running.values())
        total = self.config.max_total_num_tokens
        usage = round(min(1.0, used / total), 4)
        return {
            "dp_rank": 0,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_waiting_uncached_tokens": sum(len(r.spec.input_ids) - r.cached_tokens for r in self.waiting),
            "num_used_tokens": used,
            "num_total_tokens": total,
            "max_total_num_tokens": total,
            "max_running_requests": self.config.max_running_requests,
            "token_usage": usage,
            "gen_throughput": round(self.throughput(), 2),
            "cache_hit_rate": 0.0,
            "utilization": usage,
        }
