"""The repro scripts of issues 8 and 21 (scripts/repro/, the scenarios of ../shared/repro/ on
today's API) run and print the correct behaviour: they stay runnable as the API moves."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

EXPECTED = {
    "r1_two_trainers.py": ["A commit refused: trainer session trainer-A.1-", "B commit -> 3", ": OK"],
    "r2_dup_payload.py": ["second push: 0 groups", "second claim: []", "commit -> 1", ": OK"],
    "r3_producer_seed.py": ["refused: dataset 'data.jsonl' was pushed before", "(seed: 1 -> 2)", "duplicates: []"],
    "r4_reaped_reregister.py": ["claim after the reap: unregistered []", "heartbeat says reaped: True",
                                "T1 publish (old token): refused", "W#2 claims g0 -> publish: ok"],
    "r5_claim_retry.py": ["worker was handed: ['g0']", "in-flight hash   : ['g0']", ": OK"],
    "r5b_claim_retry_user_client.py": ["worker was handed: ['g0']", "in-flight hash   : ['g0']", "pending: 1",
                                       "commit -> 1", ": OK"],
    "r6_stranded.py": ["in-flight in Redis: []", ": OK"],
    "r7_segments.py": ["segments [20] mask len 20", "decodes"],
    "r8_starvation.py": ["reaped: 0; lost publishes: 0"],
    "r9_claim_error_kills_worker.py": ["worker thread alive: True | error: None"],
    "r10_resume_stall.py": ["resume() took"],
    "o1_session_identity_after_failover.py": ["same generation: True | same identity: False",
                                              "A commit refused: trainer session trainer.2-",
                                              "A next_batch refused: SessionFenced", "C commit -> 1", ": OK"],
    "o6_readonly_failover_is_transient.py": ["worker publish: ok after", "(waited out: ReadOnlyError",
                                             "trainer next_batch: got ['g0', 'r0']", "commit -> 2", ": OK"],
    "o4_trainer_rides_out_outage.py": ["outage right after a read): got ['a0']", "outage): got 1 group after",
                                       "audit o4: pushed 1", "audit o4s: pushed 2"],
    "o7_audit_does_not_stall_the_server.py": ["ok=True (150,000 queued)", "worker publish during the audit: ok",
                                              "trainer next_batch: ['r0', 'r1']; commit -> 2",
                                              "busy threshold: ['held'] (waited out: True)", ": OK"],
    "o8_outage_longer_than_the_lease.py": ["outage 1: ", "right after -> 0\noutage 2: ", "(lease 3s); another "
                                           "process's reap_expired() right after -> 0\nworker reincarnations: 0; "
                                           "claims per group in flight: [1]", ": OK"],
}


def test_every_script_is_checked():
    assert set(EXPECTED) == {p.name for p in (ROOT / "scripts" / "repro").glob("[ro]*.py")}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_repro_script_shows_the_correct_behaviour(script):
    proc = subprocess.run([sys.executable, f"scripts/repro/{script}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "WRONG" not in out, out
    for expected in EXPECTED[script]:
        assert expected in out, f"{script}: {expected!r} not in\n{out}"
    if script == "r10_resume_stall.py":
        assert float(re.search(r"resume\(\) took ([0-9.]+)s", out).group(1)) < 1.0, out
