"""GRPO with a real model through the real pipeline (examples/grpo_tiny.py), and the
trainer's train-inference agreement check on hand-made batches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.consumer import Batch, BatchMetrics
from pipeline.types import Group, Sample, Status
from engines.byte_lm import ByteLM, ModelConfig, token_logprobs
from local.case_task import case_reward, prompt_for
from local.grpo import AGREEMENT_TOLERANCE, AgreementError, Trainer, TrainerSettings
from pipeline.types import SEGMENTS_KEY
from tests.test_json_schemas import DEMO_TORCH_KEYS

REPO = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig(context_length=64, d_model=64, n_heads=2)
PROMPT = list(prompt_for("lower").encode())


def test_case_reward_is_the_share_of_letters_in_the_named_case():
    args = SimpleNamespace(max_new_tokens=8)
    sample = Sample(label="upper", tokens=PROMPT + list(b"ABcD"), response_length=4)
    assert asyncio_run(case_reward(args, sample)) == 3 / 8  # stopping early earns less
    sample.label = "lower"
    assert asyncio_run(case_reward(args, sample)) == 1 / 8
    with pytest.raises(ValueError, match="label must be one of"):
        asyncio_run(case_reward(args, Sample(label="title", tokens=PROMPT, response_length=0)))


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)


def _logprobs(model: ByteLM, tokens: list[int]) -> list[float]:
    t = torch.tensor([tokens])
    with torch.no_grad():
        return token_logprobs(model(t), t)[0].tolist()


def _batch(rows: list[tuple[list[int], list[tuple[ByteLM, str, int]]]]) -> Batch:
    """Groups of two samples; each row: response tokens and its segments as (model that
    generated it, reported version, length). Rollout log-probs come from those models."""
    groups = []
    for g in range(0, len(rows), 2):
        samples = []
        for i, (response, segments) in enumerate(rows[g:g + 2]):
            tokens = PROMPT + response
            lps, pos = [], len(PROMPT)
            for model, _version, n in segments:
                lps += _logprobs(model, tokens)[pos - 1:pos - 1 + n]
                pos += n
            samples.append(Sample(group_index=g, index=g + i, prompt="lower: ", label="lower", tokens=tokens,
                                  response_length=len(response), reward=float(i), rollout_log_probs=lps,
                                  weight_versions=[v for _, v, _ in segments],
                                  metadata={SEGMENTS_KEY: [n for _, _, n in segments]}, status=Status.COMPLETED))
        groups.append(Group(group_id=f"g{g}", samples=samples))
    return Batch(groups, [f"{i}-0" for i in range(len(groups))], 0, BatchMetrics())


def test_trainer_checks_every_segment_under_its_own_version_and_fails_loudly():
    torch.manual_seed(0)
    trainer = Trainer(TrainerSettings(model=CONFIG, seed=3, lr=1e-2))
    v0 = ByteLM(CONFIG, seed=3).eval()
    responses = [list(b"abcdefgh"), list(b"xyzXYZ12"), list(b"hello!!!"), list(b"qqqqqqqq")]
    report = trainer.step(_batch([(r, [(v0, "default", 8)]) for r in responses]))
    assert report.version == 0 and report.logprob_max_abs_diff <= AGREEMENT_TOLERANCE
    assert report.tokens == 32 and report.continued == 0
    v1 = ByteLM(CONFIG).eval()
    v1.load_state_dict(trainer.model.state_dict())
    assert _logprobs(v1, PROMPT + responses[0]) != pytest.approx(_logprobs(v0, PROMPT + responses[0]), abs=1e-4)

    # Aborted under version 0 after 3 tokens, continued under version 1: both checked.
    mixed = [(r, [(v0, "default", 3), (v1, "1", 5)]) for r in responses]
    report = trainer.step(_batch(mixed))
    assert report.logprob_max_abs_diff <= AGREEMENT_TOLERANCE
    assert report.continued == 4 and report.versions == ["default", "1"]

    tampered = _batch(mixed)
    tampered.groups[1].samples[0].rollout_log_probs[6] += 1e-3  # one float changed on the way
    with pytest.raises(AgreementError, match=r"mismatch .* at sample 2, response token 6 \(version 1"):
        trainer.step(tampered)
    mislabelled = [(r, [(v0, "1", 3), (v1, "1", 5)]) for r in responses]  # the prefix's version lost
    with pytest.raises(AgreementError, match="version 1"):
        trainer.step(_batch(mislabelled))
    gaps = _batch(mixed)
    gaps.groups[0].samples[1].metadata[SEGMENTS_KEY] = [3, 4]
    with pytest.raises(AgreementError, match="do not describe its 8 response tokens"):
        trainer.step(gaps)
    assert trainer.version == 2  # a failed check never stepped the optimizer


def test_a_non_finite_logprob_difference_fails_the_agreement_check():
    """NaN > tolerance is False: a NaN log-prob from the engine must not pass as agreement."""
    trainer = Trainer(TrainerSettings(model=CONFIG, seed=3))
    v0 = ByteLM(CONFIG, seed=3).eval()
    batch = _batch([(list(b"abcdefgh"), [(v0, "default", 8)]), (list(b"xyzXYZ12"), [(v0, "default", 8)])])
    batch.groups[0].samples[1].rollout_log_probs[2] = float("nan")
    with pytest.raises(AgreementError, match=r"mismatch nan > .* at sample 1, response token 2"):
        trainer.step(batch)
    assert trainer.version == 0


def _run(args: list[str], timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


REWARD_MARGIN = 0.25  # reward_last - reward_first over 30 steps; seeds 0-3 measured +0.51 to +0.64


@pytest.mark.slow
def test_grpo_tiny_learns_with_exact_logprobs_across_weight_updates(tmp_path):
    """30 steps, one engine, one worker, η = 1, a weight update (abort mode) after every
    step. Every step's agreement check recomputes each segment of each sample under
    the version it reports: a continued sample passes only if its aborted prefix and
    its continuation were each recorded with the weights that produced them."""
    steps = 30
    summary = _run(["examples/grpo_tiny.py", "--steps", str(steps), "--seed", "0", "--json",
                    "--png", str(tmp_path / "curve.png")], timeout=240)
    assert set(summary) == DEMO_TORCH_KEYS  # `rollout demo --engine torch --json`, docs/cli.md
    assert summary["ok"] and summary["steps"] == steps and summary["error"] is None
    assert summary["reward_last"] >= summary["reward_first"] + REWARD_MARGIN, summary["curve"]
    assert all(row["logprob_max_abs_diff"] <= AGREEMENT_TOLERANCE for row in summary["curve"])
    assert summary["logprob_max_abs_diff"] <= AGREEMENT_TOLERANCE
    # The engines reported every version right after loading it, and tokens of (nearly)
    # every version were trained on.
    assert summary["engine_versions_ok"]
    assert {"default", "1", str(steps - 2)} <= set(summary["weight_versions_seen"])
    assert len(summary["weight_versions_seen"]) >= steps - 2
    # Partial samples continued under the new weights, their versions recorded per segment.
    continued = [row for row in summary["curve"] if row["continued"]]
    assert continued and all(len(row["versions"]) == 2 for row in continued)
    assert summary["audit_ok"] and summary["audit"]["committed"] == steps * 8
    # Rewards read the tokens of continued groups: a decoded sample's copy has them (they were
    # a bare object() once, and 9-11 groups of `rollout demo --engine torch` were dead-lettered).
    assert summary["audit"]["dead"] == 0


@pytest.mark.slow
def test_rollout_demo_engine_torch_runs_clean():
    summary = _run(["-m", "cli", "demo", "--engine", "torch", "--steps", "3", "--n-samples", "4", "--json"],
                   timeout=180)
    assert summary["ok"] and summary["steps"] == 3 and summary["audit_ok"] and summary["audit"]["dead"] == 0
    assert summary["logprob_max_abs_diff"] <= AGREEMENT_TOLERANCE
