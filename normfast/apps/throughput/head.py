"""Section "head": head mode against per-sample-gradient pipelines (torch.func, BackPACK, Opacus)."""

from __future__ import annotations

import importlib.metadata
import time
import warnings
from dataclasses import asdict
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .floor import HEAD_FORMS, gemm_floor
from .measure import accuracy_check, environment, percentiles, rel_diff, threads, throughput, time_rounds
from .settings import HEAD_KEYS, TAU, HeadSettings

# ============================================================================
# Section "head": head mode vs per-sample-gradient tools
# ============================================================================


class HeadProblem(NamedTuple):
    """A linear head, probe activations, embeddings and M virtual batches of pairs."""

    W: torch.Tensor  # [d_out, d_in]
    b: torch.Tensor  # [d_out]
    A: torch.Tensor  # [N, d_in] probe activations
    Z: torch.Tensor  # [N, d_out] probe embeddings, Z = A Wᵀ + b
    anchors: torch.Tensor  # [M, pairs, d_in]
    positives: torch.Tensor  # [M, pairs, d_in]


def make_head_problem(n: int, d_in: int, d_out: int, m: int, pairs: int, seed: int = 0) -> HeadProblem:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    b = 0.1 * torch.randn(d_out, generator=g)
    A = torch.randn(n, d_in, generator=g)
    Z = torch.addmm(b, A, W.T)
    anchors = torch.randn(m, pairs, d_in, generator=g)
    positives = anchors + 0.5 * torch.randn(m, pairs, d_in, generator=g)
    return HeadProblem(W, b, A, Z, anchors, positives)


def info_nce_rows(W: torch.Tensor, b: torch.Tensor, x_a: torch.Tensor, x_p: torch.Tensor) -> torch.Tensor:
    """Per-row InfoNCE terms on L2-normalized head outputs (scale-invariant)."""
    z_a = F.normalize(F.linear(x_a, W, b), dim=-1)
    z_p = F.normalize(F.linear(x_p, W, b), dim=-1)
    logits = z_a @ z_p.T / TAU
    return F.cross_entropy(logits, torch.arange(x_a.shape[0]), reduction="none")


def _info_nce_module(head: torch.nn.Module, x_a: torch.Tensor, x_p: torch.Tensor) -> torch.Tensor:
    # One call of the head on both sides: BackPACK keeps only the last input of a module.
    z = F.normalize(head(torch.cat([x_a, x_p])), dim=-1)
    pairs = x_a.shape[0]
    return F.cross_entropy(z[:pairs] @ z[pairs:].T / TAU, torch.arange(pairs))


def head_directions_backward(
    W: torch.Tensor, b: torch.Tensor, anchors: torch.Tensor, positives: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``G_B, g_B`` from one ordinary backward of the mean batch loss per batch."""
    Wp, bp = W.clone().requires_grad_(True), b.clone().requires_grad_(True)
    G, g = [], []
    for x_a, x_p in zip(anchors, positives):
        gw, gb = torch.autograd.grad(info_nce_rows(Wp, bp, x_a, x_p).mean(), (Wp, bp))
        G.append(gw)
        g.append(gb)
    return torch.stack(G), torch.stack(g)


def head_directions_torch_func(
    W: torch.Tensor, b: torch.Tensor, anchors: torch.Tensor, positives: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``G_B, g_B`` as sums of per-sample (per loss row) gradients, ``vmap(grad)``."""
    pairs = anchors.shape[1]

    def row_loss(Wr, br, x_a, x_p, pick):
        # pick is a one-hot row selector: the loss term of one anchor row
        return (info_nce_rows(Wr, br, x_a, x_p) * pick).sum() / pairs

    per_row = torch.func.vmap(torch.func.grad(row_loss, argnums=(0, 1)), in_dims=(None, None, None, None, 0))
    G, g = [], []
    rows = torch.eye(pairs)
    for x_a, x_p in zip(anchors, positives):
        gw, gb = per_row(W, b, x_a, x_p, rows)
        G.append(gw.sum(0))
        g.append(gb.sum(0))
    return torch.stack(G), torch.stack(g)


def _linear_head(W: torch.Tensor, b: torch.Tensor) -> torch.nn.Linear:
    head = torch.nn.Linear(W.shape[1], W.shape[0])
    with torch.no_grad():
        head.weight.copy_(W)
        head.bias.copy_(b)
    return head


def head_directions_backpack(
    W: torch.Tensor, b: torch.Tensor, anchors: torch.Tensor, positives: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``G_B, g_B`` as sums of BackPACK's per-sample gradients (``BatchGrad``, one per input row)."""
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    head = extend(_linear_head(W, b))
    G, g = [], []
    with warnings.catch_warnings():
        # the head's input needs no gradient; BackPACK's hooks warn about that
        warnings.simplefilter("ignore", UserWarning)
        for x_a, x_p in zip(anchors, positives):
            loss = _info_nce_module(head, x_a, x_p)
            with backpack(BatchGrad()):
                loss.backward()
            G.append(head.weight.grad_batch.sum(0))
            g.append(head.bias.grad_batch.sum(0))
            head.zero_grad(set_to_none=True)
    return torch.stack(G), torch.stack(g)


def head_directions_opacus(
    W: torch.Tensor, b: torch.Tensor, anchors: torch.Tensor, positives: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``G_B, g_B`` as sums of Opacus's per-sample gradients (``GradSampleModule``, one per input row).

    ``loss_reduction="sum"`` keeps Opacus from rescaling: the per-sample
    gradients then sum to the gradient of the loss that is backpropagated.
    """
    from opacus import GradSampleModule

    inner = _linear_head(W, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        module = GradSampleModule(inner, loss_reduction="sum")
        G, g = [], []
        for x_a, x_p in zip(anchors, positives):
            _info_nce_module(module, x_a, x_p).backward()
            G.append(inner.weight.grad_sample.sum(0))
            g.append(inner.bias.grad_sample.sum(0))
            module.zero_grad(set_to_none=True)
    return torch.stack(G), torch.stack(g)


def apply_per_batch(A: torch.Tensor, Z: torch.Tensor, G: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-batch materialization: ``T = A G_Bᵀ + g_B`` for all probes, separate reductions."""
    m = G.shape[0]
    norm = torch.linalg.vector_norm(Z, dim=1)
    zhat = Z / norm[:, None]
    sum_r = torch.zeros(A.shape[0])
    sum_sq = torch.zeros(A.shape[0])
    sum_u = torch.zeros(A.shape[0], G.shape[1])
    for B in range(m):
        T = torch.addmm(g[B], A, G[B].T)
        U = -T * norm[:, None]
        sum_r += (U * zhat).sum(1)
        sum_sq += (U * U).sum(1)
        sum_u += U
    mean = sum_u / m
    m2 = (mean * mean).sum(1)
    v2 = (sum_sq - m * m2) / (m - 1)
    return {"D": sum_r / m, "m2": m2, "V2": v2, "Q": m2 + v2}


class Phases:
    """Wall time per phase of one run; directions run with their own thread count.

    The direction phases are many tiny ops (a batch of pairs through the
    head); on a small shared machine, OpenMP barriers in such ops can stall for
    milliseconds each, which says nothing about either method. All methods
    therefore compute their directions with the same ``direction_threads``.
    """

    direction_threads = 1

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def directions(self, fn: Callable, *args: Any) -> Any:
        with threads(self.direction_threads):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds["directions"] = time.perf_counter() - t0

    def statistics(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds["statistics"] = time.perf_counter() - t0
        return out


def head_normfast(problem: HeadProblem, phases: Phases, **form: Any) -> dict[str, torch.Tensor]:
    """normfast head mode: backward per batch, then ``head_mode_stats`` with its defaults (the grouped form
    with error bars; ``form`` selects another: see :data:`HEAD_FORMS`), preparation included."""
    from normfast.ops import head_mode_stats

    W, b, A, Z, anchors, positives = problem
    G, g = phases.directions(head_directions_backward, W, b, anchors, positives)
    return phases.statistics(head_mode_stats, A, Z, G, g, **form)


def _per_sample_pipeline(directions: Callable) -> Callable[[HeadProblem, Phases], dict]:
    def run(problem: HeadProblem, phases: Phases) -> dict[str, torch.Tensor]:
        W, b, A, Z, anchors, positives = problem
        G, g = phases.directions(directions, W, b, anchors, positives)
        return phases.statistics(apply_per_batch, A, Z, G, g)

    run.__doc__ = f"per-sample gradients ({directions.__name__}) summed to G_B, then per-batch application"
    return run


#: method -> (run(problem, phases), its direction function, module to import, pip package)
HEAD_METHODS: dict[str, tuple[Callable, Callable, str | None, str | None]] = {
    "normfast": (head_normfast, head_directions_backward, None, None),
    "torch.func": (_per_sample_pipeline(head_directions_torch_func), head_directions_torch_func, None, None),
    "backpack": (
        _per_sample_pipeline(head_directions_backpack),
        head_directions_backpack,
        "backpack",
        "backpack-for-pytorch",
    ),
    "opacus": (_per_sample_pipeline(head_directions_opacus), head_directions_opacus, "opacus", "opacus"),
}


def head_flop_counts(n: int, d_in: int, d_out: int, m: int, pairs: int) -> dict[str, int]:
    """Multiply-add FLOPs (2 per MAC) of the head matmuls of each method; elementwise work not counted.

    A plain backward per batch costs the forward plus the weight gradient over
    both sides of the pairs; BackPACK and Opacus cost the same (their
    per-sample outer products are the weight gradient, unsummed); the
    per-row ``torch.func`` pipeline re-runs its batch for every loss row.
    """
    from normfast.ops import head_flops

    head = d_in * d_out
    backward = m * 4 * (2 * pairs) * head
    per_row = m * pairs * 4 * (2 * pairs) * head
    apply = 2 * n * m * (d_in + 1) * d_out  # A G_Bᵀ + g_B for every batch
    forms = head_flops(n, d_in, d_out, m, bias=True)
    return {
        "normfast": backward + forms["grouped"],
        "normfast S": backward + forms["S"],
        "normfast per-batch": backward + forms["per_batch"],
        "naive": backward + apply,
        "torch.func": per_row + apply,
        "backpack": backward + apply,
        "opacus": backward + apply,
    }


def _head_sub(problem: HeadProblem, n: int) -> HeadProblem:
    return problem._replace(A=problem.A[:n], Z=problem.Z[:n])


def _head_reference(problem: HeadProblem, G: torch.Tensor, g: torch.Tensor) -> dict:
    """Every ``t_i^B = -(G_B a_i + g_B)`` materialized in float64 from the given fp32 directions.

    All methods start from fp32 gradients of the same loss; their rounding is
    checked separately (``G_B`` checks), so this reference isolates the error
    of each method's statistics.
    """
    from normfast.core.reference import brute_force_stats

    T = -(torch.einsum("bji,ni->bnj", G.double(), problem.A.double()) + g.double()[:, None, :])
    return brute_force_stats(T, problem.Z.double(), "u")


def _grouped_reference(problem: HeadProblem, G: torch.Tensor, g: torch.Tensor) -> dict:
    """The grouped estimators (the default's error bars) from every ``t_i^B`` in float64."""
    from normfast.core.reference import brute_force_grouped
    from normfast.engine.estimators.uncertainty import DEFAULT_GROUPS, effective_groups

    T = -(torch.einsum("bji,ni->bnj", G.double(), problem.A.double()) + g.double()[:, None, :])
    return brute_force_grouped(T, problem.Z.double(), effective_groups(DEFAULT_GROUPS, G.shape[0]), "u")


def run_head(s: HeadSettings, progress: bool = True) -> dict[str, Any]:
    from normfast.core.reference import stat_errors

    problem = make_head_problem(s.n, s.dim, s.dim, s.m, s.pairs)
    methods, skipped = {}, {}
    for name, (fn, directions, module, package) in HEAD_METHODS.items():
        if module is not None:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                skipped[name] = f"{package} is not installed ({exc}); pip install 'normfast[bench]'"
                continue
        methods[name] = (fn, directions)

    # accuracy first: statistics vs float64 on a subset, summed per-sample gradients vs G_B
    n_check = min(s.check, s.n)
    sub = _head_sub(problem, n_check)
    G_ref, g_ref = head_directions_backward(*problem[:2], *problem[4:])
    want = _head_reference(sub, G_ref, g_ref)
    checks, errors = [], {}
    for name, (fn, directions) in methods.items():
        errors[name] = stat_errors(fn(sub, Phases()), want, list(HEAD_KEYS))
        if name == "normfast":  # its error bars against a float64 brute force of the grouped estimators
            grouped = _grouped_reference(sub, G_ref, g_ref)
            errors["normfast error bars"] = stat_errors(fn(sub, Phases()), grouped, ["se_D", "se_V2", "se_Q"])
            checks.append(
                accuracy_check(
                    "head/normfast/error_bars",
                    max(errors["normfast error bars"].values()),
                    s.tolerance,
                    f"float64 brute force of the grouped estimators, first {n_check} probes",
                )
            )
        checks.append(
            accuracy_check(
                f"head/{name}",
                max(errors[name].values()),
                s.tolerance,
                f"float64 brute force from the fp32 G_B, first {n_check} probes",
            )
        )
        if name != "normfast":
            G, g = directions(*problem[:2], *problem[4:])
            diff = max(rel_diff(G, G_ref), rel_diff(g, g_ref))
            checks.append(
                accuracy_check(f"head/{name}/G_B", diff, s.g_tolerance, "G_B, g_B of one plain backward per batch")
            )
    failed = {c["check"].split("/")[1] for c in checks if not c["passed"]}

    timed = {name: fn for name, (fn, _) in methods.items() if name not in failed}
    if "normfast" in timed:  # the other forms, and every form's GEMM floor (timed from G_B on)
        for label, form in (("normfast S", "S"), ("normfast per-batch", "per_batch")):
            timed[label] = lambda problem, ph, kw=HEAD_FORMS[form]: head_normfast(problem, ph, **kw)
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in timed}
    outputs: dict[str, dict] = {}

    def runner(name: str) -> Callable[[], None]:
        def go() -> None:
            ph = Phases()
            outputs[name] = timed[name](problem, ph)
            phases[name].append(ph.seconds)

        return go

    floors = {f"floor {form}": gemm_floor(problem.A, form, s.dim, s.m) for form in HEAD_FORMS}
    fast = {name: s.fast_runs for name in ("normfast", "normfast S", *floors)}
    times = time_rounds(
        {**{name: runner(name) for name in timed}, **floors}, s.repeats, fast, desc="head", progress=progress
    )
    floor_times = {name: times.pop(name) for name in floors}
    seconds = {}
    for name, ts in times.items():
        seconds[name] = percentiles(ts)
        seconds[name]["phases_median"] = {k: float(np.median([p[k] for p in phases[name]])) for k in phases[name][0]}
    agreement = {
        name: stat_errors(outputs[name], outputs["normfast"], list(HEAD_KEYS))
        for name in outputs
        if name != "normfast" and "normfast" in outputs
    }
    flops = {k: v for k, v in head_flop_counts(s.n, s.dim, s.dim, s.m, s.pairs).items() if k in timed}
    base = seconds.get("normfast", {}).get("p50")
    ratios = {
        f"normfast_vs_{name}": seconds[name]["p50"] / base
        for name in seconds
        if not name.startswith("normfast") and base
    }
    # every normfast form: its statistics time (from G_B on) against the time of the GEMMs it needs
    stat_p50 = {name: seconds[name]["phases_median"]["statistics"] for name in seconds if name.startswith("normfast")}
    vs_floor = {
        name: stat_p50[name] / float(np.median(floor_times[f"floor {form}"]))
        for name, form in (("normfast", "grouped"), ("normfast S", "S"), ("normfast per-batch", "per_batch"))
        if name in stat_p50
    }
    return {
        "what": "heat/drift statistics (D, m2, V2, Q) of a linear head over N probes from M virtual "
        "InfoNCE batches; normfast = backward per batch + head_stats with its defaults (the grouped "
        "form, with error bars), and its bare S and per-batch forms as separate rows; each baseline = "
        "per-sample gradients summed to G_B, then t = -(G_B a + g_B) materialized per batch",
        "config": {
            **asdict(s),
            "d_in": s.dim,
            "d_out": s.dim,
            "dtype": "float32",
            "bias": True,
            "form": "grouped (default)",
            "direction_threads": Phases.direction_threads,
        },
        "environment": environment(),
        "skipped": skipped,
        "accuracy": checks,
        "accuracy_errors": errors,
        "full_size_agreement_with_normfast": agreement,
        "seconds": seconds,
        "items": s.n,
        "items_per_s": {name: throughput(ts, s.n) for name, ts in times.items()},
        "ratios": ratios,
        "statistics_vs_gemm_floor": vs_floor,
        "gemm_floor_seconds": {name: percentiles(ts) for name, ts in floor_times.items()},
        "flops": flops,
        "flop_ratios": {
            f"normfast_vs_{k}": v / flops["normfast"]
            for k, v in flops.items()
            if k != "normfast" and "normfast" in flops
        },
        "gflop_per_s": {k: flops[k] / seconds[k]["p50"] / 1e9 for k in flops},
        "see_also": "python -m bench run head_stats (plain-backward per-batch baseline, 10^6-probe memory)",
    }
