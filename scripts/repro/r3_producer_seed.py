# r3: a push interrupted, then resumed with another seed. Correct: refused with a clear
# error naming the difference (the cursor is fingerprinted), nothing pushed twice.
# Tests: tests/test_producer.py, tests/test_bad_input.py ("another_seed").
import json
import pathlib
import tempfile

from common import connect, Queue, server
from pipeline.producer import DatasetError, PushOptions, push_dataset

s = server(); c = connect(s.url); ns = "r3"; q = Queue(c, ns)
p = pathlib.Path(tempfile.mkdtemp()) / "data.jsonl"
p.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(10)))
orig = q.push; calls = {"n": 0}


def flaky(*a, **k):  # the first push stops after one chunk of 5
    calls["n"] += 1
    if calls["n"] == 2:
        raise KeyboardInterrupt
    return orig(*a, **k)


q.push = flaky
try:
    push_dataset(q, p, PushOptions(shuffle=True, seed=1, chunk_size=5))
except KeyboardInterrupt:
    pass
q.push = orig
try:
    push_dataset(q, p, PushOptions(shuffle=True, seed=2, chunk_size=5))   # resumed with another seed
    print("resumed with another seed: WRONG")
except DatasetError as e:
    print("refused:", e)
rows = sorted(int(x.decode().rsplit(":", 1)[1]) for x in c.lrange(q.keys.prompts, 0, -1))
print("pushed rows:", rows, "duplicates:", sorted({r for r in rows if rows.count(r) > 1}))
s.stop()
