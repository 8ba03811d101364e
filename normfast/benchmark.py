"""``normfast bench``: the probe-throughput suite.

Four sections, each a set of comparisons measured in the same process on the
same data. Before anything is timed, every method's output is checked against
a reference (a float64 brute force, or the other methods); the largest
scale-relative difference is recorded next to its tolerance, and a method
that fails its check is not timed. Timings are repeated with the methods
interleaved round by round, so that load drifting on a shared machine hits
all of them alike; the JSON keeps p20/p50/p80 and every run. A speed-up is
the ratio of medians of two methods of the same run; absolute times describe
this machine only.

``head``
    Heat and drift statistics of a linear head ``z = W a + b`` over ``N``
    probes from ``M`` virtual InfoNCE batches. normfast: one ordinary backward
    per batch gives ``G_B``, then :func:`normfast.ops.head_stats` in the S
    form. Against the pipelines a researcher would otherwise assemble from
    per-sample-gradient tools -- ``torch.func`` (``vmap(grad)`` over the
    per-row loss terms), BackPACK (``BatchGrad``) and Opacus
    (``GradSampleModule``) -- each producing per-sample head gradients, summed
    per batch to ``G_B`` and applied to every probe (``t = -(G_B a + g_B)``
    materialized batch by batch and reduced).
``jacrev``
    jvp mode against per-probe Jacobians on a small MLP: normfast's
    :class:`normfast.transmission.Tail` (all ``M`` directions in one
    ``vmap``'d forward-mode pass) vs ``vmap(jacrev)`` materializing ``J_i``
    for every probe and applying it to each direction. Both feed the same
    :class:`normfast.ops.ProbeAccumulator`.
``minilm``
    Token-level jvp through the last layer of the real all-MiniLM-L6-v2 over
    common words: K directions per ``vmap``'d pass with the frozen front
    cached once per chunk, vs two meanings of "sequential": (a) the same
    cached front, one direction per pass (isolates batching), (b) one
    ``torch.func.jvp`` per direction through the whole model (re-running the
    frozen front every time). Also the token throughput of the full engine
    (:func:`normfast.probe.probe`, directions included) and of the
    transmission alone.
``scaling``
    The engine (head mode, token-level, Parquet output) as the number of
    token rows grows; each size runs in a fresh process, which reports its
    wall time and peak resident memory. (The 10^7-token run is
    ``bench/streaming.py``.)

Results go to ``OUT/bench.json`` (and ``OUT/jvp_minilm.json``) with figures
``OUT/bench_*.png``. With ``--only`` an existing ``bench.json`` of the same
kind (quick or full) keeps its other sections.
"""
from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from normfast.encoders import ModuleEncoder

SECTIONS = ("head", "jacrev", "minilm", "scaling")
#: ``--only`` aliases
SECTION_GROUPS = {"jvp": ("jacrev", "minilm")}
#: probed parameters of the MiniLM section: the last transformer layer
MINILM_LAYER = r"encoder\.layer\.5\."
#: InfoNCE temperature of the head section's virtual batches
TAU = 0.05
HEAD_KEYS = ("D", "m2", "V2", "Q")
JVP_KEYS = ("D", "se_D", "m2", "V2", "Q")
_VERSIONED = ("normfast", "torch", "numpy", "transformers", "pyarrow", "triton",
              "backpack-for-pytorch", "opacus", "pytest-benchmark")


# ============================================================================
# Settings (full and quick)
# ============================================================================


@dataclass
class HeadSettings:
    n: int = 100_000           # probes
    dim: int = 384             # d_in = d_out of the head
    m: int = 64                # virtual batches
    pairs: int = 32            # anchor/positive pairs per batch
    repeats: int = 3           # rounds; each runs every method
    fast_runs: int = 3         # normfast runs per round (its runs are short)
    check: int = 2000          # probes checked against the float64 brute force
    tolerance: float = 1e-4    # scale-relative, statistics vs float64
    g_tolerance: float = 1e-5  # relative, sum of per-sample gradients vs the backward's G_B


@dataclass
class JacrevSettings:
    widths: tuple[int, ...] = (32, 128, 128, 32)
    n: int = 2048
    chunk: int = 64
    m: int = 16
    pairs: int = 512
    batch_size: int = 32
    repeats: int = 3
    check: int = 256
    tolerance: float = 1e-4
    threads: int = 1           # many small matmuls: one thread is faster and steadier


@dataclass
class MiniLMSettings:
    words: int = 256           # words of the batched-vs-sequential comparison
    engine_words: int = 1024   # words of the throughput figures
    chunk: int = 128           # words per chunk (the engine's chunk_size)
    m: int = 16
    k: int = 16                # directions per vmap'd pass
    batch_size: int = 32
    repeats: int = 3
    check_directions: int = 2  # directions compared against the float64 model
    tolerance: float = 1e-4    # scale-relative, transmissions


@dataclass
class ScalingSettings:
    sizes: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)   # token rows
    tokens_per_item: int = 32
    dim: int = 384
    vocab: int = 4096
    m: int = 16
    batch_size: int = 32
    chunk: int = 256           # items per chunk
    pairs: int = 4096


@dataclass
class Settings:
    head: HeadSettings = field(default_factory=HeadSettings)
    jacrev: JacrevSettings = field(default_factory=JacrevSettings)
    minilm: MiniLMSettings = field(default_factory=MiniLMSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)

    @classmethod
    def quick(cls) -> "Settings":
        """Tiny sizes: every code path and check, in seconds (used by the tests)."""
        return cls(
            head=HeadSettings(n=2000, dim=32, m=6, pairs=8, repeats=2, fast_runs=1, check=500),
            jacrev=JacrevSettings(widths=(8, 16, 16, 8), n=64, chunk=32, m=4, pairs=64,
                                  batch_size=8, repeats=2, check=32),
            minilm=MiniLMSettings(words=6, engine_words=12, chunk=6, m=3, k=3, batch_size=8,
                                  repeats=1, check_directions=1),
            scaling=ScalingSettings(sizes=(1_000, 4_000), tokens_per_item=16, dim=32, vocab=512,
                                    m=4, batch_size=8, chunk=64, pairs=256),
        )


# ============================================================================
# Shared measurement helpers
# ============================================================================


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({cpu_model()}, {os.cpu_count()} cores)"


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in _VERSIONED:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def environment() -> dict[str, Any]:
    """Device, library versions and thread count of this process, for every JSON."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"device": device_name(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "versions": library_versions(),
            "load_average": list(load) if load else None}


def percentiles(times: Sequence[float]) -> dict[str, Any]:
    """p20/p50/p80 of repeated timings (seconds), plus every run."""
    q = np.percentile(np.asarray(times, dtype=float), [20, 50, 80])
    return {"p20": float(q[0]), "p50": float(q[1]), "p80": float(q[2]),
            "runs": [float(t) for t in times]}


def throughput(times: Sequence[float], items: int) -> dict[str, float]:
    """Items per second at the p20/p50/p80 of throughput (the p80/p50/p20 of time)."""
    q = np.percentile(np.asarray(times, dtype=float), [80, 50, 20])
    return {"p20": float(items / q[0]), "p50": float(items / q[1]), "p80": float(items / q[2])}


def peak_rss_mb() -> float:
    """High-water mark of this process's resident memory, in MB.

    ``/proc/self/status`` VmHWM belongs to the current address space, so it is
    not inherited from the parent across fork + exec (``ru_maxrss`` can be).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def accuracy_check(name: str, max_rel_diff: float, tolerance: float, against: str) -> dict[str, Any]:
    """One accuracy record; NaN or inf never passes."""
    value = float(max_rel_diff)
    return {"check": name, "max_rel_diff": value, "tolerance": float(tolerance),
            "passed": bool(math.isfinite(value) and value <= tolerance), "against": against}


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (scale-relative over the whole tensor)."""
    got, want = got.detach().double(), want.detach().double()
    scale = float(want.abs().max())
    return float((got - want).abs().max()) / scale if scale > 0 else float((got - want).abs().max())


def time_rounds(methods: dict[str, Callable[[], Any]], repeats: int,
                runs_per_round: dict[str, int] | None = None, *, desc: str = "timing",
                progress: bool = True) -> dict[str, list[float]]:
    """Wall time of each method, interleaved: every round runs every method."""
    runs_per_round = runs_per_round or {}
    total = repeats * sum(runs_per_round.get(name, 1) for name in methods)
    times: dict[str, list[float]] = {name: [] for name in methods}
    with tqdm(total=total, desc=desc, unit="run", disable=not progress, leave=False) as bar:
        for _ in range(repeats):
            for name, fn in methods.items():
                for _ in range(runs_per_round.get(name, 1)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    bar.update()
    return times


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matmul-class ops ``fn`` runs (``torch.utils.flop_counter``)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


class _threads:
    """Run a block with ``n`` torch threads (0: unchanged)."""

    def __init__(self, n: int):
        self.n = n
        self.saved = torch.get_num_threads()

    def __enter__(self) -> "_threads":
        if self.n:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.saved)


# ============================================================================
# Section "head": head mode vs per-sample-gradient tools
# ============================================================================


class HeadProblem(NamedTuple):
    """A linear head, probe activations, embeddings and M virtual batches of pairs."""

    W: torch.Tensor          # [d_out, d_in]
    b: torch.Tensor          # [d_out]
    A: torch.Tensor          # [N, d_in] probe activations
    Z: torch.Tensor          # [N, d_out] probe embeddings, Z = A Wᵀ + b
    anchors: torch.Tensor    # [M, pairs, d_in]
    positives: torch.Tensor  # [M, pairs, d_in]


def make_head_problem(n: int, d_in: int, d_out: int, m: int, pairs: int, seed: int = 0) -> HeadProblem:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
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


def head_directions_backward(W: torch.Tensor, b: torch.Tensor, anchors: torch.Tensor,
                             positives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``G_B, g_B`` from one ordinary backward of the mean batch loss per batch."""
    Wp, bp = W.clone().requires_grad_(True), b.clone().requires_grad_(True)
    G, g = [], []
    for x_a, x_p in zip(anchors, positives):
        gw, gb = torch.autograd.grad(info_nce_rows(Wp, bp, x_a, x_p).mean(), (Wp, bp))
        G.append(gw)
        g.append(gb)
    return torch.stack(G), torch.stack(g)


def head_directions_torch_func(W: torch.Tensor, b: torch.Tensor, anchors: torch.Tensor,
                               positives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``G_B, g_B`` as sums of per-sample (per loss row) gradients, ``vmap(grad)``."""
    pairs = anchors.shape[1]

    def row_loss(Wr, br, x_a, x_p, pick):
        # pick is a one-hot row selector: the loss term of one anchor row
        return (info_nce_rows(Wr, br, x_a, x_p) * pick).sum() / pairs

    per_row = torch.func.vmap(torch.func.grad(row_loss, argnums=(0, 1)),
                              in_dims=(None, None, None, None, 0))
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


def head_directions_backpack(W: torch.Tensor, b: torch.Tensor, anchors: torch.Tensor,
                             positives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def head_directions_opacus(W: torch.Tensor, b: torch.Tensor, anchors: torch.Tensor,
                           positives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        with _threads(self.direction_threads):
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


def head_normfast(problem: HeadProblem, phases: Phases) -> dict[str, torch.Tensor]:
    """normfast head mode: backward per batch, then the S form (centering and ``S_c`` included)."""
    from normfast.ops import head_stats

    W, b, A, Z, anchors, positives = problem
    G, g = phases.directions(head_directions_backward, W, b, anchors, positives)
    return phases.statistics(head_stats, A, Z, G, g, form="S", radial_spread=False)


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
    "torch.func": (_per_sample_pipeline(head_directions_torch_func), head_directions_torch_func,
                   None, None),
    "backpack": (_per_sample_pipeline(head_directions_backpack), head_directions_backpack,
                 "backpack", "backpack-for-pytorch"),
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
    apply = 2 * n * m * (d_in + 1) * d_out          # A G_Bᵀ + g_B for every batch
    s_form = head_flops(n, d_in, d_out, m, bias=True)["S"]
    return {"normfast": backward + s_form, "naive": backward + apply,
            "torch.func": per_row + apply, "backpack": backward + apply, "opacus": backward + apply}


def _head_sub(problem: HeadProblem, n: int) -> HeadProblem:
    return problem._replace(A=problem.A[:n], Z=problem.Z[:n])


def _head_reference(problem: HeadProblem, G: torch.Tensor, g: torch.Tensor) -> dict:
    """Every ``t_i^B = -(G_B a_i + g_B)`` materialized in float64 from the given fp32 directions.

    All methods start from fp32 gradients of the same loss; their rounding is
    checked separately (``G_B`` checks), so this reference isolates the error
    of each method's statistics.
    """
    from normfast.reference import brute_force_stats

    T = -(torch.einsum("bji,ni->bnj", G.double(), problem.A.double()) + g.double()[:, None, :])
    return brute_force_stats(T, problem.Z.double(), "u")


def run_head(s: HeadSettings, progress: bool = True) -> dict[str, Any]:
    from normfast.reference import stat_errors

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
        checks.append(accuracy_check(f"head/{name}", max(errors[name].values()), s.tolerance,
                                     f"float64 brute force from the fp32 G_B, first {n_check} probes"))
        if name != "normfast":
            G, g = directions(*problem[:2], *problem[4:])
            diff = max(rel_diff(G, G_ref), rel_diff(g, g_ref))
            checks.append(accuracy_check(f"head/{name}/G_B", diff, s.g_tolerance,
                                         "G_B, g_B of one plain backward per batch"))
    failed = {c["check"].split("/")[1] for c in checks if not c["passed"]}

    timed = {name: fn for name, (fn, _) in methods.items() if name not in failed}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in timed}
    outputs: dict[str, dict] = {}

    def runner(name: str) -> Callable[[], None]:
        def go() -> None:
            ph = Phases()
            outputs[name] = timed[name](problem, ph)
            phases[name].append(ph.seconds)
        return go

    times = time_rounds({name: runner(name) for name in timed}, s.repeats,
                        {"normfast": s.fast_runs}, desc="head", progress=progress)
    seconds = {}
    for name, ts in times.items():
        seconds[name] = percentiles(ts)
        seconds[name]["phases_median"] = {k: float(np.median([p[k] for p in phases[name]]))
                                          for k in phases[name][0]}
    agreement = {name: stat_errors(outputs[name], outputs["normfast"], list(HEAD_KEYS))
                 for name in outputs if name != "normfast" and "normfast" in outputs}
    flops = {k: v for k, v in head_flop_counts(s.n, s.dim, s.dim, s.m, s.pairs).items() if k in timed}
    base = seconds.get("normfast", {}).get("p50")
    ratios = {f"normfast_vs_{name}": seconds[name]["p50"] / base
              for name in seconds if name != "normfast" and base}
    return {
        "what": "heat/drift statistics (D, m2, V2, Q) of a linear head over N probes from M virtual "
                "InfoNCE batches; normfast = backward per batch + head_stats S form; each baseline = "
                "per-sample gradients summed to G_B, then t = -(G_B a + g_B) materialized per batch",
        "config": {**asdict(s), "d_in": s.dim, "d_out": s.dim, "dtype": "float32", "bias": True,
                   "form": "S", "direction_threads": Phases.direction_threads},
        "environment": environment(),
        "skipped": skipped,
        "accuracy": checks,
        "accuracy_errors": errors,
        "full_size_agreement_with_normfast": agreement,
        "seconds": seconds,
        "items": s.n,
        "items_per_s": {name: throughput(ts, s.n) for name, ts in times.items()},
        "ratios": ratios,
        "flops": flops,
        "flop_ratios": {f"normfast_vs_{k}": v / flops["normfast"] for k, v in flops.items()
                        if k != "normfast" and "normfast" in flops},
        "gflop_per_s": {k: flops[k] / seconds[k]["p50"] / 1e9 for k in flops},
        "see_also": "bench/head_stats.py (plain-backward per-batch baseline, 10^6-probe memory)",
    }


# ============================================================================
# Section "jacrev": jvp mode vs per-probe Jacobians on a small model
# ============================================================================


def mlp_encoder(widths: Sequence[int], seed: int = 0,
                dtype: torch.dtype = torch.float32) -> "ModuleEncoder":
    """A tanh MLP as a :class:`~normfast.encoders.ModuleEncoder` (no head: jvp mode)."""
    from normfast.encoders import ModuleEncoder

    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = [torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh())
                                     for a, b in zip(widths[:-2], widths[1:-1])]
    blocks.append(torch.nn.Linear(widths[-2], widths[-1]))
    return ModuleEncoder(blocks, head=False).to(dtype).eval()


def _concat_stats(parts: list[dict]) -> dict:
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "M"}
    out["M"] = parts[0]["M"]
    return out


def _jvp_normfast(encoder, tangents: dict[str, torch.Tensor], X: torch.Tensor, chunk: int, k: int) -> dict:
    """normfast's path: the chunk's primal, then K directions per vmap'd jvp pass, accumulated."""
    from normfast.ops import ProbeAccumulator
    from normfast.transmission import Tail

    names = list(tangents)
    tail = Tail(encoder, names, 0, "pooled")
    m = next(iter(tangents.values())).shape[0]
    parts = []
    for lo in range(0, X.shape[0], chunk):
        front = encoder.prepare(X[lo:lo + chunk])
        z = tail.primal(front, None)
        acc = ProbeAccumulator(z.shape[0], z.shape[1], dtype=torch.float64)
        for d0 in range(0, m, k):
            group = {n: t[d0:d0 + k] for n, t in tangents.items()}
            acc.update(-tail.jvp(front, group, None), z)
        parts.append(acc.finalize())
    return _concat_stats(parts)


def _jvp_jacrev(encoder, tangents: dict[str, torch.Tensor], X: torch.Tensor, chunk: int) -> dict:
    """Naive: materialize ``J_i`` of every probe (``vmap(jacrev)``), apply it to each direction."""
    from torch.func import functional_call, jacrev, vmap

    from normfast.ops import ProbeAccumulator

    params = {n: encoder.get_parameter(n).detach() for n in tangents}
    flat_tangents = {n: t.flatten(1) for n, t in tangents.items()}

    def one_probe(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(encoder, p, ({"x": x[None]},))[0]

    jacobians = vmap(jacrev(one_probe), in_dims=(None, 0))
    parts = []
    for lo in range(0, X.shape[0], chunk):
        x = X[lo:lo + chunk]
        with torch.no_grad():
            z = encoder(encoder.prepare(x))
        J = jacobians(params, x)                     # {name: [n, d, *shape]}
        t = sum(torch.einsum("ndp,mp->mnd", J[n].flatten(2), flat_tangents[n]) for n in J)
        acc = ProbeAccumulator(z.shape[0], z.shape[1], dtype=torch.float64)
        acc.update(-t, z)
        parts.append(acc.finalize())
    return _concat_stats(parts)


def _mlp_directions(encoder, s: JacrevSettings, seed: int = 0):
    from normfast.directions import OptimizerPreset, compute_directions
    from normfast.objectives import InfoNCE
    from normfast.pairs import PairSource, virtual_batches

    g = torch.Generator().manual_seed(seed + 1)
    anchors = torch.randn(s.pairs, s.widths[0], generator=g, dtype=encoder_dtype(encoder))
    positives = anchors + 0.3 * torch.randn(anchors.shape, generator=g, dtype=anchors.dtype)
    pairs = PairSource.from_iterable(list(zip(anchors, positives)), kind="pairs")
    names = [n for n, _ in encoder.named_parameters()]
    presets = {n: OptimizerPreset("sgd") for n in names}
    batches = virtual_batches(s.pairs, s.m, s.batch_size, seed)
    dirs = compute_directions(encoder, InfoNCE(), pairs, names, presets, batches, seed=seed,
                              progress=False)
    return dirs.stacked(list(range(s.m)), "u")


def encoder_dtype(encoder: torch.nn.Module) -> torch.dtype:
    return next(encoder.parameters()).dtype


def run_jacrev(s: JacrevSettings, progress: bool = True) -> dict[str, Any]:
    from normfast.reference import brute_force_stats, stat_errors
    from normfast.transmission import Tail

    with _threads(s.threads):
        encoder = mlp_encoder(s.widths)
        tangents = _mlp_directions(encoder, s)
        X = torch.randn(s.n, s.widths[0], generator=torch.Generator().manual_seed(7))
        k = s.m
        methods = {"normfast": lambda x: _jvp_normfast(encoder, tangents, x, s.chunk, k),
                   "jacrev": lambda x: _jvp_jacrev(encoder, tangents, x, s.chunk)}

        # float64 brute force: the same model and directions in double, every t materialized
        n_check = min(s.check, s.n)
        enc64 = copy.deepcopy(encoder).double()
        tan64 = {n: t.double() for n, t in tangents.items()}
        front = enc64.prepare(X[:n_check].double())
        tail64 = Tail(enc64, list(tangents), 0, "pooled")
        want = brute_force_stats(-tail64.jvp(front, tan64, None), tail64.primal(front, None), "u")
        checks, errors = [], {}
        for name, fn in methods.items():
            errors[name] = stat_errors(fn(X[:n_check]), want, list(JVP_KEYS))
            checks.append(accuracy_check(f"jacrev/{name}", max(errors[name].values()), s.tolerance,
                                         f"float64 brute force, first {n_check} probes"))
        failed = {c["check"].split("/")[1] for c in checks if not c["passed"]}
        timed = {name: fn for name, fn in methods.items() if name not in failed}
        flops = {name: count_flops(lambda fn=fn: fn(X[:s.chunk])) * (s.n / min(s.chunk, s.n))
                 for name, fn in timed.items()}
        times = time_rounds({name: (lambda fn=fn: fn(X)) for name, fn in timed.items()}, s.repeats,
                            desc="jacrev", progress=progress)
        env = environment()
    seconds = {name: percentiles(ts) for name, ts in times.items()}
    n_params = sum(t[0].numel() for t in tangents.values())
    base = seconds.get("normfast", {}).get("p50")
    return {
        "what": "per-probe statistics (D, se_D, m2, V2, Q) of a tanh MLP over all its parameters; "
                "normfast = M directions per vmap'd forward-mode pass (Tail.jvp); naive = per-probe "
                "Jacobians by vmap(jacrev), applied to each direction; both accumulate the same way",
        "config": {**asdict(s), "parameters": n_params, "directions_per_pass": k},
        "environment": env,
        "accuracy": checks,
        "accuracy_errors": errors,
        "seconds": seconds,
        "items": s.n,
        "items_per_s": {name: throughput(ts, s.n) for name, ts in times.items()},
        "ratios": {"normfast_vs_jacrev": seconds["jacrev"]["p50"] / base}
        if base and "jacrev" in seconds else {},
        "flops": {k_: int(v) for k_, v in flops.items()},
        "flop_ratios": {"normfast_vs_jacrev": flops["jacrev"] / flops["normfast"]}
        if len(flops) == 2 else {},
        "flops_note": "matmul-class ops counted by torch.utils.flop_counter on one chunk, scaled by "
                      "the number of chunks",
    }


# ============================================================================
# Section "minilm": batched vs sequential directions, engine throughput
# ============================================================================


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _engine_batches(n_items: int, m: int, batch_size: int, seed: int) -> list[np.ndarray]:
    # the engine draws its virtual batches with this seed (normfast.probe)
    from normfast.pairs import virtual_batches

    rng = np.random.default_rng(seed)
    return virtual_batches(n_items, m, batch_size, int(rng.integers(2**31)))


class _MiniLMWork:
    """The cached pieces of the MiniLM section: model, directions, tokenized chunks."""

    def __init__(self, s: MiniLMSettings):
        from normfast.datasets import top_words
        from normfast.directions import OptimizerPreset, compute_directions, resolve_parameters
        from normfast.encoders import load_encoder
        from normfast.objectives import SimCSE
        from normfast.pairs import PairSource
        from normfast.transmission import Tail

        self.s = s
        self.encoder = load_encoder("minilm")
        self.encoder.eval()
        self.names = resolve_parameters(self.encoder, MINILM_LAYER)
        stage_of = self.encoder.stage_of_parameters()
        self.cut = min(stage_of[n] for n in self.names)
        self.engine_words = top_words(s.engine_words)
        self.words = self.engine_words[:s.words]
        # the directions the engine itself computes for the engine words (same batches, seed)
        pairs = PairSource.from_iterable(self.engine_words, kind="items")
        presets = {n: OptimizerPreset("sgd") for n in self.names}
        t0 = time.perf_counter()
        dirs = compute_directions(self.encoder, SimCSE(), pairs, self.names, presets,
                                  _engine_batches(len(pairs), s.m, s.batch_size, 0), cut=self.cut,
                                  seed=0, progress=False)
        self.directions_seconds = time.perf_counter() - t0
        self.tangents = dirs.stacked(list(range(s.m)), "u")
        self.params = {n: self.encoder.get_parameter(n).detach() for n in self.names}
        self.tail = Tail(self.encoder, self.names, self.cut, "tokens")
        self.states = [self.encoder.prepare(list(c)) for c in _chunks(self.words, s.chunk)]
        self.engine_states = [self.encoder.prepare(list(c)) for c in _chunks(self.engine_words, s.chunk)]
        self.tokens = sum(int(st["mask"].sum()) for st in self.states)
        self.engine_tokens = sum(int(st["mask"].sum()) for st in self.engine_states)

    def front(self, state: dict) -> dict:
        with torch.no_grad():
            return self.encoder(state, 0, self.cut)

    def direction(self, k: int) -> dict[str, torch.Tensor]:
        return {n: t[k:k + 1] for n, t in self.tangents.items()}

    # -- the three transmissions of one chunk -> [M, n_tokens, d] -------------------
    def groups(self) -> list[dict[str, torch.Tensor]]:
        """The M directions in groups of K (one vmap'd pass each)."""
        k = self.s.k
        return [{n: t[d0:d0 + k] for n, t in self.tangents.items()} for d0 in range(0, self.s.m, k)]

    def batched(self, state: dict) -> torch.Tensor:
        front, rows = self.front(state), state["mask"].bool()
        return torch.cat([self.tail.jvp(front, group, rows) for group in self.groups()])

    def sequential_cached(self, state: dict) -> torch.Tensor:
        front, rows = self.front(state), state["mask"].bool()
        return torch.cat([self.tail.jvp(front, self.direction(k), rows) for k in range(self.s.m)])

    def sequential_full(self, state: dict) -> torch.Tensor:
        from torch.func import functional_call, jvp

        from normfast.encoders import forward_ad_safe

        rows = state["mask"].bool()
        enc = self.encoder

        def whole_model(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(enc, p, (state,), {"start": 0, "output": "tokens"}, strict=False)

        outs = []
        with forward_ad_safe(), torch.no_grad():
            for k in range(self.s.m):
                tangent = {n: t[k] for n, t in self.tangents.items()}
                outs.append(jvp(whole_model, (self.params,), (tangent,))[1][rows])
        return torch.stack(outs)


def _float64_transmission(work: _MiniLMWork, state: dict, n_dir: int) -> torch.Tensor:
    from normfast.transmission import Tail

    enc64 = copy.deepcopy(work.encoder).double()
    tail64 = Tail(enc64, work.names, work.cut, "tokens")
    with torch.no_grad():
        front = enc64(state, 0, work.cut)
    tangents = {n: t[:n_dir].double() for n, t in work.tangents.items()}
    return tail64.jvp(front, tangents, state["mask"].bool())


def _engine_consistency(work: _MiniLMWork, result: Any) -> dict[str, Any]:
    """The engine's statistics of the first chunk vs those accumulated from the batched transmission."""
    from normfast.ops import ProbeAccumulator
    from normfast.reference import stat_errors

    state = work.engine_states[0]
    rows = state["mask"].bool()
    with torch.no_grad():
        z = work.tail.primal(work.front(state), rows)
    acc = ProbeAccumulator(z.shape[0], z.shape[1], dtype=torch.float64)
    acc.update(-work.batched(state), z)
    want = acc.finalize()
    n = z.shape[0]
    got = {k: torch.as_tensor(result.column(k)[:n]) for k in JVP_KEYS}
    errors = stat_errors(got, want, list(JVP_KEYS))
    return {"max_rel_diff": max(errors.values()), "errors": errors,
            "note": "engine output rows of the first chunk vs ProbeAccumulator fed by the batched "
                    "transmission timed here (same directions): the figures measure the engine's "
                    "own computation"}


def run_minilm(s: MiniLMSettings, progress: bool = True) -> dict[str, Any]:
    from normfast.probe import ProbeConfig, probe

    work = _MiniLMWork(s)
    first = work.states[0]
    # accuracy: every transmission of the first chunk, and the batched one vs float64
    outs = {"batched": work.batched(first), "sequential_cached": work.sequential_cached(first),
            "sequential_full": work.sequential_full(first)}
    ref64 = _float64_transmission(work, first, s.check_directions)
    checks = [accuracy_check("minilm/batched/float64", rel_diff(outs["batched"][:s.check_directions], ref64),
                             s.tolerance, f"float64 model, first chunk, {s.check_directions} directions")]
    for name in ("sequential_cached", "sequential_full"):
        checks.append(accuracy_check(f"minilm/{name}", rel_diff(outs[name], outs["batched"]), s.tolerance,
                                     "batched transmission, first chunk, all directions"))
        checks.append(accuracy_check(f"minilm/{name}/float64",
                                     rel_diff(outs[name][:s.check_directions], ref64), s.tolerance,
                                     f"float64 model, first chunk, {s.check_directions} directions"))
    failed = {c["check"].split("/")[1] for c in checks if not c["passed"]}
    del outs, ref64

    methods = {"batched": work.batched, "sequential_cached": work.sequential_cached,
               "sequential_full": work.sequential_full}
    methods = {k: v for k, v in methods.items() if k not in failed}
    flops_first = {name: count_flops(lambda fn=fn: fn(first)) for name, fn in methods.items()}
    times = time_rounds({name: (lambda fn=fn: [fn(st) for st in work.states]) for name, fn in methods.items()},
                        s.repeats, desc="minilm: batched vs sequential", progress=progress)
    seconds = {name: percentiles(ts) for name, ts in times.items()}
    base = seconds.get("batched", {}).get("p50")
    ratios = {f"batched_vs_{name}": seconds[name]["p50"] / base for name in seconds
              if name != "batched" and base}

    # throughput: the full engine (directions included) and the transmission alone
    config = ProbeConfig(params=MINILM_LAYER, mode="jvp", output="tokens", optimizer="sgd",
                         batches=s.m, batch_size=s.batch_size, seed=0, chunk_size=s.chunk,
                         directions_per_pass=s.k)
    fronts = [(work.front(st), st["mask"].bool()) for st in work.engine_states]
    groups = work.groups()

    def engine() -> Any:
        return probe(work.encoder, work.engine_words, "simcse", None, copy.deepcopy(config),
                     progress=False, model_name="all-MiniLM-L6-v2")

    def transmission() -> None:
        for front, rows in fronts:
            for group in groups:
                work.tail.jvp(front, group, rows)

    checked = engine()  # warm-up, and the run whose rows are checked
    consistency = _engine_consistency(work, checked)
    rows_engine = len(checked)
    del checked
    thr_times = time_rounds({"engine": engine, "transmission": transmission}, s.repeats,
                            desc="minilm: throughput", progress=progress)
    env = environment()
    engine_tps = throughput(thr_times["engine"], rows_engine)
    trans_tps = throughput(thr_times["transmission"], work.engine_tokens)
    transmission_flops = count_flops(lambda: [work.tail.jvp(fronts[0][0], g, fronts[0][1]) for g in groups])
    summary = {
        "model": "all-MiniLM-L6-v2", "probed": MINILM_LAYER, "output": "tokens", "M": s.m,
        "directions_per_pass": s.k, "objective": "simcse", "batch_size": s.batch_size,
        "words": s.engine_words, "chunk_words": s.chunk, "token_rows": rows_engine,
        "engine_tokens_per_s": engine_tps, "transmission_tokens_per_s": trans_tps,
        "engine_seconds": percentiles(thr_times["engine"]),
        "directions_seconds_once": work.directions_seconds,
        "transmission_seconds": percentiles(thr_times["transmission"]),
        "threads": env["threads"], "device": env["device"], "versions": env["versions"],
        "note": "token rows include [CLS] and [SEP]; the engine figure includes computing the M "
                "directions (directions_seconds_once: the same M directions computed once at set-up, "
                "outside the timed runs), the fronts, kappa, the accumulators, the quartic solve and "
                "the table; "
                "the transmission figure is the vmap'd jvp passes alone (fronts cached)",
    }
    return {
        "what": "token-level jvp through MiniLM's last layer (all its parameters), M directions; "
                "batched = front cached once per chunk, K directions per vmap'd pass (Tail.jvp); "
                "sequential_cached = same cached front, one direction per pass; sequential_full = "
                "torch.func.jvp through the whole model per direction (front re-run each time)",
        "config": {**asdict(s), "parameters": sum(p.numel() for p in work.params.values()),
                   "cut_stage": work.cut, "comparison_tokens": work.tokens,
                   "engine_tokens": work.engine_tokens},
        "environment": env,
        "accuracy": checks,
        "seconds": seconds,
        "items": work.tokens,
        "items_per_s": {name: throughput(ts, work.tokens) for name, ts in times.items()},
        "ratios": ratios,
        "flops_first_chunk": flops_first,
        "flop_ratios": {f"batched_vs_{k}": v / flops_first["batched"] for k, v in flops_first.items()
                        if k != "batched" and "batched" in flops_first},
        "flops_note": "matmul-class ops counted by torch.utils.flop_counter on the first chunk "
                      "(front included where it is run)",
        "throughput": summary,
        "transmission_flops_per_token": transmission_flops / int(fronts[0][1].sum()),
        "engine_consistency": consistency,
    }


# ============================================================================
# Section "scaling": engine throughput and peak memory vs N, fresh processes
# ============================================================================


class _TokenIds:
    """Deterministic token ids for integer items (a picklable collate function)."""

    def __init__(self, length: int, vocab: int):
        self.length = length
        self.vocab = vocab

    def __call__(self, items: Sequence[int]) -> torch.Tensor:
        i = torch.as_tensor(list(items), dtype=torch.int64)[:, None]
        p = torch.arange(self.length)
        return (i * 7919 + p * 104729 + (i * p) % 13) % self.vocab


def _mean_tokens(x: torch.Tensor) -> torch.Tensor:
    return x.mean(1)


def token_model(s: ScalingSettings, seed: int = 0) -> "ModuleEncoder":
    """Embedding -> Linear+GELU -> linear head, mean-pooled: a token encoder with a head."""
    from normfast.encoders import ModuleEncoder

    torch.manual_seed(seed)
    d = s.dim
    stages = [torch.nn.Embedding(s.vocab, d),
              torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU()),
              torch.nn.Linear(d, d)]
    return ModuleEncoder(stages, pooling=_mean_tokens, collate=_TokenIds(s.tokens_per_item, s.vocab)).eval()


def _mark_before_finalize(marks: dict[str, float]) -> None:
    """Record the peak RSS reached before the engine assembles its output file.

    Only in the throwaway scaling process: the engine streams chunks to disk,
    then concatenates them and reads the finished table back for its result.
    The mark separates the streaming loop's peak from that final read-back.
    """
    import normfast.probe as engine

    writer = getattr(engine, "ChunkedParquetWriter", None)
    if writer is None:
        return

    class MarkedWriter(writer):
        def finalize(self, *args: Any, **kwargs: Any) -> Any:
            marks["streaming_peak_rss_mb"] = peak_rss_mb()
            return super().finalize(*args, **kwargs)

    engine.ChunkedParquetWriter = MarkedWriter


def scaling_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One size of the scaling section (run in a fresh process): engine time and peak RSS."""
    from normfast.probe import ProbeConfig, probe

    s = ScalingSettings(**{k: tuple(v) if k == "sizes" else v for k, v in spec["settings"].items()})
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    n_tokens = int(spec["n"])
    encoder = token_model(s)
    items = list(range(max(1, n_tokens // s.tokens_per_item)))
    pairs = [(i, i + 1_000_003) for i in range(s.pairs)]
    config = ProbeConfig(params="head", mode="head", output="tokens", batches=s.m,
                         batch_size=s.batch_size, chunk_size=s.chunk, radial_spread=False, seed=0)
    marks: dict[str, float] = {}
    _mark_before_finalize(marks)
    setup_mb = peak_rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = probe(encoder, items, "infonce", pairs, config, out=Path(tmp) / "run.parquet",
                       progress=False, model_name="token-mlp")
        seconds = time.perf_counter() - t0
        valid = float(np.mean(result.column("valid")))
        rows = len(result)
        table_mb = result.table.nbytes / 2**20
    return {"tokens": rows, "items": len(items), "seconds": seconds, "tokens_per_s": rows / seconds,
            "peak_rss_mb": peak_rss_mb(), "rss_after_setup_mb": setup_mb,
            "streaming_peak_rss_mb": marks.get("streaming_peak_rss_mb"), "table_mb": table_mb,
            "valid_fraction": valid, "threads": torch.get_num_threads()}


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    code = ("import json, sys; from normfast.benchmark import scaling_child; "
            "print('@@' + json.dumps(scaling_child(json.loads(sys.argv[1]))))")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"normfast bench: the scaling run for N={spec['n']} failed:\n{proc.stderr[-2000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")][-1]
    return json.loads(line[2:])


def run_scaling(s: ScalingSettings, progress: bool = True) -> dict[str, Any]:
    from normfast.ops import head_flops
    from normfast.report import loglog_fit

    runs = []
    for n in tqdm(s.sizes, desc="scaling", unit="size", disable=not progress, leave=False):
        runs.append({"n_requested": n, **_run_child({"n": n, "settings": asdict(s),
                                                       "threads": torch.get_num_threads()})})
    tokens = np.array([r["tokens"] for r in runs], dtype=float)
    seconds = np.array([r["seconds"] for r in runs], dtype=float)
    # seconds = fixed + per_token * N: the fixed part is the directions and set-up
    design = np.stack([np.ones_like(tokens), tokens], 1)
    (fixed, per_token), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    predicted = design @ np.array([fixed, per_token])
    top = tokens >= tokens.max() / 10 ** 1.01 if len(tokens) > 2 else np.ones_like(tokens, bool)
    top_slope = (float(np.log(seconds[top][-1] / seconds[top][0]) / np.log(tokens[top][-1] / tokens[top][0]))
                 if top.sum() >= 2 else math.nan)
    peaks = np.array([r["peak_rss_mb"] for r in runs])
    growth = peaks - np.array([r["rss_after_setup_mb"] for r in runs])
    streaming = [r["streaming_peak_rss_mb"] for r in runs]
    for r in runs:
        r["flops_head_S_form"] = head_flops(r["tokens"], s.dim, s.dim, s.m, bias=True)["S"]
    return {
        "what": "the engine (normfast.probe, head mode, token-level rows, Parquet output) on a "
                "token encoder (embedding, linear+GELU, linear head; mean pooling) as the number of "
                "token rows N grows; each N in a fresh process (peak RSS = VmHWM)",
        "config": {**asdict(s), "form": "S (radial_spread=False)", "objective": "infonce"},
        "environment": environment(),
        "runs": runs,
        "linear_fit": {"fixed_seconds": float(fixed), "seconds_per_token": float(per_token),
                       "tokens_per_s_marginal": float(1 / per_token) if per_token > 0 else math.nan,
                       "max_rel_residual": float(np.max(np.abs(predicted - seconds) / seconds))},
        "loglog_seconds_vs_tokens": loglog_fit(tokens, seconds),
        "loglog_slope_top_decade": top_slope,
        "peak_rss_mb": {"min": float(peaks.min()), "max": float(peaks.max()),
                        "growth_over_setup_mb": [float(x) for x in growth],
                        "streaming_loop_growth_over_setup_mb":
                            [None if m is None else float(m - r["rss_after_setup_mb"])
                             for m, r in zip(streaming, runs)]},
        "memory_note": "peak_rss_mb includes the engine's final step (the finished Parquet table read "
                       "back into the ProbeResult, which grows with N); streaming_peak_rss_mb is the "
                       "peak before that step (the chunk loop)",
        "see_also": "bench/streaming.py: 10^7 tokens streamed through the engine",
    }


# ============================================================================
# Figures
# ============================================================================


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bar(ax, seconds: dict[str, dict], title: str, ratio_base: str) -> None:
    names = list(seconds)
    p50 = np.array([seconds[n]["p50"] for n in names])
    lo = p50 - np.array([seconds[n]["p20"] for n in names])
    hi = np.array([seconds[n]["p80"] for n in names]) - p50
    ax.bar(range(len(names)), p50, yerr=[lo, hi], color=["C0" if n == ratio_base else "C7" for n in names],
           capsize=3)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (p50, bars p20-p80)")
    ax.set_title(title, fontsize=9)
    base = seconds.get(ratio_base, {}).get("p50")
    if base:
        for i, n in enumerate(names):
            if n != ratio_base:
                ax.annotate(f"{p50[i] / base:.1f}x", (i, p50[i] + hi[i]), ha="center", va="bottom", fontsize=8)


def plot_head(section: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    c = section["config"]
    _bar(ax, section["seconds"], f"head mode vs per-sample gradients\nN={c['n']}, d={c['dim']}, M={c['m']}",
         "normfast")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_jvp(jacrev: dict | None, minilm: dict | None, path: Path) -> Path:
    plt = _plt()
    panels = [p for p in (jacrev, minilm) if p is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, sec in zip(axes[0], panels):
        if sec is jacrev:
            c = sec["config"]
            _bar(ax, sec["seconds"], f"jvp vs per-probe jacrev, MLP {c['widths']}\nN={c['n']}, M={c['m']}",
                 "normfast")
        else:
            c = sec["config"]
            _bar(ax, sec["seconds"], f"MiniLM last layer, token level\n{c['comparison_tokens']} tokens, "
                 f"M={c['m']}, K={c['k']}", "batched")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_scaling(section: dict, path: Path) -> Path:
    plt = _plt()
    runs = section["runs"]
    n = np.array([r["tokens"] for r in runs], dtype=float)
    fit = section["linear_fit"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.8))
    a1.loglog(n, [r["seconds"] for r in runs], "o", label="measured")
    grid = np.geomspace(n.min(), n.max(), 50)
    a1.loglog(grid, fit["fixed_seconds"] + fit["seconds_per_token"] * grid, "--",
              label=f"{fit['fixed_seconds']:.2f} s + N / {fit['tokens_per_s_marginal']:.0f} per s")
    a1.set_xlabel("token rows N")
    a1.set_ylabel("wall seconds")
    a1.legend(fontsize=8)
    a1.set_title(f"engine, head mode (slope over the top decade "
                 f"{section['loglog_slope_top_decade']:.2f})", fontsize=9)
    a2.semilogx(n, [r["tokens_per_s"] for r in runs], "o-")
    a2.set_xlabel("token rows N")
    a2.set_ylabel("tokens / s")
    a2.set_ylim(bottom=0)
    a2.set_title("throughput (fixed cost amortized as N grows)", fontsize=9)
    a3.semilogx(n, [r["peak_rss_mb"] for r in runs], "o-", label="peak RSS")
    if all(r.get("streaming_peak_rss_mb") is not None for r in runs):
        a3.semilogx(n, [r["streaming_peak_rss_mb"] for r in runs], "^-",
                    label="peak before the final read-back")
    a3.semilogx(n, [r["rss_after_setup_mb"] for r in runs], "s--", label="after set-up")
    a3.set_xlabel("token rows N")
    a3.set_ylabel("MB")
    a3.set_ylim(bottom=0)
    a3.legend(fontsize=8)
    a3.set_title("resident memory (a fresh process per N)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ============================================================================
# CLI
# ============================================================================

bench_description = """\
The probe-throughput suite. Each comparison is a ratio of medians measured in
the same run on the same data, after an accuracy check (recorded, with its
tolerance, in the JSON); a method that fails its check is not timed.

sections (--only, comma separated; 'jvp' = jacrev,minilm):
  head     head mode vs per-sample-gradient pipelines (torch.func, BackPACK, Opacus)
  jacrev   jvp mode vs per-probe Jacobians (torch.func.jacrev) on a small MLP
  minilm   MiniLM last layer, token level: K directions per pass vs one at a time
           (same cached front / whole model per direction); engine tokens/s
  scaling  engine wall time and peak memory as N grows, a fresh process per N

writes OUT/bench.json, OUT/jvp_minilm.json and OUT/bench_*.png. The full suite
takes 15-25 minutes on 2 CPU cores; --quick runs every path at tiny sizes.

examples:
  normfast bench
  normfast bench --only head,scaling --out /tmp/bench
  normfast bench --quick --out /tmp/bench-quick"""


def bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds; used by the tests)")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]",
                   help=f"sections to run: {', '.join(SECTIONS)} (or jvp); default all")
    p.add_argument("--out", default="bench/results", help="output folder (default bench/results)")
    p.add_argument("--repeats", type=int, default=None, help="timing rounds per section (default 3; quick 1-2)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default); the jacrev section always uses 1")
    p.add_argument("--head-n", type=int, default=None, help="probes of the head section (default 100000)")
    p.add_argument("--no-progress", action="store_true")


def _parse_only(fn: str, only: str | None) -> list[str]:
    if not only:
        return list(SECTIONS)
    chosen: list[str] = []
    for name in (x.strip() for x in only.split(",") if x.strip()):
        for sec in SECTION_GROUPS.get(name, (name,)):
            if sec not in SECTIONS:
                raise ValueError(f"{fn}: expected --only names from {', '.join(SECTIONS)} (or jvp), "
                                 f"got {name!r}")
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
    lines = [f"normfast bench ({'quick' if report.get('quick') else 'full'}), "
             f"{report['environment']['device']}, {report['environment']['threads']} threads"]
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
            lines.append(f"  engine {t['engine_tokens_per_s']['p50']:.0f} tokens/s, transmission alone "
                         f"{t['transmission_tokens_per_s']['p50']:.0f} tokens/s (M={t['M']}, "
                         f"{t['token_rows']} token rows)")
        if name == "scaling":
            for r in sec["runs"]:
                stream = r.get("streaming_peak_rss_mb")
                lines.append(f"  N={r['tokens']:>9}: {r['seconds']:8.2f} s, {r['tokens_per_s']:9.0f} tokens/s, "
                             f"peak RSS {r['peak_rss_mb']:.0f} MB (after set-up {r['rss_after_setup_mb']:.0f}, "
                             f"chunk loop {stream if stream is None else round(stream)})")
            fit = sec["linear_fit"]
            lines.append(f"  fit: {fit['fixed_seconds']:.2f} s fixed + N / {fit['tokens_per_s_marginal']:.0f} "
                         f"tokens/s; log-log slope over the top decade {sec['loglog_slope_top_decade']:.2f}")
    return "\n".join(lines)


def bench_main(args: argparse.Namespace) -> int:
    fn = "normfast bench"
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
    with _threads(args.threads):
        return _bench(args, sections, settings)


def _bench(args: argparse.Namespace, sections: list[str], settings: Settings) -> int:
    fn = "normfast bench"
    progress = not args.no_progress
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"

    report: dict[str, Any] = {}
    if args.only and path.exists():
        try:
            previous = json.loads(path.read_text())
            if previous.get("quick") == bool(args.quick):
                report = {k: v for k, v in previous.items() if k in SECTIONS}
        except (OSError, ValueError):
            report = {}
    runners = {"head": lambda: run_head(settings.head, progress),
               "jacrev": lambda: run_jacrev(settings.jacrev, progress),
               "minilm": lambda: run_minilm(settings.minilm, progress),
               "scaling": lambda: run_scaling(settings.scaling, progress)}
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
        figures.append(plot_head(report["head"], out / "bench_head.png"))
    if "jacrev" in report or "minilm" in report:
        figures.append(plot_jvp(report.get("jacrev"), report.get("minilm"), out / "bench_jvp.png"))
    if "scaling" in report:
        figures.append(plot_scaling(report["scaling"], out / "bench_scaling.png"))
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


def _write_report(path: Path, args: argparse.Namespace, sections: list[str], started: float,
                  report: dict[str, Any], figures: list[Path], *, complete: bool) -> dict[str, Any]:
    checks = _all_checks(report)
    flags = (["--quick"] if args.quick else []) + ([f"--only {args.only}"] if args.only else [])
    full = {
        "suite": "normfast bench",
        "quick": bool(args.quick),
        "complete": complete,
        "sections_run": sections,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "environment": environment(),
        "command": " ".join(["normfast bench", *flags]),
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
