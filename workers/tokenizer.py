"""Tokenizers for the generation workers and the SGLang simulator.

Two kinds, one interface (`encode`, `decode`, `apply_chat_template`,
`eos_token_id`):

- `ByteTokenizer`: UTF-8 bytes as token ids plus three special ids. No
  dependencies; the simulator, the demo and most tests use it.
- `HFTokenizer`: an adapter over a Hugging Face `transformers` tokenizer, or over a
  bare `tokenizers` ``tokenizer.json`` file. Both libraries are optional and are
  imported only when such a tokenizer is requested.

`load_tokenizer` picks one from a name; `encode_prompt` turns a dataset prompt
(a string or chat messages) into prompt token ids. `worker_tokenizer` decides,
before a worker starts, which tokenizer its engines need: the byte tokenizer only
for the simulator, else the served model's own (byte ids sent to a real model are
well-formed garbage it happily answers).

Chat templates: a tokenizer's own, never an invented one. `ByteTokenizer`'s own (the
simulator's convention) renders each message as ``<|role|>\\ncontent\\n`` and, with
``add_generation_prompt``, ends with ``<|assistant|>\\n``; a Hugging Face tokenizer
without a template (a base model) refuses chat messages (`ChatTemplateMissing`) rather
than wrap them in a format the model never saw::

    <|system|>
    You are terse.
    <|user|>
    What is 2 + 3?
    <|assistant|>
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

logger = logging.getLogger(__name__)

HF_INSTALL_HINT = "pip install -e '.[hf]' in your clone"
#: `model_type`s in /get_model_info of the project's own engines, whose models read
#: UTF-8 bytes as token ids: the simulator (engines/simulator.py) and the tiny PyTorch
#: model (engines/torch_engine.py).
BYTE_MODEL_TYPES = frozenset({"sim-byte-lm", "byte-lm"})
#: While an engine does not answer yet (a model still loading), log this often.
ENGINE_WAIT_LOG_S = 30.0

# Token strings tried, in order, to find the special ids of a bare tokenizer.json
# file when no tokenizer_config.json or generation_config.json beside it says which
# token is which (a guess: SmolLM2's <|endoftext|> is its unknown token, id 0).
_EOS_CANDIDATES = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[CLS]")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


class TokenizerError(RuntimeError):
    """A tokenizer cannot be loaded: its library is missing or the path is wrong."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the workers and the simulator need from a tokenizer."""

    eos_token_id: int | None
    has_chat_template: bool
    templates_by_default: bool  # string prompts go in the chat template unless told otherwise

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                            **kwargs: Any) -> str: ...


def _check_messages(messages: Any) -> list[dict]:
    """Chat messages must be a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"chat messages must be a non-empty list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"chat message {i} must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"chat message {i} needs a non-empty string 'role'")
        if not isinstance(content, str):
            raise ValueError(f"chat message {i} needs a string 'content', got {type(content).__name__}")
    return messages


def simple_chat_template(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The template documented in the module docstring."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in _check_messages(messages)]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, then BOS, EOS and PAD."""

    name_or_path = "byte"
    has_chat_template = True  # the simple template is this tokenizer's own convention
    templates_by_default = False  # the simulator's prompts are text unless asked
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    _SPECIAL_TEXT = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>"}

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text`; never adds special tokens."""
        if not isinstance(text, str):
            raise ValueError(f"can only encode str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Invalid UTF-8 becomes U+FFFD; special ids are dropped or shown as `<|eos|>` etc."""
        if not isinstance(ids, (list, tuple)):
            ids = list(ids)  # also rejects a bare int, which bytes() would take as a length
        try:
            return bytes(ids).decode("utf-8", errors="replace")  # fast path: plain bytes only
        except (ValueError, TypeError):
            pass
        out: list[str] = []
        run = bytearray()
        for token in ids:
            if 0 <= token < 256:
                run.append(token)
                continue
            if token not in self._SPECIAL_TEXT:
                raise ValueError(f"token id {token} is outside the byte vocabulary [0, {self.vocab_size})")
            if skip_special_tokens:
                continue
            # A special token splits the byte run: decode what came before it.
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(self._SPECIAL_TEXT[token])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                            **kwargs: Any) -> str:
        """The simple template; it has no place for tools or template options (ignored)."""
        return simple_chat_template(messages, add_generation_prompt)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """Adapter giving a Hugging Face tokenizer the `ByteTokenizer` interface.

    `backend` is either a `transformers.PreTrainedTokenizerBase` or a
    `tokenizers.Tokenizer` (from a bare tokenizer.json). Use `load_tokenizer`
    rather than building one directly.
    """

    def __init__(self, backend: Any, name_or_path: str = "", *, eos_token_id: int | None = None,
                 bos_token_id: int | None = None, pad_token_id: int | None = None) -> None:
        self.backend = backend
        self.name_or_path = name_or_path
        # A transformers tokenizer has `apply_chat_template`; a tokenizers.Tokenizer does not.
        self._is_transformers = hasattr(backend, "apply_chat_template")
        if self._is_transformers:
            self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(backend, "eos_token_id", None)
            self.bos_token_id = bos_token_id if bos_token_id is not None else getattr(backend, "bos_token_id", None)
            self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(backend, "pad_token_id", None)
        else:
            self.eos_token_id = eos_token_id if eos_token_id is not None else self._find_token(_EOS_CANDIDATES)
            self.bos_token_id = bos_token_id if bos_token_id is not None else self._find_token(_BOS_CANDIDATES)
            self.pad_token_id = pad_token_id if pad_token_id is not None else self._find_token(_PAD_CANDIDATES)

    @property
    def has_chat_template(self) -> bool:
        return self._is_transformers and bool(getattr(self.backend, "chat_template", None))

    @property
    def templates_by_default(self) -> bool:
        return self.has_chat_template  # an instruct model: it was trained on its template

    def _find_token(self, candidates: Sequence[str]) -> int | None:
        for token in candidates:
            token_id = self.backend.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        if self._is_transformers:
            return len(self.backend)
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without added BOS/EOS (special-token strings in the
        text, e.g. from a chat template, still map to their ids)."""
        if not isinstance(text, str):
            raise ValueError(f"can only encode str, got {type(text).__name__}")
        if self._is_transformers:
            return list(self.backend.encode(text, add_special_tokens=False))
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                            **kwargs: Any) -> str:
        """transformers' apply_chat_template as slime's Dataset calls it (tools and options too)."""
        _check_messages(messages)
        if not self.has_chat_template:
            raise ChatTemplateMissing(f"tokenizer {self.name_or_path!r} has no chat template (a base model): chat "
                                      "messages cannot be rendered the way the model was trained; give it "
                                      "string prompts, sent as text")
        try:
            return self.backend.apply_chat_template(messages, tools=tools, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt, **kwargs)
        except (TypeError, ValueError, KeyError) as exc:  # the template or an option refused the messages
            raise ValueError(f"the chat template of {self.name_or_path!r} refused the prompt: "
                             f"{type(exc).__name__}: {exc}") from None

    def __repr__(self) -> str:
        kind = "transformers" if self._is_transformers else "tokenizers"
        return f"HFTokenizer({self.name_or_path!r}, backend={kind})"


def _folder_special_ids(path: str, backend: Any) -> dict[str, int]:
    """The special ids the files beside a tokenizer.json name: tokenizer_config.json's
    `eos_token` / `bos_token` / `pad_token` (a string or {"content": ...}), else
    generation_config.json's `*_token_id` (the first of a list). A file that is
    missing or unreadable says nothing."""
    import json

    folder = os.path.dirname(os.path.abspath(path))

    def read(name: str) -> dict:
        try:
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    found: dict[str, int] = {}
    tokenizer_config, generation_config = read("tokenizer_config.json"), read("generation_config.json")
    for kind in ("eos", "bos", "pad"):
        token = tokenizer_config.get(f"{kind}_token")
        if isinstance(token, dict):
            token = token.get("content")
        token_id = backend.token_to_id(token) if isinstance(token, str) else None
        if token_id is None:
            value = generation_config.get(f"{kind}_token_id")
            value = value[0] if isinstance(value, list) and value else value
            token_id = value if isinstance(value, int) and not isinstance(value, bool) else None
        if token_id is not None:
            found[f"{kind}_token_id"] = token_id
    return found


def _load_tokenizer_json(path: str) -> HFTokenizer:
    try:
        from tokenizers import Tokenizer as RawTokenizer
    except ImportError as exc:
        raise TokenizerError(
            f"loading {path!r} needs the 'tokenizers' package: {HF_INSTALL_HINT}"
        ) from exc
    try:
        backend = RawTokenizer.from_file(path)
    except Exception as exc:  # the Rust library raises its own exception type
        raise TokenizerError(f"cannot load tokenizer file {path!r}: {exc}") from exc
    return HFTokenizer(backend, path, **_folder_special_ids(path, backend))


def _load_transformers(name_or_path: str) -> HFTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TokenizerError(
            f"loading tokenizer {name_or_path!r} needs the 'transformers' package: {HF_INSTALL_HINT}"
        ) from exc
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(name_or_path), name_or_path)
    except (OSError, ValueError) as exc:  # not found, not a tokenizer
        raise TokenizerError(f"cannot load tokenizer {name_or_path!r}: {exc}") from exc


def load_tokenizer(name_or_path: str | None) -> ByteTokenizer | HFTokenizer:
    """None or "byte" → `ByteTokenizer`; a path to a ``*.json`` file → that
    `tokenizers` file; anything else → `transformers.AutoTokenizer.from_pretrained`.

    Raises TokenizerError (with the install hint when the needed library is missing).
    """
    if name_or_path is None or name_or_path == "byte":
        return ByteTokenizer()
    if os.path.isfile(name_or_path) and name_or_path.endswith(".json"):
        return _load_tokenizer_json(name_or_path)
    return _load_transformers(name_or_path)


def render_prompt(tokenizer: Tokenizer, prompt: str | list[dict], tools: list | None = None,
                  apply_chat_template_kwargs: dict | None = None) -> str:
    """A dataset prompt in the chat template as slime's Dataset renders it under
    --apply-chat-template: a string as one user message, then
    ``apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
    **apply_chat_template_kwargs)``. Raises ValueError for what the template cannot take."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not isinstance(prompt, list):
        raise ValueError(f"prompt must be a str or a list of chat messages, got {type(prompt).__name__}")
    return tokenizer.apply_chat_template(_check_messages(prompt), add_generation_prompt=True, tools=tools,
                                         **(apply_chat_template_kwargs or {}))


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], apply_chat_template: bool | None,
                  tools: list | None = None, apply_chat_template_kwargs: dict | None = None) -> list[int]:
    """Prompt token ids for one dataset prompt.

    A list prompt (chat messages) is always rendered with the chat template; a
    string is wrapped as a single user message when `apply_chat_template`, or, when
    it is None, when the tokenizer templates by default (a model with a chat template
    of its own: an instruct model; not the simulator's bytes). Rendering is
    `render_prompt`'s (slime's call). Raises ValueError for any prompt it cannot encode
    (wrong type, malformed messages, chat messages for a tokenizer without a template),
    so callers can treat that as poison input.
    """
    if apply_chat_template is None:
        apply_chat_template = tokenizer.templates_by_default
    if isinstance(prompt, list) or (isinstance(prompt, str) and apply_chat_template):
        text = render_prompt(tokenizer, prompt, tools, apply_chat_template_kwargs)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise ValueError(f"prompt must be a str or a list of chat messages, got {type(prompt).__name__}")
    return tokenizer.encode(text)


# -- which tokenizer a worker's engines need ----------------------------------------


class TokenizerChoiceError(ValueError):
    """The worker's tokenizer does not fit its engines; the message says what to pass."""


class ChatTemplateMissing(ValueError):
    """Chat messages for a tokenizer without a chat template of its own."""


@dataclass(frozen=True)
class EngineModel:
    """What one engine (or router) URL says it serves, from /get_model_info."""

    url: str
    model_path: str | None
    tokenizer_path: str | None
    reads_bytes: bool  # one of the project's own engines

    @classmethod
    def from_model_info(cls, url: str, info: dict) -> EngineModel:
        def text(key: str) -> str | None:
            value = info.get(key)
            return value if isinstance(value, str) and value else None

        return cls(url, text("model_path"), text("tokenizer_path"), info.get("model_type") in BYTE_MODEL_TYPES)

    @property
    def tokenizer(self) -> str | None:
        """The tokenizer the engine itself uses (SGLang's tokenizer_path defaults to model_path)."""
        return self.tokenizer_path or self.model_path


def choose_tokenizer(engines: list[EngineModel], requested: str | None, allow_byte: bool) -> str | None:
    """The tokenizer name for `load_tokenizer` (None: bytes) that fits `engines`.

    The project's own engines take bytes unless another tokenizer is requested. Real
    models get `requested`, or without it the model's own tokenizer; the byte
    tokenizer against a real model only with `allow_byte`.
    """
    real = [e for e in engines if not e.reads_bytes]
    if not real:
        return requested
    if requested == "byte" and not allow_byte:
        raise TokenizerChoiceError(
            f"engine {real[0].url} serves {real[0].model_path or 'a real model'}, which would read byte-tokenized "
            "prompts as garbage: drop --tokenizer byte to use the model's own tokenizer "
            "(or pass --allow-byte-tokenizer if that is really wanted)")
    if requested is not None:
        return requested
    served = {e.tokenizer for e in real}
    if None in served:
        url = next(e.url for e in real if e.tokenizer is None)
        raise TokenizerChoiceError(f"engine {url} does not say which model it serves (no model_path in "
                                   "/get_model_info): pass --tokenizer")
    if len(served) > 1:
        raise TokenizerChoiceError(f"the engines serve different tokenizers ({', '.join(sorted(served))}): "
                                   "pass --tokenizer, or give the worker engines of one model")
    return served.pop()


def waiting_for(url: str, exc: Exception) -> str:
    """What a worker waiting for engine `url` to answer /get_model_info says: a model may
    still be loading, or (nothing listens there, the name does not resolve) the URL is wrong."""
    from .engine_errors import nothing_there

    why = nothing_there(exc)
    hint = (f"{why}: check the URL, unless the engine is still starting" if why
            else "a model may still be loading")
    return f"waiting for engine {url} to answer /get_model_info ({hint}): {exc}"


async def _engine_model(url: str, wait_log_s: float, api_key: str | None = None,
                        on_wait: Callable[[str], None] | None = None) -> EngineModel:
    """/get_model_info of `url`, waiting (with a log line now and then, and what it waits for
    given to `on_wait`) while it cannot answer."""
    from .engine import EngineClient
    from .engine_errors import EngineUnavailable

    client = EngineClient(url, api_key=api_key)
    url = client.url  # without credentials: the one logs and errors show
    delay, last_log = 0.5, float("-inf")
    try:
        while True:
            try:
                return EngineModel.from_model_info(url, await client.model_info())
            except EngineUnavailable as exc:
                said = waiting_for(url, exc)
                if on_wait is not None:
                    on_wait(said)
                if time.monotonic() - last_log >= wait_log_s:
                    logger.warning("%s", said)
                    last_log = time.monotonic()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
    finally:
        await client.close()


async def worker_tokenizer(engine_urls: list[str], requested: str | None, allow_byte: bool,
                           apply_chat_template: bool | None, wait_log_s: float = ENGINE_WAIT_LOG_S,
                           api_key: str | None = None, on_wait: Callable[[str], None] | None = None) -> str | None:
    """The tokenizer a worker for `engine_urls` must use (see `choose_tokenizer`),
    loaded once here so a missing library or model fails now, in one line.

    Waits for every engine to answer /get_model_info, unless a tokenizer other than
    bytes is requested (then what they serve changes nothing); `on_wait` hears what it
    waits for (the worker's /health says it). Raises TokenizerChoiceError.
    """
    asks_engines = requested in (None, "byte")
    engines = [await _engine_model(url, wait_log_s, api_key, on_wait) for url in engine_urls] if asks_engines else []
    name = choose_tokenizer(engines, requested, allow_byte)
    if on_wait is not None:
        on_wait(f"loading tokenizer {name or 'byte'}")
    try:
        tokenizer = load_tokenizer(name)
    except Exception as exc:  # transformers raises OSError, ValueError, ... for a missing model
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, TokenizerError):  # those name the tokenizer already
            said = f"cannot load tokenizer {name!r}: {said}"
        whose = "given with --tokenizer" if requested is not None else "the one the engines serve; --tokenizer picks another"
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            whose += "; offline (HF_HUB_OFFLINE=1) it must be in the Hugging Face cache, or a local folder"
        raise TokenizerChoiceError(f"{said} ({whose})") from None
    if apply_chat_template and not tokenizer.has_chat_template:
        raise TokenizerChoiceError(f"--apply-chat-template, but tokenizer {name!r} has no chat template (a base "
                                   "model): prompts would be wrapped in one it never saw; leave the option out "
                                   "(string prompts go as text)")
    templated = apply_chat_template or (apply_chat_template is None and tokenizer.templates_by_default)
    logger.info("tokenizer %s for engines %s; string prompts %s", name or "byte",
                ", ".join(e.url for e in engines) or "(not asked)",
                "in the model's chat template" if templated else "as text")
    return name
