"""The README's promises: its results tables equal the committed JSON, and its test
command is the one CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_tables_match_bench_results():
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "tables", "--check", "README.md"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- results:([\w-]+) -->", readme)
    assert blocks, "the README has no results tables"
    for name in blocks:
        body = readme.split(f"<!-- results:{name} -->\n", 1)[1].split(f"<!-- /results:{name} -->", 1)[0]
        assert "|" in body, f"results block {name!r} is empty"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("```", 2)[1]
    lines = [ln.split("#")[0].strip() for ln in setup.splitlines() if ln.strip() and not ln.startswith("bash")]
    install, test = lines
    assert install.startswith('pip install -e ".[test]"') and "normfast demo" in install
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci
    assert 'pip install -e ".[test]"' in ci


def test_readme_is_a_quickstart_that_links_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "the README is a quickstart: at most 200 lines (the rest is in docs/)"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local), "the README links nowhere into docs/"
    broken = [link for link in local if not (ROOT / link).exists()]
    assert not broken, f"README links to missing files: {broken}"
