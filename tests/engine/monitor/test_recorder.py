"""The training monitor (normfast.TrainingMonitor): its realized terms are the ledger's, the law from them
holds over a stationary window, a resumed run writes the same file, and ``normfast report`` reads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import normfast
from bench.experiments.e1.data import VARIANT_SPECS, build_encoder, make_concepts, variant_optimizer
from bench.experiments.e1.ledger import RealizedLedger
from normfast.engine.directions.objectives import InfoNCE
from normfast.engine.monitor import layout as monitor_layout
from tests._models import e1_toy

pytestmark = pytest.mark.usefixtures("single_thread")

# E1's toy at test size (tests/experiments/test_e1.py): a relaxation time of ~50 steps; probe_every=1 makes the
# ledger keep every recorded step's terms (its blocks)
TOY = e1_toy(heavyball_lr=0.005, adamw_lr=0.01, probe_every=1)


@pytest.fixture(scope="module")
def toy_data():
    return make_concepts(TOY)


def monitor_folders(root: Path) -> dict[str, Path]:
    """Under ``root``: a finished monitor folder and an unfinished one (released: its two blocks of 4
    recorded steps only) of E1's MLP toy, 8 recorded steps each."""
    data = make_concepts(TOY)
    n = data.x.shape[0]
    out = {}
    for name in ("finished", "unfinished"):
        enc = build_encoder("mlp", TOY, data)
        mon = normfast.TrainingMonitor(enc, list(range(n)), every=1, out=root / name, flush_every=4)
        train_toy("mlp", data, 8, lambda s, before, o: mon.before_step(o) if before else mon.after_step(), encoder=enc)
        mon.close() if name == "finished" else mon.release()
        out[name] = root / name
    return out


def copy_folder(folders: dict[str, Path], name: str, tmp_path: Path) -> Path:
    """A copy of ``folders[name]`` in ``tmp_path``, for a test to damage."""
    return Path(shutil.copytree(folders[name], tmp_path / name))


def train_toy(variant: str, data, steps: int, hooks, *, start: int = 0, encoder=None, optimizer=None):
    """E1's training loop; ``hooks(step, before: bool, optimizer)`` around every optimizer.step()."""
    v = VARIANT_SPECS[variant]
    enc = encoder if encoder is not None else build_encoder(v, TOY, data)
    opt = optimizer if optimizer is not None else variant_optimizer(v, TOY, enc.parameters())
    objective = InfoNCE(temperature=TOY.temperature)
    pairs = torch.as_tensor(data.pairs)
    for step in range(start, steps):
        idx = torch.as_tensor(np.random.default_rng([7, step]).integers(0, len(pairs), TOY.batch_size))
        loss = objective.loss(enc(enc.prepare(pairs[idx, 0].tolist())), enc(enc.prepare(pairs[idx, 1].tolist())))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        hooks(step, True, opt)
        opt.step()
        hooks(step, False, opt)
    return enc, opt


@pytest.mark.parametrize("variant", ["mlp", "mlp_heavyball", "mlp_adamw"])
def test_realized_terms_are_the_ledgers(toy_data, tmp_path, variant):
    """Same loop, same steps: the monitor (settings read off the optimizer, rows through Parquet) and
    E1's ledger (settings from the config, every step) find the same terms: a monitor with
    average=False those of every recorded step, the default (average=True) their mean over the steps
    since the previous row."""
    torch.manual_seed(0)
    n = toy_data.x.shape[0]
    every, steps = 3, 45
    holder = {}

    def hooks(step, before, opt):
        if "led" not in holder:
            enc = holder["enc"]
            holder["led"] = RealizedLedger(enc, enc.prepare(list(range(n))), VARIANT_SPECS[variant], TOY)
            holder["mons"] = [
                normfast.TrainingMonitor(
                    enc, list(range(n)), every=every, average=average, out=tmp_path / f"m{average}", flush_every=4
                )
                for average in (False, True)
            ]
        led, mons = holder["led"], holder["mons"]
        if before:
            led.before_step(record=True)
            for mon in mons:
                mon.before_step(opt)
        else:
            led.after_step(record=True)
            for mon in mons:
                mon.after_step()

    v = VARIANT_SPECS[variant]
    holder["enc"] = build_encoder(v, TOY, toy_data)
    train_toy(variant, toy_data, steps, hooks, encoder=holder["enc"])
    ledger = {
        k: np.stack([b[k].numpy() for b in holder["led"].blocks]) for k in ("task1", "task2", "decay", "remainder")
    }
    S = steps // every
    for average, mon in zip((False, True), holder["mons"]):
        path = mon.close()
        table = pq.read_table(path).sort_by([("step", "ascending"), ("item", "ascending")])
        assert monitor_layout.check_table(table.schema) == []
        meta = normfast.read_metadata(path)
        assert monitor_layout.check_metadata(meta) == []
        assert meta["recorded_steps"] == S and meta["average"] is average
        assert meta["decay_buffer"] == ("exact" if variant == "mlp_heavyball" else None)
        assert meta["law"] == ("adamw" if variant == "mlp_adamw" else "sgd")
        assert sorted(set(table["step"].to_pylist())) == list(range(0, steps, every))
        counts = np.asarray(table["n_steps"]).reshape(S, n)[:, 0]
        assert counts.tolist() == ([1] + [every] * (S - 1) if average else [1] * S)
        for k in ("task1", "task2", "decay", "remainder"):
            mine = np.asarray(table[k]).reshape(S, n)
            if average:  # the row of step s: the mean over steps s - every + 1 .. s
                want = np.stack([ledger[k][max(0, s - every + 1) : s + 1].mean(0) for s in range(0, steps, every)])
            else:
                want = ledger[k][::every]
            np.testing.assert_allclose(mine, want, rtol=1e-12, atol=1e-15, err_msg=f"{k}, average={average}")
        mine_r2 = np.asarray(table["norm"]).reshape(S, n) ** 2
        ledger_r2 = np.stack([b["R2"].numpy() for b in holder["led"].blocks])[::every]
        np.testing.assert_allclose(mine_r2, ledger_r2, rtol=1e-12)
        total = sum(np.asarray(table[k]) for k in ("task1", "task2", "decay", "remainder"))
        np.testing.assert_allclose(total, np.asarray(table["delta_r2"]), rtol=1e-9, atol=1e-14)
        # the lr column is the optimizer's: heavy-ball runs at E1's heavyball_lr
        assert set(table["lr"].to_pylist()) == {v.lr(TOY)}


def test_the_realized_terms_add_up_over_a_stationary_window(toy_data, tmp_path, capsys):
    """E1's bias-free MLP with SGD, trained for 12 relaxation times of R² and recorded at every step: over
    the late half the law solved from the monitor's realized window means reproduces the window-mean
    norms (slope and r inside E1's target), and ``normfast report`` on the folder says so.

    What this shows: that the window is stationary and the recorded terms are complete, so that their
    means balance. In a stationary window the law from the realized means gives back the mean norm by
    construction (an identity of a closed balance: any split of the same total between heat and drift
    fits as well), so this is no evidence that the law predicts a norm it has not seen.

    Beside it, on the same steps: a monitor at ``every=10`` that averages every step's terms (the
    default) closes the balance as well, and the stationarity measure from the recorded norms
    (``net_change_median``) agrees with the every-step value within 0.02 both for it and for a monitor
    that samples one step in ten (``average=False``), whose old measure (``balance_median``, a mean of
    ten-times-fewer noisy ΔR² draws) does not."""
    from normfast.cli import main
    from normfast.engine.monitor.analysis import analyze

    torch.manual_seed(0)
    n = toy_data.x.shape[0]
    enc = build_encoder("mlp", TOY, toy_data)
    settings = {"run": {"every": 1}, "averaged": {"every": 10}, "sampled": {"every": 10, "average": False}}
    mons = [normfast.TrainingMonitor(enc, list(range(n)), out=tmp_path / k, **kw) for k, kw in settings.items()]

    def hooks(step, before, opt):
        for mon in mons:
            mon.before_step(opt) if before else mon.after_step()

    train_toy("mlp", toy_data, 600, hooks, encoder=enc)
    for mon in mons:
        mon.close()
    result = analyze(tmp_path / "run", window=0.5)
    fit = result["fits"]["realized_law"]
    assert 0.85 <= fit["slope"] <= 1.15 and fit["pearson_r"] >= 0.93, fit
    assert result["stationarity"]["balance_median"] < 0.1
    # the curvature remainder is part of the balance: without it the law misses low (E1's ledger)
    assert result["fits"]["realized_law_no_remainder"]["slope"] < fit["slope"]
    assert result["dominant"]["heat"] + result["dominant"]["drift"] == n
    assert main(["report", str(tmp_path / "run"), "--window", "0.5", "--top", "3"]) == 0
    printed = capsys.readouterr().out
    assert "| law from the realized terms | " in printed and "monitor overhead: " in printed
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["fits"]["realized_law"]["slope"] == pytest.approx(fit["slope"])
    assert len(report["items"]["observed"]) == n
    assert (tmp_path / "run" / "monitor_norms.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 600 and summary["recorded_steps"] == 600 and summary["overhead_terms"] > 0

    every_step = result["stationarity"]
    averaged, sampled = (analyze(tmp_path / k, window=0.5) for k in ("averaged", "sampled"))
    assert averaged["window"]["term_steps"] == 300 and sampled["window"]["term_steps"] == 30
    fit10 = averaged["fits"]["realized_law"]
    assert 0.85 <= fit10["slope"] <= 1.15 and fit10["pearson_r"] >= 0.93, fit10
    for other in (averaged, sampled):
        assert abs(other["stationarity"]["net_change_median"] - every_step["net_change_median"]) <= 0.02
    assert abs(sampled["stationarity"]["balance_median"] - every_step["balance_median"]) > 0.2
    assert any("1 step in 10" in note for note in sampled["notes"]) and not averaged["notes"]


@pytest.mark.parametrize("variant, weight_decay", [("mlp_heavyball", 0.1), ("mlp_adamw", 0.5)])
def test_the_realized_terms_add_up_with_momentum_and_adamw(toy_data, tmp_path, variant, weight_decay):
    """The same check for heavy-ball SGD (lr 0.005, momentum 0.9) and AdamW (lr 0.01; weight decay 0.5, so
    that 600 steps are six relaxation times of R², as for SGD), a row every second step averaging both
    steps' terms (the default): the law from the realized window means reproduces the window-mean norms
    within E1's target (the balance closes: an identity in a stationary window, as above)."""
    from dataclasses import replace

    from normfast.engine.monitor.analysis import analyze

    cfg = replace(TOY, weight_decay=weight_decay)
    torch.manual_seed(0)
    n = toy_data.x.shape[0]
    enc = build_encoder(VARIANT_SPECS[variant], cfg, toy_data)
    opt = variant_optimizer(VARIANT_SPECS[variant], cfg, enc.parameters())
    mon = normfast.TrainingMonitor(enc, list(range(n)), every=2, out=tmp_path / "run")
    train_toy(
        variant,
        toy_data,
        600,
        lambda step, before, o: mon.before_step(o) if before else mon.after_step(),
        encoder=enc,
        optimizer=opt,
    )
    mon.close()
    result = analyze(tmp_path / "run", window=0.5)
    assert result["law"] == ("adamw" if variant == "mlp_adamw" else "sgd")
    fit = result["fits"]["realized_law"]
    assert 0.85 <= fit["slope"] <= 1.15 and fit["pearson_r"] >= 0.93, fit
    assert result["stationarity"]["balance_median"] < 0.15


def test_a_resumed_run_writes_the_same_parquet(toy_data, tmp_path):
    """Stopped after a checkpoint (with blocks written after it), resumed from the checkpoint: the same
    monitor.parquet, byte for byte, as an uninterrupted run (heavy-ball: the shadow decay buffer too)."""
    n = toy_data.x.shape[0]
    settings = dict(every=2, flush_every=3)
    steps, stop, crash = 40, 14, 22

    def run(out, begin, end, state=None, model=None):
        enc, opt = model if model is not None else (None, None)
        if enc is None:
            torch.manual_seed(0)
            enc = build_encoder("mlp_heavyball", TOY, toy_data)
        mon = normfast.TrainingMonitor(enc, list(range(n)), out=out, **settings)
        if state is not None:
            mon.load_state_dict(state)
        saved = {}

        def hooks(step, before, o):
            mon.before_step(o) if before else mon.after_step()
            if not before and step == stop - 1:
                saved["checkpoint"] = {
                    "model": {k: v.clone() for k, v in enc.state_dict().items()},
                    "optimizer": _clone(o.state_dict()),
                    "monitor": mon.state_dict(),
                }

        enc, opt = train_toy("mlp_heavyball", toy_data, end, hooks, start=begin, encoder=enc, optimizer=opt)
        return mon, saved.get("checkpoint")

    whole, _ = run(tmp_path / "whole", 0, steps)
    expected = whole.close().read_bytes()

    first, checkpoint = run(tmp_path / "resumed", 0, crash)
    assert first.chunks > checkpoint["monitor"]["chunks"]  # blocks were written after the checkpoint
    first.release()  # the process dies here
    blob = tmp_path / "checkpoint.pt"
    torch.save(checkpoint, blob)
    checkpoint = torch.load(blob, weights_only=True)
    torch.manual_seed(0)
    enc = build_encoder("mlp_heavyball", TOY, toy_data)
    enc.load_state_dict(checkpoint["model"])
    opt = variant_optimizer(VARIANT_SPECS["mlp_heavyball"], TOY, enc.parameters())
    opt.load_state_dict(checkpoint["optimizer"])
    second, _ = run(tmp_path / "resumed", stop, steps, state=checkpoint["monitor"], model=(enc, opt))
    got = second.close().read_bytes()
    assert got == expected
    # the monitor refuses a checkpoint made with other settings
    other = normfast.TrainingMonitor(enc, list(range(n)), out=tmp_path / "other", every=3, flush_every=3)
    with pytest.raises(ValueError, match="other settings or probes"):
        other.load_state_dict(checkpoint["monitor"])


def test_close_keeps_the_files_the_user_put_in_the_parts_folder(toy_data, tmp_path):
    n = toy_data.x.shape[0]
    enc = build_encoder("mlp", TOY, toy_data)
    mon = normfast.TrainingMonitor(enc, list(range(n)), every=1, out=tmp_path / "m", flush_every=2)
    train_toy(
        "mlp", toy_data, 5, lambda step, before, o: mon.before_step(o) if before else mon.after_step(), encoder=enc
    )
    parts = tmp_path / "m" / "monitor.parquet.parts"
    (parts / "notes.txt").write_text("mine")
    with pytest.warns(
        RuntimeWarning, match=r"monitor\.parquet\.parts: left notes\.txt \(1 file normfast did not write\)"
    ):
        path = mon.close()
    assert pq.read_table(path).num_rows == 5 * n
    assert sorted(p.name for p in parts.iterdir()) == ["notes.txt"]  # the blocks, run.json and the lock went


def _clone(state):
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state.clone() if torch.is_tensor(state) else state


def test_settings_are_validated(toy_data):
    enc = build_encoder("mlp", TOY, toy_data)
    with pytest.raises(ValueError, match="every"):
        normfast.TrainingMonitor(enc, [0, 1], every=0, out=None)
    with pytest.raises(ValueError, match="virtual"):
        normfast.TrainingMonitor(enc, [0, 1], virtual=1, out=None)
    with pytest.raises(ValueError, match="objective"):
        normfast.TrainingMonitor(enc, [0, 1], virtual=4, out=None)
    with pytest.raises(ValueError, match="at least one probe"):
        normfast.TrainingMonitor(enc, [], out=None)
    mon = normfast.TrainingMonitor(enc, [0, 1], out=None)
    with pytest.raises(ValueError, match="no optimizer"):
        mon.before_step()
    adam = torch.optim.Adam(enc.parameters(), lr=1e-3, weight_decay=0.1)
    with pytest.raises(TypeError, match="AdamW"):
        mon.before_step(adam)
    frozen = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="updates none of the parameters"):
        normfast.TrainingMonitor(enc, [0, 1], out=None).before_step(frozen)


def test_the_monitor_registry_is_released():
    assert monitor_layout.RELEASED[monitor_layout.MONITOR_VERSION] == monitor_layout.monitor_fingerprint(), (
        "the monitor registry changed: bump MONITOR_VERSION and add the fingerprint "
        "(python -m normfast.engine.monitor.layout --fingerprint) to RELEASED, with a line in CHANGES"
    )
    assert set(monitor_layout.CHANGES) == set(monitor_layout.RELEASED)


@pytest.mark.parametrize("variant", ["mlp_heavyball", "mlp_adamw"])
def test_the_clocks_clean_steps_leave_the_rows_unchanged(toy_data, tmp_path, monkeypatch, variant):
    """The clock defers a few steps' work now and then to time the step after them without the
    monitor: the rows are those of a monitor that never defers, and the summary's overhead is the wall
    time it saw against that many clean steps."""
    from normfast.engine.monitor import parts

    def monitored(folder, clock_every, depth_bytes=parts.CLOCK_DEPTH_BYTES):
        monkeypatch.setattr(parts, "CLOCK_EVERY", clock_every)
        monkeypatch.setattr(parts, "CLOCK_DEPTH_BYTES", depth_bytes)
        mon = []

        def hooks(step, before, opt):
            if before:
                mon[0].before_step(opt)
            else:
                mon[0].after_step()

        v = VARIANT_SPECS[variant]
        enc = build_encoder(v, TOY, toy_data)
        opt = variant_optimizer(v, TOY, enc.parameters())
        mon.append(normfast.TrainingMonitor(enc, list(range(len(toy_data.x))), every=5, out=folder))
        train_toy(variant, toy_data, 60, hooks, encoder=enc, optimizer=opt)
        mon[0].close()
        return pq.read_table(folder / monitor_layout.MONITOR_FILE), json.loads((folder / "summary.json").read_text())

    torch.manual_seed(0)
    deferring, summary = monitored(tmp_path / "a", 7)
    torch.manual_seed(0)
    never, _ = monitored(tmp_path / "b", 10**9)
    assert deferring.num_rows == never.num_rows == 12 * len(toy_data.x)
    for name in ("norm", "task1", "task2", "decay", "remainder", "delta_r2", "n_steps"):
        np.testing.assert_array_equal(deferring.column(name).to_numpy(), never.column(name).to_numpy(), err_msg=name)
    # stretches of CLOCK_DEPTH = 3 steps deferred from step 2, every 7: steps 5, 12, ..., 54 are clean
    assert summary["clean_steps"] == 8
    torch.manual_seed(0)
    single, one = monitored(tmp_path / "c", 7, depth_bytes=0)  # parameters "too large": stretches of one step
    assert single.equals(never) and one["clean_steps"] == 9  # steps 3, 10, ..., 59
    base = summary["clean_step_seconds"] * (summary["steps"] - 1)
    assert summary["overhead"] == pytest.approx(summary["wall_seconds"] / base - 1)
    assert summary["overhead_interference"] == pytest.approx(summary["train_seconds"] / base - 1)


def test_the_default_interval_is_the_committed_studys_decision():
    """``TrainingMonitor``'s default ``every``/``average`` are the decision of the committed study
    ``bench/results/monitor_every`` (its rule, protocol step 7): a new study result that decides
    otherwise fails here until the default follows it."""
    import inspect

    path = Path(__file__).resolve().parents[3] / "bench" / "results" / "monitor_every" / "monitor_every.json"
    decision = json.loads(path.read_text())["decision"]
    defaults = inspect.signature(normfast.TrainingMonitor).parameters
    assert defaults["every"].default == decision["every"]
    assert defaults["average"].default is decision["average"]
