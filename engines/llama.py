"""A Llama-family causal LM, the project's own forward, for `rollout torch-engine --model DIR`.

Reads a Hugging Face folder (`config.json` of a `LlamaForCausalLM`, its safetensors,
`generation_config.json`) and runs it over the engine's slot KV cache, with the same
three entry points as `engines.byte_lm.ByteLM` (`forward`, `prefill`, `decode`). It is
written from the architecture, not imported from transformers, so that the trainer's
forward (transformers' `LlamaForCausalLM`, local/grpo.py) is an independent check of
it: a bug in a layer here shows up as a log-prob disagreement there.

The layers, as Llama defines them: RMSNorm (in float32, then the gain); rotary position
embeddings on the two halves of each head (`rotate_half`, HF's layout), at each row's
own positions; grouped-query attention (`num_key_value_heads` keys and values shared
by `num_attention_heads / num_key_value_heads` query heads each; the cache stores only
the KV heads); a SwiGLU MLP `down(silu(gate(x)) * up(x))`; a final RMSNorm and an
output layer tied to the embedding when `tie_word_embeddings`. Parameter names are
HF's, so a checkpoint's state dict loads as it is.

Only the default rotary scaling is supported; a config asking for another (llama3,
yarn, ...) is refused by name rather than served wrongly.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: The `architectures` entries of config.json this forward implements.
ARCHITECTURES = ("LlamaForCausalLM",)


class ModelFolderError(ValueError):
    """An HF folder cannot be served: the message names the file and what is wrong."""


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFolderError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path} must hold a JSON object")
    return data


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, data: dict, source: str = "config.json") -> LlamaConfig:
        architectures = data.get("architectures") or []
        if not any(a in ARCHITECTURES for a in architectures):
            raise ModelFolderError(f"{source}: architectures {architectures} is not one of {', '.join(ARCHITECTURES)}")
        if data.get("hidden_act", "silu") != "silu":
            raise ModelFolderError(f"{source}: hidden_act {data.get('hidden_act')!r} is not silu")
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type != "default":
            raise ModelFolderError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        try:
            heads = int(data["num_attention_heads"])
            config = cls(
                vocab_size=int(data["vocab_size"]),
                hidden_size=int(data["hidden_size"]),
                intermediate_size=int(data["intermediate_size"]),
                num_hidden_layers=int(data["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta if theta is not None else data.get("rope_theta", 10000.0)),
                max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                attention_bias=bool(data.get("attention_bias", False)),
                mlp_bias=bool(data.get("mlp_bias", False)),
            )
        except KeyError as exc:
            raise ModelFolderError(f"{source}: {exc.args[0]} is missing") from None
        except (TypeError, ValueError) as exc:
            raise ModelFolderError(f"{source}: {exc}") from None
        if config.num_attention_heads % config.num_key_value_heads:
            raise ModelFolderError(f"{source}: num_attention_heads {config.num_attention_heads} is not a multiple "
                                   f"of num_key_value_heads {config.num_key_value_heads}")
        return config


@dataclass(frozen=True)
class GenerationFacts:
    """What generation_config.json (else config.json) says about special ids."""

    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None

    @classmethod
    def read(cls, folder: Path, config: dict) -> GenerationFacts:
        path = folder / "generation_config.json"
        data = _read_json(path) if path.is_file() else {}

        def pick(key: str) -> Any:
            return data[key] if data.get(key) is not None else config.get(key)

        eos = pick("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_ids):
            raise ModelFolderError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
        pad = pick("pad_token_id")
        return cls(eos_ids, pad if isinstance(pad, int) and not isinstance(pad, bool) else None)


class LlamaKVCache:
    """Keys and values per layer for `slots` sequences of up to `context_length` tokens (KV heads only)."""

    def __init__(self, config: LlamaConfig, slots: int, context_length: int, device: torch.device | str = "cpu"):
        shape = (config.num_hidden_layers, slots, config.num_key_value_heads, context_length, config.head_dim)
        self.keys = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, head_dim] for positions [B, T]."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        c, bias = config, config.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=bias)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        c = self.config
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin), v  # [B, heads, T, head_dim]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, cos, sin, cache: LlamaKVCache | None = None, layer: int = 0,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        if cache is not None:
            t = x.shape[1]
            cache.keys[layer, slots, :, :t] = k
            cache.values[layer, slots, :, :t] = v
        return self._attend(q, k, v, None)

    def decode(self, x, cos, sin, cache: LlamaKVCache, layer: int, slots: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)  # T = 1
        cache.keys[layer, slots, :, positions] = k[:, :, 0]
        cache.values[layer, slots, :, positions] = v[:, :, 0]
        span = int(positions.max()) + 1
        visible = torch.arange(span, device=x.device)[None, :] <= positions[:, None]  # [B, span]
        return self._attend(q, cache.keys[layer, slots, :, :span], cache.values[layer, slots, :, :span],
                            visible[:, None, None, :])


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c, bias = config, config.mlp_bias
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None, layer=0, slots=None, positions=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if positions is None:
            x = x + self.self_attn(h, cos, sin, cache, layer, slots)
        else:
            x = x + self.self_attn.decode(h, cos, sin, cache, layer, slots, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """HF's `model.*` submodule: the names of its parameters are the checkpoint's."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.rotary = Rotary(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, cache: LlamaKVCache | None,
             slots: torch.Tensor | None, decoding: bool) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rotary(positions)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, slots, positions[:, 0] if decoding else None)
        return self.lm_head(self.model.norm(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for right-padded token rows [B, T]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :].expand(tokens.shape[0], -1)
        return self._run(tokens, positions, None, None, decoding=False)

    def prefill(self, tokens: torch.Tensor, cache: LlamaKVCache, slots: torch.Tensor) -> torch.Tensor:
        """`forward`, also caching every position's keys and values in `slots`."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :].expand(tokens.shape[0], -1)
        return self._run(tokens, positions, cache, slots, decoding=False)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: LlamaKVCache,
               slots: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] for one token per row at `positions`."""
        return self._run(tokens[:, None], positions[:, None], cache, slots, decoding=True)[:, 0]


# -- HF folders ------------------------------------------------------------------------


@dataclass
class HFFolder:
    """A readable HF model folder: its config, generation facts and raw config.json."""

    path: Path
    config: LlamaConfig
    generation: GenerationFacts
    raw: dict

    @property
    def model_type(self) -> str:
        return str(self.raw.get("model_type", "llama"))

    @property
    def architectures(self) -> list[str]:
        return list(self.raw.get("architectures") or [])


def read_folder(path: str | Path) -> HFFolder:
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFolderError(f"{folder} is not a directory (an HF model folder with config.json and safetensors)")
    raw = _read_json(folder / "config.json")
    config = LlamaConfig.from_hf(raw, str(folder / "config.json"))
    return HFFolder(folder, config, GenerationFacts.read(folder, raw), raw)


def load_state(folder: HFFolder) -> dict[str, torch.Tensor]:
    """The folder's safetensors (one file, or the shards of model.safetensors.index.json)
    as float32 tensors."""
    from safetensors.torch import load_file

    index = folder.path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFolderError(f"{index}: weight_map must map names to files")
        files = sorted(set(weight_map.values()))
    elif (folder.path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelFolderError(f"{folder.path} has no model.safetensors (nor model.safetensors.index.json)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(str(folder.path / name)))
        except Exception as exc:  # safetensors raises its own error types for a bad file
            raise ModelFolderError(f"{folder.path / name}: {type(exc).__name__}: {exc}") from None
    return {k: v.float() for k, v in state.items()}


def load_weights(model: LlamaLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Load an HF state dict; a tied head may be absent from it. ModelFolderError names what does not fit."""
    if model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    expected = {k: v.shape for k, v in model.state_dict().items()
                if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(expected[k])})" for k in expected
             if k in state and state[k].shape != expected[k]]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        if wrong:
            parts.append(f"wrong shapes {', '.join(wrong[:5])}")
        raise ModelFolderError(f"{source}: the weights do not fit the model: {'; '.join(parts)}")
    with torch.no_grad():
        model.load_state_dict(state, strict=False)
