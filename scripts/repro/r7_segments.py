# r7: a group restarted from its prompt (too stale, release policy 'restart', `dead
# retry --restart`) after generating under two versions. Correct: the restart forgets
# the segments too, so the off-policy mask matches the new response and the group
# decodes. Tests: tests/test_scripts.py (release restart), tests/test_staleness.py.
from types import SimpleNamespace

from common import Group
from pipeline.codec import DecodeError, decode_group, encode_group
from workers.engine_answers import GenerateResult
from workers.group_run import GroupRunner
from workers.tokenizer import ByteTokenizer

fake = SimpleNamespace(settings=SimpleNamespace(mask_offpolicy_prefix=True), _check_version=lambda *_: None,
                       _refuse_unusable_version=lambda result: None, tokenizer=ByteTokenizer())
fake._mask_offpolicy = lambda sample: GroupRunner._mask_offpolicy(fake, sample)


def gen(sample, n, version, finish):
    GroupRunner._append(fake, sample,
                        GenerateResult([7] * n, [-0.1] * n, "x" * n, finish, None, version, 0, n, "r", None))


g = Group.fresh("g0", "p", 1); g.prompt_ids = [1, 2]; s = g.samples[0]; s.tokens = [1, 2]
gen(s, 50, "0", "abort"); gen(s, 30, "1", "stop")        # first life: 50 tokens v0 (masked) + 30 v1
print("first life: response_length", s.response_length, "mask len", len(s.loss_mask), "segments",
      s.metadata["rollout_segments"])
g.reset()                                                   # too stale: restarted from the prompt
g.prompt_ids = [1, 2]; s.tokens = [1, 2]
gen(s, 20, "3", "stop")                                     # second life: 20 tokens under v3
print("after restart: response_length", s.response_length, "segments", s.metadata["rollout_segments"],
      "mask len", len(s.loss_mask), "mask sum", sum(s.loss_mask))
try:
    decode_group(encode_group(g)); print("decodes")
except DecodeError as e:
    print("trainer-side decode: WRONG:", e)
