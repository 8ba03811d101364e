"""The parent process: build and test commands, the worker processes, the report files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

from .common import (
    CAPS,
    COMMAND_STAGES,
    DEFAULT_BUDGET,
    DRY_TEST_SELECTION,
    FLOORS,
    GRACE,
    ORDER,
    REPO,
    SCHEMA,
    TEST_FILES,
    WORKER_MODULE,
    WORKER_STAGES,
    WORKER_START_LIMIT,
    log,
    now_iso,
    read_json,
    stage_timeout,
    write_json,
)
from .markdown import markdown, stage_note, summarize


def stage_package(root: Path) -> Path:
    """A folder on which ``import normfast.kernels`` works as after an install (links only), with
    this harness beside it (the worker is ``python -m`` one of its modules)."""
    site = root / "site"
    pkg = site / "normfast"
    pkg.mkdir(parents=True)
    (site / "bench").symlink_to((REPO / "bench").resolve())
    for entry in (REPO / "normfast").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry.resolve())
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
    # No current directory on the import path: the source tree's normfast (without its
    # built extension) must not shadow the staged package.
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["TRITON_INTERPRET"] = "1" if dry_run else "0"
    env["TRITON_CACHE_DIR"] = str(cache)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_command(
    cmd: list[str], env: dict[str, str], timeout: float, log_path: Path, cwd: Path = REPO
) -> dict[str, Any]:
    """Run a command in its own process group; kill the group at the timeout."""
    t0 = time.time()
    with open(log_path, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
    text = log_path.read_text(errors="replace")
    return {
        "cmd": cmd,
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.time() - t0, 2),
        "output_tail": text[-3000:],
    }


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


def build_stage(args, staged_env: Callable[[], dict[str, str]], timeout: float, out: Path) -> dict[str, Any]:
    if args.dry_run:
        # Byte-compile only: running setup.py would need its build requirements
        # (pybind11), which pip keeps in an isolated build environment.
        cmd = [sys.executable, "-m", "py_compile", "setup.py"]
        note = "dry run: setup.py byte-compiled, nothing built (the installed extension is used)"
    else:
        cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
        note = "compiled in place"
    run = run_command(cmd, dict(os.environ, PYTHONUNBUFFERED="1"), timeout, out / "build.log")
    probe_cmd = [sys.executable, "-c", "import normfast.core._quartic as q, normfast.kernels as k; print(q.__file__)"]
    check = subprocess.run(
        probe_cmd, env=staged_env(), cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=120
    )
    result = {
        "note": note,
        "command": " ".join(cmd[1:]),
        "returncode": run["returncode"],
        "timed_out": run["timed_out"],
        "output_tail": run["output_tail"][-1500:],
        "import_ok": check.returncode == 0,
        "extension": check.stdout.strip() or check.stderr.strip()[-500:],
    }
    status = "timeout" if run["timed_out"] else ("ok" if run["returncode"] == 0 and check.returncode == 0 else "failed")
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
        cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0)), "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    slowest = sorted(cases, key=lambda c: -c["seconds"])[:5]
    return {
        "counts": counts,
        "not_passed": [c for c in cases if c["outcome"] != "passed"][:40],
        "slowest": [{"test": c["test"], "seconds": c["seconds"]} for c in slowest],
    }


def tests_stage(args, env: dict[str, str], timeout: float, out: Path) -> dict[str, Any]:
    import importlib.util

    junit = out / "tests-junit.xml"
    # From a neutral folder with absolute paths: the source tree must not be importable.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *(str(REPO / f) for f in TEST_FILES),
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        f"--rootdir={REPO}",
        f"--junitxml={junit}",
    ]
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
    result = {
        "command": f"TRITON_INTERPRET={env['TRITON_INTERPRET']} python {' '.join(shown)}",
        "returncode": run["returncode"],
        "timed_out": run["timed_out"],
        "junit": parsed,
        "output_tail": run["output_tail"][-1500:],
    }
    if run["timed_out"]:
        status = "timeout"
    elif parsed is None:
        status = "error"
    else:
        c = parsed["counts"]
        status = (
            "ok" if run["returncode"] == 0 and c["failed"] == 0 and c["error"] == 0 and c["passed"] > 0 else "failed"
        )
    return {"status": status, "result": result}


def source_info() -> dict[str, Any]:
    info: dict[str, Any] = {"repo": str(REPO)}
    try:
        info["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, text=True, capture_output=True, timeout=10
            ).stdout.strip()
            or None
        )
        status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, text=True, capture_output=True, timeout=10)
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
            "schema": SCHEMA,
            "dry_run": bool(args.dry_run),
            "command": args.command,
            "started": now_iso(),
            "finished": None,
            "budget_s": args.budget_s,
            "elapsed_s": None,
            "source": source_info(),
            "selected_stages": selected,
            "stages": {s: {"status": "skipped", "seconds": 0.0, "reason": "not selected"} for s in ORDER},
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
            timeout = stage_timeout(stage, selected, t_start, args.budget_s, caps, floors, time.time())
            if timeout < floors[stage]:
                report.set(
                    stage,
                    {"status": "skipped", "seconds": 0.0, "reason": f"budget: {max(timeout, 0):.0f} s left for it"},
                )
                continue
            log(f"\n=== {stage} (up to {timeout:.0f} s)")
            t0 = time.time()
            try:
                if stage == "build":
                    entry = build_stage(args, staged_env, timeout, out)
                else:
                    entry = tests_stage(args, staged_env(), timeout, out)
            except Exception as exc:  # noqa: BLE001 - recorded, the next stage still runs
                entry = {
                    "status": "error",
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-2000:],
                }
            entry["seconds"] = round(time.time() - t0, 2)
            report.set(stage, entry)
            note = stage_note(stage, entry)
            log(f"=== {stage}: {entry['status']} in {entry['seconds']:.1f} s" + (f" ({note})" if note else ""))
        worker_stages = [s for s in selected if s in WORKER_STAGES]
        if worker_stages:
            worker_env = dict(staged_env(), TRITON_CACHE_DIR=str(root / "triton-cache"))
            run_workers(args, worker_stages, selected, t_start, caps, floors, root, worker_env, report)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report.data["finished"] = now_iso()
    report.data["elapsed_s"] = round(time.time() - t_start, 1)
    report.data["summary"] = summarize(report.data)
    report.save()
    report.md_path.write_text(markdown(report.data))
    bad = [s for s in selected if report.data["stages"][s]["status"] != "ok"]
    return 1 if bad else 0


def run_workers(
    args,
    pending: list[str],
    selected: list[str],
    t_start: float,
    caps: dict[str, float],
    floors: dict[str, float],
    root: Path,
    env: dict[str, str],
    report: Report,
) -> None:
    results = root / "results"
    results.mkdir(exist_ok=True)
    while pending:
        plan = {
            "dry_run": args.dry_run,
            "tokens": args.tokens,
            "root": str(root),
            "stages": ",".join(pending),
            "selected": ",".join(selected),
            "t_start": t_start,
            "budget_s": args.budget_s,
            "inject": list(args.inject),
            "stage_cap": list(args.stage_cap),
        }
        cmd = [sys.executable, "-m", WORKER_MODULE, json.dumps(plan)]
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
                killed = f"timeout: stopped after {now - cur['started']:.0f} s (cap {cur['timeout']:.0f} s)"
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
            entry = {"status": status, "seconds": round(time.time() - started, 2), "error": reason, "result": partial}
            report.set(cur_stage, entry)
            log(f"=== {cur_stage}: {status} ({reason})")
            finished.append(cur_stage)
        pending = [s for s in pending if s not in finished]
