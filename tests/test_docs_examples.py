"""The README's "Python API" section: every code block uses only ``import normfast`` names (and
torch) and runs as written, in a scratch folder."""
from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

import normfast

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("single_thread")


def _api_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_api_section_has_examples():
    assert len(_api_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(_api_blocks())))
def test_api_example_uses_only_the_public_surface(index):
    tree = ast.parse(_api_blocks()[index])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            pytest.fail(f"block {index}: `from {node.module} import ...`; the README uses `import normfast` names")
        if isinstance(node, ast.Import):
            assert {a.name for a in node.names} <= {"normfast", "torch"}, ast.dump(node)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "normfast":
            assert node.attr in normfast.__all__, f"block {index}: normfast.{node.attr} is not in normfast.__all__"


@pytest.mark.parametrize("index", range(len(_api_blocks())))
def test_api_example_runs(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the examples write to runs/ under the current folder
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a user must not see raw warnings from the documented path
        exec(compile(_api_blocks()[index], f"README block {index}", "exec"), {})
    printed = capsys.readouterr().out
    if "format_summary" in _api_blocks()[index]:
        assert "normfast probe:" in printed and "quantity" in printed
    if "runs/words.parquet" in _api_blocks()[index]:
        assert (tmp_path / "runs" / "words.parquet").is_file()
        assert sorted(p.name for p in (tmp_path / "runs").glob("*.png")) == [
            "probe_heat.png", "probe_norm_vs_req.png", "probe_tokens.png"]
        lists = [ln for ln in printed.splitlines() if ln.startswith(("hottest tokens", "coldest tokens"))]
        assert len(lists) == 2
        for ln in lists:
            entries = ln.split(": ", 1)[1].split(", ")
            assert not {"[CLS]", "[SEP]"} & {e.split(" ")[0] for e in entries}, ln
            assert len(entries) == len(set(entries)), ln
    if "Sequential" in _api_blocks()[index]:
        assert "nn.Sequential split into 3 stages; head = blocks.0.2" in printed
        assert "objective infonce (temperature=0.1, symmetric=True)" in printed
        assert "mode head" in printed
