"""A Prober's directions on disk (``Prober.save``, ``Prober.load``, ``normfast directions``).

One folder:

* ``manifest.json`` -- what the directions were made from: the format, the engine version and the
  fingerprint (the model's weights and tokenizer, the encoder's settings, the pair encoder, the
  objective, the pair source, the settings the directions depend on, given second moments); and
  what they are: the probed parameters with their branches, shapes and dtypes, M, the drift's
  group counts, each heat batch's loss, adaptive M's choice, and the files with their sizes and SHA-256;
  and the fixed reference of the relative heat per output kind (``Prober.heat_reference``);
* ``heat-00000.safetensors`` ... -- one file per heat direction (M of them), keyed by parameter name
  (with ``heat_sampling="energy"``, draw ``i``'s direction folded as ``sqrt(w_i) (p_{b_i} - p̄)``; the
  manifest's ``heat_draw`` holds each draw's batch and weight);
* ``drift-000.safetensors`` ... -- one per drift group mean (K of them, with the mean-direction drift).

One file per direction, so that directions that do not fit the memory budget together are
written as they are computed and read back group by group (the directions-outer order). The
decayed parameters (the κ tangent) are not stored: they are the model's own weights, whose
fingerprint must match. A new folder is filled beside its place and renamed into it once complete;
an existing one (``overwrite``) is filled in a hidden folder inside it, and its files are moved
into place with the manifest last: either way a folder named by a manifest is whole.

What cannot lie (format 2; :mod:`normfast.engine.runner.integrity`):

* the manifest records every file's size and SHA-256 (:mod:`normfast.data.checksum`, the machinery
  of a run's chunks); ``verify_artifact`` checks every file against them, its tensors against
  the layout, every value for NaN and infinities, and the drift's group counts and M against the
  settings, when the directions are loaded -- before a probe opens its output -- and each file
  again whenever it is read. A mismatch is one ``ValueError`` line naming the file, with the
  command that makes the directions again; a folder of format 1 (no checksums) is refused the same way;
* ``overwrite`` replaces only a folder of saved directions (the manifest, the tensor files, the
  hidden folder of an interrupted save): a folder holding anything else is refused, naming it, and
  nothing in it is touched (``check_save_target``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from normfast.data.atomic import temporary_folder
from normfast.data.checksum import sha256_hex
from normfast.engine.directions.gradients import Directions, DriftMeans
from normfast.engine.directions.sampling import HeatDraw
from normfast.engine.runner.integrity import (
    MANIFEST,
    check_save_target,
    drift_file,
    heat_file,
    load_tensor_file,
    move_in,
    rebuild_advice,
    verify_artifact,
)

#: 3: the heat's directions may be importance-sampled draws (``directions.heat_draw``), folded as
#: ``sqrt(w) (p - p̄)``; 2: every file's SHA-256 in the manifest; older folders are refused, with the
#: command that makes them again
FORMAT = 3
#: the ProbeConfig fields the directions depend on; the others (lr, weight_decay and momentum: the
#: law's; output, mode, chunking, memory budget, error bars, the snapshot) act in the per-item pass only
DIRECTION_FIELDS = (
    "params",
    "optimizer",
    "betas",
    "eps",
    "no_decay",
    "batches",
    "drift_batches",
    "heat_sampling",
    "groups",
    "batch_size",
    "seed",
    "batch_indices",
    "target_rse",
    "max_batches",
    "target_quantile",
)


def plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples as lists, keys as strings): what a manifest compares."""
    return json.loads(json.dumps(value, default=str))


def is_artifact(folder: str | Path) -> bool:
    """Whether ``folder`` holds saved directions (its manifest)."""
    return (Path(folder) / MANIFEST).is_file()


def read_artifact_manifest(folder: str | Path, fn: str = "Prober.load") -> dict[str, Any]:
    """The manifest of the saved directions in ``folder`` (this artifact's; a sharded run's manifest is
    :func:`normfast.data.manifest.read_manifest`'s); a clear error for anything else."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        what = "does not exist" if not folder.exists() else "holds no saved directions (no manifest.json)"
        raise FileNotFoundError(
            f"{fn}: {folder} {what}; save directions there first (Prober.save, or normfast directions ... --out FOLDER)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{fn}: {path} is not valid JSON ({exc}); {rebuild_advice(folder)}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != "normfast directions":
        raise ValueError(
            f"{fn}: {path} is not the manifest of saved directions (normfast did not write it); give a folder "
            f"that holds saved directions"
        )
    version = manifest.get("format")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT:
        raise ValueError(
            f"{fn}: {folder} holds directions in format {version}, written by a newer normfast; this normfast "
            f"reads format {FORMAT}: upgrade normfast (pip install -U normfast), or "
            f"{rebuild_advice(folder, manifest)}"
        )
    if version != FORMAT:
        raise ValueError(
            f"{fn}: {folder} holds directions in format {version!r}, an older layout than this normfast reads "
            f"(format {FORMAT}: checksums from 2, the heat's draw from 3); {rebuild_advice(folder, manifest)}"
        )
    return manifest


def saved_config(folder: str | Path) -> Any:
    """The :class:`~normfast.engine.config.ProbeConfig` the directions in ``folder`` were saved with."""
    from normfast.engine.config import ProbeConfig

    fields = dict(read_artifact_manifest(folder)["config"])
    fields["betas"] = tuple(fields["betas"])
    return ProbeConfig(**fields)


def mismatch(saved: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    """What differs between two fingerprints, one phrase per difference (``settings.seed (saved 0, given 1)``)."""
    out = []
    for key in sorted(set(saved) | set(given)):
        a, b = saved.get(key), given.get(key)
        if plain(a) == plain(b):
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{phrase}" for phrase in mismatch(a, b)]
        else:
            out.append(f"{key} (saved {_short(a)}, given {_short(b)})")
    return out


def _short(value: Any) -> str:
    text = json.dumps(plain(value), sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def write_artifact(
    folder: str | Path,
    manifest: dict[str, Any],
    heat: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
    drift: Sequence[Mapping[str, torch.Tensor]] | None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write the directions (``heat``: ``(b, {name: tensor})`` in order; ``drift``: the group means)
    and ``manifest`` (with every file's size and SHA-256) into ``folder``: a new folder is filled beside
    its place and renamed into it; an existing one (empty, or saved directions with ``overwrite``) is
    filled in a hidden folder inside it, whose files then replace the old ones, the manifest last."""
    folder = Path(folder)
    check_save_target(folder, overwrite, f"Prober.save: {folder}")
    in_place = folder.exists()
    if in_place:
        tmp = temporary_folder(folder / "new")  # inside: the same file system, and nothing left beside it
    else:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_folder(Path(os.path.abspath(folder)))
    try:
        files = []
        for b, tensors in heat:
            files.append(_save(tmp / heat_file(b), tensors))
        for g, tensors in enumerate(drift or ()):
            files.append(_save(tmp / drift_file(g), tensors))
        manifest = {**manifest, "files": files, "bytes": sum(f["bytes"] for f in files)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str) + "\n", encoding="utf-8")
        if in_place:
            move_in(tmp, folder, [f["name"] for f in files])
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _save(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """One direction's tensors into ``path``, and its manifest entry (name, size, SHA-256). Serialized in
    memory and written with ``open`` (the mode the umask gives: safetensors' own ``save_file`` makes its
    files 0600), so the digest is of the very bytes written."""
    from safetensors.torch import save

    data = save({n: t.detach().contiguous().cpu() for n, t in tensors.items()})
    with open(path, "wb") as fh:
        fh.write(data)
    return {"name": path.name, "bytes": len(data), "sha256": sha256_hex(data)}


class ArtifactReader:
    """Serves saved directions, whole or a group of batches at a time, as :class:`Directions`.

    ``decayed``: the κ tangent, the model's own probed weights (not stored: the model's fingerprint
    was checked against the manifest's)."""

    def __init__(self, folder: str | Path, manifest: Mapping[str, Any], decayed: dict[str, torch.Tensor]):
        self.folder = Path(folder)
        self.manifest = manifest
        self.decayed = decayed
        d = manifest["directions"]
        self.names: list[str] = list(d["names"])
        self.branch_of: dict[str, str] = dict(d["branch_of"])
        self.layout = {n: (tuple(shape), dtype) for n, shape, dtype in d["layout"]}
        self.M = int(d["M"])
        self.losses = list(d["losses"])
        self.drift_counts = d["drift_counts"]
        self.entries = {e["name"]: e for e in manifest["files"]}
        #: every batch's (objective value, gradient norm), the drift's included: the objective's health
        self.batch_stats = {int(b): (float(loss), float(norm)) for b, loss, norm in d.get("batch_stats", ())}
        #: the heat's draw (heat_sampling="energy"; None: plain directions)
        self.heat = HeatDraw.from_json(d["heat_draw"]) if d.get("heat_draw") else None

    def read(self, batch_ids: Sequence[int], with_drift: bool, device: torch.device) -> Directions:
        batch_ids = list(batch_ids)
        if batch_ids and max(batch_ids) >= self.M:
            raise ValueError(
                f"Prober: the directions in {self.folder} hold {self.M} heat batches, the run asks for "
                f"batch {max(batch_ids)}; compute them again for these settings"
            )
        if with_drift and self.drift_counts is None:
            raise ValueError(
                f"Prober: the directions in {self.folder} have no drift directions (saved with "
                f"drift_batches=None); compute them again for these settings"
            )
        heat = [self._load(heat_file(b), device) for b in batch_ids]
        drift = None
        if with_drift:
            drift = DriftMeans(
                [self._load(drift_file(g), device) for g in range(len(self.drift_counts))], list(self.drift_counts)
            )
        return Directions(
            list(self.names),
            dict(self.branch_of),
            heat,
            {n: t.to(device) for n, t in self.decayed.items()},
            [self.losses[b] for b in batch_ids],
            drift,
            None,
            batch_ids[0] if batch_ids else 0,
            dict(self.batch_stats),
            heat=self.heat,
        )

    def _load(self, name: str, device: torch.device) -> dict[str, torch.Tensor]:
        """A file, checked again as it is read (it was checked whole when the directions were loaded)."""
        return load_tensor_file(
            self.folder, self.entries[name], self.layout, device, "Prober", rebuild_advice(self.folder, self.manifest)
        )


class SavedPairs:
    """The pair source of loaded directions when it is not given: its size and fingerprint only.

    The per-item pass never reads pairs; what would (the snapshot's trajectory, computing
    directions again) is refused with the fix."""

    detached = True

    def __init__(self, n: int, drawn: str):
        self.n = int(n)
        self.drawn = drawn

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: Any) -> Any:
        raise ValueError(
            "Prober: these directions were loaded without their pair source, and this step reads it; "
            "pass pairs= to Prober.load"
        )


def save_directions(prober: Any, folder: Path, *, overwrite: bool = False) -> Path:
    """``Prober.save``: the prober's directions (computed first if needed) into ``folder``."""
    from dataclasses import asdict

    from normfast.engine.runner.distributed import current_shard

    cfg = prober.config
    store = prober.store
    check_save_target(folder, overwrite, f"Prober.save: {folder}")  # before anything is computed
    if cfg.target_rse is not None and store.choice is None:
        raise ValueError(
            "Prober.save: adaptive M (config.target_rse) chooses M on the first call's probe items; call "
            "probe() first, or fix M with batches= and target_rse=None"
        )
    fp = prober.fingerprint()
    shard = current_shard()
    run = prober.new_run(0, prober.progress, shard)
    choice = store.choice
    if choice is not None:
        run.M = choice.M
    losses: list[float] = []  # filled as the heat directions are written, before the manifest is
    batch_stats: list[list[float]] = []  # (batch, objective value, gradient norm) of every batch, likewise

    def note_stats() -> None:
        batch_stats[:] = [[b, loss, norm] for b, (loss, norm) in sorted(run.batch_stats.items())]

    if choice is not None and choice.directions is not None:
        full = choice.directions
    elif choice is None and run.fits():
        full = run.all_directions()
    else:
        full = None
    if full is not None:
        losses += full.losses
        heat = [(b, full.directions[b]) for b in range(full.M)]
        drift = full.drift
        note_stats()
    else:  # the directions-outer order: computed (or read) and written a group at a time
        group = run.direction_group()

        def groups():
            for lo in range(0, run.M, group):
                part = run.directions(list(range(lo, min(lo + group, run.M))))
                losses.extend(part.losses)
                yield from ((lo + i, d) for i, d in enumerate(part.directions))
            note_stats()

        heat = groups()
        drift = None
        if prober.plan.drift_from_mean:
            drift = (choice.drift if choice is not None and choice.drift is not None else run.drift_directions()).drift
    first = full.directions[0] if full is not None and full.directions else None
    if first is None:
        first = drift.means[0] if drift is not None else None
    names = list(run.names)
    layout = [] if first is None else [(n, list(first[n].shape), str(first[n].dtype)) for n in names]
    per_direction = sum(first[n].numel() * first[n].element_size() for n in names) if first is not None else 0
    n_drift = drift.K if drift is not None else 0
    manifest = {
        "kind": "normfast directions",
        "format": FORMAT,
        "fingerprint": fp,
        "model_name": prober.model_name,
        "config": asdict(cfg),
        "directions": {
            "names": names,
            "branch_of": {n: run.presets[n].branch for n in names},
            "layout": layout,
            "M": run.M,
            "drift_counts": None if drift is None else list(drift.counts),
            "losses": losses,
            "batch_stats": batch_stats,
            "heat_draw": None if run.heat_draw is None else run.heat_draw.head(run.M).to_json(),
            "adaptive": store.adaptive if choice is not None else None,
            "mode": run.mode,
            "cut_stage": run.cut,
            "bytes_per_direction": per_direction,
            "memory_bytes": per_direction * (run.M + n_drift),
        },
        # the fixed reference of heat_rel, per output kind (Prober.heat_reference): kept with the directions
        "heat_reference": prober.saved_references(),
    }
    if shard is not None and not shard.is_root:
        for _ in heat:  # the other ranks take part in the collectives; rank 0 writes
            pass
        return folder
    return write_artifact(folder, manifest, heat, None if drift is None else drift.means, overwrite=overwrite)


def load_directions(
    cls: Any,
    folder: Path,
    encoder: Any,
    objective: Any,
    pairs: Any,
    config: Any,
    *,
    model_name: str | None = None,
    **inputs: Any,
) -> Any:
    """``Prober.load``: a Prober of class ``cls`` over the directions in ``folder``, its inputs checked
    (``inputs``: the Prober's other keyword arguments, passed to it as they are)."""
    from normfast.encoders import Encoder, load_encoder
    from normfast.engine.directions.gradients import decayed_parameters
    from normfast.engine.estimators.uncertainty import group_counts
    from normfast.engine.runner.adaptive import AdaptiveChoice

    manifest = read_artifact_manifest(folder)
    saved = manifest["fingerprint"]
    if config is None:
        config = saved_config(folder)
    if objective is None:
        objective = _saved_objective(saved["objective"])
    if model_name is None and not isinstance(encoder, str):
        model_name = manifest.get("model_name")
    if not isinstance(encoder, Encoder):
        model_name = model_name or (encoder if isinstance(encoder, str) else None)
        encoder = load_encoder(encoder)
    detached = pairs is None
    if detached:
        pairs = SavedPairs(saved["pairs"]["n"], saved["pairs"]["drawn"])
    prober = cls(encoder, objective, pairs, config, model_name=model_name, **inputs)
    if detached:
        prober.pair_hashes[False] = saved["pairs"]["drawn"]
    config = prober.config  # the settings as the Prober checked them
    differs = mismatch(saved, prober.fingerprint())
    if differs:
        raise ValueError(
            f"Prober.load: the directions in {folder} were made for other inputs: {'; '.join(differs)}; "
            f"compute them again for these (Prober(...).save(FOLDER), or normfast directions ... --out FOLDER)"
        )
    d = manifest["directions"]
    run = prober.new_run(0, False, None)
    if list(run.names) != list(d["names"]):
        raise ValueError(
            f"Prober.load: the directions in {folder} are over other parameters ({len(d['names'])} saved, "
            f"{len(run.names)} selected by params={config.params!r}); compute them again"
        )
    # every file checked now, before a probe opens its output: a refusal leaves nothing behind
    verify_artifact(
        folder,
        manifest,
        M=int(d["M"]) if d.get("adaptive") else run.M,
        drift_counts=group_counts(len(run.batches), run.groups) if prober.plan.drift_from_mean else None,
        shapes={n: tuple(encoder.get_parameter(n).shape) for n in run.names},
        heat_sampled=run.known_mean,
    )
    store = prober.store
    store.reader = ArtifactReader(folder, manifest, decayed_parameters(encoder, run.names, config.no_decay))
    if d.get("adaptive"):
        store.choice = AdaptiveChoice(int(d["M"]), None, None, list(d["adaptive"].get("rounds", [])))
        store.adaptive = dict(d["adaptive"])
    prober.source = str(folder)
    prober.references.update(manifest.get("heat_reference") or {})
    return prober


def _saved_objective(saved: Mapping[str, Any]) -> Any:
    """The objective the directions were made with, rebuilt by name and settings."""
    from normfast.engine.directions.objectives import get_objective, objective_settings

    name, settings = saved["name"], dict(saved["settings"])
    for kwargs in (settings, {k: v for k, v in settings.items() if k == "temperature"}, {}):
        try:
            objective = get_objective(name, **kwargs)
        except (TypeError, ValueError):
            continue
        if plain(objective_settings(objective)) == plain(settings):
            return objective
    raise ValueError(
        f"Prober.load: the directions were made with the objective {name!r} ({_short(settings)}), which cannot "
        f"be rebuilt by name; pass objective="
    )
