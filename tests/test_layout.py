"""The folders' arrows run one way (docs/architecture.md): the queue's core imports none of
the folders around it, and no two modules import each other, directly or through others.
Lazy imports inside functions count: they are arrows too."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "workers", "engines", "chaos", "local")
CORE_MAY_NOT_IMPORT = ("pipeline.trainers", "pipeline.ops", "workers", "engines", "chaos", "local", "cli")
#: What each folder may import from the project (besides itself and the queue's core): folders,
#: or single modules.
ALLOWED = {
    "pipeline.trainers": set(),
    # `rollout push --tokenizer` measures prompts with the tokenizer the workers will use.
    "pipeline.ops": {"workers.tokenizer"},
    "workers": {"pipeline.trainers"},  # rewards build slime Samples for slime's reward functions
    "engines": {"workers"},  # the byte tokenizer the simulator and the torch engine share with workers
    "local": {"workers", "engines", "pipeline.trainers", "pipeline.ops"},
    "chaos": {"workers", "engines", "local", "pipeline.ops", "pipeline.trainers"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            modules[module_name(path)] = path
    return modules


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports a module; `from mod import name` the module itself.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def folder_of(module: str) -> str:
    for sub in ("pipeline.trainers", "pipeline.ops"):
        if module == sub or module.startswith(sub + "."):
            return sub
    return module.split(".")[0]


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def test_the_queue_core_imports_none_of_the_folders_around_it():
    wrong = [(m, t) for m, targets in import_graph().items() if folder_of(m) == "pipeline"
             for t in targets if folder_of(t) in CORE_MAY_NOT_IMPORT]
    assert wrong == []


def test_each_folder_imports_only_the_folders_beneath_it():
    wrong = []
    for module, targets in import_graph().items():
        folder = folder_of(module)
        for target in targets:
            other = folder_of(target)
            allowed = ALLOWED.get(folder, set())
            if other not in (folder, "pipeline") and other not in allowed and target not in allowed:
                wrong.append((module, target))
    assert wrong == []


def test_no_import_cycles():
    graph = import_graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []
