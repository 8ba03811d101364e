"""What makes saved directions trustworthy (:mod:`normfast.engine.runner.artifact`): the files a
directions folder may hold, and every file checked against its manifest.

* :func:`check_save_target` -- a folder directions may be saved into: absent, empty, or (with
  ``overwrite``) saved directions only; anything else is named and left untouched.
  :func:`move_in` replaces the files of an existing folder, the manifest last.
* :func:`check_directions_folder` -- ``--directions FOLDER`` of ``probe`` and ``serve``, said before
  anything is loaded: saved directions, a place to save them, or neither (no manifest).
* :func:`verify_artifact` -- the one place where loaded directions are checked: the manifest's counts
  against the settings and the model, its file list, and every file (:func:`load_tensor_file`: size
  and SHA-256, :mod:`normfast.data.checksum`; the tensors against the layout; every value finite).
  What a later format adds to the manifest is checked here too.

Every refusal is one line naming the file, ending with :func:`rebuild_advice`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from normfast.data.checksum import read_checked

MANIFEST = "manifest.json"
#: the files of saved directions besides the manifest: what overwrite may replace
TENSOR_FILE = re.compile(r"(heat-\d{5}|drift-\d{3})\.safetensors")
#: the hidden folder an overwrite fills inside the folder (left by a save that was killed)
_FILLING = re.compile(r"\.new\.[0-9a-f]+\.tmp")


def heat_file(b: int) -> str:
    return f"heat-{b:05d}.safetensors"


def drift_file(g: int) -> str:
    return f"drift-{g:03d}.safetensors"


def rebuild_advice(folder: str | Path, manifest: Mapping[str, Any] | None = None) -> str:
    """How to make the directions in ``folder`` again (the end of every refusal of saved directions)."""
    manifest = manifest or {}
    model = manifest.get("model_name") or "MODEL"
    adapter = str(((manifest.get("fingerprint") or {}).get("encoder_settings") or {}).get("adapter", ""))
    if adapter.rsplit(".", 1)[-1] == model:  # an encoder built in Python, named by its class: no command loads it
        model = "MODEL"
    return (
        f"make them again: normfast directions {model} --pairs FILE --out {folder} --overwrite, with the "
        f"settings they were made with (or Prober(...).save(FOLDER, overwrite=True))"
    )


def _is_filling(path: Path) -> bool:
    """A hidden folder of an overwrite that was killed: only tensor files and a manifest in it."""
    return (
        _FILLING.fullmatch(path.name) is not None
        and path.is_dir()
        and not path.is_symlink()
        and all(_is_ours(p) and p.is_file() for p in path.iterdir())
    )


def _is_ours(path: Path) -> bool:
    """Whether an entry of a directions folder is one normfast writes there: a tensor file (a folder of
    that name is not), a manifest of saved directions (a user's own ``manifest.json`` is not), the
    hidden folder of an interrupted save."""
    if TENSOR_FILE.fullmatch(path.name):
        return path.is_symlink() or not path.is_dir()
    if path.name == MANIFEST:
        try:
            if not path.is_file() or path.stat().st_size > 2**26:
                return False
            return json.loads(path.read_text(encoding="utf-8")).get("kind") == "normfast directions"
        except (OSError, ValueError, AttributeError):
            return False
    return _is_filling(path)


def check_save_target(folder: str | Path, overwrite: bool, what: str) -> None:
    """Refuse to save directions into ``folder`` (``what``: how to name it, e.g. ``"Prober.save: d"``)
    unless it is absent, empty, or -- with ``overwrite`` -- a folder of saved directions only (its
    manifest, its tensor files, the hidden folder of an interrupted save): anything else in it is named,
    and nothing is touched. Called before the directions are computed, and again before they are written."""
    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise FileExistsError(f"{what} is a file; give a folder for the directions")
    entries = sorted(folder.iterdir())
    foreign = [p.name for p in entries if not _is_ours(p)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise FileExistsError(
            f"{what} holds files that are not saved directions ({shown}); choose another folder, or move them "
            f"away: overwrite replaces saved directions only"
        )
    if entries and not overwrite:
        held = "saved directions" if (folder / MANIFEST).is_file() else "the files of an interrupted save"
        raise FileExistsError(
            f"{what} holds {held} already; choose another folder, or pass overwrite=True (--overwrite) to replace them"
        )


def check_directions_folder(folder: str | Path, flag: str) -> bool:
    """``--directions FOLDER`` of ``probe`` and ``serve``, before anything is loaded or computed: True when
    it holds saved directions (a manifest), False when they are to be computed and saved there (absent or
    empty); anything else is refused in one line, with advice that works for those commands."""
    folder = Path(folder)
    if (folder / MANIFEST).is_file():
        return True
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise ValueError(f"{flag} {folder} is a file; give a folder for the directions")
    entries = sorted(p.name for p in folder.iterdir())
    if not entries:
        return False
    ours = all(_is_ours(folder / name) for name in entries)
    held = (
        "only the files of a save of directions that was interrupted"
        if ours
        else ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    )
    fix = f"delete it (rm -r {folder}) or " if ours else ""
    raise ValueError(
        f"{flag} {folder} holds no manifest.json, so no saved directions (it holds {held}); {fix}give "
        f"{flag} a folder that holds saved directions, or a new or empty one to save them to"
    )


def move_in(tmp: Path, folder: Path, names: Sequence[str]) -> None:
    """Replace the saved directions in ``folder`` by those filled in ``tmp`` (inside it): the old manifest
    goes first (the folder no longer claims to be whole), then the old files, then the new files move
    in, the manifest last."""
    (folder / MANIFEST).unlink(missing_ok=True)
    for p in folder.iterdir():
        if p == tmp:
            continue
        if _is_filling(p):
            shutil.rmtree(p)
        elif TENSOR_FILE.fullmatch(p.name) and p.name not in names:
            p.unlink()
    for name in names:
        os.replace(tmp / name, folder / name)
    os.replace(tmp / MANIFEST, folder / MANIFEST)
    tmp.rmdir()


def load_tensor_file(
    folder: Path, entry: Mapping[str, Any], layout: Mapping[str, tuple], device: Any, fn: str, advice: str
) -> dict[str, torch.Tensor]:
    """One file of saved directions, checked: its size and SHA-256 against its manifest ``entry``, its
    tensors against ``layout`` (name -> (shape, dtype)), every value finite. The bytes checked are the
    bytes parsed (safetensors: no pickle is ever run). A failure is one ``ValueError`` line naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = folder / entry["name"]
    data, why = read_checked(path, entry["sha256"], entry["bytes"])
    if data is None:
        raise ValueError(f"{fn}: {path} cannot be used: {why}; the saved directions are damaged: {advice}")
    try:
        tensors = load(data)
    except (SafetensorError, ValueError) as exc:  # a digest recorded for bytes that are no directions
        raise ValueError(f"{fn}: {path} cannot be read ({str(exc).splitlines()[0]}): {advice}") from None
    shapes = {n: (tuple(t.shape), str(t.dtype)) for n, t in tensors.items()}
    if shapes != dict(layout):
        raise ValueError(
            f"{fn}: {path} does not hold the parameters its manifest names (its tensors differ in name, shape or "
            f"dtype): {advice}"
        )
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"{fn}: {path} holds NaN or infinite values (in {name!r}): no probe can use such a direction; {advice}"
            )
    return {n: t.to(device) for n, t in tensors.items()}


def verify_artifact(
    folder: Path,
    manifest: Mapping[str, Any],
    *,
    M: int,
    drift_counts: list[int] | None,
    shapes: Mapping[str, tuple[int, ...]],
    heat_sampled: bool = False,
    fn: str = "Prober.load",
) -> None:
    """Everything that makes saved directions trustworthy, checked at once, before they are used (the one
    place for it): the manifest's counts against the settings (``M``, ``drift_counts``: the drift's group
    counts that M_D batches in K groups give; ``shapes``: the probed parameters' shapes; ``heat_sampled``:
    the heat's batches were drawn by energy, so the manifest holds the draw: M batches of the pool, each
    with a finite positive weight), its file list against them, and every file (:func:`load_tensor_file`).
    One ``ValueError`` line names what differs."""
    d = manifest["directions"]
    path = folder / MANIFEST
    advice = rebuild_advice(folder, manifest)

    def refuse(what: str) -> None:
        raise ValueError(f"{fn}: {path} {what}: the manifest was edited or damaged; {advice}")

    if d.get("drift_counts") != drift_counts:
        expected = "none (no mean-direction drift)" if drift_counts is None else str(drift_counts)
        m_d, k = sum(drift_counts or ()), len(drift_counts or ())
        refuse(
            f"records drift_counts {d.get('drift_counts')}, expected {expected}"
            + (f" (M_D = {m_d} drift batches in K = {k} groups)" if drift_counts else "")
        )
    if d.get("M") != M or len(d.get("losses") or ()) != M:
        refuse(f"records M = {d.get('M')} heat batches with {len(d.get('losses') or ())} losses, expected {M}")
    draw = d.get("heat_draw")
    if heat_sampled != bool(draw):
        refuse("records a heat draw" if draw else "records no heat draw, though the heat was drawn by energy")
    if draw:
        pool = sum(drift_counts or ())
        batches, weights = draw.get("batches"), draw.get("weights")
        if not (
            draw.get("pool") == pool
            and isinstance(batches, list)
            and isinstance(weights, list)
            and len(batches) == len(weights) == M
            and all(isinstance(b, int) and 0 <= b < pool for b in batches)
            and all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0 for w in weights)
            and isinstance(draw.get("level_se"), (int, float))
            and math.isfinite(draw["level_se"])
        ):
            refuse(f"records a heat draw that is not M = {M} batches of the pool of {pool}, each with a weight > 0")
    layout = {}
    for n, shape, dtype in d["layout"]:
        if tuple(shape) != tuple(shapes.get(n, ())):
            refuse(f"records the shape {tuple(shape)} for {n!r}, whose shape is {tuple(shapes.get(n, ()))}")
        layout[n] = (tuple(shape), dtype)
    expected_files = [heat_file(b) for b in range(M)] + [drift_file(g) for g in range(len(drift_counts or ()))]
    entries = manifest.get("files")
    ok = isinstance(entries, list) and all(
        isinstance(e, dict)
        and isinstance(e.get("bytes"), int)
        and isinstance(e.get("sha256"), str)
        and re.fullmatch(r"[0-9a-f]{64}", e["sha256"])
        for e in entries
    )
    if not ok or [e["name"] for e in entries] != expected_files:
        k = len(drift_counts or ())
        refuse(f"does not list the files of {M} heat and {k} drift directions, each with its size and SHA-256")
    for entry in entries:
        load_tensor_file(folder, entry, layout, "cpu", fn, advice)
