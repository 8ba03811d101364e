"""Throughput: the probe-throughput suite (the product ``normfast throughput``).

    python -m bench run throughput --out bench/results/throughput    # the committed suite (15-25 min on 2 cores)
    python -m bench run throughput --only head,scaling    # some sections
    python -m bench run throughput --quick                # every path at tiny sizes (the tests)

The suite is a product command (its code lives in :mod:`normfast.apps.throughput`);
this module runs it through the command's own entry point, which writes
``throughput.json``, ``jvp_minilm.json`` and the ``throughput_*.png`` figures, and renders
its README table. The protocol, as the command states it:

"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

from bench.common import product_protocol
from bench.harness import Context, UsageError, read_json

RESULTS = ("throughput.json", "jvp_minilm.json")
FIGURES = ("throughput_head.png", "throughput_jvp.png", "throughput_scaling.png")
TABLES = ("throughput",)
#: the product writes its report after every section, and its figures
WRITES_OWN_FILES = True


__doc__ += product_protocol("normfast.apps.throughput")


@dataclass
class Config:
    only: str | None = field(
        default=None,
        metadata={"help": "sections to run: head, jacrev, minilm, scaling (or jvp), comma-separated; none: all"},
    )
    repeats: int | None = field(default=None, metadata={"help": "timing rounds per section (none: 3; quick 1-2)"})
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default); jacrev always uses 1"})
    head_n: int | None = field(default=None, metadata={"help": "probes of the head section (none: 100000)"})
    size: str = field(
        default="full", metadata={"choices": ("full", "quick"), "help": "the suite's full or --quick sizes"}
    )

    @classmethod
    def quick(cls) -> "Config":
        return cls(size="quick")


def run(config: Config, ctx: Context) -> dict[str, Any]:
    from normfast.apps.throughput import throughput_main

    args = Namespace(
        quick=config.size == "quick",
        only=config.only,
        out=str(ctx.out),
        repeats=config.repeats,
        threads=config.threads,
        head_n=config.head_n,
        no_progress=not ctx.progress,
    )
    status = throughput_main(args)
    if status == 2:
        raise UsageError("normfast throughput refused the settings (its message is above)")
    report = read_json(ctx.out / "throughput.json")
    report["_written"] = ["throughput.json", *report.get("figures", [])] + (
        ["jvp_minilm.json"] if "minilm" in report else []
    )
    if status:
        report["_failed"] = "accuracy checks failed (those methods were not timed)"
    return report


def tables(report: dict[str, Any]) -> dict[str, str]:
    return {"throughput": table_throughput(report)}


def _check(d: dict, name: str) -> str:
    for c in d.get("accuracy_checks", []):
        if c["check"] == name:
            return f"{c['max_rel_diff']:.1e} ({'ok' if c['passed'] else 'FAILED'})"
    return "n/a"


def _ratio_rows(
    d: dict, section: str, ours: str, comparison: str, baselines: dict[str, str], missing: dict[str, str] | None = None
) -> list[str]:
    """One row per baseline of a section: the speed-up and FLOP ratios of ``ours`` over it, its check
    (``missing``: the baselines to list as not run, with their skip reason, when the run lacks them)."""
    sec, rows = d[section], []
    for k, text in baselines.items():
        key = f"{ours}_vs_{k}"
        if key in sec["ratios"]:
            rows.append(
                f"| {comparison} | {text} | {sec['ratios'][key]:.1f}x | {sec['flop_ratios'][key]:.1f}x | "
                f"{_check(d, f'{section}/{k}')} |"
            )
        elif missing is not None:
            rows.append(f"| {comparison} | {missing[k]} | not run: {sec['skipped'].get(k, '?')} | | |")
    return rows


def table_throughput(d: dict) -> str:
    env = d["environment"]
    rows = [
        f"Machine: {env['device']}, torch {env['versions'].get('torch', '?')}, "
        f"{env['threads']} torch thread(s) (the jacrev section: 1). Ratios are medians of methods "
        f"timed in the same run, interleaved round by round, after each method's output passed its "
        f"accuracy check.",
        "",
        "| comparison | baseline | normfast speed-up | FLOP ratio | baseline max rel. diff |",
        "|---|---|---|---|---|",
    ]
    form_rows: list[str] = []  # the head-mode forms: a second table after the comparisons
    if "head" in d:
        h, c = d["head"], d["head"]["config"]
        size = f"N = {c['n']:,}, d = {c['d_in']}, M = {c['m']}"
        label = {
            "torch.func": "`torch.func` `vmap(grad)`",
            "backpack": "BackPACK `BatchGrad`",
            "opacus": "Opacus `GradSampleModule`",
        }
        rows += _ratio_rows(
            d,
            "head",
            "normfast",
            f"head mode ({size})",
            {k: f"{t} per-sample gradients, summed per batch, applied to every probe" for k, t in label.items()},
            missing=label,
        )
        floors = h.get("statistics_vs_gemm_floor")
        if floors:
            forms = {
                "normfast": "grouped, with error bars (the default)",
                "normfast S": "bare S form (`uncertainty=False`)",
                "normfast per-batch": "per-batch form (`radial_spread=True`)",
            }
            base = h["seconds"]["normfast"]["p50"]
            form_rows = [
                "",
                f"| head-mode form ({size}) | whole run, speed relative to the default | "
                f"statistics time / its GEMM floor |",
                "|---|---|---|",
            ]
            for k, text in forms.items():
                if k in floors:
                    form_rows.append(f"| {text} | {base / h['seconds'][k]['p50']:.2f}x | {floors[k]:.2f} |")
            form_rows += [
                "",
                "normfast's head rows above run the default (the grouped form, with error bars); "
                "a form's floor is its GEMMs alone (forming its matrices from the directions and "
                "the per-probe products), timed in the same rounds.",
            ]
    if "jacrev" in d:
        j, c = d["jacrev"], d["jacrev"]["config"]
        rows.append(
            f"| jvp mode, MLP {'-'.join(map(str, c['widths']))} ({c['parameters']:,} parameters, "
            f"N = {c['n']:,}, M = {c['m']}) | per-probe Jacobians (`vmap(jacrev)`) applied to "
            f"each direction | {j['ratios']['normfast_vs_jacrev']:.1f}x | "
            f"{j['flop_ratios']['normfast_vs_jacrev']:.1f}x | {_check(d, 'jacrev/jacrev')} |"
        )
    if "minilm" in d:
        m, c = d["minilm"], d["minilm"]["config"]
        size = f"{c['comparison_tokens']:,} tokens, M = {c['m']}"
        text = {
            "sequential_cached": "one direction per pass, same cached front",
            "sequential_full": "one `torch.func.jvp` per direction through the whole model",
        }
        rows += _ratio_rows(
            d, "minilm", "batched", f"MiniLM token jvp, last layer, {c['k']} directions per pass ({size})", text
        )
    rows += form_rows
    if "minilm" in d:
        m, c = d["minilm"], d["minilm"]["config"]
        t = m["throughput"]
        rows += [
            "",
            f"MiniLM token-level jvp probing (last layer, {t['M']} directions, SimCSE, "
            f"{t['words']:,} words = {t['token_rows']:,} token rows): the whole engine "
            f"{t['engine_tokens_per_s']['p50']:,.0f} tokens/s (directions, fronts, κ, "
            f"accumulators, solve and table included); the forward-mode passes alone "
            f"{t['transmission_tokens_per_s']['p50']:,.0f} tokens/s.",
        ]
    if "scaling" in d:
        sc = d["scaling"]
        c = sc["config"]
        rows += [
            "",
            f"| token rows N (head mode, d = {c['dim']}, M = {c['m']}) | s | tokens/s | "
            "peak RSS | peak RSS while streaming |",
            "|---|---|---|---|---|",
        ]
        for r in sc["runs"]:
            stream = r["streaming_peak_rss_mb"]  # none where the run had no chunk loop to measure (quick sizes)
            rows.append(
                f"| {r['tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
                f"{r['peak_rss_mb']:,.0f} MB | {'n/a' if stream is None else f'{stream:,.0f} MB'} |"
            )
        fit = sc["linear_fit"]
        rows += [
            "",
            f"Linear fit: {fit['fixed_seconds']:.2f} s fixed + N / "
            f"{fit['tokens_per_s_marginal']:,.0f} tokens/s (largest relative residual "
            f"{fit['max_rel_residual']:.1e}); each N ran in a fresh process. The 10⁷-token "
            f"run is the streaming benchmark below.",
        ]
    return "\n".join(rows)
