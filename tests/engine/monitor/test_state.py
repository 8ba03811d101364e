"""The monitor's resume state (issue 33): it records which model it watched, so that a checkpoint
resumed on another model (hidden 16 -> 32) is refused instead of mixing two networks' steps in one
monitor.parquet, and a damaged or tampered state is one ``ValueError`` line that deletes nothing,
instead of skipping or inventing steps."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import normfast
from bench.experiments.e1.data import VARIANT_SPECS, build_encoder, make_concepts, variant_optimizer
from normfast.engine.monitor.layout import MONITOR_VERSION
from normfast.engine.monitor.state import STATE_VERSION
from tests.engine.monitor.test_recorder import TOY, train_toy

pytestmark = pytest.mark.usefixtures("single_thread")

#: 7 recorded steps in blocks of 3: blocks 0 and 1 on disk, step 6 pending in the state
STEPS, FLUSH = 7, 3


@pytest.fixture(scope="module")
def data():
    return make_concepts(TOY)


def _monitor(enc, data, out: Path, **kw):
    return normfast.TrainingMonitor(enc, list(range(data.x.shape[0])), every=1, out=out, flush_every=FLUSH, **kw)


def _hooks(mon):
    return lambda step, before, o: mon.before_step(o) if before else mon.after_step()


def _stopped(data, out: Path, cfg=TOY):
    """A monitor stopped after STEPS steps: its state (through torch.save and a safe load) and folder."""
    torch.manual_seed(0)
    enc = build_encoder("mlp", cfg, data)
    mon = _monitor(enc, data, out)
    train_toy("mlp", data, STEPS, _hooks(mon), encoder=enc)
    state = mon.state_dict()
    mon.release()
    torch.save(state, out.parent / "state.pt")
    return torch.load(out.parent / "state.pt", weights_only=True), enc


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(mon, state, folder: Path, match: str) -> str:
    before = _snapshot(folder)
    with pytest.raises(ValueError, match=match) as info:
        mon.load_state_dict(state)
    message = str(info.value)
    assert "\n" not in message and message.startswith("TrainingMonitor.load_state_dict: "), message
    assert _snapshot(folder) == before  # nothing deleted, nothing written
    return message


def test_the_state_records_the_monitored_parameters(data, tmp_path):
    state, _ = _stopped(data, tmp_path / "m")
    assert state["state_version"] == STATE_VERSION and state["monitor_version"] == MONITOR_VERSION
    assert state["parameters"] == [["blocks.0.weight", [16, 8], "float32"], ["blocks.2.weight", [8, 16], "float32"]]


def test_a_model_of_another_shape_is_refused_naming_the_first_parameter(data, tmp_path):
    state, _ = _stopped(data, tmp_path / "m")
    wider = build_encoder("mlp", replace(TOY, hidden=32), data)
    message = _refused(
        _monitor(wider, data, tmp_path / "m"),
        state,
        tmp_path / "m",
        r"another model: parameter 'blocks\.0\.weight' has shape \(32, 8\) here, \(16, 8\) in the checkpoint",
    )
    assert "blocks.2.weight" not in message
    # the same shapes in another dtype
    double = build_encoder("mlp", TOY, data).double()
    _refused(_monitor(double, data, tmp_path / "m"), state, tmp_path / "m", r"'blocks\.0\.weight' is float64 here")


def test_an_optimizer_over_other_parameters_is_refused_at_the_first_step(data, tmp_path):
    state, enc = _stopped(data, tmp_path / "m")
    mon = _monitor(enc, data, tmp_path / "m")
    mon.load_state_dict(state)
    head_only = variant_optimizer(VARIANT_SPECS["mlp"], TOY, [enc.get_parameter("blocks.2.weight")])
    with pytest.raises(ValueError, match=r"monitored 'blocks\.0\.weight', which the optimizer does not update here"):
        train_toy("mlp", data, STEPS + 1, _hooks(mon), start=STEPS, encoder=enc, optimizer=head_only)
    mon.release()


def _damage(state: dict, key: str, value) -> dict:
    state = dict(state)
    state[key] = value(state) if callable(value) else value
    return state


def _pending_step(state):
    rows = [dict(r) for r in state["pending"]]
    rows[0]["step"] = torch.full_like(rows[0]["step"], 99)
    return rows


def _pending_short(state):
    rows = [dict(r) for r in state["pending"]]
    rows[0]["norm"] = rows[0]["norm"][:3]
    return rows


DAMAGE = {
    "info-not-json": ("info", "{half", r"'info' is not JSON"),
    "info-list": ("info", "[1, 2]", r"'info' .* not a JSON object"),
    "pending-text": ("pending", "rows", r"'pending' .* list"),
    "pending-types": ("pending", [{"step": "a"}], r"'pending' row 0"),
    "pending-short": ("pending", _pending_short, r"'pending' row 0: 'norm' holds 3 values, expected 32"),
    "pending-step": ("pending", _pending_step, r"'pending' row 0 is step 99, after last_step 6"),
    "recorded-more": ("recorded", lambda s: s["recorded"] + 1, r"recorded=8 .* 2 blocks of 3 steps \+ 1 pending"),
    "recorded-text": ("recorded", "7", r"'recorded' is '7', expected an int >= 0"),
    "chunks-fewer": ("chunks", lambda s: s["chunks"] - 1, r"recorded=7 .* 1 blocks of 3 steps \+ 1 pending"),
    "next-step-back": (
        "next_step",
        lambda s: s["last_step"],
        r"next_step=6 is not after last_step 6: step 6 would be recorded again",
    ),
    "next-step-skip": ("next_step", lambda s: s["last_step"] + 4, r"next_step=10 .* would skip steps 7 to 9"),
    "first-step": ("first_step", 1, r"first_step=1 .* block 0 starts at step 0"),
    "monitor-version": ("monitor_version", 99, r"monitor format version 99, .*upgrade normfast"),
    "monitor-version-older": (
        "monitor_version",
        1,
        r"writes monitor format version 1, this normfast 2 \(the column n_steps .*\): finish that run",
    ),
    "term-sums": ("term_sums", "x", r"'term_sums' is not a dict of 'sums' \(term -> tensor\) and 'steps'"),
    "term-sums-short": (
        "term_sums",
        {"sums": {"task1": torch.zeros(3, dtype=torch.float64)}, "steps": 1},
        r"'term_sums': 'task1' is not a float64 tensor of 32 values",
    ),
    "term-sums-count": (
        "term_sums",
        {"sums": {"task1": torch.zeros(32, dtype=torch.float64)}, "steps": 1},
        r"'term_sums' hold 1 steps, a row every 1",
    ),
    "state-version": ("state_version", 99, r"state version 99, .*upgrade normfast"),
    "timing": ("timing", "fast", r"'timing' .* dict"),
    "decay-buffers": ("decay_buffers", {"blocks.0.weight": "x"}, r"'decay_buffers'"),
    "steps-seen": ("steps_seen", -1, r"'steps_seen' is -1, expected an int >= 0"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_or_tampered_state_is_one_line_and_deletes_nothing(data, tmp_path, case):
    key, value, match = DAMAGE[case]
    state, enc = _stopped(data, tmp_path / "m")
    _refused(_monitor(enc, data, tmp_path / "m"), _damage(state, key, value), tmp_path / "m", match)


def test_blocks_that_disagree_with_the_state_are_refused_and_kept(data, tmp_path):
    state, enc = _stopped(data, tmp_path / "m")
    parts = tmp_path / "m" / "monitor.parquet.parts"
    # a block and its counts moved back together: the block the state ends with is not the one on disk
    fewer = {**state, "chunks": 1, "recorded": state["recorded"] - FLUSH}
    _refused(_monitor(enc, data, tmp_path / "m"), fewer, tmp_path / "m", r"block 1 on disk starts at step 3")
    # a block the state counts is missing
    more = {**state, "chunks": 3, "recorded": state["recorded"] + FLUSH, "steps_seen": state["steps_seen"] + FLUSH}
    _refused(_monitor(enc, data, tmp_path / "m"), more, tmp_path / "m", r"lacks block\(s\) \[2\]")
    # a damaged block: named, and left where it is (it used to be deleted before the refusal)
    block = parts / "chunk-0000000.parquet"
    raw = bytearray(block.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    block.write_bytes(bytes(raw))
    message = _refused(_monitor(enc, data, tmp_path / "m"), state, tmp_path / "m", r"block 0 .* cannot be used")
    assert "nothing was deleted" in message and block.exists()


def test_a_state_of_the_previous_version_resumes_with_a_warning(data, tmp_path):
    state, enc = _stopped(data, tmp_path / "m")
    old = {k: v for k, v in state.items() if k not in ("parameters", "monitor_version")}
    old["state_version"] = 1
    mon = _monitor(enc, data, tmp_path / "m")
    with pytest.warns(UserWarning, match=r"state version 1 .* the model cannot be checked against it"):
        mon.load_state_dict(old)
    train_toy("mlp", data, STEPS + 2, _hooks(mon), start=STEPS, encoder=enc)
    table = mon.table()
    assert np.unique(table["step"].to_numpy()).tolist() == list(range(STEPS + 2))
    mon.release()
