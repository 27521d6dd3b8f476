"""What one sample may spend while it is generated: tokens, and aborts nothing explains.

Both ways a sample is generated (one /generate per attempt here, or a user's generate
function: workers/group_run.py) go through one SampleBudget per sample and claim, so an
engine that aborts every request is a fault on either path (before, it was a
preemption as long as it made a token, so a sample ended only at max_new_tokens, its
fragments published as truncated; a function was called without end, each call given the
whole token budget).

An abort is explained, and costs nothing, when something explains it: admission paused in
Redis (a weight update through the queue) or the engine draining (a rolling update), both
decided before the budget is asked; or a weight update seen in the engine's version (slime
pauses its engines with mode abort, unannounced, loads and continues: the next answer comes
from newer weights, and `observe` refunds what was charged under the old ones). Any other
abort is a preemption charged to the sample: free up to `max_preemptions` of them within
`preemption_s` of the first; past either, and at the second in a row that made no token,
each is an engine failure (retried with backoff, counted by the breaker, dead-lettered
after max_attempts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

#: Unexplained aborts a sample may take before they count as engine failures
#: (`rollout worker --max-preemptions`): slime ends each rollout with abort_all, which no
#: weight change explains, and a sample rarely lives through more than a few rollouts.
DEFAULT_MAX_PREEMPTIONS = 8
#: And the time from its first unexplained abort within which they are free
#: (`--preemption-budget`): a preemption is continued after a beat, so an engine that keeps
#: aborting is found within this even when each abort came after many tokens.
DEFAULT_PREEMPTION_S = 300.0


@dataclass
class SampleBudget:
    max_new_tokens: int
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    preemption_s: float = DEFAULT_PREEMPTION_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    charged: int = 0  # unexplained aborts since the engine's version last moved
    first_at: float | None = None  # clock() of the first of them
    stalled: int = 0  # unexplained aborts in a row that made no token
    version: str | None = None  # the engine's weight version in the last answer

    def tokens_left(self, response_length: int) -> int:
        """What the next call may generate; 0: the sample is truncated, with no call."""
        return max(0, self.max_new_tokens - response_length)

    def observe(self, version: str | None) -> None:
        """An answer from weights `version`: newer weights than the last answer's mean an
        update happened in between, which explains the aborts charged under the old ones."""
        if version is None:
            return
        if self.version is not None and version != self.version:
            self.charged, self.first_at, self.stalled = 0, None, 0
        self.version = version

    def charge(self, progressed: bool) -> str | None:
        """An abort nothing explained: None while the sample's budget covers it (a
        preemption: continue after a beat), else why it is the engine's fault."""
        now = self.clock()
        self.charged += 1
        self.first_at = now if self.first_at is None else self.first_at
        self.stalled = 0 if progressed else self.stalled + 1
        if self.stalled >= 2:
            return f"aborted {self.stalled} times in a row with no token and nothing explained it"
        if self.charged > self.max_preemptions:
            return (f"aborted {self.charged} times with nothing explained (no pause, no drain, no weight update; "
                    f"--max-preemptions {self.max_preemptions})")
        if now - self.first_at > self.preemption_s:
            return (f"aborted {self.charged} times in {now - self.first_at:.0f}s with nothing explained "
                    f"(--preemption-budget {self.preemption_s:g}s)")
        return None
