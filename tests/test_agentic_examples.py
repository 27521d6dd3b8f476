"""slime's agentic examples, as they behave, end to end through `rollout worker
--generate-function ... --reward ...`: multi-turn tool use in retool's format (code and
interpreter tags) and search-r1's (search and information tags), against an engine that
scripts both with SmolLM2's real tokenizer (tests/scripted_engine.py), with a weight update
in the middle that aborts conversations mid-way. The functions (tests/agentic_functions.py)
do what slime's do and rely on: undeclared attributes read by the reward, dict rewards with
a bool and a string, dict labels, state reset on entry, append_response_tokens, chat
prompts rendered under --apply-chat-template.

Every trained sample is checked against independent records: its prompt ids, each engine
call's tokens, log-probs and weight version (the engine's own record), loss mask 1 exactly
on engine tokens, tool output where the format puts it, the reward the script implies;
every group trained once, audit clean. Each check is shown to bite: a copy of the batch
with one mask, token, log-prob or reward corrupted fails it.
"""
from __future__ import annotations

import asyncio
import copy
import os
import re
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from engines.simulator import SimConfig
from pipeline.consumer import Consumer
from pipeline.connection import connect
from pipeline.controller import Controller
from pipeline.ops.audit import audit
from pipeline.queue import Queue
from pipeline.types import Group, Status
from tests import agentic_functions as fns
from tests.helpers import WorkerThread, consume_all, http_json, wait_for
from tests.scripted_engine import FACTS, start_scripted_engine, tool_calls_planned, wrong_on_purpose
from workers.engine_set import EngineSet
from workers.sampling import SamplingSettings
from workers.worker import WorkerSettings

pytestmark = pytest.mark.slow

MODEL_DIR = Path(os.environ.get("ROLLOUT_SMOLLM2_DIR", Path.home() / ".cache" / "rollout-queue" / "models"
                                / "smollm2"))
GROUPS, SAMPLES = 4, 3
#: Slow enough that the weight update lands in the middle of conversations.
ENGINE = dict(decode_tokens_per_s=120.0, prefill_s=0.002, seed=11)
SYSTEM = {"role": "system", "content": "Think step by step and use the tools."}
CORRUPTIONS = ["mask", "token", "log_prob", "reward"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    pytest.importorskip("transformers")
    if not (MODEL_DIR / "tokenizer.json").is_file():
        from local.models import ModelPrepareError, prepare_model

        try:
            prepare_model("smollm2", MODEL_DIR)
        except ModelPrepareError as exc:
            pytest.skip(str(exc))
    return MODEL_DIR


@pytest.fixture(scope="module")
def tok(model_dir):
    return fns.tokenizer(str(model_dir))


def questions(example: str) -> list[tuple[str, object]]:
    """(question, label) per group: retool's labels are strings, search-r1's dicts."""
    if example == "retool":
        pairs = [(1, 1), (1, 5), (1, 7), (1, 17)]  # wrong after 2 tool calls, right, right, wrong after 1
        return [(f"What is {a} + {b}?", str(a + b)) for a, b in pairs]
    subjects = ["Hamlet", "radium", "the Eiffel Tower", "penicillin"]  # the Eiffel Tower: answered wrong
    return [(f"Who wrote {s}?" if s == "Hamlet" else f"Who built {s}?" if "Tower" in s else f"Who discovered {s}?",
             {"ground_truth": {"target": [FACTS[s]]}}) for s in subjects]


@dataclass
class Run:
    example: str
    chat: bool
    pushed: list[str]
    groups: list[Group]
    answers: list  # the engine's records
    restarted: int
    audit_ok: bool
    audit_summary: str


def run_example(redis_url, queue, namespace, model_dir, tok, example: str, chat: bool) -> Run:
    engine = start_scripted_engine(SimConfig(model_path=str(model_dir), **ENGINE), _hf(model_dir), example)
    engines = EngineSet([engine.url])
    loop = asyncio.new_event_loop()
    controller = Controller(queue, engines)
    groups = []
    for i, (question, label) in enumerate(questions(example)):
        prompt = [SYSTEM, {"role": "user", "content": question}] if chat else question
        groups.append(Group.fresh(f"{example}:{i}", prompt, SAMPLES, label=label, row=i))
    queue.push_groups(groups)
    worker = WorkerThread(WorkerSettings(
        redis_url=redis_url, engine_urls=[engine.url], namespace=namespace, heartbeat_s=0.5,
        tokenizer=str(model_dir), apply_chat_template=chat, sampling=SamplingSettings(max_new_tokens=96),
        keep_response_text=True,
        generate_function=f"tests.agentic_functions:{example}_generate",
        reward=f"tests.agentic_functions:{example}_reward", reward_key="score" if example == "retool" else None))
    try:
        answers = engine.server.engine.answers
        final = lambda a: "boxed" in tok.decode(a.output_ids) or "<answer>" in tok.decode(a.output_ids)  # noqa: E731
        wait_for(lambda: any(final(a) for a in list(answers))
                 and http_json(engine.url + "/v1/loads")["loads"][0]["num_running_reqs"] > 0,
                 what="a conversation finished and others under way")
        loop.run_until_complete(controller.pause("abort"))
        loop.run_until_complete(engines.update_weights_from_disk("/ckpt/step1", weight_version="1"))
        loop.run_until_complete(controller.resume(weight_version=1))
        got = consume_all(Consumer(queue.redis, namespace), GROUPS, GROUPS)
        restarted = worker.worker.counters.restarted
    finally:
        worker.stop()
        loop.run_until_complete(engines.close())
        loop.close()
        engine.stop()
    report = audit(queue)
    return Run(example, chat, [g.group_id for g in groups], got, list(answers), restarted, report.ok,
               report.summary())


def _hf(model_dir):
    from workers.tokenizer import load_tokenizer

    return load_tokenizer(str(model_dir))


def float32(values):
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


def runs_of(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal loss-mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def expected_reward(example: str, question: str) -> object:
    """What the example's reward must give, from the script alone (attributes included)."""
    if example == "retool":
        a, b = map(int, re.findall(r"\d+", question))
        if not wrong_on_purpose(f"{a}+{b}"):
            return {"score": 1.0, "acc": True, "pred": str(a + b)}
        calls = tool_calls_planned(f"{a}+{b}")
        return {"score": min(-0.6, -1.0 + (calls - 2) / 2 * 0.1), "acc": False, "pred": str(a + b + 1)}
    subject = re.search(r"(?:wrote|discovered|built) ([^?]+)\?", question).group(1)
    return 0.2 if wrong_on_purpose(subject) else 1.0


def check(run: Run, tok) -> None:
    """Every trained sample against the engine's records and the script; raises AssertionError."""
    assert run.audit_ok, run.audit_summary
    assert sorted(g.group_id for g in run.groups) == sorted(run.pushed)  # every group, once
    finished = [a for a in run.answers if a.finish != "abort"]
    for group in run.groups:
        question = questions(run.example)[int(group.group_id.rsplit(":", 1)[1])][0]
        messages = [SYSTEM, {"role": "user", "content": question}]
        given = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) if run.chat \
            else question
        assert len(group.samples) == SAMPLES
        for s in group.samples:
            assert s.status == Status.COMPLETED and s.prompt == given
            prompt_text = fns.retool_prompt(given) if run.example == "retool" else given
            prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
            response = s.tokens[len(prompt_ids):]
            assert s.tokens[:len(prompt_ids)] == prompt_ids and len(response) == s.response_length
            assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
            calls = 0
            for value, start, end in runs_of(s.loss_mask):
                piece = response[start:end]
                if value == 1:  # one engine call's whole answer, its log-probs and version
                    matches = [a for a in finished if a.output_ids == piece
                               and float32(a.log_probs) == s.rollout_log_probs[start:end]
                               and a.weight_version == s.weight_versions[calls]]
                    if run.example == "retool":  # token in, token out: the context is the sample's own
                        matches = [a for a in matches if a.input_ids == s.tokens[:len(prompt_ids) + start]]
                    assert matches, f"sample {s.index}: engine call {calls} is not an answer the engine gave"
                    calls += 1
                else:  # tool output: in the format, loss mask 0, log-prob 0.0
                    text = tok.decode(piece)
                    assert re.fullmatch(r"\n\n<interpreter>\n\d+\n</interpreter>\n\n" if run.example == "retool"
                                        else r"\n\n<information>Doc 1\(Title: [^)]+\) It was [^<]+</information>\n\n",
                                        text), f"sample {s.index}: {text!r} is not tool output"
                    assert set(s.rollout_log_probs[start:end]) == {0.0}
            assert calls == len(s.weight_versions) >= 2 and set(s.loss_mask) == {0, 1}
            assert s.reward == expected_reward(run.example, question), (s.index, s.reward)
            if run.example == "retool":
                assert s.tool_call_count == calls - 1  # one interpreter run between engine calls
                assert s.payload_text == fns.retool_prompt(given) + s.response


def corrupt(run: Run, what: str) -> Run:
    """A copy of the run with one thing wrong in one trained sample."""
    bad = copy.deepcopy(run)
    s = bad.groups[1].samples[1]
    engine_at = s.loss_mask.index(1)
    where = len(s.tokens) - s.response_length + engine_at
    if what == "mask":
        s.loss_mask[s.loss_mask.index(0)] = 1
    elif what == "token":
        s.tokens[where] += 1
    elif what == "log_prob":
        s.rollout_log_probs[engine_at] -= 0.5
    else:
        s.reward = {**s.reward, "score": s.reward["score"] + 0.05} if isinstance(s.reward, dict) else s.reward + 0.1
    return bad


@pytest.fixture(scope="module", params=[("retool", False), ("retool", True), ("search_r1", False),
                                        ("search_r1", True)], ids=lambda p: f"{p[0]}-{'chat' if p[1] else 'text'}")
def run(request, redis_server, model_dir, tok):
    example, chat = request.param
    namespace = f"agentic-{example}-{chat}-{uuid.uuid4().hex[:6]}"
    client = connect(redis_server.url)
    try:
        yield run_example(redis_server.url, Queue(client, namespace), namespace, model_dir, tok, example, chat)
    finally:
        client.close()


def test_the_questions_reach_every_branch_of_the_rewards():
    retool = [expected_reward("retool", q) for q, _ in questions("retool")]
    assert sorted(r["score"] for r in retool) == [-1.05, -1.0, 1.0, 1.0]  # -1.05 needs tool_call_count
    assert sorted(expected_reward("search_r1", q) for q, _ in questions("search_r1")) == [0.2, 1.0, 1.0, 1.0]


def test_every_trained_sample_is_what_the_engine_and_the_example_made(run, tok):
    assert run.restarted >= 1, "the weight update aborted no conversation mid-way"
    versions = {v for g in run.groups for s in g.samples for v in s.weight_versions}
    assert versions == {"default", "1"}  # some finished before the update, some after
    check(run, tok)


@pytest.mark.parametrize("what", CORRUPTIONS)
def test_the_checks_bite(run, tok, what):
    with pytest.raises(AssertionError):
        check(corrupt(run, what), tok)
