"""A real PyTorch engine behind the SGLang-compatible server: `rollout torch-engine`.

The model is `engines.byte_lm.ByteLM` (random and seeded, or loaded from a
checkpoint) with the byte tokenizer, or, with `model_dir`, a Llama-family model from a
Hugging Face folder (`engines.llama.LlamaLM`) with the folder's own tokenizer: then the
vocabulary is the embedding's, the EOS ids come from generation_config.json (one id or
a list), the pad id from there or the tokenizer, and weight updates take another HF
folder of the same architecture. On CUDA when present, else CPU. The scheduling (waiting queue,
`max_running_requests`, pause modes, abort, the admission gate, weight versions) is
engines/core.py's; this module produces the tokens.

Continuous batching with a KV cache: every running request owns a slot of one
`KVCache`. Each decode step, run on the server's event loop between HTTP events,
gives every running request exactly one token: requests that joined since the last
step (or lost their cache) are prefilled together over their whole sequence, the rest
decode one position against their slot; then requests that stopped leave and waiting
ones take their slots before the next step. `retract` drops a request's cache (it is
prefilled again over prompt + output on resume); `in_place` keeps it. After a weight
update every live request is prefilled again, so tokens generated after the update
come from the new weights alone (SGLang keeps the stale cache of in-place requests;
at this size recomputing costs milliseconds and makes log-probs exact).

Log-probs (`return_logprob`): those of the distribution the token was sampled from,
softmax(logits / temperature), before top-k / top-p / min-p filtering. That is SGLang's
default (srt/layers/sampler.py: `logprobs = log(softmax(logits / T))` unless the
server runs with SGLANG_RETURN_ORIGINAL_LOGPROB, which takes them before the
temperature); a greedy request (temperature ~0) samples at temperature 1 with top-k 1,
as SGLang does, so its log-probs are those of the raw logits. A trainer reproduces them
with `byte_lm.token_logprobs(logits, tokens, temperature)`. `min_new_tokens` masks EOS
and the stop ids before the softmax, as SGLang's penalizer does. Penalties and
constrained decoding (regex, json_schema, logit_bias, ...) are rejected with a 400.

Sampling is seeded per request (`Engine.sample_key`): each request draws its uniforms
from its own generator, so a request's tokens do not depend on what else is batched
with it (up to float rounding of the batch's matmuls).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from . import llama
from .byte_lm import ByteLM, KVCache, ModelConfig, load_checkpoint
from .core import Engine, EngineRequest, EngineSettings, Output, State, WeightLoadError, WeightSource
from .server import EngineServer, ServerHandle, start_in_thread
from .server import serve as serve_engine
from .generate_request import GenSpec
from workers.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer

logger = logging.getLogger(__name__)

_GREEDY_TEMPERATURE = 1e-6  # below this SGLang samples greedily (top_k 1 at temperature 1)
_THROUGHPUT_DECAY = 0.9  # weight of the past in the tokens/s average reported by /v1/loads


@dataclass
class TorchEngineConfig(EngineSettings):
    """`model_path`: a checkpoint to start from (byte_lm.save_checkpoint); None: a fresh
    model built from `model` and initialised from `seed`."""

    model_path: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    # An HF folder of a Llama-family model (engines/llama.py), served instead of the byte-level
    # model, with its own tokenizer; `context_length` then bounds its KV cache per request.
    model_dir: str | None = None
    max_running_requests: int = 64  # KV cache slots
    device: str = "auto"  # auto: cuda when available, else cpu
    threads: int = 1  # torch CPU threads; the engine shares the machine with workers and a trainer
    min_step_s: float = 0.0  # pace decode steps (sleeping, CPU free), e.g. to emulate a GPU's step time

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        if self.threads < 1:
            raise ValueError("threads must be at least 1")
        if self.min_step_s < 0:
            raise ValueError("min_step_s must be >= 0")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")


class TorchRequest(EngineRequest):
    __slots__ = ("tokens", "logprobs", "top_logprobs", "input_logprobs", "slot", "cached", "rng", "stop_window")

    def __init__(self, spec: GenSpec, created: float, future: asyncio.Future, seed_material: str) -> None:
        super().__init__(spec, created, future, seed_material)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[float | None] = []
        self.slot: int | None = None  # KV cache slot while it holds one
        self.cached = 0  # positions of its sequence held in the slot (0: prefill next)
        self.rng = random.Random(seed_material)
        self.stop_window = 0  # output tokens decoded to look for stop strings (SGLang's stop_str_max_len + 1)

    def sequence(self) -> list[int]:
        return self.spec.input_ids + self.tokens


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           min_p: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and the log-probs of the distribution it came from.

    `logits` [B, V]; per row: temperature, top_p, top_k (V for none), min_p, and a
    uniform in [0, 1) choosing the token by inverse CDF over the kept tokens (SGLang's
    torch sampler keeps the same set: sorted by probability, those whose preceding mass
    is <= top_p, the first top_k, and those >= min_p times the largest)."""
    logprobs = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    probs, order = logprobs.exp().sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
    dropped = ((probs.cumsum(-1) - probs) > top_p[:, None]) | (ranks >= top_k[:, None])
    dropped |= probs < probs[:, :1] * min_p[:, None]
    kept = probs.masked_fill(dropped, 0.0)
    cdf = kept.cumsum(-1)
    pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    pick = torch.minimum(pick, (~dropped).sum(-1) - 1)  # the kept tokens are a prefix of `order`
    return order.gather(1, pick[:, None])[:, 0], logprobs


class TorchEngine(Engine):
    config: TorchEngineConfig

    def __init__(self, config: TorchEngineConfig, tokenizer: ByteTokenizer | None = None) -> None:
        torch.set_num_threads(config.threads)
        self.device = _device(config.device)
        self.folder: llama.HFFolder | None = None
        if config.model_dir is not None:
            model, tokenizer = self._build_llama(config)
        else:
            model, tokenizer = self._build_byte_lm(config, tokenizer or ByteTokenizer())
        config.max_total_num_tokens = config.max_running_requests * config.context_length
        super().__init__(config, tokenizer)
        self.model = model.to(self.device).eval()
        if self.folder is not None:
            self.model_path = self.tokenizer_path = str(self.folder.path)
            self.vocab_size = self.folder.config.vocab_size  # the embedding's rows, >= the tokenizer's
            facts = self.folder.generation
            self.eos_token_ids = frozenset(facts.eos_token_ids or [tokenizer.eos_token_id])
            pad = facts.pad_token_id if facts.pad_token_id is not None else tokenizer.pad_token_id
            self.pad_token_id = pad if pad is not None else min(self.eos_token_ids)
            self.cache = llama.LlamaKVCache(self.folder.config, config.max_running_requests, config.context_length,
                                            self.device)
        else:
            self.model_path = config.model_path or f"byte-lm-random-seed{config.seed}"
            self.tokenizer_path = self.model_path
            self.eos_token_ids = frozenset([tokenizer.eos_token_id])
            self.pad_token_id = tokenizer.pad_token_id
            self.cache = KVCache(config.model, config.max_running_requests, self.device)
        self._free_slots = list(range(config.max_running_requests - 1, -1, -1))
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._tokens_per_s = 0.0

    @staticmethod
    def _build_byte_lm(config: TorchEngineConfig, tokenizer: ByteTokenizer) -> tuple[ByteLM, ByteTokenizer]:
        model_config, state = config.model, None
        if config.model_path is not None:
            model_config, state = load_checkpoint(config.model_path)
        if model_config.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"model vocab_size {model_config.vocab_size} != tokenizer's {tokenizer.vocab_size}")
        # The checkpoint, if any, decides the architecture; the server reads these limits.
        config.model = model_config
        config.context_length = model_config.context_length
        model = ByteLM(model_config, seed=config.seed)
        if state is not None:
            model.load_state_dict(state)
        return model, tokenizer

    def _build_llama(self, config: TorchEngineConfig) -> tuple[llama.LlamaLM, HFTokenizer]:
        """An HF folder: the model from its config and safetensors, the tokenizer from its
        files (the engine then speaks the model's vocabulary, not bytes)."""
        folder = llama.read_folder(config.model_dir)
        try:
            tokenizer = load_tokenizer(str(folder.path))
        except TokenizerError as exc:
            raise ValueError(str(exc)) from None
        if not isinstance(tokenizer, HFTokenizer) or tokenizer.vocab_size > folder.config.vocab_size:
            raise ValueError(f"{folder.path}: the tokenizer's {tokenizer.vocab_size} ids do not fit the embedding's "
                             f"{folder.config.vocab_size} rows")
        config.context_length = min(config.context_length, folder.config.max_position_embeddings)
        with torch.device("meta"):  # no random initialisation of weights about to be replaced
            model = llama.LlamaLM(folder.config)
        model = model.to_empty(device="cpu")
        model.rotary = llama.Rotary(folder.config)  # its buffer is computed, not loaded
        if folder.config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        llama.load_weights(model, llama.load_state(folder), str(folder.path))
        self.folder = folder
        return model, tokenizer

    # -- hooks -------------------------------------------------------------------------

    def check(self, specs: list[GenSpec]) -> None:
        for spec in specs:
            if spec.penalized:
                raise ValueError("The torch engine does not apply frequency, presence or repetition penalties.")
            if spec.constrained:
                raise ValueError(f"The torch engine does not support {', '.join(spec.constrained)}.")

    def _create(self, spec: GenSpec, created: float, digest: bytes, seed_material: str,
                parallel: bool) -> TorchRequest:
        req = TorchRequest(spec, created, self._loop().create_future(), seed_material)
        if spec.stop_strs:
            req.stop_window = max(len(self.tokenizer.encode(s)) for s in spec.stop_strs) + 1
        return req

    def _start(self, req: TorchRequest, prefill: bool) -> None:
        self._work.set()

    def _evict(self, req: TorchRequest) -> None:
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot, req.cached = None, 0

    def output(self, req: TorchRequest) -> Output:
        return Output(tokens=list(req.tokens), logprobs=list(req.logprobs),
                      top_logprobs=list(req.top_logprobs), input_logprobs=list(req.input_logprobs))

    def produced(self, req: TorchRequest) -> int:
        return len(req.tokens)

    async def _load_weights(self, source: WeightSource, model_path: str | None, epoch: asyncio.Future) -> None:
        if source != WeightSource.DISK:
            raise WeightLoadError("the torch engine loads weights from disk only (/update_weights_from_disk).")
        if self.folder is not None:
            await self._load_llama(model_path)
        else:
            await self._load_byte_lm(model_path)
        for req in self.requests.values():
            req.cached = 0  # its cache holds the old weights' keys and values: prefill again

    async def _load_byte_lm(self, model_path: str) -> None:
        try:
            config, state = await asyncio.to_thread(load_checkpoint, model_path)
        except ValueError as exc:
            raise WeightLoadError(str(exc)) from None
        if config != self.config.model:
            diff = ", ".join(f"{k} {v} (running: {getattr(self.config.model, k)})"
                             for k, v in asdict(config).items() if getattr(self.config.model, k) != v)
            raise WeightLoadError(f"{model_path} is a different architecture: {diff}.")
        try:
            self.model.load_state_dict(state)
        except RuntimeError as exc:
            raise WeightLoadError(f"{model_path}: {exc}") from None

    async def _load_llama(self, model_path: str) -> None:
        """An HF folder, as SGLang's /update_weights_from_disk takes: same architecture and
        shapes as the running model (checked before anything changes), then its safetensors."""
        def read() -> dict[str, torch.Tensor]:
            folder = llama.read_folder(model_path)
            if folder.config != self.folder.config:
                running = asdict(self.folder.config)
                diff = ", ".join(f"{k} {v} (running: {running[k]})" for k, v in asdict(folder.config).items()
                                 if running[k] != v)
                raise llama.ModelFolderError(f"{model_path} is a different architecture: {diff}.")
            return llama.load_state(folder)

        try:
            state = await asyncio.to_thread(read)
            llama.load_weights(self.model, state, model_path)
        except llama.ModelFolderError as exc:
            raise WeightLoadError(str(exc)) from None

    def throughput(self) -> float:
        return self._tokens_per_s

    def describe(self) -> dict[str, Any]:
        if self.folder is not None:
            return {"model_type": self.folder.model_type, "architectures": self.folder.architectures,
                    "model_config": asdict(self.folder.config), "device": str(self.device)}
        return {"model_type": "byte-lm", "architectures": ["ByteLM"], "model_config": asdict(self.config.model),
                "device": str(self.device)}

    async def start(self) -> None:
        await super().start()
        self._task = asyncio.create_task(self._decode_loop())

    def close(self) -> None:
        super().close()
        if self._task is not None:
            self._task.cancel()

    # -- the decode loop ---------------------------------------------------------------

    async def _decode_loop(self) -> None:
        while True:
            batch = [r for r in self.running.values() if r.state == State.RUNNING]
            if not batch:
                self._work.clear()
                await self._work.wait()
                continue
            started = time.perf_counter()
            try:
                produced = self._step(batch)
            except Exception as exc:  # one bad step must not kill the engine: fail its requests loudly
                logger.exception("decode step failed; failing its %d requests", len(batch))
                self._fail([r for r in batch if r.outcome is None], f"engine error: {type(exc).__name__}: {exc}")
                continue
            elapsed = time.perf_counter() - started
            rate = produced / max(elapsed, 1e-9)
            self._tokens_per_s = _THROUGHPUT_DECAY * self._tokens_per_s + (1 - _THROUGHPUT_DECAY) * rate
            # Yield between steps: HTTP events (new requests, aborts, pauses) land here.
            await asyncio.sleep(max(0.0, self.config.min_step_s - elapsed))

    @torch.inference_mode()
    def _step(self, batch: list[TorchRequest]) -> int:
        """One token for every request in `batch`; returns how many were produced."""
        for req in [r for r in batch if r.spec.max_new_tokens == 0]:
            self._finish(req, {"type": "length", "length": 0})
        batch = [r for r in batch if r.outcome is None]
        fresh = [r for r in batch if r.cached == 0]
        ongoing = [r for r in batch if r.cached > 0]
        logits = []
        if fresh:
            logits.append(self._prefill(fresh))
        if ongoing:
            logits.append(self._decode(ongoing))
        if not logits:
            return 0
        rows = fresh + ongoing
        tokens, logprobs = self._sample(rows, torch.cat(logits))
        tokens_list = tokens.tolist()
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        top_n = max(r.spec.top_logprobs_num if r.spec.return_logprob else 0 for r in rows)
        top = torch.topk(logprobs, min(top_n, logprobs.shape[1])) if top_n else None
        for i, req in enumerate(rows):
            req.tokens.append(tokens_list[i])
            req.logprobs.append(chosen[i])
            if top is not None and req.spec.return_logprob and req.spec.top_logprobs_num:
                k = req.spec.top_logprobs_num
                req.top_logprobs.append(list(zip(top.values[i, :k].tolist(), top.indices[i, :k].tolist())))
            finish = self._stop_reason(req)
            if finish is not None:
                self._finish(req, finish)
        return len(rows)

    def _prefill(self, reqs: list[TorchRequest]) -> torch.Tensor:
        """Whole sequences, right-padded; fills each request's slot. Logits at each last position."""
        for req in reqs:
            if req.slot is None:
                req.slot = self._free_slots.pop()
        seqs = [r.sequence() for r in reqs]
        width = max(map(len, seqs))
        tokens = torch.full((len(reqs), width), self.pad_token_id, dtype=torch.long)
        for i, seq in enumerate(seqs):
            tokens[i, :len(seq)] = torch.tensor(seq)
        tokens = tokens.to(self.device)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        logits = self.model.prefill(tokens, self.cache, slots)
        last = torch.tensor([len(s) - 1 for s in seqs], device=self.device)
        for i, req in enumerate(reqs):
            req.cached = len(seqs[i])
            if req.spec.return_logprob and req.spec.logprob_start_len >= 0 and not req.tokens and not req.input_logprobs:
                self._record_input_logprobs(req, logits[i, :len(seqs[i])], tokens[i, :len(seqs[i])])
        return logits[torch.arange(len(reqs), device=self.device), last]

    def _record_input_logprobs(self, req: TorchRequest, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Prompt log-probs from `logprob_start_len` on (the first position has none)."""
        temperature = self._temperature(req.spec)
        lps = torch.log_softmax(logits[:-1].float() / temperature, -1).gather(-1, tokens[1:, None])[:, 0].tolist()
        start = min(req.spec.logprob_start_len, len(req.spec.input_ids))
        req.input_logprobs = [None if pos == 0 else lps[pos - 1] for pos in range(start, len(req.spec.input_ids))]

    def _decode(self, reqs: list[TorchRequest]) -> torch.Tensor:
        tokens = torch.tensor([r.tokens[-1] for r in reqs], device=self.device)
        positions = torch.tensor([r.cached for r in reqs], device=self.device)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        logits = self.model.decode(tokens, positions, self.cache, slots)
        for req in reqs:
            req.cached += 1
        return logits

    @staticmethod
    def _temperature(spec: GenSpec) -> float:
        return 1.0 if spec.greedy else spec.temperature

    def _sample(self, reqs: list[TorchRequest], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = logits.shape[1]
        banned = [i for i, r in enumerate(reqs) if len(r.tokens) < r.spec.min_new_tokens]
        if banned:
            logits = logits.clone()
            for i in banned:
                spec = reqs[i].spec
                stops = set(spec.stop_token_ids) | (set(self.eos_token_ids) if not spec.ignore_eos else set())
                logits[i, sorted(t for t in stops if 0 <= t < vocab)] = float("-inf")
        dev = self.device

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev)

        temperature = per_row([self._temperature(r.spec) for r in reqs])
        top_p = per_row([r.spec.top_p for r in reqs])
        top_k = torch.tensor([1 if r.spec.greedy else (r.spec.top_k if r.spec.top_k > 0 else vocab) for r in reqs],
                             device=dev)
        min_p = per_row([r.spec.min_p for r in reqs])
        uniforms = torch.tensor([r.rng.random() for r in reqs], dtype=torch.float64, device=dev).float()
        return sample(logits, temperature, top_p, top_k, min_p, uniforms)

    def _stop_reason(self, req: TorchRequest) -> dict | None:
        """SGLang's order (Req.update_finish_state, 0.5.20, the pinned image, to 0.5.23): a stop
        string, then a stop token id (EOS unless ignore_eos), then the length limit. Stop
        strings are matched on the decoded tail of the output: as many tokens as the longest
        stop string has, plus one."""
        spec, token = req.spec, req.tokens[-1]
        if spec.stop_strs:
            tail = self.tokenizer.decode(req.tokens[-req.stop_window:], skip_special_tokens=False)
            for stop in spec.stop_strs:
                if stop and stop in tail:
                    return {"type": "stop", "matched": stop}
        if not spec.ignore_eos and (token in self.eos_token_ids or token in spec.stop_token_ids):
            return {"type": "stop", "matched": token}
        if len(req.tokens) >= spec.max_new_tokens:
            return {"type": "length", "length": spec.max_new_tokens}
        return None


class TorchEngineServer(EngineServer):
    def __init__(self, config: TorchEngineConfig | None = None) -> None:
        super().__init__(TorchEngine(config or TorchEngineConfig()))


async def serve(config: TorchEngineConfig | None = None, host: str = "127.0.0.1", port: int = 30000) -> None:
    """Run a torch engine until cancelled."""
    await serve_engine(lambda: TorchEngineServer(config), host, port)


def start_torch_engine(config: TorchEngineConfig | None = None, host: str = "127.0.0.1",
                       port: int = 0) -> ServerHandle:
    """Start a torch engine in a daemon thread; port 0 picks a free port (see `.url`)."""
    return start_in_thread(lambda: TorchEngineServer(config), host, port, name="torch-engine")
