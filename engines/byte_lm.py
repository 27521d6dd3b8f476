"""A small causal language model over the project's byte vocabulary, built from a
config (no download), shared by the PyTorch engine (engines/torch_engine.py) and the
trainer that feeds it (local/grpo.py), so both compute the same function.

Pre-LayerNorm transformer: learned token and position embeddings, `n_layers` blocks of
causal multi-head attention and a GELU MLP, a final LayerNorm and an output layer over
`ByteTokenizer.vocab_size` ids. Three ways to run it, one set of weights:

- `forward(tokens)`: logits at every position of right-padded rows (causal attention,
  so a row's padding never reaches its real positions): what the trainer uses.
- `prefill(tokens, cache, slots)`: the same, also writing each row's keys and values
  into its slot of a `KVCache`.
- `decode(tokens, positions, cache, slots)`: one new token per row, attending to its
  slot's cached keys and values up to its position.

Checkpoints are `torch.save` files holding only tensors and plain data (format tag,
config, state dict); `load_checkpoint` reads them with `weights_only=True`, which
refuses anything else, so a checkpoint path from the network cannot run code.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.tokenizer import ByteTokenizer

CHECKPOINT_FORMAT = "rollout-byte-lm/1"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = ByteTokenizer.vocab_size
    context_length: int = 256  # position embeddings: prompt + response tokens at most
    n_layers: int = 2
    d_model: int = 128
    n_heads: int = 4
    mlp_ratio: int = 4
    init_std: float = 0.02  # small: a fresh model's next-token distribution is close to uniform

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config {f.name} must be a positive number, got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, data: Any) -> ModelConfig:
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {', '.join(sorted(unknown))}")
        return cls(**data)


class KVCache:
    """Keys and values per layer for `slots` sequences of up to `context_length` tokens."""

    def __init__(self, config: ModelConfig, slots: int, device: torch.device | str = "cpu") -> None:
        shape = (config.n_layers, slots, config.n_heads, config.context_length, config.head_dim)
        self.keys = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)


class _Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, config.mlp_ratio * d)
        self.out = nn.Linear(config.mlp_ratio * d, d)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        c = self.config
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, c.n_heads, c.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v  # each [B, heads, T, head_dim]

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attended.shape
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, self.config.d_model))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._qkv(x)
        if cache is not None:
            t = x.shape[1]
            cache.keys[layer, slots, :, :t] = k
            cache.values[layer, slots, :, :t] = v
        return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def decode(self, x: torch.Tensor, cache: KVCache, layer: int, slots: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)  # T = 1
        cache.keys[layer, slots, :, positions] = k[:, :, 0]
        cache.values[layer, slots, :, positions] = v[:, :, 0]
        span = int(positions.max()) + 1
        keys = cache.keys[layer, slots, :, :span]
        values = cache.values[layer, slots, :, :span]
        visible = torch.arange(span, device=x.device)[None, :] <= positions[:, None]  # [B, span]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :])
        return self._finish(x, attended)


class ByteLM(nn.Module):
    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.context_length, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Seeded initialisation from its own generator: the same seed gives the same
        weights in every process, whatever else used torch's global RNG."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * self.config.init_std)
            elif name.endswith("weight"):  # LayerNorm gains
                p.fill_(1.0)
            else:
                p.zero_()
        # GPT-2's scaling of the residual projections keeps the stream's variance flat in depth.
        for block in self.blocks:
            for layer in (block.proj, block.out):
                layer.weight.mul_(1.0 / math.sqrt(2 * self.config.n_layers))

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.position(positions)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for right-padded token rows [B, T]."""
        x = self._embed(tokens, torch.arange(tokens.shape[1], device=tokens.device)[None, :])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def prefill(self, tokens: torch.Tensor, cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
        """`forward`, also caching every position's keys and values in `slots`."""
        x = self._embed(tokens, torch.arange(tokens.shape[1], device=tokens.device)[None, :])
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i, slots)
        return self.head(self.ln(x))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               slots: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] for one token per row at `positions` (the slot holds every
        earlier position)."""
        x = self._embed(tokens[:, None], positions[:, None])
        for i, block in enumerate(self.blocks):
            x = block.decode(x, cache, i, slots, positions)
        return self.head(self.ln(x))[:, 0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1, from `forward` logits: [B, T-1].
    The distribution is softmax(logits / temperature), the one SGLang samples from and
    reports by default (see engines/torch_engine.py)."""
    logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return logprobs.gather(-1, tokens[:, 1:, None])[..., 0]


# -- checkpoints -----------------------------------------------------------------------


def save_checkpoint(model: ByteLM, path: str | Path) -> Path:
    """Write atomically (temp file, then rename): an engine never reads half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
    torch.save({"format": CHECKPOINT_FORMAT, "config": asdict(model.config), "state_dict": state}, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state dict); ValueError with a one-line reason for anything else."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint file at {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a file it cannot read
        raise ValueError(f"{path} is not a readable torch checkpoint: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a {CHECKPOINT_FORMAT} checkpoint (written by byte_lm.save_checkpoint)")
    state = data.get("state_dict")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: state_dict must map names to tensors")
    return ModelConfig.from_dict(data.get("config")), state
