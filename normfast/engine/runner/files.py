"""A probe run's output files: opening or resuming the work folder (a finished run returned as it is,
an earlier run's record compared through the resume key), and the saved state of the directions-outer
loop order (resumed after a kill, a group at most lost). Finishing a run is :mod:`.output`'s."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from normfast.data.manifest import manifest_path
from normfast.data.resume_key import PROBE_RESUME_KEY
from normfast.data.runwriter import ChunkedParquetWriter, holds_unfinished_run
from normfast.data.torchfiles import load_plain, save_plain
from normfast.engine.directions.gradients import NonFiniteLoss
from normfast.engine.result import ProbeResult
from normfast.engine.runner.distributed import Shard


@contextlib.contextmanager
def abandoned_if_not_finite(writer: Any) -> Iterator[None]:
    """A non-finite objective ends the run for good (the same arguments meet it again): its work folder
    goes, when this run made it, so that it does not block the next run as an unfinished one."""
    try:
        yield
    except NonFiniteLoss:
        if writer is not None:
            writer.abandon()
        raise


def open_output(
    out: Path, spec: Mapping[str, Any], key: str, shard: Shard | None, resume: bool, overwrite: bool
) -> tuple[ProbeResult | None, ChunkedParquetWriter | None, set[int]]:
    """Open (or create) the run's work folder; a finished run is returned instead when resuming.

    ``spec`` is the run's record (kept in ``run.json``) and ``key`` its resume key's hash
    (:data:`~normfast.data.resume_key.PROBE_RESUME_KEY`: the allow-list of what the rows depend on).
    Sharded: rank 0 checks and creates, then shares the outcome and the finished chunks.
    """
    finished = writer = failure = None
    done: set[int] = set()
    if shard is None or shard.is_root:
        try:
            finished = _finished_run(out, key, resume, overwrite, spec)
            if finished is None:
                writer = ChunkedParquetWriter(out, spec, resume=resume, overwrite=overwrite, key=PROBE_RESUME_KEY)
                done = writer.done()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            if shard is None:
                raise
            failure = exc
    if shard is None:
        return finished, writer, done
    shard.raise_if_root_failed(failure)
    state = shard.broadcast_object(None if finished is not None else sorted(done))
    if state is None:
        if finished is None:
            finished = ProbeResult.load(_existing_output(out))
        return finished, None, set()
    if writer is None:
        writer = ChunkedParquetWriter(out, spec, attach=True, key=PROBE_RESUME_KEY)
    return None, writer, set(state)


def _existing_output(out: Path) -> Path | None:
    for p in (manifest_path(out), out):
        if p.exists():
            return p
    return None


def _finished_run(
    out: Path, key: str, resume: bool, overwrite: bool, spec: Mapping[str, Any] | None = None
) -> ProbeResult | None:
    """With ``resume``: the finished run at ``out`` if it was made with the same arguments."""
    existing = _existing_output(out)
    if not resume or existing is None or holds_unfinished_run(out):
        return None
    try:
        result = ProbeResult.load(existing)
    except ValueError:
        if overwrite:
            return None  # unreadable here (damaged, or of a newer format): replaced
        raise
    if "spec_fingerprint" not in result.metadata:
        return None
    # its metadata through today's allow-list: keys added or dropped since it was written do not matter
    if PROBE_RESUME_KEY.fingerprint(result.metadata) == key:
        return result
    if not overwrite:
        changed = PROBE_RESUME_KEY.describe(result.metadata, spec or {})
        raise ValueError(
            f"cannot resume: {existing} holds a finished run made with different arguments; "
            f"changed: {changed}. Pass overwrite=True (CLI: --overwrite) to replace it"
        )
    return None


# ----------------------------------------------------------------------------
# the directions-outer loop order: its per-chunk state saved after every direction group
# ----------------------------------------------------------------------------
def _outer_file(writer: ChunkedParquetWriter, c: int) -> Path:
    return writer.parts / f"outer-{c:07d}.pt"


def restore_outer_state(run: Any, todo: Sequence[int]) -> tuple[dict[int, Any], dict[int, tuple], dict[int, int], int]:
    """Resume of the directions-outer order: ``(accumulators, kept per-chunk state, direction groups
    already in each restored chunk, the first group to compute)``, read from the work folder
    (nothing without one). Sharded: the first group is agreed by every rank (a collective)."""
    writer = run.writer
    accs: dict[int, Any] = {}
    kept: dict[int, tuple] = {}
    ahead: dict[int, int] = {}
    for c in todo if writer is not None else ():
        path = _outer_file(writer, c)
        if not path.exists():
            continue
        try:
            saved = load_plain(path, "the directions-outer state")
            meta, z, kappa, drift = saved["kept"]
            acc = run.new_accumulator(z.shape[0], z.shape[-1])
            states = saved["accumulator"]
            for part, state in zip(getattr(acc, "groups", [acc]), states):
                part.load_state_dict({k: v.to(run.device) for k, v in state.items()})
        except Exception as exc:  # noqa: BLE001 - a damaged state file: that chunk starts over
            warnings.warn(
                f"resume: {path} cannot be used ({type(exc).__name__}: {exc}); its chunk starts over",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        accs[c], ahead[c] = acc, int(saved["groups_done"])
        kept[c] = (meta, z, tuple(kappa), drift)
    first = min((ahead.get(c, 0) for c in todo), default=0)
    if run.shard is not None:
        first = min(run.shard.all_gather_object(first))
    return accs, kept, ahead, first


def save_outer_state(
    run: Any, groups_done: int, todo: Sequence[int], accs: Mapping[int, Any], kept: Mapping[int, tuple]
) -> None:
    """After a direction group: every chunk's accumulators and kept state into the work folder (atomic
    per chunk), so that a kill loses at most the group in progress."""
    writer = run.writer
    if writer is None:
        return
    for c in todo:
        acc = accs[c]
        state = {
            "groups_done": groups_done,
            "accumulator": [part.state_dict() for part in getattr(acc, "groups", [acc])],
            "kept": list(kept[c]),
        }
        save_plain(state, _outer_file(writer, c), writer.parts)
