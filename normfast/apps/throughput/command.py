"""``normfast throughput``: the command that runs the sections and writes the report."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from .figures import plot_head, plot_jvp, plot_scaling
from .head import run_head
from .jvp import run_jacrev, run_minilm
from .measure import environment, threads
from .scaling import run_scaling
from .settings import SECTION_GROUPS, SECTIONS, Settings

# ============================================================================
# CLI
# ============================================================================

throughput_description = """\
The probe-throughput suite. Each comparison is a ratio of medians measured in
the same run on the same data, after an accuracy check (recorded, with its
tolerance, in the JSON); a method that fails its check is not timed.

sections (--only, comma separated; 'jvp' = jacrev,minilm):
  head     head mode vs per-sample-gradient pipelines (torch.func, BackPACK, Opacus)
  jacrev   jvp mode vs per-probe Jacobians (torch.func.jacrev) on a small MLP
  minilm   MiniLM last layer, token level: several directions per pass vs one at a time
           (same cached front / whole model per direction); engine tokens/s
  scaling  engine wall time and peak memory as N grows, a fresh process per N

writes OUT/throughput.json, OUT/jvp_minilm.json and OUT/throughput_*.png. The full suite
takes 15-25 minutes on 2 CPU cores; --quick runs every path at tiny sizes.

examples:
  normfast throughput
  normfast throughput --only head,scaling --out /tmp/bench
  normfast throughput --quick --out /tmp/bench-quick"""


def throughput_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds; used by the tests)")
    p.add_argument(
        "--only",
        default=None,
        metavar="NAME[,NAME]",
        help=f"sections to run: {', '.join(SECTIONS)} (or jvp); default all",
    )
    p.add_argument(
        "--out",
        default="runs/throughput",
        help="output folder (default runs/throughput, git-ignored; the committed results: "
        "--out bench/results/throughput)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timing rounds per section (default 3; quick 1-2)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: torch's default); the jacrev section always uses 1"
    )
    p.add_argument("--head-n", type=int, default=None, help="probes of the head section (default 100000)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. for a log file)")


def _parse_only(fn: str, only: str | None) -> list[str]:
    if not only:
        return list(SECTIONS)
    chosen: list[str] = []
    for name in (x.strip() for x in only.split(",") if x.strip()):
        for sec in SECTION_GROUPS.get(name, (name,)):
            if sec not in SECTIONS:
                raise ValueError(f"{fn}: expected --only names from {', '.join(SECTIONS)} (or jvp), got {name!r}")
            if sec not in chosen:
                chosen.append(sec)
    if not chosen:
        raise ValueError(f"{fn}: expected at least one section in --only, got {only!r}")
    return [s for s in SECTIONS if s in chosen]


def _all_checks(report: dict) -> list[dict]:
    return [c for name in SECTIONS for c in report.get(name, {}).get("accuracy", [])]


def _all_ratios(report: dict) -> dict[str, float]:
    return {f"{name}/{k}": v for name in SECTIONS for k, v in report.get(name, {}).get("ratios", {}).items()}


def format_summary(report: dict) -> str:
    lines = [
        f"normfast throughput ({'quick' if report.get('quick') else 'full'}), "
        f"{report['environment']['device']}, {report['environment']['threads']} threads"
    ]
    for name in SECTIONS:
        sec = report.get(name)
        if sec is None:
            continue
        lines.append(f"\n[{name}]")
        for method, q in sec.get("seconds", {}).items():
            lines.append(f"  {method:<18} p50 {q['p50']:9.3f} s  (p20 {q['p20']:.3f}, p80 {q['p80']:.3f})")
        for k, v in sec.get("ratios", {}).items():
            lines.append(f"  ratio {k}: {v:.1f}x")
        for k, v in sec.get("flop_ratios", {}).items():
            lines.append(f"  FLOP ratio {k}: {v:.1f}x")
        for c in sec.get("accuracy", []):
            mark = "ok" if c["passed"] else "FAILED"
            lines.append(f"  check {c['check']}: {c['max_rel_diff']:.1e} (tol {c['tolerance']:.0e}) {mark}")
        if name == "minilm":
            t = sec["throughput"]
            lines.append(
                f"  engine {t['engine_tokens_per_s']['p50']:.0f} tokens/s, transmission alone "
                f"{t['transmission_tokens_per_s']['p50']:.0f} tokens/s (M={t['M']}, "
                f"{t['token_rows']} token rows)"
            )
        if name == "scaling":
            for r in sec["runs"]:
                stream = r.get("streaming_peak_rss_mb")
                lines.append(
                    f"  N={r['tokens']:>9}: {r['seconds']:8.2f} s, {r['tokens_per_s']:9.0f} tokens/s, "
                    f"peak RSS {r['peak_rss_mb']:.0f} MB (after set-up {r['rss_after_setup_mb']:.0f}, "
                    f"chunk loop {stream if stream is None else round(stream)})"
                )
            fit = sec["linear_fit"]
            lines.append(
                f"  fit: {fit['fixed_seconds']:.2f} s fixed + N / {fit['tokens_per_s_marginal']:.0f} "
                f"tokens/s; log-log slope over the top decade {sec['loglog_slope_top_decade']:.2f}"
            )
    return "\n".join(lines)


def throughput_main(args: argparse.Namespace) -> int:
    fn = "normfast throughput"
    try:
        sections = _parse_only(fn, args.only)
        if args.repeats is not None and args.repeats < 1:
            raise ValueError(f"{fn}: expected --repeats >= 1, got {args.repeats}")
        if args.threads < 0:
            raise ValueError(f"{fn}: expected --threads >= 0, got {args.threads}")
        if args.head_n is not None and args.head_n < 2:
            raise ValueError(f"{fn}: expected --head-n >= 2, got {args.head_n}")
    except ValueError as exc:
        print(f"{fn}: error: {exc}", file=sys.stderr)
        return 2
    settings = Settings.quick() if args.quick else Settings()
    if args.repeats is not None:
        for part in (settings.head, settings.jacrev, settings.minilm):
            part.repeats = args.repeats
    if args.head_n is not None:
        settings.head.n = args.head_n
        settings.head.check = min(settings.head.check, args.head_n)
    with threads(args.threads):
        return _bench(args, sections, settings)


def _bench(args: argparse.Namespace, sections: list[str], settings: Settings) -> int:
    fn = "normfast throughput"
    progress = not args.no_progress
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "throughput.json"

    report: dict[str, Any] = {}
    if args.only and path.exists():
        try:
            previous = json.loads(path.read_text())
            if previous.get("quick") == bool(args.quick):
                report = {k: v for k, v in previous.items() if k in SECTIONS}
        except (OSError, ValueError):
            report = {}
    runners = {
        "head": lambda: run_head(settings.head, progress),
        "jacrev": lambda: run_jacrev(settings.jacrev, progress),
        "minilm": lambda: run_minilm(settings.minilm, progress),
        "scaling": lambda: run_scaling(settings.scaling, progress),
    }
    started = time.time()
    for name in sections:
        print(f"{fn}: section {name} ...", flush=True)
        load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        t0 = time.perf_counter()
        report[name] = runners[name]()
        report[name]["load_average_start"] = load_start
        report[name]["section_seconds"] = time.perf_counter() - t0
        report[name]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        # written after every section, so that a later failure keeps what was measured
        _write_report(path, args, sections, started, report, [], complete=False)

    figures = []
    if "head" in report:
        figures.append(plot_head(report["head"], out / "throughput_head.png"))
    if "jacrev" in report or "minilm" in report:
        figures.append(plot_jvp(report.get("jacrev"), report.get("minilm"), out / "throughput_jvp.png"))
    if "scaling" in report:
        figures.append(plot_scaling(report["scaling"], out / "throughput_scaling.png"))
    full = _write_report(path, args, sections, started, report, figures, complete=True)
    if "minilm" in report:
        (out / "jvp_minilm.json").write_text(json.dumps(report["minilm"]["throughput"], indent=2) + "\n")
    print(format_summary(full))
    print(f"\nwrote {path}" + "".join(f"\nwrote {out / p.name}" for p in figures))
    if not full["all_checks_passed"]:
        bad = [c["check"] for c in full["accuracy_checks"] if not c["passed"]]
        print(f"{fn}: accuracy checks failed (methods not timed): {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _write_report(
    path: Path,
    args: argparse.Namespace,
    sections: list[str],
    started: float,
    report: dict[str, Any],
    figures: list[Path],
    *,
    complete: bool,
) -> dict[str, Any]:
    checks = _all_checks(report)
    flags = (["--quick"] if args.quick else []) + ([f"--only {args.only}"] if args.only else [])
    full = {
        "suite": "normfast throughput",
        "quick": bool(args.quick),
        "complete": complete,
        "sections_run": sections,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "environment": environment(),
        "command": " ".join(["normfast throughput", *flags]),
        "ratios": _all_ratios(report),
        "accuracy_checks": checks,
        "all_checks_passed": all(c["passed"] for c in checks),
        "figures": [p.name for p in figures],
        "note": "ratios are p50 over p50 of methods timed in the same run on the same data, after the "
        "accuracy checks listed; absolute seconds describe this machine only",
        **{name: report[name] for name in SECTIONS if name in report},
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(full, indent=2, default=float) + "\n")
    os.replace(tmp, path)
    return full
