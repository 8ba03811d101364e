"""The tree keeps the shape of the architecture: layers import one way, no cycles, small modules.

The rule (docs/design.md, "Layers"): ``core`` <- ``engine`` <- ``apps`` <- ``cli``, with
``data`` and ``encoders`` used by ``engine`` and ``apps``; ``kernels`` is used
by ``engine`` only and reads only ``core`` (each kernel's record names its reference); ``ops``
(the array backend) reads ``engine`` and ``core``. Every import
counts, including the lazy ones inside functions (a lazy import still ties the two modules
together). Inside the engine the tree follows the pipeline (one sub-package per stage, each
declaring ``__all__``), and no module imports another's private name.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "normfast"

# layer -> the layers it may import (besides itself)
ALLOWED = {
    "core": set(),
    "kernels": {"core"},  # a kernel's record names its plain-torch reference
    "data": {"core"},
    "encoders": {"core"},
    "engine": {"core", "data", "encoders", "kernels"},
    "apps": {"core", "data", "encoders", "engine", "kernels", "ops"},
    "cli": {"apps"},
    "main": {"cli"},
    "ops": {"core", "engine"},
    "stable": set(),
    "root": {"core", "data", "encoders", "engine", "apps", "ops"},  # the lazy public facade
}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for base, prefix in ((PACKAGE, "normfast"),):
        for f in sorted(base.rglob("*.py")):
            parts = f.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((prefix, *parts))] = f
    return out


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return {"cli": "cli", "__main__": "main"}.get(parts[1], parts[1])


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every normfast import in ``path``, relative ones resolved."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import sub` imports the sub-module when there is one
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else target))
    return [(ln, m) for ln, m in out if m == "normfast" or m.startswith("normfast.")]


def test_layers_import_one_way():
    bad = []
    for module, path in MODULES.items():
        src = _layer(module)
        for line, target in _imports(module, path):
            dst = _layer(target)
            if dst == src or dst in ALLOWED[src]:
                continue
            if dst == "root" and _only_version(path, line):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {src} imports {dst} ({target})")
    assert not bad, "layer rule broken:\n" + "\n".join(bad)


def _only_version(path: Path, line: int) -> bool:
    text = path.read_text().splitlines()[line - 1].strip()
    return text == "from normfast import __version__"


def test_no_import_cycles():
    graph = {m: {t for _, t in _imports(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # a package's __init__ re-exporting its own sub-modules is not a cycle with them
    for m in graph:
        graph[m] = {t for t in graph[m] if not (MODULES[m].name == "__init__.py" and t.startswith(m + "."))}
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore stays in its module: make it public or move it. (The one
    exception is the compiled solver, ``normfast.core._quartic``, which only its wrapper imports.)"""
    bad = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("normfast")):
                bad += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: {a.name} from {node.module}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_quartic"
                ]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


ENGINE = PACKAGE / "engine"
#: the engine's sub-packages, in pipeline order (docs/design.md maps each one)
STAGES = ("directions", "transmission", "estimators", "diagnostics", "runner", "trajectory", "monitor", "report")


def test_the_engine_tree_shows_its_pipeline():
    top = sorted(p.name for p in ENGINE.iterdir() if p.name not in ("__init__.py", "__pycache__"))
    assert len(top) <= 15, f"normfast/engine/ has {len(top)} entries: group them by stage ({top})"
    assert not [n for n in top if n.startswith("monitor_")], top
    assert {p.name for p in ENGINE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(STAGES)
    design = (ROOT / "docs" / "design.md").read_text()
    for stage in STAGES:
        assert f"normfast.engine.{stage}" in design, f"docs/design.md does not map engine/{stage}/"


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_declares_what_it_offers(stage):
    module = importlib.import_module(f"normfast.engine.{stage}")
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"normfast.engine.{stage}.__all__ names what it lacks: {missing}"


def test_the_monitor_lives_in_one_package():
    """Every module that is the training monitor's sits in normfast/engine/monitor/."""
    elsewhere = [
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if "monitor" in p.stem and ENGINE / "monitor" not in p.parents
    ]
    assert not elsewhere, elsewhere


def test_tests_mirror_the_source():
    tests = ROOT / "tests"
    folders = [p for p in tests.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert len(folders) >= 5, folders
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert len(top) <= 10, f"tests/ has {len(top)} test files at its top: {top}"


def test_no_module_over_the_size_limit():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split by responsibility): {long}"


def test_public_names_are_the_sub_packages_objects():
    import normfast
    from normfast.encoders import load_encoder
    from normfast.engine.config import ProbeConfig
    from normfast.engine.probe import probe
    from normfast.ops import ProbeAccumulator, head_stats

    assert probe is normfast.probe and ProbeConfig is normfast.ProbeConfig
    assert load_encoder is normfast.load_encoder
    assert head_stats is normfast.ops.head_stats and ProbeAccumulator is normfast.ops.ProbeAccumulator


def test_import_normfast_stays_light():
    code = "import sys, normfast; print(sorted(m for m in ('torch', 'numpy', 'normfast.engine') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------
# bench/: the experiment harness (python -m bench)

BENCH = ROOT / "bench"
BENCH_MAX_LINES = MAX_LINES
PUBLIC = ("normfast", "normfast.ops")


def test_bench_modules_are_small_and_leave_sys_path_alone():
    files = sorted(BENCH.rglob("*.py"))
    assert len(files) > 20
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > BENCH_MAX_LINES}
    assert not long, f"bench modules over {BENCH_MAX_LINES} lines (split the experiment into a package): {long}"
    edits = [str(p.relative_to(ROOT)) for p in files if "sys.path" in p.read_text()]
    assert not edits, f"sys.path edited in {edits}: `python -m bench` from the repository root imports bench"


def test_bench_imports_only_the_public_api_and_the_stable_entries():
    """bench/ reaches into the package only through ``normfast``, ``normfast.ops`` and the names in
    the ``__all__`` of the stable internals (:mod:`normfast.stable`)."""
    from normfast.stable import MODULES as STABLE

    exported = {m: set(importlib.import_module(m).__all__) for m in STABLE}

    def allowed(module: str, name: str | None) -> bool:
        if module in PUBLIC or (name is not None and f"{module}.{name}" in STABLE):
            return True
        return module in STABLE and (name is None or name in exported[module])

    bad = []
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "normfast":
                bad += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if not allowed(node.module, a.name)
                ]
            elif isinstance(node, ast.Import):
                bad += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "normfast" and not allowed(a.name, None)
                ]
    assert not bad, "bench imports names outside the stable internals (normfast.stable):\n" + "\n".join(bad)


def test_every_stable_module_declares_all_it_offers():
    from normfast.stable import MODULES as STABLE

    for module in STABLE:
        m = importlib.import_module(module)
        assert isinstance(getattr(m, "__all__", None), (list, tuple)), f"{module} declares no __all__"
        assert all(hasattr(m, n) for n in m.__all__), module


def test_no_top_level_folder_shadows_an_installed_package():
    """The repository root is on the import path of the tests and of ``python -m bench``: a folder there
    named like a distribution the dependencies import hides it (a top-level ``kernels/`` hid the PyPI
    ``kernels`` that transformers >= 5.25 imports, and every model load failed)."""
    shadowing = {"kernels", "triton", "torch", "transformers", "datasets", "tokenizers"}
    found = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name in shadowing)
    assert not found, f"move these folders into a package: {found}"
