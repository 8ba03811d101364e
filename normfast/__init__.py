"""normfast: probe the optimization statistics that set contrastive embedding norms.

The stable public surface is what ``import normfast`` exposes (``__all__``);
every name is imported lazily, on first use, so ``import normfast`` stays light:

* probing: :func:`probe`, :class:`Prober` (the directions once, then probes in seconds),
  :class:`ProbeConfig`, :class:`ProbeResult`; :func:`probe_corpus` (every token of a corpus in
  context, the ``--corpus`` recipe; ``result.types("word")`` per word);
* models: :func:`load_encoder`, :class:`Encoder`, :class:`ModuleEncoder`;
* virtual batches: :class:`PairSource` (:func:`virtual_batches`, the default draw) and the
  objectives :class:`InfoNCE`, :class:`CLIPLoss`, :class:`SupCon`, :class:`SimCSE`
  (:func:`get_objective` by name; :class:`Objective` and :func:`check_scale_invariance` for your own);
* the law: :func:`solve_quartic`, :func:`equilibrium_coefficients`, :func:`equilibrium_norm`;
* output: :func:`read_metadata` (a run's settings), :data:`SCHEMA_VERSION` (the Parquet format,
  documented column by column in :mod:`normfast.data.schema`);
* retrieval: :func:`rescale_documents`, :func:`alpha_sweep`, :func:`export_faiss`, :func:`load_beir`;
* training: :class:`TrainingMonitor` (every probe item's realized radial budget while a model trains),
  its adapters :class:`MonitorCallback` (``transformers``/sentence-transformers trainers) and
  :class:`LightningMonitor` (Lightning, an optional extra);
* :mod:`ops` -- the array backend for other frontends (accumulators, head statistics, solver).

Layers (each a sub-package; imports flow one way, checked by the tests):
:mod:`normfast.core` <- :mod:`normfast.engine` <- :mod:`normfast.apps` <- :mod:`normfast.cli`,
with :mod:`normfast.data` and :mod:`normfast.encoders` used by the engine and the apps.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> defining module
_LAZY = {
    "probe": "normfast.engine.probe",
    "Prober": "normfast.engine.prober",
    "probe_corpus": "normfast.apps.corpus",
    "ProbeConfig": "normfast.engine.config",
    "ProbeResult": "normfast.engine.result",
    "load_encoder": "normfast.encoders",
    "Encoder": "normfast.encoders",
    "ModuleEncoder": "normfast.encoders",
    "PairSource": "normfast.data.pairs",
    "virtual_batches": "normfast.data.batches",
    "Objective": "normfast.engine.directions.objectives",
    "check_scale_invariance": "normfast.engine.directions.objectives",
    "InfoNCE": "normfast.engine.directions.objectives",
    "CLIPLoss": "normfast.engine.directions.objectives",
    "SupCon": "normfast.engine.directions.objectives",
    "SimCSE": "normfast.engine.directions.objectives",
    "get_objective": "normfast.engine.directions.objectives",
    "solve_quartic": "normfast.core.equilibrium",
    "equilibrium_coefficients": "normfast.core.equilibrium",
    "equilibrium_norm": "normfast.core.equilibrium",
    "read_metadata": "normfast.data.io",
    "SCHEMA_VERSION": "normfast.data.schema",
    "load_beir": "normfast.data.beir",
    "rescale_documents": "normfast.apps.retrieval.scoring",
    "alpha_sweep": "normfast.apps.retrieval.sweep",
    "export_faiss": "normfast.apps.retrieval.scoring",
    "TrainingMonitor": "normfast.engine.monitor.recorder",
    "MonitorCallback": "normfast.engine.monitor.callbacks",
    "LightningMonitor": "normfast.engine.monitor.lightning",
}
# public sub-modules reachable as attributes
_MODULES = {"ops": "normfast.ops"}

__all__ = ["__version__", *_LAZY, *_MODULES]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'normfast' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
