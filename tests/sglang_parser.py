"""SGLang's own command-line parser, from the sglang wheel, to check the compose file's
engine command line without a GPU.

`sglang.launch_server` turns its arguments into `ServerArgs` with
`prepare_server_args(argv)`; `parse` runs exactly that, in a subprocess whose path
starts with `DIR`. `install` (run by scripts/test) puts there the sglang wheel
WITHOUT its dependencies (they include CUDA builds of torch: gigabytes) and the small
packages the parser's modules import; torch and numpy come from the test extra. It
is kept out of the test environment because sglang pins its own transformers,
tokenizers and huggingface-hub. Two stand-ins: an empty `triton` module, which
`sglang.srt.utils.common` imports at the top and uses only inside kernel helpers
(the real one is a 1 GB wheel), and `torchvision.io`, whose `decode_jpeg` it imports at the top
and calls only on images.

    python -m tests.sglang_parser install
    python -m tests.sglang_parser parse --model-path Qwen/Qwen2.5-0.5B-Instruct --port 30000
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

#: The SGLang release of the engine image that docker-compose.yml pins (SGLANG_IMAGE).
VERSION = "0.5.20"
#: Where `install` puts it: outside the repository, so it survives fresh clones on one machine.
DIR = Path(os.environ.get("ROLLOUT_SGLANG_PARSER_DIR",
                          Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                          / "rollout-queue" / f"sglang-{VERSION}"))
#: What the modules behind `prepare_server_args` import, besides torch and numpy.
PARSER_IMPORTS = ["msgspec", "pybase64", "pillow", "pyzmq", "orjson", "psutil", "requests", "starlette",
                  "pydantic", "tqdm", "packaging", "typing_extensions", "anyio", "ipython",
                  "sniffio", "httpx", "distro", "jiter"]  # the last four: what openai (no deps below) imports
#: Imported at the top of those modules by 0.5.20 but only used when serving: installed without
#: their dependencies (xgrammar's include torch builds).
PARSER_IMPORTS_NO_DEPS = ["openai", "partial_json_parser", "xgrammar", "apache-tvm-ffi"]
_REPO = Path(__file__).resolve().parent.parent
_MARKER = "installed"


#: How `install` fills DIR; another layout means another installation.
_LAYOUT = "self-contained"


def _stamp() -> str:
    """What an installation holds: another list of imports means another installation."""
    return " ".join([VERSION, _LAYOUT, *PARSER_IMPORTS, *PARSER_IMPORTS_NO_DEPS]) + "\n"


def installed() -> bool:
    return (DIR / _MARKER).exists() and (DIR / _MARKER).read_text() == _stamp()


def install() -> None:
    if installed():
        return
    shutil.rmtree(DIR, ignore_errors=True)  # pip --target does not replace what is there
    # --ignore-installed: every dependency goes into DIR, also those the installing
    # environment has (anyio's sniffio, say): DIR is shared by every environment on the
    # machine, and a virtual environment without them would find the parser broken.
    pip = [sys.executable, "-m", "pip", "install", "-q", "--ignore-installed", "--target", str(DIR)]
    subprocess.run(pip + PARSER_IMPORTS, check=True)
    subprocess.run(pip + ["--no-deps", f"sglang=={VERSION}", *PARSER_IMPORTS_NO_DEPS], check=True)
    (DIR / _MARKER).write_text(_stamp())


def parse(argv: list[str]) -> dict:
    """`prepare_server_args(argv)` of SGLang `VERSION`: the parsed settings, or
    ValueError with argparse's message (an unknown flag, a bad value)."""
    if not installed():
        raise RuntimeError(f"SGLang {VERSION}'s parser is not installed in {DIR}: run "
                           "`python -m tests.sglang_parser install` (scripts/test does)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DIR), str(_REPO)]))
    proc = subprocess.run([sys.executable, "-m", "tests.sglang_parser", "parse", *argv], cwd=_REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise ValueError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}")
    return json.loads(proc.stdout)


def _parse_here(argv: list[str]) -> None:
    import types

    triton, triton_language = types.ModuleType("triton"), types.ModuleType("triton.language")
    # torch._dynamo, imported by the test environment's transformers (the [llm] extra), takes
    # the stand-in for the real package and reads triton.language.dtype at import.
    triton_language.dtype = type("dtype", (), {})
    triton.language = triton_language
    sys.modules.update({"triton": triton, "triton.language": triton_language})
    # 0.5.20's sglang.srt.utils.common imports torchvision.io.decode_jpeg at the top and calls
    # it only to decode images; torchvision is a CUDA-matched wheel of its own.
    from importlib.machinery import ModuleSpec

    vision, vision_io = types.ModuleType("torchvision"), types.ModuleType("torchvision.io")
    vision.__spec__, vision_io.__spec__ = ModuleSpec("torchvision", None), ModuleSpec("torchvision.io", None)
    vision.io, vision_io.decode_jpeg = vision_io, None
    sys.modules.update({"torchvision": vision, "torchvision.io": vision_io})
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)  # a msgspec Struct: its fields are the settings
    print(json.dumps({name: getattr(args, name) for name in args.__struct_fields__}, default=str))


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "install":
        install()
        print(DIR)
    elif command == "parse":
        _parse_here(rest)
    else:
        sys.exit(f"unknown command {command!r}: install or parse")
