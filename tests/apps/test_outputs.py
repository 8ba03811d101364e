"""Where output goes, and what a first run prints.

Every command and experiment writes to runs/ (ignored by git) unless told otherwise: the quick
path of each, run with its defaults in a scratch copy of the repository (conftest.py, one copy per
quick path), must leave `git status` of its copy clean. ``normfast demo`` as a user runs it prints no raw warnings, no
special tokens in its token lists, and no token twice.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")

# quick path -> (the Debian data it needs, the folder under runs/ it writes by default)
QUICK_PATHS = {
    "e2_quick": ("wordnet", "e2"),
    "e3_quick": ("wordnet", "e3"),
    "e4_quick": ("wordnet", "e4"),
    "e5_quick": ("fashion-mnist", "e5"),
    "bench_quick": (None, "throughput"),
    "demo_run": (None, "demo"),
    "cli_runs": (None, "cli"),
}


@pytest.fixture(scope="session")
def cli_runs(repo_copies, tiny_bert_folder) -> dict[str, str]:
    """probe -> report, solve and retrieval on toy inputs, every output under runs/ (relative paths)."""
    import json
    import shutil

    repo_copy = repo_copies("cli_runs")
    work = repo_copy / "runs" / "cli"
    work.mkdir(parents=True)
    shutil.copytree(tiny_bert_folder, work / "bert")
    (work / "words.txt").write_text("apple\nriver\nthe\nblue\n")
    np.save(work / "coeffs.npy", np.array([[1.0, 0.0, -5.0, 0.0, 4.0]]))
    beir = work / "beir"
    beir.mkdir()
    (beir / "corpus.jsonl").write_text(
        "".join(
            json.dumps({"_id": f"d{i}", "text": t}) + "\n"
            for i, t in enumerate(["a red apple", "a blue river", "the sea"])
        )
    )
    (beir / "queries.jsonl").write_text(json.dumps({"_id": "q0", "text": "fruit"}) + "\n")
    (beir / "qrels").mkdir()
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq0\td0\t1\n")
    rng = np.random.default_rng(0)
    np.savez(
        work / "vectors.npz",
        query_ids=np.array(["q0"]),
        queries=rng.normal(size=(1, 4)),
        doc_ids=np.array(["d0", "d1", "d2"]),
        docs=rng.normal(size=(3, 4)),
    )
    return {
        "probe": run_cli(
            repo_copy,
            "probe",
            "runs/cli/bert",
            "--probes",
            "runs/cli/words.txt",
            "--tokens",
            "--batches",
            "2",
            "--drift-batches",
            "8",
            "--batch-size",
            "4",
            "--out",
            "runs/cli/run.parquet",
            "--no-progress",
        ),
        "report": run_cli(repo_copy, "report", "runs/cli/run.parquet"),
        "solve": run_cli(repo_copy, "solve", "runs/cli/coeffs.npy"),
        "retrieval": run_cli(
            repo_copy, "retrieval", "--beir", "runs/cli/beir", "--vectors", "runs/cli/vectors.npz", "--no-progress"
        ),
    }


@pytest.mark.parametrize(
    "fixture",
    [
        pytest.param(name, marks=[pytest.mark.needs_data(data)] if data else [])
        for name, (data, _) in QUICK_PATHS.items()
    ],
)
def test_quick_path_leaves_the_repository_clean(request, repo_copies, fixture):
    """Each quick path in its own copy (conftest.py), with its default output location."""
    request.getfixturevalue(fixture)
    repo_copy = repo_copies(fixture)
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=repo_copy,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert status == "", f"the quick run {fixture} changed the repository:\n{status}"
    written = sorted(p.name for p in (repo_copy / "runs").iterdir())
    assert written == [QUICK_PATHS[fixture][1]], written
    assert any((repo_copy / "runs" / written[0]).iterdir())


@pytest.mark.parametrize("command", ["demo", "throughput", "report", "retrieval", "solve", "probe"])
def test_no_command_defaults_to_the_committed_results(command):
    """Commands without a quick path here: their --out default is none, or under runs/."""
    from normfast.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    out = next((a for a in sub._actions if "--out" in a.option_strings), None)
    default = None if out is None else out.default
    assert default is None or str(default).startswith("runs/"), f"normfast {command} --out defaults to {default}"


def _out_defaults(path: Path) -> list[tuple[int, str]]:
    """``(line, default expression with module-level names expanded)`` of every ``--out`` option in a file."""
    import ast

    tree = ast.parse(path.read_text())
    names = {
        t.id: ast.unparse(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "add_argument"
            and any(isinstance(a, ast.Constant) and a.value == "--out" for a in node.args)
        ):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if "required" in kw and ast.literal_eval(kw["required"]) is True:
            continue
        text = ast.unparse(kw["default"]) if "default" in kw else "None"
        for _ in range(3):  # RUNS = REPO / "runs" / "e4", REPO = Path(__file__)...
            text = re.sub(
                r"\b[A-Z_][A-Z0-9_]*\b", lambda m: f"({names[m.group(0)]})" if m.group(0) in names else m.group(0), text
            )
        found.append((node.lineno, text))
    return found


ROOT = Path(__file__).resolve().parents[2]


def test_every_experiment_writes_under_runs_unless_told():
    """`python -m bench run NAME` without --out writes under runs/NAME (git-ignored), never bench/results."""
    from bench.cli import config_parser, default_out
    from bench.harness import EXPERIMENTS, load

    for name in EXPERIMENTS:
        assert default_out(name) == Path("runs") / name
        out = next(a for a in config_parser(name, load(name))._actions if "--out" in a.option_strings)
        assert out.default is None, f"{name}: --out defaults to {out.default}; the runner chooses runs/{name}"
    assert "/runs/" in (ROOT / ".gitignore").read_text().splitlines()


SCRIPTS = sorted(
    p
    for p in [*ROOT.joinpath("bench").rglob("*.py"), *ROOT.joinpath("normfast", "apps").rglob("*.py")]
    if "--out" in p.read_text()
)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_out_option_defaults_to_runs_or_is_required(path):
    """Static, so that it covers the full benchmarks too (minutes each) and any script added later:
    an --out option is required, has no default, or defaults under runs/ -- never bench/results."""
    for line, default in _out_defaults(path):
        assert default == "None" or ("runs" in default and "results" not in default), (
            f"{path.relative_to(ROOT)}:{line}: --out defaults to {default}; default to runs/ (git-ignored) "
            f"and write committed results only with an explicit --out bench/results"
        )


# ---------------------------------------------------------------------------
# normfast demo, as printed


def _token_list(printed: str, which: str) -> list[str]:
    line = next(ln for ln in printed.splitlines() if ln.startswith(f"{which} tokens"))
    return line.split(": ", 1)[1].split(", ")


def test_demo_prints_no_warnings_and_clean_token_lists(demo_run):
    demo_run, folder = demo_run
    assert demo_run.returncode == 0, demo_run.stderr[-3000:]
    out, err = demo_run.stdout, demo_run.stderr
    for stream in (out, err):
        assert not re.search(r"\w*Warning\b", stream), stream[-3000:]
    assert "probing (jvp mode)" in err  # the progress bars are there, and nothing else is
    assert "all-MiniLM-L6-v2" in out and "Spearman(Zipf, norm" in out
    for which in ("hottest", "coldest"):
        entries = _token_list(out, which)
        tokens = [e.split(" ")[0] for e in entries]
        assert len(entries) == 8 and len(set(tokens)) == len(tokens), entries
        assert not {"[CLS]", "[SEP]", "[PAD]"} & set(tokens), entries
    table = pq.read_table(folder / "demo.parquet")
    words = set(table.column("text").to_pylist())
    assert len(words) == 60 and "the" in words
    assert np.all(np.isfinite(table.column("V2").to_numpy()))
    special = table.column("is_special").to_numpy()
    assert set(np.asarray(table.column("token"))[special]) == {"[CLS]", "[SEP]"}
    assert special.sum() == 2 * 60
    assert (folder / "demo_norm_vs_req.png").exists()


def test_demo_writes_its_page(demo_run):
    """`normfast demo` writes the run's page (`normfast view`) with the demo's reading, and says where."""
    import json

    demo_run, folder = demo_run
    assert demo_run.returncode == 0, demo_run.stderr[-3000:]
    assert "wrote runs/demo/demo.html" in demo_run.stdout
    page = (folder / "demo.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script id="nf-data" type="application/json">(.*?)</script>', page, re.S).group(1))
    table = pq.read_table(folder / "demo.parquet")
    assert data["rows"]["n"] == table.num_rows and data["totals"]["rows"] == table.num_rows
    assert data["header"]["notes"].startswith("how to read R_eq here:")
    assert data["types"]["token"]["total"] >= 60 and len(data["docs"]) == 60


def test_demo_reads_the_regime_first_and_never_shows_a_bare_slope(demo_run):
    """The regime check right under the header, and the fit of norms against R_eq only with its reading."""
    demo_run, folder = demo_run
    assert demo_run.returncode == 0, demo_run.stderr[-3000:]
    lines = demo_run.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("probe run:"))
    assert lines[head + 1].startswith("regime: ")
    fit = next(i for i, ln in enumerate(lines) if "observed norm vs R_eq" in ln)
    assert "comparison, not a test of the law" in lines[fit - 1]
    assert "how to read R_eq here:" in demo_run.stdout and "not a fit to the present norms" in demo_run.stdout
    table = pq.read_table(folder / "demo.parquet")
    assert set(table.column("regime").to_pylist()) <= {"law applicable", "heat-dominated", "not applicable"}


def test_cli_quick_paths_print_what_they_wrote(cli_runs):
    assert "hottest tokens" in cli_runs["probe"] and "wrote runs/cli/run.parquet" in cli_runs["probe"]
    assert "wrote runs/cli/run_tokens.png" in cli_runs["report"]
    assert "ndcg@10" in cli_runs["retrieval"]
