"""``Prober``: the directions once, then probes in seconds.

A probe's cost has two parts. The *directions* -- the M heat batches' update directions and the
drift's group means over its M_D batches -- depend on the model, the objective, the pair source and
the settings, never on the probe items. The *per-item pass* -- the frozen front, the directional
derivatives along those directions, κ and the law -- is all that depends on the items. A
:class:`Prober` computes the directions at its first use (or :meth:`Prober.prepare`), keeps them,
and every later :meth:`Prober.probe` pays only the per-item pass. :func:`normfast.probe` is one call
of a fresh Prober: one code path, so a Prober's table equals ``normfast.probe``'s for the same
items, pair source, config and seed, value for value.

Decisions
---------
* **The pair source is explicit.** ``normfast.probe`` with SimCSE and no ``pairs`` draws its
  virtual batches from the probe items, so its directions depend on the items. A Prober needs
  ``pairs=`` (SimCSE: the items to draw batches from; they may be the first call's items); it binds
  that source at construction and refuses ``pairs=None``.
* **Adaptive M is fixed at first use.** With ``config.target_rse`` the first call chooses M on its
  first chunk of items (as ``normfast.probe`` does) and every later call reuses that M and its
  directions; the choice is in every result's ``adaptive`` metadata and in a saved artifact.
* **The snapshot predictor runs per call** (``config.snapshot``): it trains a copy of the model
  along the items of the call.
* **Weights that change void the directions.** A call checks that no parameter or buffer of the
  model (and of the pair encoder) was replaced or changed in place (an optimizer step, a
  ``load_state_dict``) since the directions were computed, and refuses if one was: make a new
  Prober. (Values changed through ``.data`` escape this check.)
* **Directions that do not fit** ``memory_budget_mb`` together (the directions-outer order) are not
  kept in memory: each call computes them again in groups, unless they come from a saved artifact,
  which serves them group by group from disk.
* **Sharded** (every rank constructs the Prober and makes the same calls): the directions are
  computed on rank 0 and broadcast at the first use, then kept on every rank.
* **The relative heat has a fixed reference.** ``heat_rel`` is a row's log heat minus a reference
  level. ``normfast.probe`` (one run, one set of items) takes the median over the run's own rows; a
  Prober answers many calls, and a row's ``heat_rel`` must not depend on the other items of its
  call, so its reference is fixed with the directions (:mod:`normfast.engine.runner.reference`;
  ``relative_heat="pairs"``, the default; ``"run"`` gives ``normfast.probe``'s). The same item gets
  the same ``heat_rel`` alone and in any company; it differs from ``normfast.probe``'s by one
  constant per call, and every other column is equal value for value.

The Prober is the session: its settings (one :class:`~normfast.engine.config.ProbePlan`, checked once),
its directions, its identity (the fingerprints of the weights, tokenizer and pair source) and its calls.
A call's output -- its record and resume key, the output opened or resumed, the chunks written, the
finish (one file, in memory, sharded) and the run-level summaries -- is
:mod:`normfast.engine.runner.output`'s; saved directions (:meth:`Prober.save`, :meth:`Prober.load`) are
:mod:`normfast.engine.runner.artifact`'s.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from normfast.core.checks import check_finite_weights
from normfast.data.batches import check_in_source
from normfast.data.pairs import PairSource, as_pair_source
from normfast.encoders import Encoder
from normfast.encoders.tokenizing import unknown_token_warning
from normfast.engine.config import ProbeConfig, ProbePlan, as_plan
from normfast.engine.directions.objectives import objective_settings
from normfast.engine.result import ProbeResult
from normfast.engine.runner.chunks import as_probe_sequence
from normfast.engine.runner.distributed import current_shard
from normfast.engine.runner.output import call_record, probe_call
from normfast.engine.runner.provenance import encoder_tokenizer, hash_items, hash_model, hash_pairs, hash_tokenizer
from normfast.engine.runner.reference import reference_pass, saved_references
from normfast.engine.runner.state import DirectionStore, ProbeRun

#: where ``heat_rel``'s reference level comes from: the pair source's items, or the call's own rows
RELATIVE_HEAT = ("pairs", "run")


class Prober:
    """A probe whose directions are computed once and kept: ``Prober(...).probe(items)`` per call.

    Args:
        encoder: an :class:`~normfast.encoders.Encoder`, an ``nn.Module``, or a spec string for
            :func:`normfast.encoders.load_encoder`.
        objective: an objective object or name (``"infonce"``, ``"clip"``, ``"supcon"``, ``"simcse"``).
        pairs: the virtual-batch source (a ``PairSource``, a ``Dataset``, or an iterable of pairs /
            (item, label) tuples / items). Required: the directions come from it and are kept for
            every later call (SimCSE: the items to draw batches from).
        config: a :class:`ProbeConfig` (defaults otherwise), checked here once into the Prober's
            :class:`~normfast.engine.config.ProbePlan` (or such a plan, made and checked before); fixed for
            the Prober's life: ``prober.config`` is its checked copy, which cannot be changed.
        pair_encoder, second_moments, model_name, progress: as for :func:`normfast.probe`.
        relative_heat: ``heat_rel``'s reference: ``"pairs"`` (default) fixed with the directions
            (:meth:`heat_reference`), ``"run"`` each call's own median (:func:`normfast.probe`'s).

    Every :meth:`probe` after the first (or after :meth:`prepare`) costs only the per-item pass;
    its table equals :func:`normfast.probe`'s for the same items, pairs, config and seed (``heat_rel``
    apart: a constant shift). The decisions (adaptive M fixed at first use, changed weights refused,
    the reference, ...) are in the module's docstring (:mod:`normfast.engine.prober`).
    """

    def __init__(
        self,
        encoder: Encoder | str | torch.nn.Module,
        objective: Any = "simcse",
        pairs: Any = None,
        config: ProbeConfig | ProbePlan | None = None,
        *,
        pair_encoder: Encoder | None = None,
        second_moments: Mapping[str, torch.Tensor] | None = None,
        model_name: str | None = None,
        progress: bool = True,
        relative_heat: str = "pairs",
    ):
        from normfast.encoders import load_encoder
        from normfast.engine.directions.objectives import get_objective

        if relative_heat not in RELATIVE_HEAT:
            raise ValueError(f"Prober: relative_heat must be one of {RELATIVE_HEAT}, got {relative_heat!r}")
        plan = as_plan(config)  # the settings checked once, here or by the caller that made the plan
        if not isinstance(encoder, Encoder):
            encoder = load_encoder(encoder)
        if model_name is None:
            model_name = encoder.spec or type(encoder).__name__
        self.encoder = encoder
        self.pair_encoder = pair_encoder
        self._scanned: tuple | None = None
        # a NaN or infinite weight makes every row NaN: said now, before anything is computed or written
        self._scan_weights(self._weights_stamp())
        if isinstance(objective, str):
            objective = get_objective(objective)
        if pairs is None:
            raise ValueError(
                "Prober: pairs= is required: the directions come from the pair source and are kept for every "
                "later call, so they cannot come from each call's probe items (normfast.probe's SimCSE default); "
                "pass the items or pairs to draw virtual batches from, e.g. Prober(encoder, 'simcse', pairs=sentences)"
            )
        # a loaded artifact's pair source may be its fingerprint alone (runner.artifact.SavedPairs)
        if not (isinstance(pairs, PairSource) or getattr(pairs, "detached", False)):
            pairs = as_pair_source(pairs, objective, ())
        if plan.batch_indices is not None:  # the plan checked their count and sizes; their range is the source's
            check_in_source("probe", "config.batch_indices", plan.batch_indices, len(pairs))
        self.objective = objective
        self.pairs = pairs
        self.plan = plan
        self.config = plan.config  # the settings as checked: a copy that cannot be changed
        self.second_moments = second_moments
        self.model_name = str(model_name)
        self.progress = progress
        self.store = DirectionStore()
        self.source = "computed"  # or the folder the directions were read from
        self.relative_heat = relative_heat
        #: output kind -> the fixed reference of heat_rel (:meth:`heat_reference`); saved with the directions
        self.references: dict[str, dict[str, Any]] = {}
        #: whether the missing heat reference of loaded directions was said once (runner.reference)
        self.reference_warned = False
        self._identity: dict[str, Any] | None = None
        self._stamp: tuple | None = None
        self.pair_hashes: dict[bool, str] = {}

    # -- what the directions depend on -----------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether the directions are held (computed, or readable from a saved artifact)."""
        s = self.store
        return s.directions is not None or s.choice is not None or s.reader is not None

    def _weights_stamp(self) -> tuple:
        """Every parameter's and buffer's storage and in-place version: any replacement or in-place change
        (an optimizer step, ``load_state_dict``) moves it."""
        modules = [self.encoder] + ([self.pair_encoder] if self.pair_encoder is not None else [])
        return tuple(
            (name, t.data_ptr(), t._version) for m in modules for name, t in (*m.named_parameters(), *m.named_buffers())
        )

    def _scan_weights(self, stamp: tuple) -> None:
        """Refuse NaN or infinite weights (the model's and the pair encoder's): once per state of the weights."""
        check_finite_weights("probe", self.encoder)
        if self.pair_encoder is not None:
            check_finite_weights("probe", self.pair_encoder, "the pair encoder")
        self._scanned = stamp

    def _model_identity(self) -> dict[str, Any]:
        """The model's fingerprints (weights, tokenizer, settings, the pair encoder's), computed once;
        refuses weights changed since the directions were computed."""
        stamp = self._weights_stamp()
        if self._identity is not None and stamp == self._stamp:
            return self._identity
        if self._identity is not None and self.ready:
            changed = next((a[0] for a, b in zip(stamp, self._stamp) if a != b), "a parameter")
            raise ValueError(
                f"Prober.probe: the model's weights changed since its directions were computed ({changed} "
                f"first); the directions hold for the weights they came from: make a new Prober"
            )
        if stamp != self._scanned:  # changed before any direction was computed: scanned again
            self._scan_weights(stamp)
        self._identity = {
            "model_fingerprint": hash_model(self.encoder),
            "tokenizer_fingerprint": hash_tokenizer(encoder_tokenizer(self.encoder)),
            "encoder_settings": self.encoder.settings(),
            "pair_encoder": None if self.pair_encoder is None else _identity(self.pair_encoder),
        }
        self._stamp = stamp
        return self._identity

    def _pair_fingerprint(self, run: ProbeRun, every_pair: bool) -> str:
        """The pair source's hash: of the pairs the virtual batches draw (every pair: the snapshot's
        trajectory draws its own); computed once per kind and kept in ``pair_hashes``."""
        if every_pair not in self.pair_hashes:
            drawn = None if every_pair else np.concatenate([np.ravel(b) for b in run.batches])
            self.pair_hashes[every_pair] = hash_pairs(self.pairs, drawn)
        return self.pair_hashes[every_pair]

    def fingerprint(self) -> dict[str, Any]:
        """What the directions depend on: the engine version, the model, the objective, the pair
        source, the settings and given second moments (a saved artifact's manifest holds it)."""
        from normfast import __version__
        from normfast.engine.runner.artifact import DIRECTION_FIELDS

        ident = self._model_identity()
        run = self.new_run(0, False, None)
        settings = {k: getattr(self.config, k) for k in DIRECTION_FIELDS}
        if settings["batch_indices"] is not None:
            settings["batch_indices"] = hash_items([list(map(int, b)) for b in settings["batch_indices"]])
        return {
            "normfast": __version__,
            "model": ident["model_fingerprint"],
            "tokenizer": ident["tokenizer_fingerprint"],
            "encoder_settings": ident["encoder_settings"],
            "pair_encoder": ident["pair_encoder"],
            "objective": {"name": self.objective.name, "settings": objective_settings(self.objective)},
            "pairs": {"n": len(self.pairs), "drawn": self._pair_fingerprint(run, False)},
            "second_moments": hash_items(sorted(self.second_moments.items())) if self.second_moments else None,
            "settings": settings,
        }

    def new_run(self, n_items: int, progress: bool, shard: Any) -> ProbeRun:
        """One call's run state (a :class:`~normfast.engine.runner.state.ProbeRun`) over this Prober's
        direction store: what :meth:`probe` walks, and what the artifact code fills or reads the store
        through. An engine entry, not a user's: the API page leaves it out (docs/hooks.py)."""
        return ProbeRun(
            self.encoder,
            self.objective,
            self.pairs,
            self.plan,
            self.pair_encoder,
            progress,
            self.second_moments,
            shard=shard,
            n_items=n_items,
            store=self.store,
        )

    # -- directions ---------------------------------------------------------------------
    def prepare(self) -> "Prober":
        """Compute (or read) the directions now, so that the first :meth:`probe` pays only the per-item
        pass; returns the Prober. Directions that do not fit the memory budget are not kept (see the
        module's docstring); adaptive M chooses M on the first call's items, so it waits for that call."""
        if self.config.target_rse is not None:
            if self.store.choice is None:
                raise ValueError(
                    "Prober.prepare: adaptive M (config.target_rse) chooses M on the first call's probe items; "
                    "call probe() first, or fix M with batches= and target_rse=None"
                )
            return self
        self._model_identity()
        run = self.new_run(0, self.progress, current_shard())
        if run.fits():
            run.all_directions()
        elif self.plan.drift_from_mean:
            run.drift_directions()
        return self

    # -- the reference of heat_rel (normfast.engine.runner.reference) ----------------------
    def heat_reference(self, output: str | None = None) -> dict[str, Any] | None:
        """The fixed reference level of ``heat_rel`` for ``output`` rows (default: the config's), computed
        once from the pair source's items and kept (and saved with the directions); ``None`` for loaded
        directions that hold none for ``output`` and came without their pair source."""
        output = output or self.config.output
        if output not in self.references and not getattr(self.pairs, "detached", False):
            self.references[output] = reference_pass(self, output)
        return self.references.get(output)

    def saved_references(self) -> dict[str, dict[str, Any]]:
        """What :meth:`save` writes beside the directions (:mod:`normfast.engine.runner.reference`)."""
        return saved_references(self)

    def save(self, folder: str | Path, *, overwrite: bool = False) -> Path:
        """Write the directions to ``folder`` (computing them first if needed): one safetensors file per
        direction and a JSON manifest with their fingerprint (:mod:`normfast.engine.runner.artifact`).
        Returns the folder. :meth:`load` reads them back for the same model and settings."""
        from normfast.engine.runner.artifact import save_directions

        return save_directions(self, Path(folder), overwrite=overwrite)

    @classmethod
    def load(
        cls,
        folder: str | Path,
        encoder: Encoder | str | torch.nn.Module,
        objective: Any = None,
        pairs: Any = None,
        config: ProbeConfig | ProbePlan | None = None,
        *,
        pair_encoder: Encoder | None = None,
        second_moments: Mapping[str, torch.Tensor] | None = None,
        model_name: str | None = None,
        progress: bool = True,
    ) -> "Prober":
        """A Prober over the directions saved in ``folder`` for ``encoder``.

        ``objective``, ``pairs`` and ``config`` default to those the directions were made with (the
        pair source by its fingerprint only: pass ``pairs`` for ``config.snapshot``). Whatever is given
        must match the manifest: the model's weights and tokenizer, the encoder's settings, the
        objective, the pair source, the direction settings (a ``config`` may differ in lr,
        weight_decay, momentum, output, mode, chunking and error bars: those act per item) and the
        engine version; a mismatch is refused in one line naming what differs.
        """
        from normfast.engine.runner.artifact import load_directions

        return load_directions(
            cls,
            Path(folder),
            encoder,
            objective,
            pairs,
            config,
            pair_encoder=pair_encoder,
            second_moments=second_moments,
            model_name=model_name,
            progress=progress,
        )

    # -- one call ---------------------------------------------------------------------
    def probe(
        self,
        items: Sequence[Any],
        out: str | Path | None = None,
        *,
        resume: bool = False,
        overwrite: bool = False,
        ids: Sequence[str] | None = None,
        progress: bool | None = None,
        distributed: bool = True,
    ) -> ProbeResult:
        """Probe ``items`` with the kept directions (computed at the first call): the per-item pass only.

        ``items``, ``out``, ``resume``, ``overwrite``, ``ids`` and ``distributed`` are those of
        :func:`normfast.probe`; ``progress`` defaults to the Prober's. Returns a :class:`ProbeResult`
        whose table equals ``normfast.probe``'s for the same items, pairs, config and seed.
        """
        config = self.config
        progress = self.progress if progress is None else progress
        probes = as_probe_sequence(items)
        if len(probes) == 0:
            raise ValueError("probe: expected at least one probe item, got an empty probe set")
        if config.snapshot and getattr(self.pairs, "detached", False):
            raise ValueError(
                "Prober.probe: config.snapshot trains a copy of the model on the pair source, which these "
                "loaded directions came without: pass pairs= to Prober.load"
            )
        unknown = unknown_token_warning(self.encoder, probes)
        if unknown is not None:
            warnings.warn(unknown, UserWarning, stacklevel=2)
        if ids is None and callable(getattr(probes, "ids", None)):  # e.g. corpus windows: "DOC_ID/WINDOW"
            ids = probes.ids()
        if ids is not None:
            ids = [str(i) for i in ids]
            if len(ids) != len(probes):
                raise ValueError(f"probe: expected one id per probe item, got {len(ids)} ids for {len(probes)} items")
        ident = self._model_identity()
        shard = current_shard() if distributed else None
        run = self.new_run(len(probes), progress and (shard is None or shard.is_root), shard)
        pairs_hash = self._pair_fingerprint(run, bool(config.snapshot))
        metadata, record, key = call_record(self, run, probes, ids, ident, pairs_hash)
        snapshot = None
        if config.snapshot:
            from normfast.engine.trajectory.snapshot import snapshot_prediction

            def snapshot() -> Any:
                return snapshot_prediction(
                    self.encoder,
                    probes,
                    self.objective,
                    self.pairs,
                    self.plan,
                    second_moments=self.second_moments,
                    progress=run.progress,
                )

        return probe_call(
            self,
            run,
            probes,
            ids,
            metadata,
            record,
            key,
            out=out,
            resume=resume,
            overwrite=overwrite,
            snapshot=snapshot,
        )

    def __repr__(self) -> str:
        state = "directions held" if self.ready else "directions at first use"
        src = "" if self.source == "computed" else f", read from {self.source}"
        return f"Prober({self.model_name!r}, {self.objective.name}, {len(self.pairs)} pairs, {state}{src})"


def _identity(encoder: Encoder) -> dict[str, Any]:
    """What makes an encoder's embeddings: its settings, weights and tokenizer (for the pair encoder)."""
    return {
        "settings": encoder.settings(),
        "model_fingerprint": hash_model(encoder),
        "tokenizer_fingerprint": hash_tokenizer(encoder_tokenizer(encoder)),
    }
