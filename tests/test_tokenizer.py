"""Tests for workers.tokenizer: the byte tokenizer, prompt encoding, the Hugging
Face adapter (tokenizers file path; transformers path with a stand-in) and the
tokenizer a worker picks for its engines (real HTTP to the simulator and to an
engine answering like SGLang serving a real model)."""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import types

import pytest
from hypothesis import given, strategies as st

from pipeline.redis_server import free_port
from tests.helpers import FakeModelEngine, wait_for
from engines.simulator import SimConfig, start_simulator
from workers.tokenizer import (
    ByteTokenizer,
    ChatTemplateMissing,
    EngineModel,
    HFTokenizer,
    TokenizerChoiceError,
    choose_tokenizer,
    encode_prompt, render_prompt,
    load_tokenizer,
    simple_chat_template,
    worker_tokenizer,
)

# --- ByteTokenizer -------------------------------------------------------------


def test_byte_tokenizer_constants():
    tok = ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (256, 257, 258, 259)


def test_encode_is_utf8_bytes_without_specials():
    tok = ByteTokenizer()
    assert tok.encode("hé") == [104, 0xC3, 0xA9]
    assert tok.encode("") == []


@given(st.text())
def test_round_trip_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_decode_skips_or_shows_special_tokens():
    tok = ByteTokenizer()
    ids = [tok.bos_token_id] + tok.encode("hi") + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>hi<|eos|><|pad|>"


def test_decode_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([0xC3]) == "\ufffd"  # truncated 2-byte sequence
    assert tok.decode([0xFF, 104]) == "\ufffdh"
    # a special token between the bytes of one character does not glue them together
    assert tok.decode([0xC3, 257, 0xA9], skip_special_tokens=False) == "\ufffd<|eos|>\ufffd"


def test_decode_rejects_out_of_vocab_ids():
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        ByteTokenizer().decode([300])


def test_chat_template_format():
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2 + 3?"}]
    assert tok.apply_chat_template(messages) == "<|system|>\nBe terse.\n<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("What is 2 + 3?\n")


@pytest.mark.parametrize("bad", [[], "hi", [{"role": "user"}], [{"content": "x"}], ["x"], [{"role": "user", "content": 3}]])
def test_chat_template_rejects_malformed_messages(bad):
    with pytest.raises(ValueError):
        simple_chat_template(bad)


# --- encode_prompt -------------------------------------------------------------


def test_encode_prompt_plain_string():
    tok = ByteTokenizer()
    assert encode_prompt(tok, "abc", apply_chat_template=False) == [97, 98, 99]


def test_encode_prompt_string_with_template_is_one_user_message():
    tok = ByteTokenizer()
    ids = encode_prompt(tok, "abc", apply_chat_template=True)
    assert tok.decode(ids) == "<|user|>\nabc\n<|assistant|>\n"


@pytest.mark.parametrize("flag", [True, False])
def test_encode_prompt_messages_always_templated(flag):
    tok = ByteTokenizer()
    messages = [{"role": "user", "content": "abc"}]
    assert tok.decode(encode_prompt(tok, messages, apply_chat_template=flag)) == "<|user|>\nabc\n<|assistant|>\n"


@pytest.mark.parametrize("bad", [None, 3, {"role": "user", "content": "x"}, [{"role": "user"}]])
def test_encode_prompt_rejects_bad_prompts_with_value_error(bad):
    with pytest.raises(ValueError):
        encode_prompt(ByteTokenizer(), bad, apply_chat_template=True)


# --- load_tokenizer ------------------------------------------------------------


@pytest.mark.parametrize("name", [None, "byte"])
def test_load_byte(name):
    assert isinstance(load_tokenizer(name), ByteTokenizer)


def test_missing_transformers_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[hf\]' in your clone"):
        load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")


def test_missing_tokenizers_gives_install_hint(monkeypatch, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[hf\]' in your clone"):
        load_tokenizer(str(path))


def test_tokenizers_file_round_trip(tokenizer_json):
    tok = load_tokenizer(tokenizer_json)
    assert isinstance(tok, HFTokenizer)
    text = "What is 12 + 30? héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == tok.backend.token_to_id("<|endoftext|>")
    assert tok.pad_token_id == tok.backend.token_to_id("<pad>")
    assert tok.vocab_size <= 400
    # special tokens are stripped on decode unless asked for
    assert tok.decode(ids + [tok.eos_token_id]) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=False).endswith("<|endoftext|>")


def test_a_tokenizer_without_a_template_never_gets_an_invented_one(tokenizer_json):
    """A bare tokenizer.json (like a base model) has no chat template: chat messages are
    refused (the worker dead-letters the group with this message), string prompts go as text."""
    tok = load_tokenizer(tokenizer_json)
    assert not tok.has_chat_template
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    with pytest.raises(ChatTemplateMissing, match="has no chat template"):
        tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match="has no chat template"):
        encode_prompt(tok, messages, apply_chat_template=None)
    for choice in (None, False):  # by default, a model without a template gets its prompts as text
        assert tok.decode(encode_prompt(tok, "What is 2 + 3?", apply_chat_template=choice)) == "What is 2 + 3?"


class _FakeHFTokenizer:
    """Stands in for a transformers tokenizer (transformers is not installed)."""

    eos_token_id = 2
    bos_token_id = 1
    pad_token_id = 0

    def __init__(self, chat_template):
        self.chat_template = chat_template
        self.calls = []

    def __len__(self):
        return 1000

    def encode(self, text, add_special_tokens=True):
        self.calls.append(("encode", add_special_tokens))
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i < 3))

    def apply_chat_template(self, messages, tools=None, tokenize=True, add_generation_prompt=False, **kwargs):
        assert tokenize is False
        self.calls.append(("template", tools, kwargs))
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")


def _install_fake_transformers(monkeypatch, chat_template):
    loaded = []

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(path):
            loaded.append(path)
            return _FakeHFTokenizer(chat_template)

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=AutoTokenizer))
    return loaded


def test_transformers_adapter(monkeypatch):
    loaded = _install_fake_transformers(monkeypatch, chat_template="{{ jinja }}")
    tok = load_tokenizer("org/model")
    assert loaded == ["org/model"]
    assert isinstance(tok, HFTokenizer)
    assert (tok.eos_token_id, tok.bos_token_id, tok.vocab_size) == (2, 1, 1000)
    assert tok.encode("ab") == [97, 98]
    assert tok.backend.calls == [("encode", False)]  # no special tokens added
    assert tok.decode([1, 97, 98, 2]) == "ab"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x[assistant]"


def test_transformers_adapter_without_template_refuses_chat_messages(monkeypatch):
    _install_fake_transformers(monkeypatch, chat_template=None)
    tok = load_tokenizer("org/model")
    with pytest.raises(ChatTemplateMissing, match="'org/model' has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_the_models_own_template_is_applied_by_default(monkeypatch):
    _install_fake_transformers(monkeypatch, chat_template="{{ jinja }}")
    tok = load_tokenizer("org/model")
    assert tok.has_chat_template
    assert encode_prompt(tok, "x", apply_chat_template=None) == tok.encode("[user]x[assistant]")
    assert encode_prompt(tok, "x", apply_chat_template=False) == tok.encode("x")  # --no-apply-chat-template


def test_a_prompt_is_rendered_with_slimes_call_tools_and_template_options_included(monkeypatch):
    _install_fake_transformers(monkeypatch, chat_template="{{ jinja }}")
    tok = load_tokenizer("org/model")
    tools = [{"type": "function", "function": {"name": "search"}}]
    assert render_prompt(tok, "x", tools, {"enable_thinking": False}) == "[user]x[assistant]"
    assert tok.backend.calls[-1] == ("template", tools, {"enable_thinking": False})
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]
    assert render_prompt(tok, chat) == "[system]s[user]x[assistant]" and tok.backend.calls[-1] == ("template", None, {})


# --- the tokenizer a worker's engines need -------------------------------------------

SIM = EngineModel("http://sim:1", "sim/byte-lm", "sim/byte-lm", reads_bytes=True)
QWEN = EngineModel("http://a:1", "Qwen/Qwen2.5-7B-Instruct", None, reads_bytes=False)


def test_simulators_take_bytes_unless_asked_otherwise():
    assert choose_tokenizer([SIM, SIM], None, allow_byte=False) is None
    assert choose_tokenizer([SIM], "org/tok", allow_byte=False) == "org/tok"


def test_a_real_model_gets_its_own_tokenizer_by_default():
    assert choose_tokenizer([QWEN], None, allow_byte=False) == "Qwen/Qwen2.5-7B-Instruct"
    with_path = EngineModel("http://b:1", "/models/q", "/models/q-tok", reads_bytes=False)
    assert choose_tokenizer([with_path], None, allow_byte=False) == "/models/q-tok"
    assert choose_tokenizer([QWEN], "/models/other", allow_byte=False) == "/models/other"


def test_byte_tokenizer_against_a_real_model_is_refused_unless_allowed():
    with pytest.raises(TokenizerChoiceError, match=r"Qwen/Qwen2.5-7B-Instruct.*--allow-byte-tokenizer"):
        choose_tokenizer([SIM, QWEN], "byte", allow_byte=False)
    assert choose_tokenizer([QWEN], "byte", allow_byte=True) == "byte"


def test_engines_of_different_or_unnamed_models_need_an_explicit_tokenizer():
    other = EngineModel("http://c:1", "meta-llama/Llama-3.1-8B", None, reads_bytes=False)
    with pytest.raises(TokenizerChoiceError, match="different tokenizers"):
        choose_tokenizer([QWEN, other], None, allow_byte=False)
    unnamed = EngineModel("http://d:1", None, None, reads_bytes=False)
    with pytest.raises(TokenizerChoiceError, match="http://d:1 does not say which model"):
        choose_tokenizer([unnamed], None, allow_byte=False)
    assert choose_tokenizer([QWEN, other], "org/tok", allow_byte=False) == "org/tok"


def test_the_simulator_is_recognised_by_its_model_info():
    sim = start_simulator(SimConfig(seed=0))
    try:
        assert asyncio.run(worker_tokenizer([sim.url], None, allow_byte=False, apply_chat_template=False)) is None
    finally:
        sim.stop()


def test_a_worker_takes_the_served_models_tokenizer_and_refuses_bytes(tokenizer_json):
    engine = FakeModelEngine(tokenizer_json)
    try:
        run = lambda requested, template=None: asyncio.run(asyncio.wait_for(
            worker_tokenizer([engine.url], requested, allow_byte=False, apply_chat_template=template), 30))
        assert run(None) == tokenizer_json
        # This model has no chat template: asking for one is refused at start, not invented.
        with pytest.raises(TokenizerChoiceError, match="--apply-chat-template, but tokenizer .* has no chat template"):
            run(None, True)
        with pytest.raises(TokenizerChoiceError, match="--allow-byte-tokenizer"):
            run("byte")
        # A tokenizer named explicitly does not depend on what the engines serve.
        engine.close()
        assert run(tokenizer_json) == tokenizer_json
        engine = FakeModelEngine(tokenizer_json)
        engine.model_info["tokenizer_path"] = str(tokenizer_json) + ".missing.json"
        with pytest.raises(TokenizerChoiceError, match=r"cannot load tokenizer .*missing") as failed:
            run(None)
        assert str(failed.value).count("cannot load tokenizer") == 1
        assert str(failed.value).endswith("(the one the engines serve; --tokenizer picks another)")
    finally:
        engine.close()


def test_a_tokenizer_that_cannot_load_offline_is_said_once_with_what_to_do(monkeypatch):
    """Not "cannot load tokenizer X (the one the engines serve ...): cannot load tokenizer X: ..."
    for a tokenizer given with --tokenizer."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TokenizerChoiceError) as failed:
        asyncio.run(worker_tokenizer([], "no-such-org/no-such-model", allow_byte=False, apply_chat_template=False))
    message = str(failed.value)
    assert message.startswith("cannot load tokenizer 'no-such-org/no-such-model': ") and "\n" not in message
    assert message.count("cannot load tokenizer") == 1 and "the engines serve" not in message
    assert message.endswith("(given with --tokenizer; offline (HF_HUB_OFFLINE=1) it must be in the Hugging Face "
                            "cache, or a local folder)")


def test_a_worker_waits_for_an_engine_that_is_not_up_yet(caplog):
    """Nothing listens at the URL: the waiting line says to check it (a wrong port waits
    forever otherwise), and what it waits for goes to `on_wait` (the worker's /health)."""
    port = free_port()
    result: dict = {}
    states: list[str] = []
    caplog.set_level(logging.WARNING, logger="workers.tokenizer")

    def wait() -> None:
        result["tokenizer"] = asyncio.run(worker_tokenizer([f"http://127.0.0.1:{port}"], None, allow_byte=False,
                                                           apply_chat_template=False, wait_log_s=0,
                                                           on_wait=states.append))

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    wait_for(lambda: "waiting for engine" in caplog.text, what="the waiting log line")
    assert thread.is_alive()
    assert "nothing listens there (connection refused): check the URL" in caplog.text
    assert "a model may still be loading" not in caplog.text
    assert states[0].startswith(f"waiting for engine http://127.0.0.1:{port} to answer /get_model_info")
    sim = start_simulator(SimConfig(seed=0), port=port)
    try:
        thread.join(30)
        assert not thread.is_alive() and result == {"tokenizer": None}
        assert states[-1] == "loading tokenizer byte"
    finally:
        sim.stop()


def test_an_engine_that_answers_503_while_loading_is_waited_for_as_loading(caplog):
    import http.server

    class Loading(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Loading)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    caplog.set_level(logging.WARNING, logger="workers.tokenizer")

    async def briefly():
        await asyncio.wait_for(worker_tokenizer([f"http://127.0.0.1:{server.server_address[1]}"], None, False,
                                                False, wait_log_s=0), 1.0)

    try:
        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(briefly())
    finally:
        server.shutdown()
        server.server_close()
    assert "(a model may still be loading)" in caplog.text and "check the URL" not in caplog.text


def _chatml_tokenizer_json(folder):
    """A SmolLM2-shaped tokenizer.json: <|endoftext|> is id 0 (its unk), <|im_end|> ends a turn."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The capital of France is Paris."] * 10, trainer=trainer)
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_a_bare_tokenizer_json_takes_its_eos_from_the_folders_tokenizer_config(tmp_path):
    path = _chatml_tokenizer_json(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text(
        '{"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|im_end|>"}')
    tok = load_tokenizer(str(path))
    assert tok.eos_token_id == tok.backend.token_to_id("<|im_end|>") == 2  # not <|endoftext|> (0)
    assert tok.bos_token_id == 1
    assert tok.pad_token_id == 2


def test_a_bare_tokenizer_json_takes_its_eos_from_generation_config_when_the_tokenizer_config_says_none(tmp_path):
    path = _chatml_tokenizer_json(tmp_path / "model")
    (tmp_path / "model" / "generation_config.json").write_text('{"eos_token_id": [2, 0], "pad_token_id": 2}')
    tok = load_tokenizer(str(path))
    assert tok.eos_token_id == 2
    assert tok.pad_token_id == 2


def test_a_lone_tokenizer_json_still_guesses_from_the_token_strings(tmp_path):
    path = _chatml_tokenizer_json(tmp_path / "model")
    assert load_tokenizer(str(path)).eos_token_id == 0  # nothing says otherwise: the first candidate
