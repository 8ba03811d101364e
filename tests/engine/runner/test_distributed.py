"""Sharding a probe run over ranks (gloo on CPU, two processes): the sharded table equals the
single-process one row for row, a killed rank's finished chunks survive and a rerun computes only
the missing ones, manifests read back as one table, and accumulators merge exactly across ranks."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from normfast.encoders import ModuleEncoder
from normfast.engine.directions.objectives import InfoNCE
from normfast.engine.probe import ProbeConfig, ProbeResult, probe
from tests._chunks import interrupted_at

WORLD = 2
N_ITEMS, T = 23, 5  # 23 items of 5 positions: 6 chunks of 4 items, the last one short


pytestmark = pytest.mark.usefixtures("single_thread")


def _setup(seed: int = 0):
    """A token model with a linear head (so head mode applies), its probe items and pairs."""
    torch.manual_seed(seed)
    enc = ModuleEncoder([nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8)], pooling=lambda x: x.mean(1))
    g = torch.Generator().manual_seed(seed + 1)
    items = [torch.randn(T, 6, generator=g) for _ in range(N_ITEMS)]
    pairs = [(torch.randn(T, 6, generator=g), torch.randn(T, 6, generator=g)) for _ in range(40)]
    return enc, items, pairs


CONFIGS = {
    "jvp_tokens": dict(
        params="all", mode="jvp", output="tokens", batches=4, drift_batches=12, batch_size=8, chunk_size=4, seed=3
    ),
    "head_pooled": dict(
        params="head", mode="head", output="pooled", batches=5, drift_batches=12, batch_size=8, chunk_size=4, seed=4
    ),
    # adaptive M: rank 0 chooses M on the first chunk and shares it with the directions
    "jvp_adaptive": dict(
        params="head",
        mode="jvp",
        output="pooled",
        batches=4,
        groups=2,
        drift_batches=40,
        target_rse=0.1,  # at 0.15 the heat drawn by energy is resolved at the first M already
        max_batches=40,
        batch_size=8,
        chunk_size=4,
        seed=5,
    ),
}


def _outer_config(enc) -> ProbeConfig:
    n_params = sum(p.numel() for p in enc.parameters())
    return ProbeConfig(
        params="all",
        mode="jvp",
        output="tokens",
        batches=6,
        drift_batches=12,
        batch_size=8,
        chunk_size=4,
        directions_per_pass=2,
        memory_budget_mb=2.5 * n_params * 4 * 2 / 2**20,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, fn, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


#: what every rank imports (pyarrow imports pandas, where installed, on its first table), imported
#: once into the fork server the ranks are forked from: a rank then starts in a fraction of a
#: second, where a spawned interpreter imports all of it afresh (seconds, twice per launch)
RANK_PRELOAD = [
    "torch",
    "torch.distributed",
    "normfast.engine.probe",
    "normfast.encoders",
    "pyarrow.parquet",
    "scipy.stats",
    "pandas",
    "transformers.models.bert.modeling_bert",
    "tests._forkwarm",
]  # and what the CLI runs of tests/faults/test_runs.py's killed children need


def _spawn(fn, *args) -> None:
    """``fn(rank, *args)`` in WORLD processes of one gloo group (torch.multiprocessing, fork server)."""
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when this process first starts the server
    mp.start_processes(_entry, args=(_free_port(), fn, args), nprocs=WORLD, join=True, start_method="forkserver")


# ---------------------------------------------------------------------------
# workers (run in every rank)


def _sharded_runs(rank: int, folder: str) -> None:
    import warnings

    from normfast.engine.runner.distributed import merge_across_ranks
    from normfast.ops import ProbeAccumulator

    folder = Path(folder)
    enc, items, pairs = _setup()
    res = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(**CONFIGS["jvp_tokens"]),
        out=folder / "jvp.parquet",
        progress=False,
    )
    (folder / f"jvp-rank{rank}.json").write_text(json.dumps({"len": len(res), "path": str(res.path)}))
    # in memory: every rank receives the whole table
    res = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**CONFIGS["head_pooled"]), progress=False)
    pq.write_table(res.table, folder / f"head-rank{rank}.parquet")
    # a Prober sharded: its directions broadcast at the first call and kept on every rank for the second
    from normfast.engine.prober import Prober

    prober = Prober(enc, InfoNCE(0.1), pairs, ProbeConfig(**CONFIGS["jvp_tokens"]), progress=False)
    prober.probe(items[:5])
    pq.write_table(prober.probe(items).table, folder / f"prober-rank{rank}.parquet")
    res = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**CONFIGS["jvp_adaptive"]), progress=False)
    pq.write_table(res.table, folder / f"adaptive-rank{rank}.parquet")
    (folder / f"adaptive-rank{rank}.json").write_text(json.dumps(res.metadata["adaptive"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the directions-outer warning
        probe(enc, items, InfoNCE(0.1), pairs, _outer_config(enc), out=folder / "outer.parquet", progress=False)
    # direction sharding with the backend API: each rank accumulates its half of the directions
    g = torch.Generator().manual_seed(7)
    t = torch.randn(6, 9, 5, generator=g, dtype=torch.float64)
    z = torch.randn(9, 5, generator=g, dtype=torch.float64)
    acc = ProbeAccumulator(9, 5, dtype=torch.float64)
    acc.update(t[rank * 3 : (rank + 1) * 3], z)
    stats = merge_across_ranks(acc).finalize()
    torch.save({k: v for k, v in stats.items() if k != "M"} | {"M": acc.M}, folder / f"merged-rank{rank}.pt")
    # a chunk that raises on one rank makes every rank raise (nobody waits forever)
    try:
        with interrupted_at(3, ValueError("injected failure in chunk 3")):
            probe(
                enc,
                items,
                InfoNCE(0.1),
                pairs,
                ProbeConfig(**CONFIGS["jvp_tokens"]),
                out=folder / "fails.parquet",
                progress=False,
            )
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    (folder / f"fails-rank{rank}.txt").write_text(message)


def _crash_then_resume(rank: int, folder: str, attempt: int) -> None:
    import normfast.data.runwriter as runwriter

    folder = Path(folder)
    real_write = runwriter.ChunkedParquetWriter.write_chunk
    log = folder / f"computed-{attempt}-rank{rank}.txt"

    def write_chunk(self, index, table):
        real_write(self, index, table)
        with open(log, "a") as fh:
            fh.write(f"{index}\n")
        if attempt == 1 and rank == 1:
            os._exit(1)  # a hard crash right after this rank's first chunk is on disk

    runwriter.ChunkedParquetWriter.write_chunk = write_chunk
    enc, items, pairs = _setup()
    probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(**CONFIGS["jvp_tokens"]),
        out=folder / "run.parquet",
        resume=attempt > 1,
        progress=False,
    )


# ---------------------------------------------------------------------------
# tests


def _plain(table):
    return table.replace_schema_metadata(None)


def test_sharded_runs_equal_single_process_and_manifest_reads_back(tmp_path, capsys):
    _spawn(_sharded_runs, str(tmp_path))
    enc, items, pairs = _setup()

    # jvp, token rows, written as a manifest over one part per rank
    single = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**CONFIGS["jvp_tokens"]), progress=False)
    manifest = tmp_path / "jvp.manifest.json"
    assert manifest.exists() and not (tmp_path / "jvp.parquet").exists()
    assert not (tmp_path / "jvp.parquet.parts").exists()
    blob = json.loads(manifest.read_text())
    assert [p["path"] for p in blob["parts"]] == ["jvp.rank0-of-2.parquet", "jvp.rank1-of-2.parquet"]
    assert [p["chunks"] for p in blob["parts"]] == [[0, 3], [3, 6]]
    assert blob["rows"] == N_ITEMS * T == sum(p["rows"] for p in blob["parts"])
    assert blob["metadata"]["world_size"] == 2
    assert blob["fingerprint"] == blob["metadata"]["spec_fingerprint"] == single.metadata["spec_fingerprint"]
    for key in ("regime", "reason", "reasons", "fractions"):  # rank 0 tallies every rank's chunks
        assert blob["metadata"]["regime"][key] == single.metadata["regime"][key]
    for r in range(WORLD):  # every rank returned the whole run
        assert json.loads((tmp_path / f"jvp-rank{r}.json").read_text()) == {"len": N_ITEMS * T, "path": str(manifest)}
    loaded = ProbeResult.load(manifest)
    assert loaded.files is not None and len(loaded) == N_ITEMS * T
    assert _plain(loaded.table).equals(_plain(single.table))  # row for row, bit for bit
    np.testing.assert_array_equal(loaded.column("item"), np.repeat(np.arange(N_ITEMS), T))
    # the parts are self-describing Parquet files too
    part0 = pq.read_table(tmp_path / "jvp.rank0-of-2.parquet")
    assert part0.num_rows == 12 * T and json.loads(part0.schema.metadata[b"normfast"])["M"] == 4

    # head mode in memory: both ranks hold the same, complete table
    single = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**CONFIGS["head_pooled"]), progress=False)
    for r in range(WORLD):
        assert _plain(pq.read_table(tmp_path / f"head-rank{r}.parquet")).equals(_plain(single.table))

    # a sharded Prober's second call: the single process's Prober's table (heat_rel against the same fixed
    # reference, the pair source's items), on every rank
    from normfast.engine.prober import Prober

    alone = Prober(enc, InfoNCE(0.1), pairs, ProbeConfig(**CONFIGS["jvp_tokens"]), progress=False)
    alone.probe(items[:5], distributed=False)
    single = alone.probe(items, distributed=False)
    assert single.metadata["heat_reference"]["source"] == "pairs"
    for r in range(WORLD):
        assert _plain(pq.read_table(tmp_path / f"prober-rank{r}.parquet")).equals(_plain(single.table))

    # adaptive M: every rank got rank 0's M and the same table as one process
    single = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**CONFIGS["jvp_adaptive"]), progress=False)
    assert single.metadata["M"] > 4
    for r in range(WORLD):
        assert _plain(pq.read_table(tmp_path / f"adaptive-rank{r}.parquet")).equals(_plain(single.table))
        assert json.loads((tmp_path / f"adaptive-rank{r}.json").read_text())["M"] == single.metadata["M"]

    # directions-outer loop order: one broadcast per direction group
    with pytest.warns(UserWarning, match="directions-outer"):
        single = probe(enc, items, InfoNCE(0.1), pairs, _outer_config(enc), progress=False)
    assert _plain(ProbeResult.load(tmp_path / "outer.manifest.json").table).equals(_plain(single.table))

    # accumulators merged across ranks equal one accumulator over all directions
    from normfast.ops import ProbeAccumulator

    g = torch.Generator().manual_seed(7)
    t = torch.randn(6, 9, 5, generator=g, dtype=torch.float64)
    z = torch.randn(9, 5, generator=g, dtype=torch.float64)
    ref = ProbeAccumulator(9, 5, dtype=torch.float64).update(t, z).finalize()
    for r in range(WORLD):
        got = torch.load(tmp_path / f"merged-rank{r}.pt", weights_only=True)
        assert got["M"] == 6
        for k in ("D", "se_D", "sign_stability", "m2", "V2", "Q"):
            torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=1e-14)

    # chunk 3 (rank 1's second) raised: both ranks raised, rank 0 with rank 1's error; finished chunks stay
    assert (tmp_path / "fails-rank1.txt").read_text() == "injected failure in chunk 3"
    assert (tmp_path / "fails-rank0.txt").read_text() == "injected failure in chunk 3 (raised on rank 1 of 2)"
    kept = sorted(p.name for p in (tmp_path / "fails.parquet.parts").glob("chunk-*.parquet"))
    assert kept == [f"chunk-{c:07d}.parquet" for c in (0, 1, 2, 4)]  # rank 1 stopped at 3

    # a finished sharded run is picked up by a resume with any world size, not recomputed
    again = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(**CONFIGS["jvp_tokens"]),
        out=tmp_path / "jvp.parquet",
        resume=True,
        progress=False,
    )
    assert again.path == manifest and again.metadata["world_size"] == 2

    # normfast report reads the manifest as one run
    from normfast.cli import main

    assert main(["report", str(manifest), "--no-plots"]) == 0
    assert f"rows: {N_ITEMS * T}" in capsys.readouterr().out

    # a damaged manifest is refused with the part named
    (tmp_path / "jvp.rank1-of-2.parquet").rename(tmp_path / "moved.parquet")
    with pytest.raises(FileNotFoundError, match="rank1-of-2"):
        ProbeResult.load(manifest)
    (tmp_path / "moved.parquet").rename(tmp_path / "jvp.rank1-of-2.parquet")
    blob["parts"][0]["rows"] += 1
    manifest.write_text(json.dumps(blob))
    with pytest.raises(ValueError, match="holds 60 rows, the manifest .* says 61"):
        ProbeResult.load(manifest)


def test_killed_rank_leaves_chunks_and_rerun_computes_only_the_missing(tmp_path):
    enc, items, pairs = _setup()
    single = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**CONFIGS["jvp_tokens"]), progress=False)

    with pytest.raises(Exception):  # rank 1 dies; the launcher stops rank 0
        _spawn(_crash_then_resume, str(tmp_path), 1)
    parts = tmp_path / "run.parquet.parts"
    survived = {int(p.stem.split("-")[1]) for p in parts.glob("chunk-*.parquet")}
    assert 1 in survived  # rank 1's first chunk, written before the crash
    assert survived < set(range(6))  # rank 1's other chunks (3, 5) never ran
    assert not (tmp_path / "run.manifest.json").exists() and not (tmp_path / "run.parquet").exists()
    for p in parts.glob("chunk-*.parquet"):  # every surviving chunk file is complete
        assert pq.read_table(p).num_rows == min(4, N_ITEMS - 4 * int(p.stem.split("-")[1])) * T

    _spawn(_crash_then_resume, str(tmp_path), 2)
    computed = []
    for r in range(WORLD):
        log = tmp_path / f"computed-2-rank{r}.txt"
        computed += [int(x) for x in log.read_text().split()] if log.exists() else []
    assert sorted(computed) == sorted(set(range(6)) - survived)
    result = ProbeResult.load(tmp_path / "run.manifest.json")
    assert _plain(result.table).equals(_plain(single.table))
    assert not parts.exists()


class _OnDemand:
    """A probe set read by slices only (no __iter__, not a list): records what was asked for."""

    def __init__(self, items):
        self.items, self.asked = items, []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, key):
        if not isinstance(key, slice):
            raise TypeError("slices only")
        self.asked.append(len(range(*key.indices(len(self.items)))))
        return self.items[key]


def test_out_result_is_lazy_and_resume_of_a_finished_run_returns_it(tmp_path):
    enc, items, pairs = _setup()
    cfg = ProbeConfig(**CONFIGS["jvp_tokens"])
    on_demand = _OnDemand(items)
    res = probe(enc, on_demand, InfoNCE(0.1), pairs, cfg, out=tmp_path / "a.parquet", progress=False)
    # read chunk by chunk (and once whole-range for the fingerprint, by slices of <= 4096)
    assert on_demand.asked.count(N_ITEMS) == 1 and on_demand.asked.count(4) == 5
    assert res._table is None and res.files == [tmp_path / "a.parquet"]  # nothing read yet
    assert len(res) == N_ITEMS * T and res._table is None
    mem = probe(enc, items, InfoNCE(0.1), pairs, cfg, progress=False)
    np.testing.assert_array_equal(res.column("V2"), mem.column("V2"))
    batches = list(res.iter_batches(columns=["item", "r_eq"], batch_size=7))
    assert max(b.num_rows for b in batches) == 7 and sum(b.num_rows for b in batches) == len(mem)
    assert res._table is None
    assert _plain(res.table).equals(_plain(mem.table))
    # resume on the finished file: returned as is (not recomputed); other arguments are refused
    again = probe(enc, items, InfoNCE(0.1), pairs, cfg, out=tmp_path / "a.parquet", resume=True, progress=False)
    assert again.metadata["seconds"] == res.metadata["seconds"]
    other = ProbeConfig(**{**CONFIGS["jvp_tokens"], "seed": 9})
    with pytest.raises(ValueError, match="finished run made with different arguments"):
        probe(enc, items, InfoNCE(0.1), pairs, other, out=tmp_path / "a.parquet", resume=True, progress=False)
