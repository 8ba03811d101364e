"""E1's figures: the fits per variant (equilibrium.png) and the ledger's terms (ledger.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Observed stationary norm against each trajectory-average law, one panel per variant: the dense
    law along the steps' own batches (the headline), along fresh batches (protocol v3) and the
    checkpoints' law."""
    from matplotlib.ticker import FuncFormatter

    plt = _plt()
    n = len(results)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 4.1 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)

    def ticks(axis: Any) -> tuple[FuncFormatter, FuncFormatter]:
        """Plain-number labels; minor ticks labelled at 2, 3 and 5 x 10^k, or all of them when the axis
        spans less than a factor of 3 (else a narrow range would carry no label at all)."""

        def minor(v: float, _: Any) -> str:
            lo, hi = axis.get_view_interval()
            lead = round(v / 10 ** np.floor(np.log10(v)), 6)
            return f"{v:.2g}" if hi / lo < 3 or lead in (2, 3, 5) else ""

        return FuncFormatter(lambda v, _: f"{v:.2g}"), FuncFormatter(minor)

    for ax, res in zip(axes.flat, results):
        obs = np.asarray(res["observed"])
        series = (
            ("predicted_full", "tab:blue", "checkpoints, full law", "full_law"),
            ("predicted_dense_fresh_batch", "tab:orange", "dense, fresh batch (v3)", "dense_fresh_batch_corrected_law"),
            ("predicted_dense", "tab:red", "dense, own batch", "dense_corrected_law"),
        )
        shown = [s for s in series if s[0] in res]
        values = [obs]
        for key, color, label, fit in shown:
            pred = np.asarray(res[key], dtype=float)
            values.append(pred[np.isfinite(pred)])
            f = res["fits"].get(fit)
            tag = f" ({f['slope']:.2f} / {f['pearson_r']:.3f})" if f else ""
            ax.loglog(pred, obs, ".", ms=3, color=color, alpha=0.6, label=label + tag)
        lo = min(float(v.min()) for v in values if v.size)
        hi = max(float(v.max()) for v in values if v.size)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        head = "dense_corrected_law" if "predicted_dense" in res else "full_law"
        f = res["fits"][head]
        ax.set_title(
            f"{res['variant']} ({res['optimizer']})\n{head.replace('_', ' ')}: slope {f['slope']:.2f}, "
            f"r {f['pearson_r']:.3f}",
            fontsize=9,
        )
        for axis in (ax.xaxis, ax.yaxis):
            major, minor = ticks(axis)
            axis.set_major_formatter(major)
            axis.set_minor_formatter(minor)
        ax.tick_params(which="minor", labelsize=6)
        ax.tick_params(axis="x", which="both", labelrotation=45)
        ax.set_xlabel("predicted R_eq")
        ax.set_ylabel("observed stationary norm")
        ax.legend(fontsize=7, loc="upper left", title="law (slope / r)", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ledger(results: list[dict[str, Any]], path: Path) -> None:
    """Per variant: the realized window-mean terms beside the engine's estimates (mean over items,
    in units of the realized decay term), and the per-item first-order task term against its estimate."""
    plt = _plt()
    n = len(results)
    fig, axes = plt.subplots(2, n, figsize=(3.6 * n, 7), squeeze=False)
    rows = ("task1", "task2", "decay", "remainder", "total")
    for k, res in enumerate(results):
        ax = axes[0][k]
        scale = abs(res["terms"]["decay"]["realized_mean"])
        x = np.arange(len(rows))
        real = [res["terms"][t]["realized_mean"] / scale for t in rows]
        avg = [res["terms"][t]["checkpoint_average"]["mean"] / scale for t in rows]
        last = [res["terms"][t]["last_checkpoint"]["mean"] / scale for t in rows]
        ax.bar(x - 0.27, real, 0.27, label="realized", color="k")
        ax.bar(x, avg, 0.27, label="engine, checkpoint mean", color="tab:blue")
        ax.bar(x + 0.27, last, 0.27, label="engine, last checkpoint", color="tab:orange")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xticks(x, ["task 1st", "task 2nd", "decay", "remainder", "total"], rotation=30, fontsize=8)
        ax.set_title(f"{res['variant']}: mean term / |realized decay|", fontsize=9)
        if k == 0:
            ax.legend(fontsize=7)
        ax = axes[1][k]
        real_t1 = np.asarray(res["realized"]["task1"])
        for key, color, alpha, label in (
            ("estimated_checkpoint_average", "tab:blue", None, "checkpoint mean"),
            ("estimated_last_checkpoint", "tab:orange", 0.5, "last checkpoint"),
        ):
            ax.plot(np.asarray(res[key]["task1"]), real_t1, ".", ms=3, color=color, alpha=alpha, label=label)
        lim = np.nanmax(np.abs(real_t1)) * 1.2
        ax.plot([-lim, lim], [-lim, lim], "k--", lw=0.8)
        ax.set_xlabel("engine's first-order task term")
        ax.set_ylabel("realized (window mean)")
        ax.set_title("first-order task term per item", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
