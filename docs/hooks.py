"""mkdocs hooks: every generated part of the site, rendered at build time so it cannot go stale.

A page asks for generated content with a marker on a line of its own:

    <!-- results:NAME -->     a results table from bench/results/*.json (bench/tables.py, render_all())
    <!-- cli:COMMAND -->      `normfast COMMAND --help` from the real argparse parser
                              (cli:main: `normfast --help`; cli:commands: every command, one section each)
    <!-- schema:output -->    the Parquet columns and metadata keys (normfast.data.schema)
    <!-- schema:resume-key --> what a resume compares: the allow-list of a run's metadata (normfast.data.resume_key)
    <!-- schema:monitor -->   a training monitor folder's columns and keys (normfast.engine.monitor.layout)
    <!-- schema:monitor-report --> the files `normfast report` writes there (normfast.engine.monitor.readout)
    <!-- schema:serve -->     `normfast serve`'s JSON API: its rows and JSON Schemas (normfast.apps.serve.protocol)
    <!-- objectives:table --> every registered objective with what it declares: its batches, settings and
                              flags, chance level, saturation rule, pair encoder
                              (normfast.engine.directions.objectives)
    <!-- api:NAME NAME ... --> mkdocstrings blocks for public names of `import normfast`
                              (api:ops: the array backend, normfast.ops)
    <!-- stable:modules -->   the stable internals and what each offers (normfast.stable)
    <!-- include:PATH -->     a file of the repository, as it is (e.g. bench/NOTES.md)

A marker that names nothing known fails the build. The figures in bench/results/**/*.png join the
site as results/EXPERIMENT/NAME.png (on_files), so pages link them as ../results/EXPERIMENT/NAME.png without a copy in
docs/. `expand()` needs neither mkdocs nor a build: the tests call it on every page.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MARKER = re.compile(
    r"^<!-- (?P<kind>results|cli|schema|objectives|api|stable|include):(?P<arg>[^>]*?) -->[ \t]*$", re.M
)
HELP_WIDTH = "100"  # argparse wraps help to $COLUMNS: a fixed width makes the pages reproducible


class MarkerError(ValueError):
    """A marker that names no table, command, file or public name."""


# ---------------------------------------------------------------------------------------------
# the generators


@functools.cache
def result_tables() -> dict[str, str]:
    """Block name -> markdown, from the committed JSON (bench.tables.render_all())."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.tables import render_all

    return render_all()


@contextlib.contextmanager
def _help_width():
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of `normfast COMMAND`, as `normfast COMMAND ...` parses its arguments."""
    from normfast import cli

    if command not in cli.COMMANDS:
        raise MarkerError(f"cli:{command}: no such command (normfast.cli.COMMANDS: {', '.join(cli.COMMANDS)})")
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def cli_help(command: str) -> str:
    """`normfast --help` (command "main"), `normfast COMMAND --help`, or every command in turn."""
    from normfast import cli

    if command == "commands":
        return "\n\n".join(
            f"## `normfast {name}`\n\n{summary[0].upper() + summary[1:]}.\n\n{cli_help(name)}"
            for name, (_, summary) in cli.COMMANDS.items()
        )
    with _help_width():
        text = (cli.build_parser() if command == "main" else command_parser(command)).format_help()
    return "```text\n" + text.rstrip() + "\n```"


def schema_tables(which: str = "output") -> str:
    from normfast.apps.serve import protocol
    from normfast.data import resume_key, schema
    from normfast.engine.monitor import layout, readout

    modules = {"monitor": layout, "monitor-report": readout, "serve": protocol}
    return {**modules, "resume-key": resume_key}.get(which, schema).render_markdown()


def objective_table() -> str:
    """Every registered objective, as the registry declares it (the order is the registry's)."""
    from normfast.engine.directions.objectives import objective_classes

    def shown(value) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return f"{value:g}" if isinstance(value, float) else str(value)

    rows = [
        "| `--objective` | class | a virtual batch holds | settings: flag (default) | chance level | saturated when "
        "| its positives go through |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, cls in objective_classes().items():
        declared = [
            f"`{s.flag}`" + ("" if s.type is bool else f" ({shown(s.default)})") + f": {s.help}"
            for s in cls.declared_settings
        ]
        fixed = [f"{k}: always {shown(v)}" for k, v in cls.fixed_settings.items()]
        chance = f"`{cls.chance.formula}` (B: batch size)" if cls.chance is not None else "none"
        rows.append(
            f"| `{name}` | `{cls.__name__}` | {cls.needs}: {cls.summary} | {'<br>'.join(declared + fixed) or 'none'} "
            f"| {chance} | {cls.saturation_text()} "
            f"| {'a second encoder (open_clip: the other tower)' if cls.needs_pair_encoder else 'the probed encoder'} |"
        )
    return "\n".join(rows)


def _public_path(name: str) -> str:
    """The import path mkdocstrings reads a public name from: where it is defined today (the
    module layout behind `import normfast` may change; the public name does not)."""
    import normfast

    obj = getattr(normfast, name)
    return f"{obj.__module__}.{obj.__qualname__}"


#: public methods of a public class that other engine modules call but a user does not: documented in
#: the code, left off the API page (mkdocstrings already leaves out names with a leading underscore)
ENGINE_ENTRIES: dict[str, tuple[str, ...]] = {
    "Prober": ("new_run",)  # normfast.engine.runner.artifact builds its runs through it
}


def api_blocks(arg: str) -> str:
    import normfast

    out = []
    for name in arg.split():
        if name not in normfast.__all__:
            raise MarkerError(f"api:{name}: not in normfast.__all__")
        obj = getattr(normfast, name)
        if name == "ops":
            shown = [n for n in obj.__all__ if n not in normfast.__all__]
            again = [n for n in obj.__all__ if n in normfast.__all__]
            out.append(
                f"::: {obj.__name__}\n    options:\n      show_root_heading: false\n"
                f"      members: [{', '.join(shown)}]\n"
            )
            if again:
                out.append(
                    "`normfast.ops` also holds "
                    + ", ".join(f"`{n}`" for n in again)
                    + ", the same functions as `normfast."
                    + again[0]
                    + "` etc. above.\n"
                )
        elif isinstance(obj, (str, int)):  # SCHEMA_VERSION, __version__: a value, not a docstring
            what = {
                "SCHEMA_VERSION": "the version of the output format ([Output format](output-format.md))",
                "__version__": "the installed version of normfast",
            }.get(name, "")
            out.append(f"### `normfast.{name}`\n\n`{obj!r}`: {what}.\n")
        elif name in ENGINE_ENTRIES:
            hidden = ", ".join(f'"!^{m}$"' for m in ENGINE_ENTRIES[name])
            out.append(f'::: {_public_path(name)}\n    options:\n      filters: ["!^_", {hidden}]\n')
        else:
            out.append(f"::: {_public_path(name)}\n")
    return "\n".join(out)


def stable_table(arg: str) -> str:
    """The stable internals (normfast.stable): one row per module, with the names of its __all__."""
    import importlib

    from normfast import stable

    if arg != "modules":
        raise MarkerError(f"stable:{arg}: only stable:modules exists")
    rows = [
        f"Version {stable.VERSION} (`normfast.stable.VERSION`).",
        "",
        "| module | what it offers | its `__all__` |",
        "|---|---|---|",
    ]
    for module, what in stable.MODULES.items():
        names = ", ".join(f"`{n}`" for n in importlib.import_module(module).__all__)
        rows.append(f"| `{module}` | {what} | {names} |")
    return "\n".join(rows)


def include(arg: str) -> str:
    path = (ROOT / arg).resolve()
    if ROOT not in path.parents or not path.is_file():
        raise MarkerError(f"include:{arg}: no such file in the repository")
    return path.read_text().rstrip("\n")


def render(kind: str, arg: str) -> str:
    if kind == "results":
        tables = result_tables()
        if arg not in tables:
            raise MarkerError(
                f"results:{arg}: bench/tables.py renders no such table from bench/results "
                f"(known: {', '.join(sorted(tables))})"
            )
        return tables[arg]
    if kind == "cli":
        return cli_help(arg)
    if kind == "schema":
        if arg not in ("output", "resume-key", "monitor", "monitor-report", "serve"):
            raise MarkerError(
                f"schema:{arg}: only schema:output, schema:resume-key, schema:monitor, schema:monitor-report and "
                f"schema:serve exist"
            )
        return schema_tables(arg)
    if kind == "objectives":
        if arg != "table":
            raise MarkerError(f"objectives:{arg}: only objectives:table exists")
        return objective_table()
    if kind == "api":
        return api_blocks(arg)
    if kind == "stable":
        return stable_table(arg)
    return include(arg)


def expand(markdown: str, page: str = "?") -> str:
    """Replace every marker of a page by its generated content. A page with `api:` markers must
    name every public name of `import normfast` (so a new one cannot go undocumented)."""
    api_names: set[str] = set()

    def one(m: re.Match) -> str:
        if m.group("kind") == "api":
            api_names.update(m.group("arg").split())
        try:
            return render(m.group("kind"), m.group("arg").strip())
        except MarkerError as e:
            raise MarkerError(f"{page}: {e}") from None

    text = MARKER.sub(one, markdown)
    if api_names:
        import normfast

        missing = [n for n in normfast.__all__ if n not in api_names]
        if missing:
            raise MarkerError(f"{page}: public names without an api: marker: {', '.join(missing)}")
    return text


# ---------------------------------------------------------------------------------------------
# mkdocs events


def on_page_markdown(markdown: str, page, config, files) -> str:
    from mkdocs.exceptions import PluginError

    try:
        return expand(markdown, page.file.src_uri)
    except MarkerError as e:
        raise PluginError(str(e)) from None


def on_files(files, config):
    """bench/results/**/*.png become results/**/*.png of the site (read from where they are; the
    toy-size bench/results/NAME/quick/ is not a result)."""
    from mkdocs.structure.files import File

    for png in sorted(RESULTS.rglob("*.png")):
        rel = png.relative_to(RESULTS)
        if "quick" in rel.parts[:-1]:
            continue
        files.append(
            File(
                f"results/{rel.as_posix()}",
                src_dir=str(RESULTS.parent),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
