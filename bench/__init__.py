"""normfast's experiments and benchmarks in one harness.

    python -m bench list                       # every experiment: name, title, default output
    python -m bench run NAME [--quick] [--seed N] [--out DIR] [options]
    python -m bench tables --check README.md   # the README's results tables against bench/results

Each experiment is a module of :mod:`bench.experiments` (the contract:
:mod:`bench.harness`); the runner (:mod:`bench.cli`) parses its options from
its ``Config``, seeds, times, writes the JSON and the figures, and prints its
tables with the command that reproduces them. :mod:`bench.tables` renders the
README's (and the docs') results tables from ``bench/results``.

Experiment code calls the public API (``import normfast``, ``normfast.ops``)
and, where it needs more, only the sub-package entries listed in
:data:`STABLE` (``tests/test_layout.py`` checks every import of ``bench/``
against it).

``bench/test_micro.py`` is not an experiment: it holds pytest-benchmark
micro-benchmarks (``pytest bench/test_micro.py --benchmark-only``), the tool
made for them; pytest's ``testpaths`` leave it out of the test suite.
"""
from __future__ import annotations

from typing import Any

#: The package internals bench/ may import besides ``normfast`` and ``normfast.ops``: module ->
#: names (``"*"``: the module as a whole). Products (``normfast validate``, ``normfast bench``)
#: are entered through their commands' functions; the rest are study tools a reader may reuse.
STABLE: dict[str, tuple[str, ...]] = {
    # products wrapped by the harness (e1, throughput), and E1's parts that e1_drift reuses
    "normfast.apps.validate": ("VARIANTS", "validate_main"),
    "normfast.apps.validate.data": ("E1Config", "VARIANT_SPECS", "make_concepts", "make_optimizer", "probe_config"),
    "normfast.apps.validate.laws": ("TARGET_R", "TARGET_SLOPE", "law_norms"),
    "normfast.apps.validate.training": ("train", "load_checkpoint", "window_start"),
    "normfast.apps.validate.experiment": ("interval_coverage",),
    "normfast.apps.validate.report": ("plot",),
    # the trajectory pieces E1's counterfactual and AdamW studies continue training with
    "normfast.engine.snapshot": ("relaxation_steps", "snapshot_prediction"),
    "normfast.engine.trajectory": ("TrajectoryMeter", "start_adam"),
    "normfast.engine.directions": ("adam_second_moments",),
    "normfast.data.pairs": ("virtual_batches",),
    "normfast.apps.benchmark": ("bench_main", "apply_per_batch", "cpu_model", "head_directions_backward",
                                "library_versions", "make_head_problem", "percentiles"),
    "normfast.apps.benchmark.head": ("HEAD_FORMS", "form_gemms", "gemm_floor"),
    # fine-tuning a real encoder to equilibrium (E2)
    "normfast.apps.training": ("CheckpointLaw", "CheckpointSnapshots", "HealthThresholds", "Resume",
                               "TrainSettings", "health", "pilot", "probe_checkpoints", "split_decay", "train",
                               "train_epochs", "zero_shot_entropy"),
    "normfast.apps.retrieval": ("DEFAULT_ALPHAS", "METRICS", "plot_sweep"),
    "normfast.apps.judgments": ("judgment_sweep", "verdict"),
    # the training monitor's report of a monitor folder (the monitor experiment)
    "normfast.apps.monitor.report": ("FIGURE_FILE", "REPORT_FILE", "monitor_report"),
    # the solver's OpenMP team size (the quartic benchmark reports it)
    "normfast.core._quartic": ("default_threads",),
    # statistics and float64 references
    "normfast.core.stats": ("correlation", "loglog_fit", "loglog_fit_ci", "paired_bootstrap", "spearman"),
    "normfast.core.bootstrap": ("correlation_with_ci", "paired_bootstrap_means", "partial_spearman_with_ci",
                                "spearman_ci"),
    "normfast.core.reference": ("*",),
    "normfast.engine.uncertainty": ("DEFAULT_GROUPS", "effective_groups", "t_quantile"),
    "normfast.engine.regime": ("classify_rows", "run_regime"),
    "normfast.engine.aggregate": ("aggregate", "plot_type_heat"),
    "normfast.engine.provenance": ("library_versions",),
    # data sets and encoders
    "normfast.data.wordnet": ("*",),
    "normfast.data.wordnet_collection": ("*",),
    "normfast.data.word_frequencies": ("*",),
    "normfast.data.fashion_mnist": ("*",),
    "normfast.data.gensim_data": ("*",),
    "normfast.data.corpus": ("CorpusWindows", "split_sentences"),
    "normfast.data.io": ("json_ready",),
    "normfast.encoders": ("CachedFrontEncoder", "DenseLayer", "HFEncoder"),
    "normfast.encoders.packaged": ("minilm_path",),
    "normfast.encoders.text": ("encode_texts", "wordpiece_lengths"),
    # the kernels' cost model, tile lists and resource report (GPU notes), and one launcher (gpu_check)
    "normfast.kernels": ("costs", "head_stack", "resources"),
    "normfast.kernels.utils": ("accumulate_configs", "head_configs", "last_config"),
}


def catalog() -> list[dict[str, Any]]:
    """Every experiment: ``name``, ``title``, ``protocol`` (its docstring), ``command`` (the one that
    writes the committed results), ``tables`` (README blocks), ``figures`` and ``results`` (file
    names under bench/results). Imports no heavy library (torch is imported by ``run`` only)."""
    from bench import harness

    out = []
    for name in harness.EXPERIMENTS:
        m = harness.load(name)
        out.append({"name": name, "title": harness.title(m), "protocol": (m.__doc__ or "").strip(),
                    "command": f"python -m bench run {name} --out bench/results",
                    "tables": list(m.TABLES), "figures": list(m.FIGURES), "results": list(m.RESULTS)})
    return out
