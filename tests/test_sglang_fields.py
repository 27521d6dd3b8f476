"""Both engines answer /generate with the meta_info fields SGLang's own code builds.

The field lists are read from the sglang wheel that scripts/test installs without its
dependencies (tests/sglang_parser.py): the dict literal TokenizerManager builds for every
answer, the keys it adds for a generation, the logprob keys of add_logprob_to_meta_info,
and those of the in-queue abort answer. A renamed or added field in SGLang fails here,
not in a worker reading a real engine."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests import sglang_parser
from tests.helpers import http_call
from engines.byte_lm import ModelConfig
from engines.simulator import SimConfig, start_simulator
from engines.torch_engine import TorchEngineConfig, start_torch_engine

TOKENIZER_MANAGER = Path("sglang") / "srt" / "managers" / "tokenizer_manager.py"


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def _dict_keys(node: ast.Dict) -> set[str]:
    return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def _meta_info_keys(func: ast.FunctionDef) -> set[str]:
    """Keys of `meta_info = {...}`, `meta_info.update({...})` and `meta_info["k"] = ...` in `func`."""
    keys: set[str] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "meta_info" for t in node.targets) \
                and isinstance(node.value, ast.Dict):
            keys |= _dict_keys(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "meta_info" \
                and node.args and isinstance(node.args[0], ast.Dict):
            keys |= _dict_keys(node.args[0])
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                        and target.value.id == "meta_info" and isinstance(target.slice, ast.Constant):
                    keys.add(target.slice.value)
    return keys


@pytest.fixture(scope="module")
def sglang_fields() -> dict[str, set[str]]:
    source = sglang_parser.DIR / TOKENIZER_MANAGER
    if not source.is_file():
        pytest.skip(f"the sglang {sglang_parser.VERSION} wheel is not installed: python -m tests.sglang_parser install")
    tree = ast.parse(source.read_text())
    batch = _meta_info_keys(_function(tree, "_handle_batch_output"))
    logprobs = {k for k in _meta_info_keys(_function(tree, "add_logprob_to_meta_info"))
                if not k.endswith("top_logprobs") and "token_ids_logprob" not in k and "sampling" not in k}
    abort = _meta_info_keys(_function(tree, "_handle_abort_req"))
    # Fields SGLang adds only with options the engines do not have (metrics, multimodal,
    # hidden states, routed experts, dp ranks, weight-version spans, sampling masks).
    batch = {k for k in batch if k in {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
                                       "reasoning_tokens", "completion_tokens", "cached_tokens"}}
    return {"generate": batch | logprobs, "abort": {k for k in abort if not k.startswith("weight_version_")}
            | logprobs | {"completion_tokens"}}


def test_the_field_lists_read_from_sglang_hold_what_this_test_relies_on(sglang_fields):
    assert {"num_retractions", "reasoning_tokens", "completion_tokens", "output_token_logprobs_length",
            "output_token_logprobs"} <= sglang_fields["generate"]
    assert "total_retractions" not in sglang_fields["generate"]
    assert {"id", "finish_reason", "weight_version", "e2e_latency"} <= sglang_fields["abort"]


@pytest.fixture(scope="module", params=["simulator", "torch"])
def engine(request):
    if request.param == "simulator":
        with start_simulator(SimConfig(seed=0, decode_tokens_per_s=5000.0)) as handle:
            yield handle
    else:
        torch.set_num_threads(1)
        with start_torch_engine(TorchEngineConfig(seed=0, model=ModelConfig(context_length=64),
                                                  max_running_requests=4)) as handle:
            yield handle


def test_a_finished_answer_carries_sglangs_meta_info_fields(engine, sglang_fields):
    status, out = http_call(engine.url, "/generate", {"input_ids": list(b"hello"), "return_logprob": True,
                                                      "sampling_params": {"max_new_tokens": 4}})
    assert status == 200, out
    meta = out["meta_info"]
    assert sglang_fields["generate"] <= set(meta), sglang_fields["generate"] - set(meta)
    assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert meta["num_retractions"] == 0 and meta["reasoning_tokens"] == 0
