"""The documentation site's generated parts (docs/hooks.py): every marker on every page renders
(a results table from the committed JSON, a command's --help, the output format, the API
blocks), no committed result is left off the site, and every figure a page shows exists.
`mkdocs build --strict` itself runs in CI (.ci/run)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


def _hooks():
    spec = importlib.util.spec_from_file_location("normfast_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_every_marker_renders(page):
    text = page.read_text()
    rendered = hooks.expand(text, str(page.relative_to(DOCS)))
    assert not hooks.MARKER.search(rendered)
    for m in hooks.MARKER.finditer(text):
        kind, arg = m.group("kind"), m.group("arg").strip()
        if kind == "results":
            assert hooks.result_tables()[arg] in rendered
        if kind == "cli" and arg not in ("main", "commands"):
            assert f"usage: normfast {arg}" in rendered
        if kind == "schema":  # the registry's tables, e.g. every key of a monitor's report.json
            assert hooks.schema_tables(arg) in rendered
        if kind == "objectives":  # every registered objective, as it declares itself
            assert hooks.objective_table() in rendered


def test_an_unknown_marker_fails_the_build():
    for bad in (
        "<!-- results:no_such_table -->",
        "<!-- cli:no_such_command -->",
        "<!-- schema:input -->",
        "<!-- objectives:list -->",
        "<!-- include:no/such/file.md -->",
        "<!-- api:no_such_name -->",
    ):
        with pytest.raises(hooks.MarkerError):
            hooks.expand(f"# page\n\n{bad}\n", "test.md")


def test_the_api_page_names_every_public_name():
    import normfast

    with pytest.raises(hooks.MarkerError, match="without an api: marker"):
        hooks.expand("<!-- api:probe -->\n", "test.md")
    rendered = hooks.expand((DOCS / "api.md").read_text(), "api.md")
    for name in normfast.__all__:
        assert f"normfast.{name}" in rendered or f"::: {hooks._public_path(name)}" in rendered or name == "ops"
    assert f"::: {normfast.ops.__name__}" in rendered


def test_the_cli_reference_covers_every_command():
    from normfast import cli

    rendered = hooks.expand((DOCS / "cli.md").read_text(), "cli.md")
    for command in cli.COMMANDS:
        assert f"## `normfast {command}`" in rendered
        assert hooks.command_parser(command).format_usage().split()[2] == command


def test_every_committed_result_is_on_the_site():
    shown = set()
    for page in [*PAGES, ROOT / "README.md"]:
        shown |= set(re.findall(r"<!-- results:([\w-]+) -->", page.read_text()))
    missing = sorted(set(hooks.result_tables()) - shown)
    assert not missing, f"results tables rendered from bench/results but shown on no page: {missing}"


def test_every_figure_exists():
    shown = set()
    for page in PAGES:
        for m in re.finditer(r"\]\((?:\.\./)*results/([^) ]+)", page.read_text()):
            assert (ROOT / "bench" / "results" / m.group(1)).is_file(), f"{page.name}: {m.group(1)}"
            shown.add(m.group(1))
    assert shown, "no page shows a figure"
