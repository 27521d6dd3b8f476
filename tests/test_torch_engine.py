"""The PyTorch engine over real HTTP: log-probs against a direct forward pass of the
same model, the sampling parameters, continuous batching, the pause modes, weight
updates from checkpoints the trainer writes, and the real sglang-router in front."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from tests.helpers import RouterProcess, http_call, wait_for
from engines.byte_lm import ByteLM, ModelConfig, save_checkpoint, token_logprobs
from workers.tokenizer import ByteTokenizer
from engines.torch_engine import TorchEngineConfig, start_torch_engine

TOK = ByteTokenizer()
PROMPT = list(b"lower: ")
SMALL = ModelConfig(context_length=128)
LP_TOLERANCE = 1e-5  # float32: batched KV-cache decoding vs one full forward pass

_pool = ThreadPoolExecutor(max_workers=8)


def generate(url: str, body: dict, timeout: float = 30.0) -> dict | list:
    status, out = http_call(url, "/generate", body, timeout=timeout)
    assert status == 200, out
    return out


def in_background(url: str, body: dict) -> Future:
    return _pool.submit(http_call, url, "/generate", body, None, 60.0)


def reference(seed: int = 0, config: ModelConfig = SMALL) -> ByteLM:
    """The model the engine builds from the same config and seed, in this process."""
    return ByteLM(config, seed=seed).eval()


def direct_logprobs(model: ByteLM, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    tokens = torch.tensor([prompt + output])
    with torch.no_grad():
        return token_logprobs(model(tokens), tokens, temperature)[0, len(prompt) - 1:].tolist()


def logprobs_of(out: dict) -> list[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


def load(url: str) -> dict:
    return http_call(url, "/v1/loads")[1]["loads"][0]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    with start_torch_engine(TorchEngineConfig(seed=0, model=SMALL, max_running_requests=8)) as handle:
        yield handle


@pytest.fixture
def slow():
    """Decode steps of at least 20 ms, so requests stay in flight long enough to poke at."""
    with start_torch_engine(TorchEngineConfig(seed=0, model=SMALL, max_running_requests=2, min_step_s=0.02)) as h:
        yield h


# --- log-probs ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_output_logprobs_match_a_direct_forward_pass(engine, temperature):
    out = generate(engine.url, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 24, "temperature": temperature, "ignore_eos": True, "sampling_seed": 5}})
    assert out["output_ids"] == [e[1] for e in out["meta_info"]["output_token_logprobs"]]
    expected = direct_logprobs(reference(), PROMPT, out["output_ids"], temperature)
    assert max(abs(a - b) for a, b in zip(logprobs_of(out), expected)) <= LP_TOLERANCE
    # After the temperature, as SGLang: at 0.7 the same tokens are likelier than at 1.0.
    if temperature != 1.0:
        untempered = direct_logprobs(reference(), PROMPT, out["output_ids"], 1.0)
        assert sum(logprobs_of(out)) != pytest.approx(sum(untempered), abs=1e-3)


def test_prompt_logprobs_of_a_forced_sequence_match_a_direct_forward_pass(engine):
    forced = list(b"The quick brown fox jumps over the lazy dog")
    out = generate(engine.url, {"input_ids": forced, "return_logprob": True, "logprob_start_len": 0,
                                "sampling_params": {"max_new_tokens": 1}})
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == forced and entries[0][0] is None
    expected = direct_logprobs(reference(), forced[:1], forced[1:])
    assert max(abs(e[0] - x) for e, x in zip(entries[1:], expected)) <= LP_TOLERANCE


def test_top_logprobs_are_the_distributions_best(engine):
    out = generate(engine.url, {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 3,
                                "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    top = out["meta_info"]["output_top_logprobs"]
    assert len(top) == 4 and all(len(t) == 3 for t in top)
    for entries, (lp, token, _) in zip(top, out["meta_info"]["output_token_logprobs"]):
        assert entries[0][1] == token and entries[0][0] == lp  # greedy: the best is the one taken
        assert entries[0][0] >= entries[1][0] >= entries[2][0]


# --- sampling parameters ------------------------------------------------------------


def test_top_k_1_is_greedy(engine):
    greedy = generate(engine.url, {"input_ids": PROMPT, "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
    model = reference()
    with torch.no_grad():
        seq = list(PROMPT)
        for _ in range(16):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert greedy["output_ids"] == seq[len(PROMPT):]
    for seed in (1, 2):
        top1 = generate(engine.url, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 16, "top_k": 1, "ignore_eos": True, "sampling_seed": seed}})
        assert top1["output_ids"] == greedy["output_ids"]
        assert logprobs_of(top1) == pytest.approx(logprobs_of(greedy), abs=LP_TOLERANCE)


def test_same_sampling_seed_same_sample_and_different_seeds_differ(engine):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 3}}
    first, again = generate(engine.url, body), generate(engine.url, body)
    assert first["output_ids"] == again["output_ids"]
    body["sampling_params"]["sampling_seed"] = 4
    assert generate(engine.url, body)["output_ids"] != first["output_ids"]


def test_top_p_keeps_only_the_nucleus(engine):
    out = generate(engine.url, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 32, "top_p": 0.05, "ignore_eos": True, "sampling_seed": 1}})
    model = reference()
    tokens = torch.tensor([PROMPT + out["output_ids"]])
    with torch.no_grad():
        probs = torch.softmax(model(tokens)[0, len(PROMPT) - 1:-1], -1)
    for step, token in enumerate(out["output_ids"]):
        row = probs[step]
        mass_before = row[row > row[token]].sum()  # the mass of likelier tokens
        assert mass_before <= 0.05 + 1e-6


def test_stop_token_ends_the_sample(engine):
    free = generate(engine.url, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "ignore_eos": True}})["output_ids"]
    stop = free[5]
    first = free.index(stop)
    out = generate(engine.url, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "stop_token_ids": [stop], "no_stop_trim": True}})
    assert out["output_ids"] == free[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_string_ends_the_sample(engine):
    free = generate(engine.url, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "ignore_eos": True}})["output_ids"]
    stop = TOK.decode(free[6:8])
    out = generate(engine.url, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "stop": [stop], "ignore_eos": True}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop in TOK.decode(out["output_ids"]) and len(out["output_ids"]) <= 8


def test_a_stop_string_beats_a_stop_token_which_beats_the_length_limit_as_in_sglang(engine):
    """SGLang's Req.update_finish_state (0.5.20 to 0.5.23) checks stop strings, then stop tokens, then
    the length, when several end a request on the same token."""
    free = generate(engine.url, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "ignore_eos": True}})["output_ids"]
    token = next(t for t in free if t < 128)  # an ASCII byte: its own one-character string
    first = free.index(token)
    params = {"max_new_tokens": first + 1, "temperature": 0, "stop_token_ids": [token]}
    out = generate(engine.url, {"input_ids": PROMPT, "sampling_params": {**params, "stop": [chr(token)]}})
    assert out["output_ids"] == free[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": chr(token)}
    out = generate(engine.url, {"input_ids": PROMPT, "sampling_params": params})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}


def test_max_new_tokens_holds(engine):
    for limit in (0, 1, 9):
        out = generate(engine.url, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
            "max_new_tokens": limit, "ignore_eos": True}})
        assert len(out["output_ids"]) == limit == len(out["meta_info"]["output_token_logprobs"])
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": limit}


def test_unsupported_parameters_are_a_400_naming_them(engine):
    status, out = http_call(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "repetition_penalty": 1.2}})
    assert status == 400 and "penalt" in out["error"]["message"]
    status, out = http_call(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "regex": "a+"}})
    assert status == 400 and "regex" in out["error"]["message"]
    status, out = http_call(engine.url, "/generate", {"input_ids": [1, 2, 300],
                                                      "sampling_params": {"max_new_tokens": 8}})
    assert status == 400 and "vocab" in out["error"]["message"]


# --- batching and scheduling ----------------------------------------------------------


def test_a_sample_does_not_depend_on_its_batch(engine):
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 9}}
    alone = generate(engine.url, body)
    crowd = generate(engine.url, {"input_ids": [PROMPT, list(b"x"), list(b"some longer prompt"), PROMPT],
                                  "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 9}})
    for out in (crowd[0], crowd[3]):
        assert out["output_ids"] == alone["output_ids"]
        assert logprobs_of(out) == pytest.approx(logprobs_of(alone), abs=LP_TOLERANCE)


def test_requests_join_and_leave_between_decode_steps(slow):
    """max_running 2: a long request keeps decoding while short ones join its batch,
    finish and leave; a third request waits for a slot."""
    long = in_background(slow.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})
    wait_for(lambda: load(slow.url)["num_running_reqs"] == 1, what="the long request running")
    short = [in_background(slow.url, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True}}) for _ in range(2)]
    wait_for(lambda: load(slow.url)["num_waiting_reqs"] == 1 or all(f.done() for f in short), what="a queued request")
    for f in short:
        status, out = f.result(timeout=30)
        assert status == 200 and len(out["output_ids"]) == 3
    assert not long.done()  # the short ones joined and left while it kept going
    status, out = long.result(timeout=60)
    assert status == 200 and len(out["output_ids"]) == 100


def _start_long(url: str, rid: str, tokens: int = 60) -> Future:
    future = in_background(url, {"input_ids": PROMPT, "rid": rid, "return_logprob": True, "sampling_params": {
        "max_new_tokens": tokens, "ignore_eos": True, "sampling_seed": 11}})
    wait_for(lambda: load(url)["num_used_tokens"] >= len(PROMPT) + 5, what=f"{rid} producing tokens")
    return future


def test_pause_abort_returns_the_partial_output_with_its_logprobs(slow):
    future = _start_long(slow.url, "a1")
    assert http_call(slow.url, "/pause_generation", {"mode": "abort"})[0] == 200
    status, out = future.result(timeout=30)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= len(out["output_ids"]) < 60
    assert logprobs_of(out) == pytest.approx(direct_logprobs(reference(), PROMPT, out["output_ids"]),
                                             abs=LP_TOLERANCE)
    http_call(slow.url, "/continue_generation", {})


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_paused_requests_continue_the_same_sample(slow, mode):
    uninterrupted = generate(slow.url, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 11}})
    future = _start_long(slow.url, f"p-{mode}", tokens=40)
    http_call(slow.url, "/pause_generation", {"mode": mode})
    assert not future.done()
    http_call(slow.url, "/continue_generation", {})
    status, out = future.result(timeout=30)
    assert status == 200 and out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
    assert out["output_ids"] == uninterrupted["output_ids"]
    assert logprobs_of(out) == pytest.approx(logprobs_of(uninterrupted), abs=LP_TOLERANCE)


# --- weights ------------------------------------------------------------------------


def test_a_checkpoint_changes_outputs_exactly_as_loading_it_in_the_trainer(tmp_path):
    with start_torch_engine(TorchEngineConfig(seed=0, model=SMALL)) as eng:
        body = {"input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 2}}
        before = generate(eng.url, body)
        trained = ByteLM(SMALL, seed=0)
        with torch.no_grad():  # a "training step": any change to every weight
            for p in trained.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        path = save_checkpoint(trained, tmp_path / "step-1.pt")
        status, reply = http_call(eng.url, "/update_weights_from_disk",
                                  {"model_path": str(path), "weight_version": "1"})
        assert status == 200 and reply["success"], reply
        assert http_call(eng.url, "/get_model_info")[1]["weight_version"] == "1"
        after = generate(eng.url, body)
        assert after["meta_info"]["weight_version"] == "1"
        assert after["output_ids"] != before["output_ids"]
        trainer_side = ByteLM(SMALL, seed=123)  # different init, then the checkpoint
        trainer_side.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
        expected = direct_logprobs(trainer_side.eval(), PROMPT, after["output_ids"])
        assert max(abs(a - b) for a, b in zip(logprobs_of(after), expected)) <= LP_TOLERANCE


def test_in_place_requests_continue_under_the_new_weights(tmp_path):
    with start_torch_engine(TorchEngineConfig(seed=0, model=SMALL, min_step_s=0.02)) as eng:
        future = _start_long(eng.url, "ip", tokens=50)
        http_call(eng.url, "/pause_generation", {"mode": "in_place"})
        paused_at = load(eng.url)["num_used_tokens"] - len(PROMPT)
        new = ByteLM(SMALL, seed=7)
        path = save_checkpoint(new, tmp_path / "new.pt")
        status, reply = http_call(eng.url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "2",
                                                                         "flush_cache": False})
        assert status == 200 and reply["num_paused_requests"] == 0
        http_call(eng.url, "/continue_generation", {})
        status, out = future.result(timeout=30)
        assert out["meta_info"]["weight_version"] == "2"
        got = logprobs_of(out)
        old_lp = direct_logprobs(reference(), PROMPT, out["output_ids"])
        new_lp = direct_logprobs(new.eval(), PROMPT, out["output_ids"])
        assert max(abs(a - b) for a, b in zip(got[:paused_at], old_lp[:paused_at])) <= LP_TOLERANCE
        assert max(abs(a - b) for a, b in zip(got[paused_at:], new_lp[paused_at:])) <= LP_TOLERANCE


def test_a_bad_checkpoint_is_refused_and_the_old_weights_stay(engine, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    other = save_checkpoint(ByteLM(ModelConfig(context_length=128, d_model=64)), tmp_path / "narrow.pt")
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    before = generate(engine.url, body)
    for path, says in ((tmp_path / "missing.pt", "no checkpoint"), (junk, "not a readable"),
                       (other, "different architecture: d_model 64")):
        status, reply = http_call(engine.url, "/update_weights_from_disk",
                                  {"model_path": str(path), "weight_version": "9"})
        assert status == 400 and not reply["success"] and says in reply["message"], reply
    assert http_call(engine.url, "/get_model_info")[1]["weight_version"] == "default"
    assert generate(engine.url, body)["output_ids"] == before["output_ids"]
    status, reply = http_call(engine.url, "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert status == 400 and "from disk only" in reply["message"]


def test_info_health_and_flush(engine):
    assert http_call(engine.url, "/health") == (200, "")
    info = http_call(engine.url, "/get_model_info")[1]
    assert info["architectures"] == ["ByteLM"] and info["weight_version"] == "default"
    server = http_call(engine.url, "/get_server_info")[1]
    assert server["context_length"] == 128 and server["model_config"]["n_layers"] == 2
    assert http_call(engine.url, "/flush_cache", method="POST")[0] == 200


# --- behind the real router -----------------------------------------------------------


@pytest.mark.slow
def test_generates_behind_the_real_sglang_router(engine, tmp_path):
    router = RouterProcess([engine.url], str(tmp_path / "router.log"))
    try:
        router.wait_ready([engine.url])
        out = generate(router.url, {"input_ids": PROMPT, "return_logprob": True, "rid": "via-router",
                                    "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 1}})
        assert out["meta_info"]["id"] == "via-router" and len(out["output_ids"]) == 12
        assert max(abs(a - b) for a, b in zip(logprobs_of(out), direct_logprobs(reference(), PROMPT,
                                                                                 out["output_ids"]))) <= LP_TOLERANCE
    finally:
        router.stop()
