"""``normfast throughput``: the probe-throughput suite.

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
    per batch gives ``G_B``, then :func:`normfast.ops.head_mode_stats` in the S
    form. Against the pipelines a researcher would otherwise assemble from
    per-sample-gradient tools -- ``torch.func`` (``vmap(grad)`` over the
    per-row loss terms), BackPACK (``BatchGrad``) and Opacus
    (``GradSampleModule``) -- each producing per-sample head gradients, summed
    per batch to ``G_B`` and applied to every probe (``t = -(G_B a + g_B)``
    materialized batch by batch and reduced).
``jacrev``
    jvp mode against per-probe Jacobians on a small MLP: normfast's
    :class:`normfast.engine.transmission.jvp.Tail` (all ``M`` directions in one
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
    (:func:`normfast.engine.probe.probe`, directions included) and of the
    transmission alone.
``scaling``
    The engine (head mode, token-level, Parquet output) as the number of
    token rows grows; each size runs in a fresh process, which reports its
    wall time and peak resident memory. (The 10^7-token run is
    ``python -m bench run streaming``.)

Results go to ``OUT/throughput.json`` (and ``OUT/jvp_minilm.json``) with figures
``OUT/throughput_*.png``. With ``--only`` an existing ``throughput.json`` of the same
kind (quick or full) keeps its other sections.
"""

from .command import format_summary, throughput_arguments, throughput_description, throughput_main
from .head import (
    HeadProblem,
    Phases,
    apply_per_batch,
    head_directions_backpack,
    head_directions_backward,
    head_directions_opacus,
    head_directions_torch_func,
    head_flop_counts,
    head_normfast,
    info_nce_rows,
    make_head_problem,
    run_head,
)
from .jvp import mlp_encoder, run_jacrev, run_minilm
from .measure import (
    accuracy_check,
    count_flops,
    cpu_model,
    environment,
    machine_name,
    peak_rss_mb,
    percentiles,
    rel_diff,
    throughput,
    time_rounds,
)
from .scaling import run_scaling, scaling_child, token_model
from .settings import (
    BASELINE_PACKAGES,
    SECTIONS,
    HeadSettings,
    JacrevSettings,
    MiniLMSettings,
    ScalingSettings,
    Settings,
)

__all__ = [
    "throughput_arguments",
    "throughput_description",
    "throughput_main",
    "format_summary",
    "HeadProblem",
    "Phases",
    "apply_per_batch",
    "head_directions_backpack",
    "head_directions_backward",
    "head_directions_opacus",
    "head_directions_torch_func",
    "head_flop_counts",
    "head_normfast",
    "info_nce_rows",
    "make_head_problem",
    "run_head",
    "mlp_encoder",
    "run_jacrev",
    "run_minilm",
    "accuracy_check",
    "count_flops",
    "cpu_model",
    "environment",
    "machine_name",
    "peak_rss_mb",
    "percentiles",
    "rel_diff",
    "throughput",
    "time_rounds",
    "run_scaling",
    "scaling_child",
    "token_model",
    "BASELINE_PACKAGES",
    "SECTIONS",
    "HeadSettings",
    "JacrevSettings",
    "MiniLMSettings",
    "ScalingSettings",
    "Settings",
]
