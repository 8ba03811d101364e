"""The state of one probe run (:class:`ProbeRun`), shared by its chunks: what is probed, how
(mode, presets, branches), the virtual batches and their update directions, the accumulators,
and the progress bar over the chunks; and what outlives a run (:class:`DirectionStore`): the
directions a :class:`~normfast.engine.prober.Prober` keeps for its next calls."""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from normfast.encoders import Encoder
from normfast.engine.config import ProbePlan
from normfast.engine.diagnostics.health import objective_health
from normfast.engine.directions.gradients import Directions, compute_directions, estimate_second_moments, unused_warning
from normfast.engine.directions.parameters import resolve_parameters
from normfast.engine.directions.sampling import HeatDraw
from normfast.engine.estimators.accumulator import ProbeAccumulator
from normfast.engine.estimators.drift import drift_from_groups
from normfast.engine.estimators.grouped import GroupedAccumulator
from normfast.engine.runner.distributed import Shard
from normfast.engine.runner.heat import resolve_heat_sampling, sampled_directions
from normfast.engine.transmission.jvp import Tail


class DirectionStore:
    """The directions kept across the probe calls of one :class:`~normfast.engine.prober.Prober`.

    They depend on the model, the objective, the pair source and the settings, never on the probe
    items, so a run finds here what an earlier run (or a saved artifact, ``reader``) computed:
    ``directions`` (the M heat directions with the drift's group means, when they fit the memory
    budget), ``drift`` (the drift's group means alone: the directions-outer order), ``choice`` (adaptive
    M: the M chosen on the first call's first chunk, fixed from then on), ``second_moments`` (AdamW's
    estimated ``v̂``, for the directions-outer groups) and ``reader`` (an artifact on disk that serves
    the directions, whole or group by group: :mod:`normfast.engine.runner.artifact`).
    """

    def __init__(self, reader: Any = None):
        self.directions: Directions | None = None
        self.drift: Directions | None = None
        self.choice: Any = None
        self.adaptive: dict[str, Any] | None = None
        self.second_moments: dict[str, torch.Tensor] | None = None
        self.reader = reader
        #: every virtual batch's (objective value, gradient norm) seen by any run: the objective's health,
        #: so that a later run (whose directions come from here) reports and classifies as the first did
        self.batch_stats: dict[int, tuple[float, float]] = {}
        #: the heat's draw from the drift's pool and the pool's mean direction (heat_sampling="energy"), so
        #: that a later run folds the heat's directions it computes again as the first did
        self.heat_draw: HeatDraw | None = None
        self.pool_mean: dict[str, torch.Tensor] | None = None


class ProbeRun:
    """State shared by the chunks of one probe run: the probed parameters and the cut, the presets,
    the mode, the virtual batches, the directions (computed once, shared across ranks) and the
    accumulators.

    It receives its call's :class:`~normfast.engine.config.ProbePlan` (checked by the entry point; read
    here, never checked again), its objective and pair source as resolved there, and the given AdamW
    ``second_moments``."""

    def __init__(
        self,
        encoder: Encoder,
        objective: Any,
        pairs: Any,
        plan: ProbePlan,
        pair_encoder: Encoder | None,
        progress: bool,
        second_moments: Mapping[str, torch.Tensor] | None = None,
        shard: Shard | None = None,
        n_items: int = 0,
        store: DirectionStore | None = None,
    ):
        self.shard = shard
        self.store = store
        self.n_items = n_items
        self.encoder = encoder
        self.objective = objective
        self.pairs = pairs
        self.plan = plan
        self.config = config = plan.config  # the settings as checked
        self.pair_encoder = pair_encoder
        self.progress = progress
        self.device = encoder.device
        self.names = resolve_parameters(encoder, config.params)
        stage_of = encoder.stage_of_parameters()
        self.cut = min(stage_of[n] for n in self.names)
        self.presets = plan.presets_for(self.names)
        #: AdamW's v̂ given by the caller (ahead of any estimate, per parameter)
        self.given_v = second_moments
        self.branches = tuple(b for b in ("u", "w") if b in {p.branch for p in self.presets.values()})
        self.branch = "uw" if len(self.branches) == 2 else self.branches[0]
        self.mode = self._choose_mode()
        self.output = config.output
        if self.output == "tokens" and not encoder.has_tokens:
            raise ValueError(
                f"probe: output='tokens' needs a sequence model; {type(encoder).__name__} has no token positions"
            )
        rng = np.random.default_rng(config.seed)
        from normfast.data.batches import virtual_batches  # looked up per run: patchable

        batch_seed = int(rng.integers(2**31))
        if plan.batch_indices is None:
            # M_D batches with the mean-direction drift; the first M (drawn first from the same
            # generator, so the same as without it) are the heat's
            self.batches = virtual_batches(len(pairs), plan.total_batches, config.batch_size, batch_seed)
        else:  # explicit batches replace the draw, in the same layout (checked against the source by the Prober)
            self.batches = list(plan.batch_indices)
        self.acc_dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        self.groups = plan.groups  # K: heat batch b (and drift batch b) in group b mod K
        self.M = config.batches  # the heat's M (adaptive M may raise it)
        self.adaptive: dict[str, Any] | None = None
        self.estimated_v = store.second_moments if store is not None else None
        self.snapshot = None  # the single-snapshot predictor (config.snapshot), for every item at once
        self.writer = None  # set by probe when it writes files (the resume state lives beside them)
        self.truncation_warned = False  # inputs cut at the model's maximum length: warned once per run
        #: every virtual batch's (objective value, gradient norm) seen so far: the objective's health
        self.batch_stats: dict[int, tuple[float, float]] = {} if store is None else store.batch_stats
        self.unused_warned = False  # probed parameters no batch reaches: warned once per run
        self.heat_sampling, self.heat_sampling_note = resolve_heat_sampling(plan, self.branch)
        self.heat_draw: HeatDraw | None = store.heat_draw if store is not None else None
        self.pool_mean: dict[str, torch.Tensor] | None = store.pool_mean if store is not None else None
        self.pool: Directions | None = None  # the pool pass (the drift's group means), once per run

    @property
    def known_mean(self) -> bool:
        """Whether the heat's directions are centered and weighted draws (the known-mean estimator)."""
        return self.heat_sampling == "energy"

    @property
    def heat_level_se(self) -> float:
        """The pool's own error of the heat's level (log units; 0 for the plain draw)."""
        return self.heat_draw.level_se if self.heat_draw is not None else 0.0

    def computed_nothing(self) -> bool:
        """Whether this run saw no virtual batch (a resume whose chunks were all written before)."""
        return not self.batch_stats

    def heat_sampling_info(self) -> dict[str, Any]:
        """The run's metadata ``heat_sampling``: what ran, why, and the draw's figures."""
        info: dict[str, Any] = {"asked": self.config.heat_sampling, "method": self.heat_sampling}
        if self.heat_sampling_note:
            info["note"] = self.heat_sampling_note
        if self.heat_draw is not None:
            info.update(self.heat_draw.head(self.M).metadata())
        return info

    def _choose_mode(self) -> str:
        mode = self.config.mode
        head = self.encoder.head()
        head_ok = (
            head is not None
            and set(self.names) <= set(head.parameter_names)
            and head.weight_name in self.names
            and self.branch != "uw"
        )
        if mode == "head" and not head_ok:
            hint = self.encoder.head_hint() if head is None and hasattr(self.encoder, "head_hint") else ""
            raise ValueError(
                "probe: mode='head' needs the probed parameters to be exactly the final linear "
                "head's weight (and bias) with one optimizer preset; use mode='jvp' or params='head'"
                + (f". {type(self.encoder).__name__} has no head: {hint}" if hint else "")
            )
        if mode == "auto":
            return "head" if head_ok else "jvp"
        return mode

    # -- directions -------------------------------------------------------------
    def all_directions(self) -> Directions:
        """The M heat directions and, with the mean-direction drift, the drift's K group means (one pass).

        Kept in the run's store (when it has one) for the next run."""
        store = self.store
        if store is not None and store.directions is not None:
            return store.directions
        if store is not None and store.reader is not None:
            dirs = self._noted(store.reader.read(range(self.M), self.plan.drift_from_mean, self.device))
        else:
            dirs = self._shared(lambda: self.fresh_directions(list(range(self.M)), self.plan.drift_from_mean))
        if store is not None:
            store.directions = dirs
        return dirs

    def drift_directions(self) -> Directions:
        """Only the drift's K group means over its M_D batches (the directions-outer order)."""
        store = self.store
        if store is not None and store.drift is not None:
            return store.drift
        if store is not None and store.reader is not None:
            dirs = self._noted(store.reader.read([], True, self.device))
        else:
            dirs = self._shared(lambda: self.fresh_directions([], True))
        if store is not None:
            store.drift = dirs  # K directions: kept, like the second moments
        return dirs

    def directions(self, batch_ids: Sequence[int]) -> Directions:
        """Directions for the given (consecutive) heat batches, without the drift (not kept: the
        directions-outer order is for directions that do not fit in memory together)."""
        store = self.store
        if store is not None and store.reader is not None:
            return self._noted(store.reader.read(batch_ids, False, self.device))
        return self._shared(lambda: self.fresh_directions(batch_ids, False))

    def fits(self) -> bool:
        """Whether the M directions fit the memory budget together (the chunks-outer order)."""
        return self.direction_group() >= self.M

    def _shared(self, compute: Callable[[], Directions]) -> Directions:
        """Sharded: computed on rank 0 only and broadcast (a collective: every rank calls it)."""
        if self.shard is None:
            return self._noted(compute())
        dirs, failure = None, None
        if self.shard.is_root:
            try:
                dirs = compute()
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank
                failure = exc
        self.shard.raise_if_root_failed(failure)
        return self._noted(self.shard.share_directions(dirs, self.device))

    def _noted(self, dirs: Directions) -> Directions:
        """Keep the batches' objective values and gradient norms (and the heat's draw, on every rank); warn
        once about unreached parameters."""
        self.batch_stats.update(dirs.batch_stats)
        self.adopt_heat(dirs)
        if dirs.unused and not self.unused_warned:
            self.unused_warned = True
            if self.shard is None or self.shard.is_root:
                warnings.warn(unused_warning(dirs.unused), UserWarning, stacklevel=2)
        return dirs

    def adopt_heat(self, dirs: Directions | None) -> None:
        """The heat's draw of directions computed elsewhere (rank 0's, or a saved artifact's), kept on this
        rank and in the store: every rank's rows take its level error."""
        if dirs is not None and dirs.heat is not None and self.heat_draw is None:
            self.heat_draw = dirs.heat
            if self.store is not None:  # a later run of the same store reads its directions from there
                self.store.heat_draw = dirs.heat

    def objective_health(self) -> dict[str, Any]:
        """The virtual objective's health over every batch seen (:mod:`normfast.engine.diagnostics.health`)."""
        return objective_health(self.batch_stats, self.config.batch_size, self.groups, self.objective)

    def checkpoint(self, failure: BaseException | None) -> None:
        """Sharded: every rank learns whether any rank failed (a collective); raise if one did."""
        if self.shard is not None:
            self.shard.exchange(failure)
        elif failure is not None:
            raise failure

    def chunk_len(self, c: int) -> int:
        return min(self.config.chunk_size, self.n_items - c * self.config.chunk_size)

    def bar(self, todo: Sequence[int], desc: str) -> "ChunkBar":
        return ChunkBar(self, todo, desc)

    def fresh_directions(self, batch_ids: Sequence[int], with_drift: bool) -> Directions:
        """The directions of the given heat batches computed now (never read from the store or a saved
        artifact; :meth:`directions` and :meth:`all_directions` choose), with the drift's group means when
        ``with_drift`` (:func:`~normfast.engine.directions.gradients.compute_directions` over this run)."""
        if self.known_mean:
            return sampled_directions(self, batch_ids, with_drift)
        cfg = self.config
        if with_drift:
            # one pass over all M_D batches: the first len(batch_ids) kept, all summed per group;
            # AdamW's v̂ (when not given) is the mean of ĝ² over all of them
            dirs = self.directions_pass(
                self.batches,
                keep=len(batch_ids),
                drift_groups=self.groups,
                check_invariance=True,
                second_moments=self.given_v,
            )
            if dirs.second_moments:
                self.keep_second_moments(dirs.second_moments)
            return dirs
        second = self.given_v
        if len(batch_ids) < len(self.batches) and "w" in self.branches:
            if self.estimated_v is None and self.given_v is None:  # AdamW's v̂ must come from all batches
                adam = [n for n in self.names if self.presets[n].preconditioned]
                estimated = estimate_second_moments(
                    self.encoder,
                    self.objective,
                    self.pairs,
                    adam,
                    self.batches,
                    cut=self.cut,
                    pair_encoder=self.pair_encoder,
                    seed=cfg.seed,
                    progress=self.progress,
                    check_invariance=False,
                )
                self.keep_second_moments(estimated)
            second = self.second_moments(self.estimated_v)
        return self.directions_pass(
            [self.batches[b] for b in batch_ids],
            batch_offset=batch_ids[0],
            check_invariance=batch_ids[0] == 0 and not self.plan.drift_from_mean,
            second_moments=second,
        )

    def directions_pass(self, batches: Sequence[Any], **options: Any) -> Directions:
        """One pass of :func:`~normfast.engine.directions.gradients.compute_directions` over ``batches``
        with this run's model, objective, pair source, parameters and presets, its frozen front, pair
        encoder, decay exemptions, seed and progress bars (unreached parameters are said once, by the run);
        ``options``: the pass's own (kept batches, drift groups, batch ids, invariance check, v̂)."""
        cfg = self.config
        return compute_directions(
            self.encoder,
            self.objective,
            self.pairs,
            self.names,
            self.presets,
            batches,
            warn_unused=False,
            cut=self.cut,
            pair_encoder=self.pair_encoder,
            no_decay=cfg.no_decay,
            seed=cfg.seed,
            progress=self.progress,
            **options,
        )

    def second_moments(self, estimated: Mapping[str, torch.Tensor] | None) -> Mapping[str, torch.Tensor] | None:
        """AdamW's v̂ per parameter: the given one where there is one, else ``estimated``."""
        if not estimated:
            return self.given_v
        return {**estimated, **(self.given_v or {})}

    def keep_second_moments(self, second: dict[str, torch.Tensor]) -> None:
        self.estimated_v = second
        if self.store is not None:
            self.store.second_moments = second

    # -- one chunk -----------------------------------------------------------------
    def front(self, items: Sequence[Any]) -> tuple[dict, dict, torch.Tensor | None]:
        state = self.encoder.prepare(items)
        with torch.no_grad():
            front = self.encoder(state, 0, self.cut) if self.cut > 0 else state
        rows = state["mask"].bool() if self.output == "tokens" else None
        return state, front, rows

    def direction_bytes(self) -> int:
        """Memory of one update direction over the probed parameters (fp32)."""
        return sum(self.encoder.get_parameter(n).numel() for n in self.names) * 4

    def direction_group(self) -> int:
        """How many of the M directions fit in half the memory budget together."""
        return self.direction_group_for(self.M)

    def direction_group_for(self, m: int) -> int:
        """How many of ``m`` directions fit in half the memory budget together, beside the drift's K group
        means (held for the whole run when the drift comes from its own batches)."""
        per = max(self.direction_bytes(), 1)
        budget = self.config.memory_budget_mb * 2**20 / 2 - self.drift_bytes()
        return int(max(1, min(m, budget // per)))

    def drift_bytes(self) -> int:
        """Memory of the drift's K group-mean directions (0 with the per-batch drift)."""
        return self.groups * self.direction_bytes() if self.plan.drift_from_mean else 0

    def k_per_pass(self, n_rows: int, dim: int) -> int:
        if self.config.directions_per_pass is not None:
            return min(self.config.directions_per_pass, self.M)
        if not self.encoder.batched_directions:  # the encoder runs faster one direction per pass
            return 1
        tail_stages = max(1, self.encoder.n_stages - self.cut)
        # heuristic: a tangent carries ~16 activations of width d per row and tail stage (fp32), and the
        # pass stacks its directions over the probed parameters once more
        per_direction = n_rows * dim * tail_stages * 16 * 4 + self.direction_bytes()
        budget = self.config.memory_budget_mb * 2**20 / 2
        return int(max(1, min(self.M, budget // max(per_direction, 1))))

    def new_accumulator(self, n: int, d: int):
        kw = dict(branch=self.branch, device=self.device, dtype=self.acc_dtype, known_mean=self.known_mean)
        if self.config.uncertainty:
            return GroupedAccumulator(n, d, groups=self.groups, **kw)
        return ProbeAccumulator(n, d, **kw)

    def jvp_drift(self, tail: Tail, front: dict, rows, z: torch.Tensor, dirs: Directions) -> dict[str, Any]:
        """Drift statistics along the K group-mean directions of ``dirs.drift`` (K more jvps per branch)."""
        drift = dirs.drift
        step = min(self.k_per_pass(z.shape[0], z.shape[-1]), drift.K)
        out: dict[str, Any] = {}
        for b in self.branches:
            # stacked a pass at a time: the K means are not copied whole
            parts = [
                tail.jvp(front, drift.stacked(dirs.names, dirs.branch_of, b, range(lo, min(lo + step, drift.K))), rows)
                for lo in range(0, drift.K, step)
            ]
            stats = drift_from_groups(-torch.cat(parts), z, drift.counts, branch=b)
            reason = stats.pop("reason")
            for key in ("valid", "M"):
                stats.pop(key)
            out.setdefault("loo", {}).update(stats.pop("loo"))
            out.update(stats)
            out["reason"] = reason if "reason" not in out else torch.where(out["reason"] != 0, out["reason"], reason)
        return out

    def jvp_update(self, acc, tail: Tail, front: dict, rows, z: torch.Tensor, dirs: Directions) -> None:
        K = self.k_per_pass(z.shape[0], z.shape[-1])
        for lo in range(0, dirs.M, K):
            ids = list(range(lo, min(lo + K, dirs.M)))
            ts = {}
            for b in self.branches:
                ts[b] = -tail.jvp(front, dirs.stacked(ids, b), rows)
            kw = {"first_batch": dirs.first_batch + lo} if self.config.uncertainty else {}
            if self.branch == "uw":
                acc.update(ts["u"], z, t_w=ts["w"], **kw)
            else:
                acc.update(ts[self.branch], z, **kw)


class ChunkBar:
    """Progress over the chunks of a run, counted in probe items (so the ETA is right whatever the
    chunk sizes), with the rows written so far and their rate."""

    def __init__(self, run: ProbeRun, todo: Sequence[int], desc: str):
        self.run = run
        total = sum(run.chunk_len(c) for c in todo)
        if run.shard is not None:
            desc = f"{desc}, rank 0 of {run.shard.world_size}"
        self.bar = tqdm(
            total=total,
            desc=desc,
            unit="item",  # whole items: no unit scaling, which would show "8.00/30.0"
            disable=not run.progress,
            smoothing=0.05,
            dynamic_ncols=True,
        )
        self.rows = 0
        self.t0 = time.perf_counter()

    def advance(self, c: int, rows: int) -> None:
        self.rows += rows
        if self.bar.disable:
            return
        rate = self.rows / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.rows:,} rows, {rate:,.0f} rows/s", refresh=False)
        self.bar.update(self.run.chunk_len(c))

    def close(self) -> None:
        self.bar.close()
