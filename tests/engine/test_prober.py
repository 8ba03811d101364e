"""The Prober (issue 35): directions once, then probes that pay only the per-item pass.

Its tables equal ``normfast.probe``'s for the same items, pairs, config and seed, value for value
(one code path); a later call computes no direction; saved directions load back (in this process
and in a new one) to the same tables, and an artifact made for other inputs is refused, naming what
differs; streaming, resume, adaptive M, the directions-outer order and changed weights behave as
the Prober's docstring says."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import normfast
import normfast.engine.runner.state as state_module
from bench.sentences import FIRST
from normfast.encoders import HFEncoder, ModuleEncoder
from normfast.engine.config import ProbeConfig
from normfast.engine.probe import probe
from normfast.engine.prober import Prober
from tests._models import tanh_mlp, tiny_bert, vector_data

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
SENTENCES = FIRST[:8]
NEW = ["democracy is an idea", "the cat slept all day", "bread was warm"]


def rows(result) -> pa.Table:
    """The table without its schema metadata (which holds the wall time)."""
    return result.table.replace_schema_metadata(None)


def _nan_free(value):
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, list):
        return [_nan_free(v) for v in value]
    return value


#: the columns measured against a reference level: a Prober's is fixed with its directions (the pair
#: source's items), normfast.probe's is the run's own median, so they differ by one constant per call
RELATIVE = ("heat_rel", "se_heat_rel")


def assert_same_rows(a, b) -> None:
    """Equal value for value (bitwise for floats; NaN where the other has NaN)."""
    ta, tb = rows(a), rows(b)
    assert ta.schema == tb.schema
    for name in ta.column_names:
        x, y = ta.column(name).to_pylist(), tb.column(name).to_pylist()
        assert _nan_free(x) == _nan_free(y), name


def assert_same_as_fresh(got, fresh) -> None:
    """A Prober's call against a fresh ``normfast.probe`` of the same items: every column equal value for
    value, except ``heat_rel``, which is the same log heat against another reference level (the pair
    source's items for the Prober, the run's own rows for probe): it differs by exactly the difference
    of the two levels, the same for every row."""
    import numpy as np

    ta, tb = rows(got), rows(fresh)
    assert ta.schema == tb.schema
    for name in ta.column_names:
        if name not in RELATIVE:
            assert _nan_free(ta.column(name).to_pylist()) == _nan_free(tb.column(name).to_pylist()), name
    ref_a, ref_b = got.metadata["heat_reference"], fresh.metadata["heat_reference"]
    assert (ref_a["source"], ref_b["source"]) == ("pairs", "run")
    shift = np.asarray(ta.column("heat_rel"), float) - np.asarray(tb.column("heat_rel"), float)
    finite = np.isfinite(shift)
    assert finite.any() and np.array_equal(finite, np.isfinite(np.asarray(tb.column("heat_rel"), float)))
    assert np.allclose(shift[finite], ref_b["log_level"] - ref_a["log_level"], rtol=0, atol=1e-12)


def _mlp(seed: int = 0) -> ModuleEncoder:
    return tanh_mlp(seed=seed)


def _toy(n_items=9, n_pairs=40, seed=1):
    return vector_data(n_items, n_pairs, seed=seed)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # toy models: scale-invariance notes
        yield


@pytest.fixture(scope="module")
def bert(minilm_tokenizer):
    return HFEncoder(tiny_bert(minilm_tokenizer), minilm_tokenizer, max_length=16)


def _bert_config(**kw) -> ProbeConfig:
    kw = {
        "params": r"encoder\.layer\.1\.",
        "mode": "jvp",
        "output": "tokens",
        "batches": 4,
        "drift_batches": 8,
        "groups": 2,
        "batch_size": 4,
        "seed": 3,
        "chunk_size": 2,
        **kw,
    }
    return ProbeConfig(**kw)


#: the direction passes of one run at the default heat sampling: the drift's M_D batches (their energies
#: among them), then the heat's batches drawn from them by energy
PASSES = 2


class CountDirections:
    """Counts the direction computations (``compute_directions`` as the run state calls it, the heat drawn
    by energy included: every pass goes through ``ProbeRun.directions_pass``)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = state_module.compute_directions

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(state_module, "compute_directions", counted)


# ---------------------------------------------------------------------------
# a Prober's tables are probe's tables


def test_a_later_call_equals_a_fresh_probe_and_computes_no_direction(bert, monkeypatch):
    count = CountDirections(monkeypatch)
    prober = Prober(bert, "simcse", pairs=SENTENCES, config=_bert_config(), progress=False)
    assert not prober.ready
    first = prober.probe(SENTENCES[:3])
    # one run's directions: a pass over the drift's batches, then the heat's batches drawn from them
    assert count.calls == PASSES and prober.ready
    second = prober.probe(NEW)
    assert count.calls == PASSES, "the second call computed directions again"
    fresh = probe(bert, NEW, "simcse", SENTENCES, _bert_config(), progress=False)
    assert count.calls == 2 * PASSES
    assert_same_as_fresh(second, fresh)
    assert_same_as_fresh(first, probe(bert, SENTENCES[:3], "simcse", SENTENCES, _bert_config(), progress=False))
    # the metadata too, less what measures this process (and the reference: the pair source's, fixed)
    for key in ("spec_fingerprint", "input_fingerprints", "model_fingerprint", "M", "regime", "heat_sampling"):
        assert second.metadata[key] == fresh.metadata[key], key
    assert second.metadata["heat_reference"] == first.metadata["heat_reference"] == prober.heat_reference()


#: the tolerance of "the same heat_rel": the rows of one text padded alone or beside longer texts
#: differ in float32 rounding only (log units)
SAME_HEAT_REL = 1e-6


def _rows_of(result, item: int) -> dict[str, list]:
    table = result.table
    keep = [i == item for i in table.column("item").to_pylist()]
    return {name: [v for v, k in zip(table.column(name).to_pylist(), keep) if k] for name in table.column_names}


def test_an_items_relative_heat_does_not_depend_on_the_other_items_of_its_call(bert):
    """Issue 40: heat_rel against a reference fixed with the directions -- the same sentence alone and
    inside a 32-text call gets the same heat_rel; against each call's own median it would not."""
    import numpy as np

    prober = Prober(bert, "simcse", pairs=SENTENCES, config=_bert_config(), progress=False)
    text = "democracy is a fragile idea"
    crowd = [f"{w} and {v} were all we had" for w in ("bread", "salt", "rain", "ink") for v in range(8)]
    crowd[17] = text
    alone = prober.probe([text])
    together = prober.probe(crowd)
    a, b = _rows_of(alone, 0), _rows_of(together, 17)
    assert a["token"] == b["token"] and len(a["token"]) == 7
    assert np.allclose(a["heat_rel"], b["heat_rel"], rtol=0, atol=SAME_HEAT_REL)
    assert np.allclose(a["se_heat_rel"], b["se_heat_rel"], rtol=0, atol=SAME_HEAT_REL)
    reference = alone.metadata["heat_reference"]
    assert reference == together.metadata["heat_reference"]
    assert (reference["source"], reference["items"], reference["output"]) == ("pairs", len(SENTENCES), "tokens")
    # the run's own median (normfast.probe's reference) moves with the company the text keeps
    run_a = probe(bert, [text], "simcse", SENTENCES, _bert_config(), progress=False)
    run_b = probe(bert, crowd, "simcse", SENTENCES, _bert_config(), progress=False)
    moved = np.abs(np.subtract(_rows_of(run_a, 0)["heat_rel"], _rows_of(run_b, 17)["heat_rel"]))
    assert np.nanmin(moved) > 100 * SAME_HEAT_REL
    # and the summary says which reference it is
    assert "(relative heat: log V2 minus the median of the pair source's items)" in together.format_summary()
    assert "(relative heat: log V2 minus the run's median)" in run_b.format_summary()


def test_directions_saved_without_a_reference_fall_back_to_the_calls_median_with_a_warning(bert, tmp_path):
    """Directions saved before the fixed reference (no heat_reference in the manifest), loaded without their
    pair source: each call's own median, said once; with the pair source, the reference is computed."""
    folder = Prober(bert, "simcse", pairs=SENTENCES, config=_bert_config(), progress=False).save(tmp_path / "d")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["heat_reference"]) == {"tokens", "pooled"}
    del manifest["heat_reference"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    loaded = Prober.load(folder, bert, progress=False)
    with pytest.warns(UserWarning, match=r"hold no heat reference for output='tokens'.*pass pairs= to Prober\.load"):
        got = loaded.probe(NEW)
    assert got.metadata["heat_reference"]["source"] == "run"
    with_pairs = Prober.load(folder, bert, pairs=SENTENCES, progress=False)
    assert with_pairs.probe(NEW).metadata["heat_reference"]["source"] == "pairs"


def test_head_mode_and_pooled_rows_equal_a_fresh_probe():
    items, pairs = _toy()
    cfg = ProbeConfig(params="head", batches=4, drift_batches=8, batch_size=8, chunk_size=4)
    with _quiet():
        enc = _mlp()
        prober = Prober(enc, "infonce", pairs, cfg, progress=False).prepare()
        assert prober.ready
        got = prober.probe(items)
        fresh = probe(enc, items, "infonce", pairs, cfg, progress=False)
    assert got.metadata["mode"] == "head"
    assert_same_as_fresh(got, fresh)


def test_streaming_and_resume_through_a_prober(bert, tmp_path, monkeypatch):
    prober = Prober(bert, "simcse", pairs=SENTENCES, config=_bert_config(), progress=False)
    prober.prepare()
    out = tmp_path / "run.parquet"
    written = prober.probe(SENTENCES, out)
    assert written.path == out and out.is_file()
    assert_same_as_fresh(written, probe(bert, SENTENCES, "simcse", SENTENCES, _bert_config(), progress=False))
    # an interrupted run (two of its four chunks written) resumed by a Prober computes only the rest
    import normfast.engine.runner.output as output  # where a call runs its chunks

    real = output.run_chunks
    again = tmp_path / "again.parquet"

    def two_chunks(run, probes, ids, todo, emit):
        real(run, probes, ids, todo[:2], emit)
        raise KeyboardInterrupt

    monkeypatch.setattr(output, "run_chunks", two_chunks)
    with pytest.raises(KeyboardInterrupt):
        prober.probe(SENTENCES, again)
    monkeypatch.setattr(output, "run_chunks", real)
    done = []

    def counted(run, probes, ids, todo, emit):
        done.extend(todo)
        real(run, probes, ids, todo, emit)

    monkeypatch.setattr(output, "run_chunks", counted)
    resumed = prober.probe(SENTENCES, again, resume=True)
    assert done == [2, 3]
    assert_same_rows(resumed, written)


def test_adaptive_m_is_chosen_on_the_first_call_and_then_fixed(monkeypatch):
    items, pairs = _toy(n_items=12, n_pairs=60)
    cfg = ProbeConfig(
        params="head",
        batches=4,
        drift_batches=24,
        groups=2,
        batch_size=6,
        chunk_size=6,
        target_rse=0.05,
        max_batches=12,
    )
    count = CountDirections(monkeypatch)
    with _quiet():
        prober = Prober(_mlp(), "infonce", pairs, cfg, progress=False)
        with pytest.raises(ValueError, match=r"Prober\.prepare: adaptive M .* first call"):
            prober.prepare()
        first = prober.probe(items)
        calls = count.calls
        second = prober.probe(items[3:])
    assert count.calls == calls, "the second call chose M again"
    assert first.metadata["adaptive"]["M"] == second.metadata["adaptive"]["M"] == second.metadata["M"] > 4
    assert second.metadata["adaptive"] == first.metadata["adaptive"]


# ---------------------------------------------------------------------------
# what a Prober refuses


def test_a_prober_needs_an_explicit_pair_source(bert):
    with pytest.raises(ValueError, match=r"^Prober: pairs= is required"):
        Prober(bert, "simcse", config=_bert_config())


def test_changed_weights_are_refused_after_the_directions():
    items, pairs = _toy()
    cfg = ProbeConfig(params="head", batches=4, drift_batches=8, batch_size=8)
    with _quiet():
        enc = _mlp()
        prober = Prober(enc, "infonce", pairs, cfg, progress=False)
        prober.probe(items)
        with torch.no_grad():
            enc.blocks[2].weight.mul_(1.01)  # an optimizer step would do this in place
        with pytest.raises(ValueError, match=r"weights changed since its directions were computed \(blocks\.2"):
            prober.probe(items)


# ---------------------------------------------------------------------------
# saved directions


def test_saved_directions_load_to_the_same_table_and_others_are_refused(bert, tmp_path, monkeypatch):
    cfg = _bert_config()
    prober = Prober(bert, "simcse", pairs=SENTENCES, config=cfg, progress=False, model_name="tiny")
    folder = prober.save(tmp_path / "dirs")
    manifest = json.loads((folder / "manifest.json").read_text())
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["drift-000.safetensors", "drift-001.safetensors"] + [
        f"heat-{b:05d}.safetensors" for b in range(4)
    ] + ["manifest.json"]
    assert manifest["bytes"] == sum((folder / f).stat().st_size for f in files if f != "manifest.json")
    assert manifest["fingerprint"]["pairs"]["n"] == len(SENTENCES)
    want = prober.probe(NEW)

    count = CountDirections(monkeypatch)
    loaded = Prober.load(folder, bert, progress=False)  # objective, config and pairs from the manifest
    got = loaded.probe(NEW)
    assert count.calls == 0 and loaded.source == str(folder)
    assert_same_rows(got, want)
    assert got.metadata["spec_fingerprint"] == want.metadata["spec_fingerprint"]
    # a config that differs only per item (the law's lr, the output) is accepted, and equals a fresh run
    other = _bert_config(lr=2e-3, output="pooled")
    pooled = Prober.load(folder, bert, "simcse", SENTENCES, other, progress=False).probe(NEW)
    assert_same_as_fresh(pooled, probe(bert, NEW, "simcse", SENTENCES, other, progress=False))
    # its reference (pooled rows) was saved with the directions: the same as a Prober with pairs computes
    fresh_reference = Prober(bert, "simcse", SENTENCES, other, progress=False).heat_reference()
    assert pooled.metadata["heat_reference"] == fresh_reference

    refusals = [
        (dict(config=_bert_config(seed=4)), r"settings\.seed \(saved 3, given 4\)"),
        (dict(config=_bert_config(batch_size=5)), r"settings\.batch_size \(saved 4, given 5\)"),
        (dict(objective=normfast.SimCSE(temperature=0.1)), r"objective\.settings\.temperature"),
        (dict(pairs=SENTENCES[:-1]), r"pairs\.n \(saved 8, given 7\)"),
    ]
    for kw, named in refusals:
        with pytest.raises(ValueError, match=r"^Prober\.load: the directions in .* were made for other inputs: "):
            Prober.load(folder, bert, progress=False, **kw)
        with pytest.raises(ValueError, match=named):
            Prober.load(folder, bert, progress=False, **kw)


def test_other_weights_and_a_damaged_file_are_refused(minilm_tokenizer, tmp_path):
    a = HFEncoder(tiny_bert(minilm_tokenizer, seed=0), minilm_tokenizer, max_length=16)
    b = HFEncoder(tiny_bert(minilm_tokenizer, seed=1), minilm_tokenizer, max_length=16)
    folder = Prober(a, "simcse", pairs=SENTENCES, config=_bert_config(), progress=False).save(tmp_path / "d")
    with pytest.raises(ValueError, match=r"made for other inputs: model \(saved \"[0-9a-f]{16}\", given") as err:
        Prober.load(folder, b, progress=False)
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"holds no saved directions"):
        Prober.load(tmp_path, a, progress=False)
    with pytest.raises(FileExistsError, match=r"overwrite=True"):
        Prober(a, "simcse", pairs=SENTENCES, config=_bert_config(), progress=False).save(folder)
    (folder / "heat-00002.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match=r"heat-00002\.safetensors cannot be used: it holds 20 bytes"):
        Prober.load(folder, a, progress=False)  # checked whole when loaded, before any probe


def test_directions_that_do_not_fit_are_read_from_disk_group_by_group(tmp_path, monkeypatch):
    items, pairs = _toy()
    # a budget for one direction at a time: the directions-outer order
    cfg = ProbeConfig(mode="jvp", batches=4, drift_batches=8, batch_size=8, chunk_size=4, memory_budget_mb=0.0004)
    with _quiet():
        enc = _mlp()
        folder = Prober(enc, "infonce", pairs, cfg, progress=False).save(tmp_path / "d")
        fresh = probe(enc, items, "infonce", pairs, cfg, progress=False)
        count = CountDirections(monkeypatch)
        loaded = Prober.load(folder, enc, pairs=pairs, progress=False)
        got = loaded.probe(items)
    assert count.calls == 0
    assert_same_as_fresh(got, fresh)


def test_saved_directions_give_the_same_table_in_a_new_process(tmp_path):
    items, pairs = _toy()
    cfg = ProbeConfig(mode="jvp", batches=4, drift_batches=8, batch_size=8, chunk_size=4)
    with _quiet():
        prober = Prober(_mlp(), "infonce", pairs, cfg, progress=False)
        prober.save(tmp_path / "d")
        want = prober.probe(items)
    code = textwrap.dedent(
        f"""
        import warnings, torch
        from torch import nn
        import normfast
        from tests.engine.test_prober import _mlp, _toy
        warnings.simplefilter("ignore", UserWarning)
        torch.set_num_threads(1)
        items, _ = _toy()
        prober = normfast.Prober.load({str(tmp_path / "d")!r}, _mlp(), progress=False)
        prober.probe(items, {str(tmp_path / "new.parquet")!r})
        """
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)
    assert_same_rows(normfast.ProbeResult.load(tmp_path / "new.parquet"), want)
