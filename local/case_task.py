"""The toy task of the GRPO example (local/grpo.py): write letters of the case the
prompt names.

A prompt is ``"lower: "`` or ``"upper: "``; the reward is the share of the response's
`max_new_tokens` positions holding a letter of that case (so stopping early or writing
anything else earns less). A randomly initialised byte-level model writes one of the
259 ids almost uniformly, about 10% of them letters of a given case: every group has
some reward to compare, and a policy gradient learns first "letters", then "the case
the prompt asks for". No torch here: the workers import this reward.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from pipeline.types import Sample

CASES = {"lower": range(ord("a"), ord("z") + 1), "upper": range(ord("A"), ord("Z") + 1)}
REWARD_PATH = "local.case_task:case_reward"  # what `rollout worker --reward` loads


def prompt_for(case: str) -> str:
    return f"{case}: "


def write_dataset(path: Path, rows: int, seed: int) -> Path:
    """`rows` prompts, both cases equally often, shuffled; JSONL with input and label."""
    cases = [case for _ in range((rows + 1) // 2) for case in CASES][:rows]
    random.Random(seed).shuffle(cases)
    with Path(path).open("w") as f:
        for case in cases:
            f.write(json.dumps({"input": prompt_for(case), "label": case}) + "\n")
    return Path(path)


def score(case: str, response_tokens: list[int], max_new_tokens: int) -> float:
    letters = CASES[case]
    return sum(t in letters for t in response_tokens) / max_new_tokens


async def case_reward(args: Any, sample: Sample) -> float:
    """slime's reward signature; `args.max_new_tokens` is the workers' response limit."""
    if sample.label not in CASES:
        raise ValueError(f"sample {sample.index}: label must be one of {', '.join(CASES)}, got {sample.label!r}")
    return score(sample.label, sample.response_tokens, args.max_new_tokens)
