"""The wire format: msgpack maps with a schema version.

Token ids are little-endian int32 bytes, log-probs little-endian float32 bytes and
loss masks packed bits; in-flight checkpoints (pipeline/checkpoints.py) are records in the
same encoding. The tokenized prompt and the prompt text are stored once per
group; each sample stores only the tokens after the prompt. Long response texts are
zlib-compressed. The group's sampling settings (`smp`) are an optional field: groups
without it decode as before. Decoding validates every field and raises `DecodeError`; nothing
is ever unpickled or evaluated. Decoded token ids and log-probs stay packed until
first read (`PackedSample`): the trainer's screening of a batch reads versions and
rewards only, and turning 16k numbers per sample into Python objects is most of
what decoding would cost.

Labels and rewards are JSON values (a dict reward keeps its non-numeric entries). The
Sample fields slime declares beyond the core ones, and the attributes user code set
on a sample (`sample.tool_call_count`), travel in the optional map `x` when not at their
defaults: JSON values only, at most MAX_ATTRIBUTE_BYTES per sample (an EncodeError names
the attribute past it). The group's `pp` (the prompt as pushed, kept while the samples
hold its chat-template rendering) is optional too.
"""
from __future__ import annotations

import struct
import sys
import zlib
from array import array
from dataclasses import MISSING, dataclass
from typing import Any

import msgpack

from .types import (SAMPLE_FIELDS, SEGMENTS_KEY, Group, PrefixCacheInfo, Sample, SamplingRecord, SpecInfo, Status,
                    json_problem)

SCHEMA_VERSION = 1
_COMPRESS_TEXT_OVER = 512  # bytes; below this zlib's header costs more than it saves
_BIG_ENDIAN = sys.byteorder == "big"


class DecodeError(ValueError):
    """A stored entry is not a valid group of this schema."""


class EncodeError(ValueError):
    """A group breaks the schema and cannot be stored; the message names the field."""


def _pack_array(typecode: str, values: list) -> bytes:
    if not values:
        return b""
    try:
        # struct is about twice as fast as array() from a list, and explicitly little-endian.
        return struct.pack(f"<{len(values)}{typecode}", *values)
    except (struct.error, OverflowError):
        pass
    try:  # e.g. a finite float beyond float32: array stores inf
        arr = array(typecode, values)
    except (TypeError, OverflowError) as exc:  # a token id beyond int32, a string among numbers
        raise EncodeError(f"{'token ids' if typecode == 'i' else 'log-probs'}: {exc}") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def _unpack_array(typecode: str, data: Any, what: str) -> list:
    if not isinstance(data, bytes) or len(data) % 4:
        raise DecodeError(f"{what}: expected a byte string of 4-byte items, got {type(data).__name__}")
    arr = array(typecode)
    arr.frombytes(data)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tolist()


def _pack_mask(mask: list[int] | None) -> list | None:
    if mask is None:
        return None
    if all(mask):  # the common case costs two bytes
        return [len(mask), b""]
    bits = bytearray((len(mask) + 7) // 8)
    for i, m in enumerate(mask):
        if m:
            bits[i >> 3] |= 1 << (i & 7)
    return [len(mask), bytes(bits)]


def _unpack_mask(packed: Any, response_length: int, what: str) -> list[int] | None:
    if packed is None:
        return None
    if not (isinstance(packed, list) and len(packed) == 2 and isinstance(packed[0], int)
            and not isinstance(packed[0], bool) and packed[0] >= 0 and isinstance(packed[1], bytes)):
        raise DecodeError(f"{what}: loss_mask: expected [length >= 0, bits]")
    length, bits = packed
    if length != response_length:  # slime: one mask entry per response token
        raise DecodeError(f"{what}: loss_mask has {length} entries for {response_length} response tokens")
    if not bits:
        return [1] * length
    if len(bits) != (length + 7) // 8:
        raise DecodeError(f"{what}: loss_mask: {len(bits)} bytes cannot hold {length} bits")
    return [(bits[i >> 3] >> (i & 7)) & 1 for i in range(length)]


@dataclass(frozen=True)
class PackedArray:
    """Token ids (int32) or log-probs (float32) still in their wire bytes, after `prefix`
    (the group's prompt ids, for tokens). A value, not a marker: a copy of it (copy,
    deepcopy, pickle) is still one, so a copied PackedSample unpacks like the original."""

    typecode: str  # "i" or "f"
    data: bytes
    prefix: list[int] | None = None

    def unpack(self) -> list:
        tail = _unpack_array(self.typecode, self.data, "tokens" if self.typecode == "i" else "log-probs")
        return self.prefix + tail if self.prefix else tail


class PackedSample(Sample):
    """A decoded Sample whose token ids and log-probs are unpacked on first read. The
    packed bytes live in the instance's own `tokens` / `rollout_log_probs` entries, so
    whatever copies the instance copies them."""

    @property
    def tokens(self) -> list[int]:
        value = self.__dict__["tokens"]
        if type(value) is PackedArray:
            value = self.__dict__["tokens"] = value.unpack()
        return value

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        self.__dict__["tokens"] = value

    @property
    def rollout_log_probs(self) -> list[float] | None:
        value = self.__dict__["rollout_log_probs"]
        if type(value) is PackedArray:
            value = self.__dict__["rollout_log_probs"] = value.unpack()
        return value

    @rollout_log_probs.setter
    def rollout_log_probs(self, value: list[float] | None) -> None:
        self.__dict__["rollout_log_probs"] = value

    def packed_tokens(self) -> tuple[list[int], bytes] | None:
        """(prompt ids, little-endian int32 bytes of the rest) while the tokens were
        neither read nor replaced; None after. For zero-copy readers (torch_adapter)."""
        value = self.__dict__["tokens"]
        return (value.prefix or [], value.data) if type(value) is PackedArray else None

    def packed_log_probs(self) -> bytes | None:
        """Little-endian float32 bytes of the log-probs while unread and unreplaced."""
        value = self.__dict__["rollout_log_probs"]
        return value.data if type(value) is PackedArray else None


#: Sample fields with a wire field of their own; every other field travels in "x" when it
#: is not at its default, with the attributes user code set.
_CORE_FIELDS = frozenset({"group_index", "index", "prompt", "label", "metadata", "tokens", "response_length",
                          "response", "reward", "loss_mask", "rollout_log_probs", "weight_versions", "status"})
#: What the attributes of one sample ("x": non-default fields beyond the core ones, and
#: attributes user code set) may take as msgpack, together. A generate function that
#: stores more (a whole transcript per turn) gets an EncodeError naming the attribute.
MAX_ATTRIBUTE_BYTES = 1024 * 1024


def _attributes(s: Sample) -> dict[str, Any]:
    """The sample's "x" map: JSON values only, at most MAX_ATTRIBUTE_BYTES."""
    out: dict[str, Any] = {}
    state = vars(s)
    for name in state.keys() - _CORE_FIELDS:
        value = state[name]
        default = _DEFAULTS.get(name, _MISSING)
        if value is default or (default is not _MISSING and value == default):
            continue
        if name in ("spec_info", "prefix_cache_info"):
            value = value.to_dict()
        problem = json_problem(value, name)
        if problem:
            raise EncodeError(f"sample {s.index}: attribute {problem}; attributes travel as JSON values")
        out[name] = value
    if out:
        size = 0
        for name, value in out.items():
            size += len(msgpack.packb(value, use_bin_type=True))
            if size > MAX_ATTRIBUTE_BYTES:
                raise EncodeError(f"sample {s.index}: attribute {name!r} takes the sample's attributes to {size:,} "
                                  f"bytes, over the limit of {MAX_ATTRIBUTE_BYTES:,} (codec.MAX_ATTRIBUTE_BYTES)")
    return out


def _encode_sample(s: Sample, prompt_ids: list[int], shared_prompt: bool, with_text: bool) -> dict:
    if s.loss_mask is not None and len(s.loss_mask) != s.response_length:  # slime: one per response token
        raise EncodeError(f"sample {s.index}: loss_mask has {len(s.loss_mask)} entries for "
                          f"{s.response_length} response tokens")
    # A label is any JSON value; a reward a number or a dict of JSON values (the worker
    # checks the trained value, rewards.validate_reward).
    problem = json_problem(s.label, "label") or (json_problem(s.reward, "reward") if type(s.reward) is dict else None)
    if problem:
        raise EncodeError(f"sample {s.index}: {problem}")
    n_prompt = len(prompt_ids)
    tokens = s.tokens
    shares_prompt = n_prompt > 0 and tokens[:n_prompt] == prompt_ids
    tail = tokens[n_prompt:] if shares_prompt else tokens
    text = s.response.encode() if with_text else b""
    compressed = len(text) > _COMPRESS_TEXT_OVER
    encoded = {
        "gi": s.group_index,
        "ix": s.index,
        "p": None if shared_prompt else s.prompt,
        "l": s.label,
        "m": s.metadata,
        "sp": shares_prompt,
        "t": _pack_array("i", tail),
        "rl": s.response_length,
        "r": zlib.compress(text, 1) if compressed else text,
        "rz": compressed,
        "rw": s.reward,
        "lm": _pack_mask(s.loss_mask),
        "lp": None if s.rollout_log_probs is None else _pack_array("f", s.rollout_log_probs),
        "wv": s.weight_versions,
        "st": s.status.value,
    }
    attributes = _attributes(s)
    if attributes:  # optional: most samples have none
        encoded["x"] = attributes
    return encoded


def check_sample(sample: Sample) -> None:
    """Raise EncodeError, naming the field or attribute, if `sample` cannot be stored."""
    try:
        msgpack.packb(_encode_sample(sample, [], False, False), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, EncodeError):
            raise
        raise EncodeError(f"sample {sample.index}: {type(exc).__name__}: {exc}") from None


def encode_group(group: Group, with_response_text: bool = True) -> bytes:
    """`with_response_text=False` leaves the response texts out (the trainer trains on
    tokens; the text can be decoded from them), saving ~1.8 bytes per token.
    Raises EncodeError, naming the field, for a group that breaks the schema."""
    try:
        return _encode_group(group, with_response_text)
    except (TypeError, ValueError, OverflowError) as exc:  # msgpack: a value it cannot pack
        if isinstance(exc, EncodeError):
            raise
        raise EncodeError(f"group {group.group_id}: {type(exc).__name__}: {exc}") from None


def _encode_group(group: Group, with_response_text: bool) -> bytes:
    prompts = [s.prompt for s in group.samples]
    shared = bool(prompts) and all(p == prompts[0] for p in prompts)
    fields = {
        "v": SCHEMA_VERSION,
        "id": group.group_id,
        "pid": _pack_array("i", group.prompt_ids),
        "gp": prompts[0] if shared else None,
        "s": [_encode_sample(s, group.prompt_ids, shared, with_response_text) for s in group.samples],
        "att": group.attempts,
        "rst": group.restarts,
        "adm": group.admitted_version,
        "ds": group.dataset,
        "ep": group.epoch,
        "row": group.row,
        "ct": group.created_at,
        "clt": group.claimed_at,
        "ft": group.finished_at,
        "wk": group.worker,
        "err": group.error,
    }
    if group.pushed_prompt is not None:  # optional, as smp
        fields["pp"] = group.pushed_prompt
    if group.sampling is not None:  # optional: groups without it decode as before
        r = group.sampling
        fields["smp"] = [r.temperature, r.top_p, r.top_k, r.max_new_tokens, list(r.stop), list(r.stop_token_ids),
                         r.skip_special_tokens]
    return msgpack.packb(fields, use_bin_type=True)


def _decode_sampling(value: Any) -> SamplingRecord | None:
    """The optional `smp` field: [temperature, top_p, top_k, max_new_tokens, stop strings,
    stop token ids, skip_special_tokens] (the first four alone from older workers)."""
    if value is _MISSING or value is None:
        return None
    if type(value) is not list or len(value) not in (4, 7):
        raise DecodeError("group: field 'smp' should be a list of 4 or 7 sampling settings")
    temperature, top_p, top_k, max_new_tokens = value[:4]
    stop, stop_token_ids, skip = value[4:] if len(value) == 7 else ([], [], None)
    if type(stop) is not list or not all(type(s) is str for s in stop):
        raise DecodeError("group: field 'smp' stop should be a list of strings")
    if type(stop_token_ids) is not list or not all(type(t) is int for t in stop_token_ids):
        raise DecodeError("group: field 'smp' stop token ids should be a list of integers")
    if skip is not None and type(skip) is not bool:
        raise DecodeError("group: field 'smp' skip_special_tokens should be a boolean")
    if type(temperature) not in (int, float) or type(top_p) not in (int, float):
        raise DecodeError("group: field 'smp' temperature and top_p should be numbers")
    if type(top_k) is not int or type(max_new_tokens) is not int:
        raise DecodeError("group: field 'smp' top_k and max_new_tokens should be integers")
    return SamplingRecord(float(temperature), float(top_p), top_k, max_new_tokens, tuple(stop), tuple(stop_token_ids),
                          skip)


_NONE = type(None)
_MISSING = object()
# Allowed exact types per field. Exact, so an int field rejects True (bool is its own
# type) and one table lookup per field keeps decoding cheap.
_SAMPLE_FIELDS: dict[str, tuple] = {
    "gi": (int, _NONE), "ix": (int, _NONE), "p": (str, list, _NONE),
    "m": (dict,), "sp": (bool,), "t": (bytes,), "rl": (int,), "r": (bytes,), "rz": (bool,),
    "rw": (int, float, dict, _NONE), "lp": (bytes, _NONE), "wv": (list,), "st": (str,),
}
_GROUP_FIELDS: dict[str, tuple] = {
    "id": (str,), "pid": (bytes,), "gp": (str, list, _NONE), "s": (list,), "att": (int,), "rst": (int,),
    "adm": (int, _NONE), "ds": (str,), "ep": (int,), "row": (int,), "ct": (int, float),
    "clt": (int, float, _NONE), "ft": (int, float, _NONE), "wk": (str, _NONE), "err": (str, _NONE),
}
_STATUS = {s.value: s for s in Status}
_DEFAULTS = {name: (f.default_factory() if f.default_factory is not MISSING else f.default)
             for name, f in SAMPLE_FIELDS.items()}
#: The fields beyond the core ones whose defaults are values (None, 0, False): a decoded
#: sample starts from these; the three others are made new for each.
_IMMUTABLE_DEFAULTS = {name: f.default for name, f in SAMPLE_FIELDS.items()
                       if name not in _CORE_FIELDS and f.default_factory is MISSING}
_NUMBER = (int, float)
# Allowed exact types of the declared fields that travel in "x" (JSON values are checked
# apart); spec_info and prefix_cache_info are maps of counts.
_ATTRIBUTE_FIELDS: dict[str, tuple] = {
    "rollout_id": (int, _NONE), "multimodal_inputs": (dict, _NONE), "multimodal_train_inputs": (dict, _NONE),
    "multimodal_train_input_id": (str, _NONE), "apply_chat_template_kwargs": (dict,),
    "rollout_top_p_token_ids": (list, _NONE), "rollout_top_p_token_offsets": (list, _NONE),
    "rollout_routed_experts": (list, _NONE), "remove_sample": (bool,), "teacher_log_probs": (list, _NONE),
    "generate_function_path": (str, _NONE), "custom_rm_path": (str, _NONE), "train_metadata": (dict, _NONE),
    "session_id": (str, _NONE), "non_generation_time": _NUMBER, "spec_info": (dict,), "prefix_cache_info": (dict,),
}


def _decode_attributes(value: Any, what: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise DecodeError(f"{what}: field 'x' should be a map, got {type(value).__name__}")
    out = {}
    for name, item in value.items():
        problem = json_problem(item, f"attribute {name!r}") if type(name) is str else "a key that is not a string"
        if problem:
            raise DecodeError(f"{what}: {problem}")
        if name in _CORE_FIELDS or name.startswith("_"):
            raise DecodeError(f"{what}: attribute {name!r} cannot travel as an attribute")
        types = _ATTRIBUTE_FIELDS.get(name)
        if types is not None and type(item) not in types:
            raise DecodeError(f"{what}: attribute {name!r} should be "
                              f"{'/'.join(t.__name__ for t in types if t is not _NONE)}, got {type(item).__name__}")
        if name == "spec_info":
            item = SpecInfo.from_dict(item)
        elif name == "prefix_cache_info":
            item = PrefixCacheInfo.from_dict(item)
        out[name] = item
    return out


def _check_fields(m: dict, schema: dict[str, tuple], what: str) -> None:
    for key, types in schema.items():
        value = m.get(key, _MISSING)
        if type(value) in types:
            continue
        if value is _MISSING:
            raise DecodeError(f"{what}: missing field {key!r}")
        if type(value) is bool:
            raise DecodeError(f"{what}: field {key!r} is a bool")
        names = "/".join(t.__name__ for t in types if t is not _NONE)
        raise DecodeError(f"{what}: field {key!r} should be {names}, got {type(value).__name__}")


def _check_packed(data: Any, what: str) -> bytes:
    if not isinstance(data, bytes) or len(data) % 4:
        raise DecodeError(f"{what}: expected a byte string of 4-byte items, got {type(data).__name__}")
    return data


def _decode_sample(m: Any, prompt_ids: list[int], group_prompt: Any, i: int) -> Sample:
    what = f"sample {i}"
    if type(m) is not dict:
        raise DecodeError(f"{what}: expected a map, got {type(m).__name__}")
    _check_fields(m, _SAMPLE_FIELDS, what)
    if "lm" not in m:  # checked by _unpack_mask; absent is not "all ones" (that is [n, b""])
        raise DecodeError(f"{what}: missing field 'lm'")
    tail = _check_packed(m["t"], f"{what} tokens")
    prefix = prompt_ids if m["sp"] else []
    n_tokens = len(prefix) + len(tail) // 4
    text = m["r"]
    if m["rz"]:
        try:
            text = zlib.decompress(text)
        except zlib.error as exc:
            raise DecodeError(f"{what}: response text does not decompress: {exc}") from None
    status = _STATUS.get(m["st"])
    if status is None:
        raise DecodeError(f"{what}: unknown status {m['st']!r}")
    response_length = m["rl"]
    if not 0 <= response_length <= n_tokens:
        raise DecodeError(f"{what}: response_length {response_length} outside 0..{n_tokens}")
    lp = m["lp"]
    if lp is not None and len(_check_packed(lp, f"{what} log-probs")) // 4 != response_length:
        # slime: one rollout log-prob per response token.
        raise DecodeError(f"{what}: {len(lp) // 4} log-probs for {response_length} response tokens")
    wv = m["wv"]
    if not all(type(v) is str for v in wv):
        raise DecodeError(f"{what}: weight_versions must be strings")
    prompt = m["p"] if m["p"] is not None else group_prompt
    if not isinstance(prompt, (str, list)):
        raise DecodeError(f"{what}: no prompt (neither the sample's nor the group's)")
    reward = m["rw"]
    label = m.get("l", _MISSING)
    problem = ("missing field 'l'" if label is _MISSING else json_problem(label, "label")) or \
        (json_problem(reward, "reward") if type(reward) is dict else None)
    if problem:
        raise DecodeError(f"{what}: {problem}")
    sample = PackedSample.__new__(PackedSample)  # fields set directly: decoding is a hot path
    fields = sample.__dict__
    fields.update(_IMMUTABLE_DEFAULTS)
    fields.update(apply_chat_template_kwargs={}, spec_info=SpecInfo(), prefix_cache_info=PrefixCacheInfo())
    fields.update(
        group_index=m["gi"],
        index=m["ix"],
        prompt=prompt,
        label=m["l"],
        metadata=m["m"],
        tokens=PackedArray("i", tail, prefix),
        response_length=response_length,
        response=text.decode("utf-8", errors="replace"),
        reward=float(reward) if type(reward) is int else reward,
        loss_mask=_unpack_mask(m["lm"], response_length, what),
        rollout_log_probs=None if lp is None else PackedArray("f", lp),
        weight_versions=wv,
        status=status,
    )
    if "x" in m:
        fields.update(_decode_attributes(m["x"], what))
    return sample


def decode_group(data: bytes) -> Group:
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage input
        raise DecodeError(f"not msgpack: {exc}") from None
    if type(m) is not dict:
        raise DecodeError(f"expected a map, got {type(m).__name__}")
    version = m.get("v")
    if version != SCHEMA_VERSION:
        raise DecodeError(f"schema version {version!r}, this code reads {SCHEMA_VERSION}")
    _check_fields(m, _GROUP_FIELDS, "group")
    prompt_ids = _unpack_array("i", m["pid"], "prompt_ids")
    samples = [_decode_sample(s, prompt_ids, m["gp"], i) for i, s in enumerate(m["s"])]
    return Group(
        group_id=m["id"], samples=samples, prompt_ids=prompt_ids, attempts=m["att"], restarts=m["rst"],
        admitted_version=m["adm"], dataset=m["ds"], epoch=m["ep"], row=m["row"], created_at=m["ct"],
        claimed_at=m["clt"], finished_at=m["ft"], worker=m["wk"], error=m["err"],
        sampling=_decode_sampling(m.get("smp", _MISSING)),
        pushed_prompt=_decode_pushed_prompt(m.get("pp")),
    )


def _decode_pushed_prompt(value: Any) -> str | list | None:
    if value is not None and type(value) not in (str, list):
        raise DecodeError(f"group: field 'pp' should be a prompt (str or list), got {type(value).__name__}")
    return value


# -- in-flight checkpoints (pipeline/checkpoints.py) --------------------------------------------

#: The schema of a checkpoint record; a record of another is refused (its group restarts).
CHECKPOINT_SCHEMA = 1


@dataclass
class SampleProgress:
    """What a checkpoint keeps of one sample: its response so far (the tokens after its
    prompt) and what resuming it needs. The optional fields are kept only where the
    writer asks (a generate function's samples: their text, metadata and reward)."""

    response_ids: list[int]
    log_probs: list[float] | None  # one per response token; None: the sample has none
    loss_mask: list[int] | None  # None: all ones
    weight_versions: list[str]  # per engine call, as Sample.weight_versions
    segments: list[int] | None  # tokens per engine call (metadata SEGMENTS_KEY); None: not known
    status: Status
    prompt_ids: list[int] | None = None  # the tokens before the response, when not the group's prompt
    response: str | None = None  # None: decoded from the tokens when resumed
    metadata: dict | None = None  # None: the claimed group's, with `segments`
    reward: float | dict | None = None
    updated_ms: int = 0  # Redis time of the write that last changed it (set when read)

    @classmethod
    def of(cls, sample: Sample, prompt_ids: list[int], whole: bool = False) -> SampleProgress:
        """A sample's progress as it stands (its response tokens copied, its other lists
        shared); `whole` keeps its text, metadata, reward and, when they differ from the
        group's, its prompt."""
        tokens = sample.tokens
        start = len(tokens) - sample.response_length
        progress = cls(tokens[start:] if sample.response_length else [], sample.rollout_log_probs,
                       sample.loss_mask, sample.weight_versions, sample.metadata.get(SEGMENTS_KEY), sample.status)
        if whole:
            prompt = tokens[:start]
            progress.prompt_ids = None if prompt == prompt_ids else prompt
            progress.response, progress.metadata, progress.reward = sample.response, sample.metadata, sample.reward
        return progress


    def apply_to(self, sample: Sample, prompt_ids: list[int]) -> None:
        """Put this progress back into `sample` (resuming it where the checkpoint left it).
        Without a kept text its `response` is left to the caller (decoded from the tokens)."""
        sample.tokens = list(prompt_ids if self.prompt_ids is None else self.prompt_ids) + self.response_ids
        sample.response_length = len(self.response_ids)
        sample.rollout_log_probs = None if self.log_probs is None else list(self.log_probs)
        sample.loss_mask = None if self.loss_mask is None else list(self.loss_mask)
        sample.weight_versions = list(self.weight_versions)
        if self.metadata is not None:
            sample.metadata = dict(self.metadata)
        if self.segments is None:
            sample.metadata.pop(SEGMENTS_KEY, None)
        else:
            sample.metadata[SEGMENTS_KEY] = list(self.segments)
        sample.status = self.status
        if self.response is not None:
            sample.response = self.response
        if self.reward is not None:
            sample.reward = self.reward


def encode_checkpoint_record(changes: list[tuple[int, int, SampleProgress]]) -> bytes:
    """One record of a group's checkpoint: per changed sample (its position in the group,
    the response offset from which its tokens are written, its progress) the tokens from
    that offset on and its small fields whole. A record appended to earlier ones extends
    each sample from its offset; offset 0 writes the sample anew. Raises EncodeError."""
    entries = []
    try:
        for position, offset, p in changes:
            if not 0 <= offset <= len(p.response_ids):
                raise EncodeError(f"sample {position}: offset {offset} outside its {len(p.response_ids)} tokens")
            entry = {
                "i": position, "o": offset, "t": _pack_array("i", p.response_ids[offset:]),
                "lp": None if p.log_probs is None else _pack_array("f", p.log_probs[offset:]),
                "lm": None if p.loss_mask is None else _pack_mask(p.loss_mask[offset:]),
                "wv": list(p.weight_versions), "sg": None if p.segments is None else list(p.segments),
                "st": p.status.value,
            }
            if p.prompt_ids is not None:
                entry["pt"] = _pack_array("i", p.prompt_ids)
            if p.response is not None:
                entry["r"] = p.response
            if p.metadata is not None:
                entry["m"] = p.metadata
            if p.reward is not None:
                entry["rw"] = p.reward
            entries.append(entry)
        return msgpack.packb({"v": CHECKPOINT_SCHEMA, "s": entries}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # msgpack: a value it cannot pack
        if isinstance(exc, EncodeError):
            raise
        raise EncodeError(f"checkpoint record: {type(exc).__name__}: {exc}") from None


_RECORD_FIELDS: dict[str, tuple] = {
    "i": (int,), "o": (int,), "t": (bytes,), "lp": (bytes, _NONE), "lm": (list, _NONE), "wv": (list,),
    "sg": (list, _NONE), "st": (str,),
}
_RECORD_OPTIONAL: dict[str, tuple] = {"pt": (bytes,), "r": (str,), "m": (dict,), "rw": (int, float, dict)}


def decode_checkpoint(records: list[bytes], times_ms: list[int] | None = None) -> dict[int, SampleProgress]:
    """Replay a checkpoint's records, oldest first, into each sample's progress by its
    position in the group; `times_ms` (one per record) dates each sample's last change.
    Raises DecodeError for a record that is not of this schema or does not follow the
    ones before it."""
    samples: dict[int, SampleProgress] = {}
    for k, data in enumerate(records):
        what = f"checkpoint record {k + 1}"
        try:
            m = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several types for garbage input
            raise DecodeError(f"{what}: not msgpack: {exc}") from None
        if type(m) is not dict or m.get("v") != CHECKPOINT_SCHEMA or type(m.get("s")) is not list:
            raise DecodeError(f"{what}: not a checkpoint record of schema {CHECKPOINT_SCHEMA}")
        for entry in m["s"]:
            _replay(samples, entry, what, times_ms[k] if times_ms and k < len(times_ms) else 0)
    return samples


def _replay(samples: dict[int, SampleProgress], e: Any, what: str, at_ms: int) -> None:
    if type(e) is not dict:
        raise DecodeError(f"{what}: an entry is a {type(e).__name__}, not a map")
    _check_fields(e, _RECORD_FIELDS, what)
    for key, types in _RECORD_OPTIONAL.items():
        if key in e and type(e[key]) not in types:
            raise DecodeError(f"{what}: field {key!r} should be {'/'.join(t.__name__ for t in types)}")
    position, offset = e["i"], e["o"]
    what = f"{what}, sample {position}"
    status = _STATUS.get(e["st"])
    if position < 0 or offset < 0 or status is None:
        raise DecodeError(f"{what}: position {position}, offset {offset} or status {e['st']!r} is not one")
    if not all(type(v) is str for v in e["wv"]) or (e["sg"] is not None and not all(
            type(n) is int and n >= 0 for n in e["sg"])):
        raise DecodeError(f"{what}: weight versions must be strings and segments counts")
    p = samples.get(position)
    if p is None:
        p = samples[position] = SampleProgress([], None, None, [], None, status)
    if offset > len(p.response_ids):
        raise DecodeError(f"{what}: continues at token {offset} of {len(p.response_ids)}")
    new = _unpack_array("i", e["t"], f"{what} tokens")
    del p.response_ids[offset:]
    p.response_ids += new
    # Log-probs and mask follow the tokens: cut at the offset, extended by this record's.
    if e["lp"] is None:
        if p.log_probs is not None and offset and new:
            raise DecodeError(f"{what}: tokens without log-probs after tokens with them")
        if offset == 0:
            p.log_probs = None
    else:
        lps = _unpack_array("f", e["lp"], f"{what} log-probs")
        if len(lps) != len(new) or (p.log_probs is None and offset):
            raise DecodeError(f"{what}: {len(lps)} log-probs for {len(new)} tokens after {offset}")
        if p.log_probs is None:
            p.log_probs = []
        del p.log_probs[offset:]
        p.log_probs += lps
    if e["lm"] is None and offset == 0:
        p.loss_mask = None
    elif e["lm"] is not None or p.loss_mask is not None:
        if p.loss_mask is None:
            p.loss_mask = [1] * offset
        del p.loss_mask[offset:]
        p.loss_mask += [1] * len(new) if e["lm"] is None else _unpack_mask(e["lm"], len(new), what)
    p.weight_versions, p.segments, p.status, p.updated_ms = e["wv"], e["sg"], status, at_ms
    if "pt" in e:
        p.prompt_ids = _unpack_array("i", e["pt"], f"{what} prompt")
    for key, name in (("r", "response"), ("m", "metadata"), ("rw", "reward")):
        if key in e:
            setattr(p, name, e[key])
