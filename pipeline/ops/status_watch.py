"""`rollout status --watch`: a snapshot every interval until Ctrl-C. A Redis restart or
failover is a state of the watch, not its end, and it is drawn in the view itself (a
banner with the outage's length and the age of the numbers shown), on a terminal and
when piped: a line on stderr would be drawn over by the live display."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import redis

from pipeline.queue import Queue

from .status import RateTracker, StatusSnapshot, snapshot
from .status_render import Outage, render

#: How long after Redis answers again the view still says it was unreachable, and for how long.
RECOVERY_SHOWN_S = 60.0


@dataclass
class StatusWatch:
    """The watch's state: the last good snapshot, when it was read, and the outage under
    way (or just ended). `read()` never raises for an unreachable Redis."""

    queue: Queue
    tracker: RateTracker
    interval: float
    clock: Callable[[], float] = time.time
    last: StatusSnapshot | None = None
    last_good: float | None = None  # clock() of the last good read
    outage: Outage | None = None

    def read(self) -> bool:
        """Take a snapshot; True when it worked, False when Redis could not be reached."""
        try:
            snap = snapshot(self.queue, self.tracker)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            now = self.clock()
            if self.outage is None or self.outage.ended is not None:
                self.outage = Outage(type(exc).__name__, since=now, last_good=self.last_good,
                                     retry_s=self.interval)
            self.outage.now = now
            return False
        now = self.clock()
        if self.outage is not None:
            if self.outage.ended is None:
                self.outage.ended = now
            self.outage.now = now
            if now - self.outage.ended > RECOVERY_SHOWN_S:
                self.outage = None
        self.last, self.last_good = snap, now
        return True

    def view(self):
        """What a terminal shows: the last good numbers under the outage banner, if any."""
        if self.last is None:
            from rich.text import Text

            return Text("\n".join(self.outage.banner()) if self.outage else "reading ...", style="bold red")
        return render(self.last, outage=self.outage)

    def run_live(self, console, reads: int | None = None) -> None:
        """On a terminal: one live view, redrawn after every read (`reads`: stop after that many)."""
        from rich.live import Live

        with Live(self.view(), console=console, refresh_per_second=4) as live:
            for _ in self._reads(reads):
                live.update(self.view(), refresh=True)

    def run_piped(self, console, reads: int | None = None) -> None:
        """Piped or redirected: the full view after every good read, a one-line banner after every failed one."""
        for ok in self._reads(reads):
            if ok:
                console.print(render(self.last, outage=self.outage))
                console.rule()
            else:
                console.print(f"{time.strftime('%H:%M:%S')} {'; '.join(self.outage.banner())}", style="bold red",
                              markup=False, soft_wrap=True)

    def _reads(self, reads: int | None):
        n = 0
        while reads is None or n < reads:
            if n:
                time.sleep(self.interval)
            yield self.read()
            n += 1
