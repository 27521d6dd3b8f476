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

`h100-llama2-7b` is checked against a published measurement rather than derived alone:
vLLM serving Llama-2-7B (fp16) on one H100 with 64 GB, every request 250 prompt and 261
output tokens, 2,000 requests at once, `--max-num-seqs` b = 1 … 512, chunked prefill of
512 tokens per step (FerranAgulloLopez/vLLMBatchingMemoryGap at a918634,
benchmarks/definitive_results/advisor/output_length/_260/llama-2-7b/_<b>__2000/). Its
constants come from the bytes and FLOPs of the model; the table only fixes t1:

- weights 12.55 GiB = 13.48 GB ("Loading model weights took 12.5523 GB" in the server
  log), read once per step;
- KV: 32 layers x 32 heads x 128 dims x 2 (K, V) x 2 bytes = 512 KiB per token, read
  every step like the weights, so per_kv_token = 524,288 / 13.48e9 = 3.89e-5 of t1;
- per_request = 0: 13.5 GFLOP per decoded token, 1.7 TFLOP per step at b = 128, stays
  under the weight read (a memory-bound step), and the table leaves nothing to fit;
- prefill: 13.5 GFLOP per prompt token at 60% of 989 TFLOP/s = 22.7 µs per token,
  prefill_per_token = 0.00212; chunked_prefill_size 512 (the run's max_num_batched_tokens);
- t1 = 10.70 ms: the published 10.86 ms per output token at b = 1 is one request with on
  average 250 + 130 tokens cached, t1 · (1 + 3.89e-5 · 380.5);
- KV capacity 90,624 tokens (`LLAMA2_7B_KV_TOKENS`): vLLM's default
  gpu_memory_utilization 0.9 of the GPU's 63.43 GiB, less the 12.73 GiB of the weights
  and activations' peak and 0.10 GiB outside torch, leaves 44.26 GiB = 5,664 blocks of
  16 tokens (the server log). Above b = 128 a batch of 511-token contexts no longer fits:
  the engine runs as many as the cache holds and throughput stops growing. On an 80 GB
  H100 the same arithmetic gives 0.9 · 79.1 − 12.83 = 58.4 GiB, about 119,600 tokens.
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
    t1_s: float = 0.0  # real seconds of the step of one request alone on the modelled GPU (0: none)

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
    EngineProfile("h100-llama2-7b", 0.0, 3.89e-5, 0.00212, 512,
                  "Llama-2-7B fp16 on one H100 64 GB under vLLM, checked against a published t(b) table "
                  "(bench/engine_table.py; run it with max_total_num_tokens = LLAMA2_7B_KV_TOKENS)",
                  t1_s=0.010703),
)}
CALIBRATED = "h100-llama8b"
#: The calibrated profile's t1 in real seconds (one request decoding alone); a simulator
#: at decode_tokens_per_s = 1 / CALIBRATED_T1_S ≈ 161 runs in real time.
CALIBRATED_T1_S = 0.0062
#: KV capacity in tokens of the H100 64 GB that h100-llama2-7b models (vLLM's 5,664 blocks of 16).
LLAMA2_7B_KV_TOKENS = 90_624


def engine_profile(name: str) -> EngineProfile:
    """The profile called `name`; ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown engine profile {name!r}; known: {', '.join(PROFILES)}") from None
