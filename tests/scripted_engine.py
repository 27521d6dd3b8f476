"""An SGLang-shaped engine that scripts multi-turn tool use with a real HF tokenizer
(SmolLM2's), for the tests of slime's agentic examples (tests/test_agentic_examples.py).

It is the simulator (engines/simulator.py: scheduling, pauses, aborts, weight updates,
token-by-token release) with another model: each answer is the next turn of a scripted
conversation, read from the prompt text, in one of two formats:

- retool's: turn 1 writes code in ``<code>...</code>``; after an ``<interpreter>`` block it
  answers ``Answer: \\boxed{N}`` (right, or off by one for some samples); a sample may call
  the interpreter twice first.
- search-r1's: turn 1 ``<search>query</search>``; after an ``<information>`` block it answers
  ``<answer>...</answer>``.

Log-probs follow from the prompt, the position and the weight version. Every finished
request is recorded (`answers`): the ids it was given, the ids and log-probs it answered,
its weight version and finish reason, so a test can check each trained token against an
independent record.
"""
from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from typing import Any

from engines.core import Outcome
from engines.server import ServerHandle, start_in_thread
from engines.sim_model import Plan
from engines.simulator import SimConfig, SimEngine, SimRequest, SimServer

_QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")
_WHO = re.compile(r"Who (?:wrote|discovered|built) ([^?]+)\?")


@dataclass
class Answer:
    input_ids: list[int]
    output_ids: list[int]
    log_probs: list[float]
    weight_version: str
    finish: str


def _hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def wrong_on_purpose(prompt: str) -> bool:
    """Some conversations answer wrong (the reward's negative branch), decided by the question."""
    return _hash("wrong", prompt) % 3 == 0


def tool_calls_planned(prompt: str) -> int:
    """Interpreter calls a retool conversation makes before answering: 0, 1 or 2."""
    return _hash("calls", prompt) % 3


def thinking(question: str, turn: int) -> str:
    """Some text before the action, longer for some questions: conversations end at
    different times, so a weight update finds some finished and others under way."""
    return "Let me think. " * (_hash("think", question, turn) % 4 * 4)


def retool_turn(conversation: str) -> str:
    """The next assistant turn of a retool conversation (its last question decides)."""
    asked = _QUESTION.findall(conversation)
    a, b = map(int, asked[-1]) if asked else (0, 0)
    assistant = conversation.rsplit("<|im_start|>assistant", 1)[-1]
    done = assistant.count("<interpreter>")
    if done < tool_calls_planned(f"{a}+{b}"):
        return f"{thinking(f'{a}+{b}', done)}Let me compute it.\n<code>\nprint({a} + {b})\n</code>"
    value = a + b + (1 if wrong_on_purpose(f"{a}+{b}") else 0)
    return f"{thinking(f'{a}+{b}', done)}The interpreter agrees.\nAnswer: \\boxed{{{value}}}"


#: What the scripted search backend knows: question subject -> answer.
FACTS = {"Hamlet": "Shakespeare", "radium": "Marie Curie", "the Analytical Engine": "Charles Babbage",
         "Don Quixote": "Cervantes", "penicillin": "Alexander Fleming", "the Eiffel Tower": "Gustave Eiffel"}


def search_r1_turn(conversation: str) -> str:
    asked = _WHO.findall(conversation)
    subject = asked[-1].strip() if asked else "nothing"
    if "<information>Doc" not in conversation:  # a search result (the prompt may name the tags)
        return f"<think>{thinking(subject, 0)}I should look this up.</think>\n<search>{subject}</search>"
    answer = FACTS.get(subject, "unknown")
    if wrong_on_purpose(subject):
        answer = "Isaac Newton"
    return f"<think>The documents say it.</think>\n<answer>{answer}</answer>"


SCRIPTS = {"retool": retool_turn, "search_r1": search_r1_turn}


class ScriptedEngine(SimEngine):
    """SimEngine's scheduling; each plan is the script's next turn, tokenized by the HF tokenizer."""

    def __init__(self, config: SimConfig, tokenizer: Any, script: str) -> None:
        super().__init__(config, tokenizer)
        self.script = SCRIPTS[script]
        self.answers: list[Answer] = []
        self._lock = threading.Lock()

    def _create(self, spec, created: float, digest: bytes, seed_material: str, parallel: bool) -> SimRequest:
        conversation = self.tokenizer.decode(spec.input_ids, skip_special_tokens=False)
        text = self.script(conversation)
        tokens = self.tokenizer.encode(text)
        finish: dict = {"type": "stop", "matched": self.tokenizer.eos_token_id}
        for stop in spec.stop_strs:
            if text.endswith(stop):
                finish = {"type": "stop", "matched": stop}
        if isinstance(finish["matched"], int):
            tokens.append(self.tokenizer.eos_token_id)
        if len(tokens) > spec.max_new_tokens:
            tokens, finish = tokens[:spec.max_new_tokens], {"type": "length", "length": spec.max_new_tokens}
        version = self.weight_version
        log_probs = [-(_hash(conversation, i, version) % 2000) / 1000 - 0.001 for i in range(len(tokens))]
        plan = Plan(tokens=tokens, logprobs=log_probs, finish=finish)
        return SimRequest(spec, created, self._loop().create_future(), seed_material,
                          self._cached_tokens(digest, len(spec.input_ids)), plan)

    def _complete(self, req, outcome, finish) -> None:
        super()._complete(req, outcome, finish)
        out = self.output(req)
        with self._lock:
            self.answers.append(Answer(list(req.spec.input_ids), list(out.tokens), list(out.logprobs),
                                       req.weight_version, (finish or {}).get("type", outcome.value)
                                       if outcome != Outcome.ABORTED else "abort"))

    def describe(self) -> dict[str, Any]:
        return {"model_type": "llama", "architectures": ["ScriptedLlama"], "simulator": False}


class ScriptedServer(SimServer):
    def __init__(self, config: SimConfig, tokenizer: Any, script: str) -> None:
        super(SimServer, self).__init__(ScriptedEngine(config, tokenizer, script),
                                        stream_interval_s=config.stream_interval_s)


def start_scripted_engine(config: SimConfig, tokenizer: Any, script: str) -> ServerHandle:
    """The engine in a daemon thread (see `.url`, `.server.engine.answers`)."""
    return start_in_thread(lambda: ScriptedServer(config, tokenizer, script), name=f"scripted-{script}")
