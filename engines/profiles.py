"""How long a simulated engine step takes: the named engine profiles, in one place.

A real engine decodes all its running requests together, one token each per step, and a
step takes longer as the batch grows (weights are read once per step; KV reads and
FLOPs grow with each request and each cached token):

    t(b, kv, p) = t1 · (1 + per_request·b + per_kv_token·kv + prefill_per_token·p)

where t1 = 1 / `SimConfig.decode_tokens_per_s` is the step of one request alone, b the
requests decoding, kv the tokens in the KV cache and p the prompt tokens prefilled in
that step (chunked, at most `chunked_prefill_size` per step, as SGLang's scheduler
interleaves a prefill chunk with the decodes). A profile holds the coefficients as
fractions of t1, so the same profile runs at real speed (decode_tokens_per_s = 1/t1 of
the GPU) or faster (the benchmarks' setting) without changing its shape.

`flat` is the model the simulator had before: every request decodes at t1 whatever
the batch, and prefill is a fixed `SimConfig.prefill_s` per request that delays only
that request. It is kept so that the sensitivity of a result to the engine model can
be shown (docs/performance.md).

The calibration of `h100-llama8b` (Llama-3.1-8B, bf16, one H100 SXM, SGLang or vLLM)
is derived in docs/performance.md: t1 ≈ 6.2 ms (16.1 GB of weights read at 77% of
3.35 TB/s, the fraction of the memory roofline a published single-request vLLM decode
of the same model reached); per KV token 128 KiB read at the same rate (≈ 51 ns, so
per_kv_token ≈ 8.2e-6); per request ≈ 35 µs of matmul, sampling and scheduling work
(per_request ≈ 0.0056); prefill ≈ 27 µs per token (16 GFLOP per token at 60% of
989 TFLOP/s; prefill_per_token ≈ 0.0044); chunked_prefill_size 8192 (SGLang's default
on an 80 GB GPU). At 256 requests with 1k-token contexts t(b)/t1 ≈ 4.6.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineProfile:
    """Step-time coefficients, as fractions of t1 (the step of one request alone)."""

    name: str
    per_request: float  # added per request decoding in the step
    per_kv_token: float  # added per token held in the KV cache
    # Added per prompt token prefilled in the step. 0 means the flat model: a fixed
    # SimConfig.prefill_s per request that never delays the others.
    prefill_per_token: float
    chunked_prefill_size: int  # prompt tokens prefilled per step at most
    description: str

    @property
    def chunked(self) -> bool:
        return self.prefill_per_token > 0

    def step_factor(self, batch: int, kv_tokens: int, prefill_tokens: int = 0) -> float:
        """t(b, kv, p) / t1."""
        return 1.0 + self.per_request * batch + self.per_kv_token * kv_tokens + self.prefill_per_token * prefill_tokens

    def slowdown(self, batch: int, kv_tokens: int) -> float:
        """r: the step at this batch and cache against the step of one request alone."""
        return self.step_factor(batch, kv_tokens) / self.step_factor(1, 0)


PROFILES: dict[str, EngineProfile] = {p.name: p for p in (
    EngineProfile("flat", 0.0, 0.0, 0.0, 8192,
                  "every request decodes at t1 whatever the batch; fixed prefill_s per request"),
    EngineProfile("h100-llama8b", 0.0056, 8.2e-6, 0.0044, 8192,
                  "Llama-3.1-8B bf16 on one H100 SXM (derivation in docs/performance.md)"),
    # The calibrated engine with every decoding request standing for 8: a benchmark that
    # runs 32 slots per engine (to spare the CPU) then slows down as an engine running
    # 256 requests does. The upper end of the r sweep.
    EngineProfile("heavy", 8 * 0.0056, 8 * 8.2e-6, 0.0044, 8192,
                  "h100-llama8b with each request standing for 8 (32 slots behave like 256)"),
)}
CALIBRATED = "h100-llama8b"
#: The calibrated profile's t1 in real seconds (one request decoding alone); a simulator
#: at decode_tokens_per_s = 1 / CALIBRATED_T1_S ≈ 161 runs in real time.
CALIBRATED_T1_S = 0.0062


def engine_profile(name: str) -> EngineProfile:
    """The profile called `name`; ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown engine profile {name!r}; known: {', '.join(PROFILES)}") from None
