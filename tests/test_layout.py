"""The tree keeps the shape of the architecture: layers import one way, no cycles, small modules.

The rule (README, "Layout"): ``core`` <- ``engine`` <- ``apps`` <- ``cli``, with
``data`` and ``encoders`` used by ``engine`` and ``apps``; ``kernels`` is used
by ``engine`` only. Every import counts, including the lazy ones inside
functions (a lazy import still ties the two modules together).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "normfast"
KERNELS = ROOT / "kernels"

# layer -> the layers it may import (besides itself)
ALLOWED = {
    "core": set(),
    "kernels": set(),
    "data": {"core"},
    "encoders": {"core"},
    "engine": {"core", "data", "encoders", "kernels"},
    "apps": {"core", "data", "encoders", "engine", "kernels"},
    "cli": {"apps"},
    "main": {"cli"},
    "root": {"core", "data", "encoders", "engine", "apps"},  # the lazy public facade
}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for base, prefix in ((PACKAGE, "normfast"), (KERNELS, "normfast.kernels")):
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


def test_no_module_over_the_size_limit():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split by responsibility): {long}"


def test_public_names_are_the_sub_packages_objects():
    from normfast.encoders import load_encoder
    from normfast.engine.config import ProbeConfig
    from normfast.engine.ops import ProbeAccumulator, head_stats
    from normfast.engine.probe import probe

    import normfast

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
    """bench/ reaches into the package only through ``normfast``, ``normfast.ops`` and bench.STABLE."""
    from bench import STABLE

    def allowed(module: str, name: str | None) -> bool:
        if module in PUBLIC or (name is not None and f"{module}.{name}" in STABLE):
            return True
        names = STABLE.get(module)
        return names is not None and (name is None or "*" in names or name in names)

    bad = []
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "normfast":
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                        if not allowed(node.module, a.name)]
            elif isinstance(node, ast.Import):
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}" for a in node.names
                        if a.name.split(".")[0] == "normfast" and not allowed(a.name, None)]
    assert not bad, "bench imports package internals not listed in bench.STABLE:\n" + "\n".join(bad)
    for module in STABLE:  # every stable entry exists
        assert importlib.util.find_spec(module) is not None, module
