"""``python -m bench``: list the experiments, run one, render the results tables.

    python -m bench list
    python -m bench run NAME [--quick] [--seed N] [--out DIR] [--no-progress] [options]
    python -m bench run NAME --help            # NAME's options (its Config's fields)
    python -m bench tables [--check FILE ...] [--write FILE ...]
    python -m bench figures NAME --json FILE --out DIR   # redraw NAME's figures from a result JSON

``run`` writes under ``runs/NAME`` unless ``--out`` says otherwise; the
committed results in ``bench/results/NAME`` change only with an explicit
``--out bench/results/NAME``. The options of an experiment are generated from its
``Config`` dataclass: a field ``batch_size`` is ``--batch-size``; a boolean
field is a flag (``--name``, or ``--no-name`` when it defaults to true); a
tuple takes several values. ``--quick`` starts from ``Config.quick()``, and
the options given replace its values.
"""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any, Sequence

from bench import harness

PROG = "python -m bench"


def default_out(name: str) -> Path:
    """Where ``run NAME`` writes without ``--out``: under runs/ (git-ignored), never bench/results."""
    return Path("runs") / name


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _types(config_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(config_cls)


def _base(hint: Any) -> tuple[Any, bool]:
    """``(element type, is a tuple)`` of a field's annotation; ``X | None`` counts as ``X``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        return (args[0] if args else str), True
    if origin is not None and args:  # Optional / Union
        return _base(args[0])
    return hint, False


def config_parser(name: str, module: Any) -> argparse.ArgumentParser:
    """The options of ``run NAME``: the common ones, then one per field of the experiment's Config."""
    quick = module.Config.quick()
    p = argparse.ArgumentParser(
        prog=f"{PROG} run {name}", description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="start from Config.quick(): the quick size")
    p.add_argument(
        "--seed",
        type=int,
        default=argparse.SUPPRESS,
        help="seed of the run (default: the config's seed, else 0); Python, numpy and torch are seeded with it",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output folder (default {default_out(name)}, git-ignored; the committed results: "
        f"--out bench/results/{name})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group(f"{name} options (fields of its Config)")
    hints = _types(module.Config)
    for f in fields(module.Config):
        if f.name == "seed":
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        quick_value = getattr(quick, f.name)
        text = f.metadata.get("help", "")
        text += f"{' ' if text else ''}(default {default!r}" + (
            f"; --quick: {quick_value!r})" if quick_value != default else ")"
        )
        kind, many = _base(hints[f.name])
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if kind is bool and not many:
            if default is True:
                g.add_argument("--no-" + f.name.replace("_", "-"), action="store_false", **kw)
            else:
                g.add_argument(_option(f.name), action="store_true", **kw)
        elif many:
            g.add_argument(_option(f.name), type=kind, nargs="+", action="extend", **kw)
        else:
            g.add_argument(_option(f.name), type=kind, **kw)
    return p


def build_config(module: Any, args: argparse.Namespace) -> Any:
    """``Config()`` or ``Config.quick()``, with the options given on top; validated."""
    cfg = module.Config.quick() if args.quick else module.Config()
    given = {f.name: getattr(args, f.name) for f in fields(cfg) if hasattr(args, f.name)}
    hints = _types(module.Config)
    for key, value in given.items():
        if _base(hints[key])[1]:
            given[key] = tuple(value)
    cfg = replace(cfg, **given)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def reproduce(name: str, module: Any, cfg: Any, quick: bool, seed: int, out: Path | None) -> str:
    """The command that reproduces ``cfg``: the options whose value differs from the starting point."""
    base = module.Config.quick() if quick else module.Config()
    parts = [PROG, "run", name] + (["--quick"] if quick else [])
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "seed" or value == getattr(base, f.name):
            continue
        if isinstance(value, bool):
            parts.append(_option(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple):
            parts += [_option(f.name), *map(str, value)]
        else:
            parts += [_option(f.name), str(value)]
    if seed != 0 or any(f.name == "seed" for f in fields(cfg)):
        parts += ["--seed", str(seed)]
    if out is not None:
        parts += ["--out", str(out)]
    return " ".join(parts)


def cmd_list() -> int:
    from bench import catalog

    rows = catalog()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['title']}")
        print(f"{'':<{width}}  writes {default_out(r['name'])}/ by default (results: {', '.join(r['results'])})")
    return 0


def cmd_run(argv: Sequence[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(
            f"usage: {PROG} run NAME [--quick] [--seed N] [--out DIR] [options]\n"
            f"experiments: {', '.join(harness.EXPERIMENTS)}",
            file=sys.stderr,
        )
        return 2
    name = argv[0]
    if name not in harness.EXPERIMENTS:
        print(
            f"{PROG} run: unknown experiment {name!r}; expected one of {', '.join(harness.EXPERIMENTS)}",
            file=sys.stderr,
        )
        return 2
    module = harness.load(name)
    args = config_parser(name, module).parse_args(list(argv[1:]))
    try:
        cfg = build_config(module, args)
    except ValueError as exc:
        print(f"{PROG} run {name}: error: {exc}", file=sys.stderr)
        return 2
    seed = getattr(args, "seed", getattr(cfg, "seed", 0))
    if hasattr(cfg, "seed"):
        cfg = replace(cfg, seed=seed)
    out = args.out if args.out is not None else default_out(name)
    command = reproduce(name, module, cfg, args.quick, seed, args.out)
    ctx = harness.Context(out=out, progress=not args.no_progress, quick=args.quick, command=command)
    try:
        done = harness.execute(name, cfg, ctx, seed=seed)
    except harness.UsageError as exc:
        print(f"{PROG} run {name}: error: {exc}", file=sys.stderr)
        return 2
    for title, table in done.tables.items():
        print(f"\n## {title}\n\n{table}")
    print(f"\n{done.wall_seconds:.0f} s wall, {done.cpu_seconds:.0f} s CPU; reproduce with: {command}")
    if done.failed:
        print(f"{PROG} run {name}: {done.failed}", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in done.written))
    return 1 if done.failed else 0


def cmd_tables(argv: Sequence[str]) -> int:
    from bench import tables

    p = argparse.ArgumentParser(
        prog=f"{PROG} tables", description=tables.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--check",
        type=Path,
        nargs="+",
        default=[],
        metavar="FILE",
        help="markdown files whose <!-- results:NAME --> blocks must equal the committed JSON",
    )
    p.add_argument(
        "--write", type=Path, nargs="+", default=[], metavar="FILE", help="markdown files whose blocks to refresh"
    )
    args = p.parse_args(list(argv))
    for path in args.write:
        tables.write(path)
    bad = {str(path): tables.check(path) for path in args.check}
    bad = {k: v for k, v in bad.items() if v}
    for path, names in bad.items():
        print(f"{path}: tables out of date with bench/results: {', '.join(names)}", file=sys.stderr)
    if not args.check and not args.write:
        for name, text in tables.render_all().items():
            print(f"<!-- results:{name} -->\n{text}\n<!-- /results:{name} -->\n")
    return 1 if bad else 0


def cmd_figures(argv: Sequence[str]) -> int:
    """Redraw an experiment's figures from a result JSON it wrote (after a change to the drawing alone)."""
    p = argparse.ArgumentParser(prog=f"{PROG} figures", description=cmd_figures.__doc__)
    p.add_argument("name", choices=harness.EXPERIMENTS)
    p.add_argument("--json", type=Path, required=True, help="the result JSON the experiment's run wrote")
    p.add_argument("--out", type=Path, required=True, help="where to write the figures")
    args = p.parse_args(list(argv))
    module = harness.load(args.name)
    draw = getattr(module, "figures", None)
    if draw is None:
        print(f"{PROG} figures: {args.name} has no figures to redraw from its JSON", file=sys.stderr)
        return 2
    if not args.json.is_file():
        print(f"{PROG} figures: no such result file: {args.json}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        written = draw(harness.read_json(args.json), args.out)
    except KeyError as exc:  # a figure that needs the run's live objects, not only its JSON
        print(
            f"{PROG} figures: {args.name}'s figures need {exc} (not in the JSON): rerun the experiment", file=sys.stderr
        )
        return 2
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"list": lambda rest: cmd_list(), "run": cmd_run, "tables": cmd_tables, "figures": cmd_figures}
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])
