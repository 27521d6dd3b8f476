# r10: resume() while workers cannot claim at once (the results backlog at max_ready,
# the steady state when generation outpaces training). Correct: resume() returns at
# once instead of waiting 5 s for a first claim. Test: tests/test_weight_update.py
# (Issue 8 #14).
import asyncio
import time

from common import Group, Queue, claim, connect, produce, server
from pipeline.control import configure
from pipeline.controller import Controller

s = server(); ns = "r10"; c = connect(s.url); q = Queue(c, ns)
configure(c, q.keys, max_ready=2)
produce(q, 2)                                     # backlog full
q.push_groups([Group.fresh(f"p{i}", "p", 2, row=i) for i in range(5)])
print("a live worker's claim:", claim(q, "w2", 1).status.value)
ctl = Controller(q)


async def main():
    await ctl.pause("in_place")
    t = time.monotonic(); r = await ctl.resume(weight_version=1)
    print(f"resume() took {time.monotonic() - t:.3f}s ->", r)


asyncio.run(main()); s.stop()
