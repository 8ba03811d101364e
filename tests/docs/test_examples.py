"""Every example in the README and on the documentation site (docs/**/*.md) works as shown:

* each ```python block uses only ``import normfast`` names (and torch) and runs as written, in a
  scratch folder (identical blocks, e.g. the README's and Getting started's, run once);
* each shell line that runs ``normfast ...`` (or ``... -m normfast ...``) parses with the real
  command-line parser;
* each ``python -m bench run NAME`` names an experiment of the runner.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import textwrap
import warnings
from pathlib import Path

import pytest

import normfast
from bench.harness import EXPERIMENTS as EXPERIMENT_REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: the experiments `python -m bench run NAME` runs (the runner's registry: what `python -m bench list` prints)
EXPERIMENTS = tuple(EXPERIMENT_REGISTRY)

SHELLS = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)

pytestmark = pytest.mark.usefixtures("single_thread")


def _blocks(langs: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(where, code)`` for every fenced block in one of ``langs``, in page order."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in _FENCE.finditer(text):
            if m.group("lang") in langs:
                line = text.count("\n", 0, m.start()) + 1
                out.append((f"{page.relative_to(ROOT)}:{line}", textwrap.dedent(m.group("body"))))
    return out


#: recipes for other readers of a run's Parquet files: tests/data/test_parquet_readers.py runs them on real runs
READER_RECIPES = re.compile(r"^import (duckdb|polars|pandas)\b", re.M)
READER_RECIPE_PAGE = "docs/view.md"


#: clients of a running `normfast serve`: tests/apps/test_serve.py runs them against a live service
SERVE_CLIENTS = re.compile(r"NORMFAST_SERVE")
SERVE_CLIENT_PAGE = "docs/backend.md"


def _python_examples() -> dict[str, str]:
    """where -> code, one entry per distinct block (the first place it appears); the reader recipes
    and the service's clients are left to the tests that give them runs to read and a service to call."""
    seen: dict[str, str] = {}
    for where, code in _blocks(("python",)):
        seen.setdefault(code, where)
    return {
        where: code
        for code, where in seen.items()
        if not READER_RECIPES.search(code) and not SERVE_CLIENTS.search(code)
    }


EXAMPLES = _python_examples()


def test_reader_recipes_are_where_their_test_runs_them():
    recipes = [where for where, code in _blocks(("python",)) if READER_RECIPES.search(code)]
    assert recipes and all(w.startswith(READER_RECIPE_PAGE + ":") for w in recipes), recipes
    clients = [where for where, code in _blocks(("python",)) if SERVE_CLIENTS.search(code)]
    assert len(clients) == 1 and clients[0].startswith(SERVE_CLIENT_PAGE + ":"), clients


def _command_lines() -> list[tuple[str, list[str]]]:
    """``(where, argv after 'normfast')`` for every normfast invocation in a shell block."""
    out = []
    for where, code in _blocks(SHELLS):
        for line in code.splitlines():
            line = line.strip().removeprefix("$ ")
            if not line or line.startswith("#"):
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.commenters = "#"
            lexer.whitespace_split = True
            tokens = list(lexer)
            segment: list[str] = []
            for tok in [*tokens, ";"]:
                if tok in ("&&", "||", "|", ";", "&"):
                    while segment and re.fullmatch(r"\w+=\S*", segment[0]):
                        segment.pop(0)  # VAR=value prefixes
                    if segment[:1] == ["normfast"]:
                        argv = segment[1:]
                    elif "-m" in segment and segment[segment.index("-m") + 1 :][:1] == ["normfast"]:
                        argv = segment[segment.index("-m") + 2 :]
                    else:
                        argv = None
                    if argv is not None:
                        out.append((f"{where} normfast {' '.join(argv)}", argv))
                    segment = []
                else:
                    segment.append(tok)
    return out


COMMANDS = _command_lines()


def test_the_pages_have_examples():
    readme = [w for w in EXAMPLES if w.startswith("README.md")]
    api = [w for w in EXAMPLES if w.startswith("docs/api.md")]
    assert readme, "the README has no Python example"
    assert len(api) >= 2, "the Python API page has fewer than two examples"
    assert len(COMMANDS) >= 10, COMMANDS


@pytest.mark.parametrize("where", list(EXAMPLES))
def test_example_uses_only_the_public_surface(where):
    tree = ast.parse(EXAMPLES[where])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            pytest.fail(f"{where}: `from {node.module} import ...`; the docs use `import normfast` names")
        if isinstance(node, ast.Import):
            assert {a.name for a in node.names} <= {"normfast", "torch"}, f"{where}: {ast.dump(node)}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "normfast":
            assert node.attr in normfast.__all__, f"{where}: normfast.{node.attr} is not in normfast.__all__"


@pytest.mark.parametrize("where", list(EXAMPLES))
def test_example_runs(where, tmp_path, monkeypatch, capsys):
    code = EXAMPLES[where]
    monkeypatch.chdir(tmp_path)  # the examples write to runs/ under the current folder
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a user must not see raw warnings from the documented path
        exec(compile(code, where, "exec"), {})
    printed = capsys.readouterr().out
    if "format_summary" in code:
        assert "probe run:" in printed and "quantity" in printed
    if "runs/words.parquet" in code:
        assert (tmp_path / "runs" / "words.parquet").is_file()
        assert sorted(p.name for p in (tmp_path / "runs").glob("*.png")) == [
            "probe_heat.png",
            "probe_norm_vs_req.png",
            "probe_tokens.png",
        ]
        lists = [ln for ln in printed.splitlines() if ln.startswith(("hottest tokens", "coldest tokens"))]
        assert len(lists) == 2
        for ln in lists:
            entries = ln.split(": ", 1)[1].split(", ")
            assert not {"[CLS]", "[SEP]"} & {e.split(" ")[0] for e in entries}, ln
            assert len(entries) == len(set(entries)), ln
    if "Sequential" in code:
        assert "nn.Sequential split into 3 stages; head = blocks.0.2" in printed
        assert "objective infonce (temperature=0.1, symmetric=True)" in printed
        assert "mode head" in printed


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_command_line_parses(where, argv):
    from normfast import cli

    command = next((a for a in argv if not a.startswith("-")), None)
    assert command in cli.COMMANDS, f"{where}: no such command {command!r}"
    parser = cli.build_parser(command)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{where}: the parser refused it (exit {e.code}): {err.getvalue().strip()}")
    assert args.command == command


def test_bench_commands_name_an_experiment():
    found = []
    for page in PAGES:
        for m in re.finditer(r"python -m bench run ([A-Za-z_]\w*)", page.read_text()):
            if m.group(1) != "NAME":  # the placeholder of the general form
                found.append((page.relative_to(ROOT), m.group(1)))
    assert found, "no page shows how to reproduce a result"
    unknown = [(str(p), name) for p, name in found if name not in EXPERIMENTS]
    assert not unknown, f"`python -m bench run NAME` with an unknown NAME: {unknown}"
    assert {name for _, name in found} == set(EXPERIMENTS), (
        f"experiments the docs never show how to run: {sorted(set(EXPERIMENTS) - {n for _, n in found})}"
    )
