"""The ``normfast`` command line.

Each subcommand lives next to the code it drives: the registry below names,
per command, the module that defines ``add_arguments(parser)`` and
``run(args) -> int`` for it (as ``<command>_arguments`` / ``<command>_main``).
Only the chosen command's module is imported, so ``normfast --help`` and
``normfast --version`` stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys
import warnings
from typing import Iterator, Sequence

from normfast import __version__

# command -> (module, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "solve": ("normfast.apps.solve", "solve the equilibrium quartic for rows of coefficients (.npy/.csv)"),
    "probe": ("normfast.apps.probe_command", "probe a model: drift, heat, damping and R_eq per input or token"),
    "directions": (
        "normfast.apps.directions_command",
        "compute a probe's directions once and save them, for probes that then take seconds",
    ),
    "serve": (
        "normfast.apps.serve.command",
        "a local web service: probe texts over a JSON API and an interactive page",
    ),
    "demo": ("normfast.apps.demo", "offline demo: token-level probe of the real all-MiniLM-L6-v2 on common words"),
    "throughput": ("normfast.apps.throughput", "throughput suite: head/jvp modes against per-sample-gradient tools"),
    "report": ("normfast.apps.report_command", "summarize a probe run (.parquet) and draw its figures"),
    "aggregate": (
        "normfast.apps.aggregate",
        "per-type statistics of a token-level run: by vocabulary entry or by whole word",
    ),
    "view": (
        "normfast.apps.view",
        "one self-contained HTML page of a run (text colored by heat, type tables, figures) or a monitor folder",
    ),
    "compare": (
        "normfast.apps.compare",
        "two runs over the same inputs, type by type: what changed, with error bars and a multiple-testing flag",
    ),
    "retrieval": (
        "normfast.apps.retrieval.command",
        "norm-discounted retrieval: alpha sweep with baselines on a BEIR collection",
    ),
}

DESCRIPTION = """\
normfast measures, for every probe item of a contrastive encoder (an input or a
single token), the optimization statistics that set its embedding norm --
radial drift D, stochastic heat V^2, radial damping kappa -- and predicts the
equilibrium norm R_eq from them.

Run `normfast COMMAND --help` for the details of a command."""


def _command_table() -> str:
    width = max(len(c) for c in COMMANDS)
    return "\n".join(f"  {c:<{width}}  {summary}" for c, (_, summary) in COMMANDS.items())


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normfast",
        description=DESCRIPTION,
        epilog="commands:\n" + _command_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"normfast {__version__}")
    # the commands are listed once, in the epilog's table (argparse's own list would repeat them)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="one of the commands below")
    for name, (module_name, summary) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, add_help=False)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            description=getattr(module, f"{name}_description", summary),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        getattr(module, f"{name}_arguments")(p)
        p.set_defaults(_main=getattr(module, f"{name}_main"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        command = None  # let argparse report the unknown command
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if getattr(args, "_main", None) is None:
        parser.print_help()
        return 0 if command is None and not argv else 2
    try:
        with one_line_warnings(f"normfast {command}"):
            return int(args._main(args) or 0)
    except KeyboardInterrupt:
        hint = "; --resume continues from the finished chunks" if command == "probe" else ""
        print(f"normfast {command}: interrupted{hint}", file=sys.stderr)
        return 130
    except OSError as exc:  # the disk, the file system, permissions: one line naming the file and the fix
        print(f"normfast {command}: error: {describe_os_error(exc, command)}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def one_line_warnings(prefix: str) -> Iterator[None]:
    """While a command runs, a warning prints as one line, ``PREFIX: warning: MESSAGE``, without the source
    file and line a Python warning carries, and each distinct message once."""
    before = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None) -> str:  # noqa: ARG001 - warnings' API
        return f"{prefix}: warning: {' '.join(str(message).split())}\n"

    with warnings.catch_warnings():
        warnings.simplefilter("once")
        warnings.formatwarning = one_line
        try:
            yield
        finally:
            warnings.formatwarning = before


#: errno -> what to do about it
_OS_FIXES = {
    errno.ENOSPC: "free space (or choose another --out), then run the same command again{resume}",
    errno.EDQUOT: "free space within your quota (or choose another --out), then run the same command again{resume}",
    errno.EACCES: "choose an --out in a folder you may write, or change the permissions",
    errno.EPERM: "choose an --out in a folder you may write, or change the permissions",
    errno.EROFS: "choose an --out on a writable file system",
    errno.EISDIR: "give the path of a file, not of a folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EIO: "the disk reported an error; check it, then run the same command again{resume}",
}


def describe_os_error(exc: OSError, command: str | None = None) -> str:
    """One line for an operating-system error: what failed, on which file, and the fix."""
    number = exc.errno
    if number is None:  # pyarrow's I/O errors carry the errno in their text only
        text = str(exc)
        number = next(
            (n for n in _OS_FIXES if f"errno {n}]" in text.lower() or os.strerror(n).lower() in text.lower()), None
        )
    what = exc.strerror or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    where = f": {exc.filename}" if exc.filename else ""
    if exc.filename2:
        where += f" -> {exc.filename2}"
    fix = _OS_FIXES.get(number)
    if fix is None:
        return f"{what}{where}"
    resume = " with --resume (the finished chunks are kept)" if command == "probe" else ""
    return f"{what}{where}; {fix.format(resume=resume)}"


if __name__ == "__main__":
    raise SystemExit(main())
