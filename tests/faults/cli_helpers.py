"""What the fault tests of the probe command share: small run settings, the probe command line, and the
check that a refusal is one line (the fixtures `words` and `no_compute` are in this folder's conftest)."""

#: a tiny run: four heat batches, eight drift batches, two groups
F = ["--batches", "4", "--drift-batches", "8", "--groups", "2", "--batch-size", "8", "--no-progress"]


def probe_args(model, words, out, *extra) -> list[str]:
    """``normfast probe`` on a model folder and a words file, the tiny settings, one layer probed."""
    return [
        "probe",
        str(model),
        "--probes",
        str(words),
        "--params",
        r"encoder\.layer\.1\.",
        *F,
        "--out",
        str(out),
        *extra,
    ]


def one_error_line(err: str) -> str:
    """The one line the command printed about itself (no traceback)."""
    ours = [line for line in err.splitlines() if line.startswith("normfast ")]
    assert len(ours) == 1 and "Traceback" not in err, err
    return ours[0]
