"""Scale-out: shard the probe items of one run over the ranks of a ``torch.distributed`` group.

Launch with ``torchrun`` (``torchrun --nproc-per-node 4 -m normfast probe ...``),
or call :func:`normfast.engine.probe.probe` with the same arguments in every rank of
an initialized default process group. gloo serves CPU runs, NCCL GPU runs
(:func:`init_from_env` picks by device, as the CLI does; with NCCL each rank
must have set its CUDA device, ``torch.cuda.set_device``, before ``probe``).
Tables are bit-identical to a single-process run when every process uses the
same number of threads (``torchrun`` sets ``OMP_NUM_THREADS=1``): BLAS
reductions depend on it.

What is sharded, and how
------------------------
* **Probe items.** A run is cut into chunks of ``chunk_size`` items (the
  unit of streaming and resume). The chunks not yet finished are dealt round
  robin: the ``i``-th missing chunk goes to rank ``i % world_size``, so on a
  fresh run chunk ``c`` goes to rank ``c % world_size``, and a resumed run
  spreads only the missing chunks evenly, whatever world size it runs with.
* **Directions.** The virtual-batch directions (and the decayed parameters,
  the κ tangent) are computed once, on rank 0, and broadcast, one virtual
  batch per broadcast (the extra memory is one flattened direction), so every
  rank probes with bit-identical directions. In head mode these are exactly
  the stacked head directions. With the directions-outer loop order each
  group is computed and broadcast in turn.
* **Output.** Every rank writes its finished chunks into the run's work
  folder ``OUT.parquet.parts/``, which therefore must be on a filesystem all
  ranks see. When every chunk is done, rank ``r`` writes part ``r``, the
  ``r``-th contiguous block of chunks, as ``OUT.rank{r}-of-{W}.parquet`` (so
  the parts in order hold the items in order), and rank 0 writes
  ``OUT.manifest.json`` (:mod:`normfast.data.manifest`) and removes the work folder.
  ``ProbeResult.load`` and ``normfast report`` read the manifest as one
  table. Without ``out=`` the ranks exchange their rows and every rank gets
  the whole table in memory.

Failure
-------
A rank whose chunk raises reports it at the next exchange and every rank
raises (no rank is left waiting). A rank that dies outright leaves the others
blocked in the next collective until the launcher stops them (``torchrun``
does) or the process group times out. Either way the finished chunk files
stay valid; rerunning with ``resume=True`` (CLI ``--resume``), with any
number of ranks, computes only the missing chunks.

Supported, and not
------------------
Supported: item sharding in every mode (head, jvp with the chunks-outer or
directions-outer loop order), pooled and token outputs, all optimizer
presets, resuming with a different world size, in-memory results.

Not supported by :func:`~normfast.engine.probe.probe`: splitting the *directions* of
one chunk over ranks (every rank evaluates all ``M`` directions on its own
items). :func:`merge_across_ranks` is the exact building block for that
layout (each rank accumulates different directions for the same probes, then
Chan's merge), for frontends that drive :class:`~normfast.ops.ProbeAccumulator`
themselves. Also unsupported: process groups other than the default one, and
hosts that do not share the output filesystem.
"""

from __future__ import annotations

import builtins
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from normfast.engine.directions.gradients import Directions, DriftMeans
from normfast.engine.directions.sampling import HeatDraw

# Exception types rebuilt under their own name on the ranks that did not raise,
# so that every rank fails the same way (the CLI reports these as user errors).
_PORTABLE_ERRORS = (
    "ValueError",
    "TypeError",
    "FileExistsError",
    "FileNotFoundError",
    "RuntimeError",
    "FloatingPointError",
    "KeyError",
    "IndexError",
    "MemoryError",
    "NotImplementedError",
    "PermissionError",
    "IsADirectoryError",
    "OSError",
)


@dataclass(frozen=True)
class Shard:
    """This process's place in the default process group (``world_size > 1``)."""

    rank: int
    world_size: int
    backend: str

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where tensors must live for this backend's collectives."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- objects ---------------------------------------------------------------
    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; for small objects)."""
        box = [obj if self.is_root else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (pickled)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    # -- failure ---------------------------------------------------------------
    def raise_if_root_failed(self, exc: BaseException | None) -> None:
        """Collective: rank 0 passes the exception it caught (or None); every rank raises if it failed."""
        status = self.broadcast_object(None if exc is None else _describe(exc))
        if self.is_root:
            if exc is not None:
                raise exc
            return
        if status is not None:
            raise _rebuild(status, origin="rank 0")

    def exchange(self, exc: BaseException | None, payload: Any = None) -> list[Any]:
        """Collective: every rank passes the exception it caught (or None) and a payload.

        If any rank failed, every rank raises (the failed ones their own exception,
        the others the first failure, rebuilt); otherwise returns the payloads in rank order.
        """
        items = self.all_gather_object((None if exc is None else _describe(exc), payload))
        failed = [(r, status) for r, (status, _) in enumerate(items) if status is not None]
        if failed:
            if exc is not None:
                raise exc
            r, status = failed[0]
            raise _rebuild(status, origin=f"rank {r} of {self.world_size}")
        return [p for _, p in items]

    def check_agree(self, value: str, what: str) -> None:
        """Collective: raise on every rank unless all ranks hold the same ``value``."""
        values = self.all_gather_object(value)
        if len(set(values)) > 1:
            raise ValueError(
                f"probe: the ranks were called with different {what} (fingerprints by rank: "
                f"{values}); every rank must pass the same model, probes, objective, pairs "
                f"and config"
            )

    # -- directions ------------------------------------------------------------
    def share_directions(self, dirs: Directions | None, device: torch.device) -> Directions:
        """Collective: rank 0's :class:`Directions` on every rank, bit for bit.

        Rank 0 passes its directions, the others ``None``. One broadcast per
        virtual batch and per drift group mean (tensors flattened per dtype)
        plus one for the decayed parameters; received tensors are placed on
        ``device``. (AdamW's estimated ``v̂`` stays on rank 0, which alone
        computes directions.)
        """
        header = None
        if self.is_root:
            first = dirs.directions[0] if dirs.directions else (dirs.drift.means[0] if dirs.drift else {})
            header = {
                "names": list(dirs.names),
                "branch_of": dict(dirs.branch_of),
                "losses": list(dirs.losses),
                "batch_stats": dict(dirs.batch_stats),
                "unused": list(dirs.unused),
                "M": dirs.M,
                "drift_counts": None if dirs.drift is None else list(dirs.drift.counts),
                "first_batch": dirs.first_batch,
                "layout": [(n, tuple(first[n].shape), str(first[n].dtype)) for n in dirs.names],
                "decayed": [(n, tuple(t.shape), str(t.dtype)) for n, t in dirs.decayed.items()],
                "heat": None if dirs.heat is None else dirs.heat.to_json(),
            }
        header = self.broadcast_object(header)
        directions = []
        for b in range(header["M"]):
            sent = dirs.directions[b] if self.is_root else None
            directions.append(self._broadcast_tensors(sent, header["layout"], device))
        drift = None
        if header["drift_counts"] is not None:
            means = [
                self._broadcast_tensors(dirs.drift.means[g] if self.is_root else None, header["layout"], device)
                for g in range(len(header["drift_counts"]))
            ]
            drift = DriftMeans(means, list(header["drift_counts"]))
        decayed = self._broadcast_tensors(dirs.decayed if self.is_root else None, header["decayed"], device)
        if self.is_root:
            return dirs
        return Directions(
            header["names"],
            header["branch_of"],
            directions,
            decayed,
            header["losses"],
            drift,
            first_batch=header["first_batch"],
            batch_stats=header["batch_stats"],
            unused=header["unused"],
            heat=None if header["heat"] is None else HeatDraw.from_json(header["heat"]),
        )

    def _broadcast_tensors(
        self, tensors: dict[str, torch.Tensor] | None, layout: Sequence[tuple], device: torch.device
    ) -> dict[str, torch.Tensor]:
        comm = self.comm_device
        out: dict[str, torch.Tensor] = {}
        by_dtype: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name, shape, dtype in layout:
            by_dtype.setdefault(dtype, []).append((name, tuple(shape)))
        for dtype_name, entries in by_dtype.items():
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            sizes = [_numel(shape) for _, shape in entries]
            if self.is_root:
                flat = torch.cat([tensors[n].detach().reshape(-1) for n, _ in entries]).to(comm)
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=comm)
            dist.broadcast(flat, src=0)
            if self.is_root:
                continue
            flat = flat.to(device)
            for (name, shape), piece in zip(entries, flat.split(sizes)):
                out[name] = piece.view(shape)
        return tensors if self.is_root else out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _describe(exc: BaseException) -> tuple[str, str]:
    """``(name, message)``: the name of the exception's nearest built-in class that every rank can rebuild
    (a full disk or a locked run folder arrives as an ``OSError``, which the CLI reports in one line)."""
    portable = next(
        (
            c.__name__
            for c in type(exc).__mro__
            if c.__name__ in _PORTABLE_ERRORS and getattr(builtins, c.__name__, None) is c
        ),
        type(exc).__name__,
    )
    return portable, str(exc)


def _rebuild(status: tuple[str, str], origin: str) -> BaseException:
    name, message = status
    cls = getattr(builtins, name, None) if name in _PORTABLE_ERRORS else None
    if cls is None:
        return RuntimeError(f"{origin} failed: {name}: {message}")
    return cls(f"{message} (raised on {origin})")


def current_shard() -> Shard | None:
    """The :class:`Shard` of this process, or None outside a process group of two or more ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if world < 2:
        return None
    return Shard(dist.get_rank(), world, str(dist.get_backend()))


def init_from_env(device: str | torch.device = "cpu") -> tuple[torch.device, bool]:
    """Join the process group ``torchrun`` describes in the environment, if any.

    With ``WORLD_SIZE > 1`` in the environment and no group yet, initializes
    the default group (``env://``): NCCL when ``device`` is CUDA (each rank then
    uses ``cuda:LOCAL_RANK``), gloo otherwise. Returns ``(device for this rank,
    whether a group was created here)``; the caller destroys a group it created.
    """
    device = torch.device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or not dist.is_available():
        return device, False
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device, False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, True


def chunks_for_rank(todo: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The chunks a rank computes: every ``world_size``-th of the missing chunks, from its rank."""
    return list(todo)[rank::world_size]


def part_blocks(n_chunks: int, world_size: int) -> list[range]:
    """Contiguous, near-equal blocks of chunk indices; block ``r`` becomes part ``r``."""
    bounds = [round(r * n_chunks / world_size) for r in range(world_size + 1)]
    return [range(bounds[r], bounds[r + 1]) for r in range(world_size)]


def merge_across_ranks(acc: Any) -> Any:
    """Merge the :class:`~normfast.ops.ProbeAccumulator` of every rank into each rank's, in place.

    For the direction-sharded layout: every rank accumulated *different*
    directions for the *same* probes; afterwards every rank holds the
    statistics over all of them (Chan's parallel formula, merged in rank
    order, so every rank gets bit-identical state). A plain all-reduce(sum)
    would not be exact: the state is a mean and centred sums, not a sum.
    Outside a process group of two or more ranks, returns ``acc`` unchanged.
    """
    from normfast.engine.estimators.accumulator import ProbeAccumulator

    if not isinstance(acc, ProbeAccumulator):
        raise TypeError(f"merge_across_ranks: expected a ProbeAccumulator, got {type(acc).__name__}")
    shard = current_shard()
    if shard is None:
        return acc
    comm = shard.comm_device
    state = acc.state_dict()
    gathered: dict[str, list[torch.Tensor]] = {}
    for name, value in state.items():
        local = value.reshape(-1).to(comm)
        bucket = [torch.empty_like(local) for _ in range(shard.world_size)]
        dist.all_gather(bucket, local)
        gathered[name] = [t.to(acc.device).reshape(value.shape) for t in bucket]
    merged = ProbeAccumulator(
        acc.n_probes, acc.dim, branch=acc.branch, device=acc.device, dtype=acc.dtype, backend=acc.backend
    )
    for r in range(shard.world_size):
        other = ProbeAccumulator(
            acc.n_probes, acc.dim, branch=acc.branch, device=acc.device, dtype=acc.dtype, backend=acc.backend
        )
        other.load_state_dict({name: values[r] for name, values in gathered.items()})
        merged.merge(other)
    return acc.load_state_dict(merged.state_dict())
