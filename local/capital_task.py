"""The task of the GRPO demo on a real instruct model (`rollout demo --engine llm`):
name a country's capital, briefly.

A prompt is one chat message ("What is the capital of Japan?"), so the workers render
it with the model's own chat template. The reward reads the decoded response text (what
the engine's tokenizer made of the tokens): 1.0 when it names the capital and the model
ended its answer by itself within the token budget, 0.5 when it names it but was cut
off, 0 otherwise. SmolLM2-135M-Instruct sampled at temperature 1 answers right about
half of the time and often rambles past a short budget, so groups differ and GRPO has
something to move: correctness and getting to the point. No torch here: the workers
import this reward.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from pipeline.types import Sample, Status

CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Germany": "Berlin", "Spain": "Madrid",
    "England": "London", "Russia": "Moscow", "China": "Beijing", "Egypt": "Cairo", "Greece": "Athens",
    "Portugal": "Lisbon", "Austria": "Vienna", "Ireland": "Dublin", "Norway": "Oslo", "Poland": "Warsaw",
    "Canada": "Ottawa",
}
REWARD_PATH = "local.capital_task:capital_reward"  # what `rollout worker --reward` loads


def messages_for(country: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the capital of {country}?"}]


def write_dataset(path: Path, rows: int, seed: int) -> Path:
    """`rows` prompts cycling through the countries in a seeded order; JSONL with chat
    messages as input and the capital as label."""
    countries = list(CAPITALS)
    random.Random(seed).shuffle(countries)
    with Path(path).open("w") as f:
        for i in range(rows):
            country = countries[i % len(countries)]
            f.write(json.dumps({"input": messages_for(country), "label": CAPITALS[country]}) + "\n")
    return Path(path)


def score(label: str, response_text: str, finished: bool) -> float:
    if label.lower() not in response_text.lower():
        return 0.0
    return 1.0 if finished else 0.5


async def capital_reward(args: Any, sample: Sample) -> float:
    """slime's reward signature."""
    if not isinstance(sample.label, str) or sample.label not in CAPITALS.values():
        raise ValueError(f"sample {sample.index}: label must be one of the capitals, got {sample.label!r}")
    return score(sample.label, sample.response, sample.status == Status.COMPLETED)
