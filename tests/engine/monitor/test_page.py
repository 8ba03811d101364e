"""A training monitor folder's page (`normfast view FOLDER`): its numbers against the folder's Parquet and
`normfast report`'s analysis, its bounds (steps binned, a few items' trajectories), the command; then in a
real headless Chromium (tests/_browser.py): it loads from file:// with no console error and no request,
its table and figures show the folder's numbers, choosing an item draws it, a screenshot is not blank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import normfast
from normfast.cli import main
from normfast.engine.monitor.analysis import analyze
from normfast.engine.monitor.page import block_se, monitor_page_data, write_monitor_page
from tests._browser import Tab, assert_screenshot_not_blank, launch

pytestmark = pytest.mark.usefixtures("single_thread")

ITEMS, STEPS, EVERY = 12, 80, 2


class Net(torch.nn.Module):  # the two-layer MLP of docs/monitor.md
    def __init__(self):
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def train(folder: Path, terms: bool = True) -> Path:
    """The docs' toy loop: SGD with weight decay, InfoNCE on noisy copies, the monitor every EVERY steps."""
    torch.manual_seed(0)
    net = Net()
    items = torch.randn(128, 16)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, weight_decay=0.1)
    loss_fn = normfast.InfoNCE(temperature=0.1)
    ids = [f"item-{i}" for i in range(ITEMS)]
    monitor = normfast.TrainingMonitor(net, items[:ITEMS], every=EVERY, out=folder, ids=ids, terms=terms)
    for _ in range(STEPS):
        batch = items[torch.randint(0, 128, (16,))]
        loss = loss_fn.loss(net(batch), net(batch + 0.3 * torch.randn_like(batch)))
        optimizer.zero_grad()
        loss.backward()
        monitor.before_step(optimizer)
        optimizer.step()
        monitor.after_step()
    monitor.close()
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("monitor-page")
    return {"terms": train(base / "terms"), "norms": train(base / "norms", terms=False)}


def matrix(folder: Path, column: str) -> np.ndarray:
    t = pq.read_table(folder / "monitor.parquet").sort_by([("step", "ascending"), ("item", "ascending")])
    return np.asarray(t[column].to_numpy(), float).reshape(-1, ITEMS)


def embedded(page: Path) -> dict:
    m = re.search(r'<script id="nf-data" type="application/json">(.*?)</script>', page.read_text("utf-8"), re.S)
    assert m, "the page has no data element"
    return json.loads(m.group(1))


def test_block_se_is_the_batch_means_error():
    x = np.arange(12.0)[:, None] * np.array([[1.0, -2.0]])
    blocks = x.reshape(4, 3, 2).mean(1)  # 4 contiguous blocks of 3 steps
    np.testing.assert_allclose(block_se(x, blocks=4), blocks.std(0, ddof=1) / 2)
    assert np.isnan(block_se(x[:1])).all()  # one step: no error bar


def test_the_page_holds_the_folders_numbers(folders):
    folder = folders["terms"]
    data = monitor_page_data(folder)
    result = analyze(folder)
    S, w = STEPS // EVERY, result["window"]["recorded_steps"]
    assert data["steps"]["bin"] == 1 and data["steps"]["x"] == list(range(0, STEPS, EVERY))  # every step
    assert data["series"]["item"] == list(range(ITEMS)) and len(data["shown"]) == 5
    np.testing.assert_allclose(np.array(data["series"]["norm"], float).T, matrix(folder, "norm"), rtol=1e-4)
    # the table: window means as the report has them, their errors by batch means over the window's steps
    t = data["items"]
    assert t["id"] == [f"item-{i}" for i in range(ITEMS)]
    np.testing.assert_allclose(t["q"]["observed"]["mean"], result["items"]["observed"], rtol=1e-4)
    np.testing.assert_allclose(t["q"]["r_eq_realized"]["mean"], result["items"]["r_eq_realized"], rtol=1e-4)
    decay = matrix(folder, "decay")[S - w :]
    blocks = np.stack([decay[p].mean(0) for p in np.array_split(np.arange(w), 10)])
    np.testing.assert_allclose(t["q"]["decay"]["se"], blocks.std(0, ddof=1) / np.sqrt(10), rtol=5e-3)  # 3 digits
    assert data["steps"]["blocks"] == 10
    # R_eq over steps: the law over the trailing window; its last point is the report's prediction
    law = np.array(data["series"]["r_eq"], float)
    np.testing.assert_allclose(law[:, -1], result["items"]["r_eq_realized"], rtol=1e-4)
    assert np.isnan(law[:, : w - 1]).all() and np.isfinite(law[:, w - 1 :]).all()
    # over the whole run the first row (its own step) and the others (EVERY steps each) weigh by their steps
    whole = np.array(monitor_page_data(folder, window=1.0)["series"]["r_eq"], float)[:, -1]
    np.testing.assert_allclose(whole, analyze(folder, window=1.0)["items"]["r_eq_realized"], rtol=1e-4)
    # the budget: each term's mean over every item, per recorded step
    task = matrix(folder, "task1") + matrix(folder, "task2")
    np.testing.assert_allclose(data["mean_terms"]["task"], task.mean(1), rtol=1e-3, atol=1e-12)
    assert "every recorded step (40)" in data["header"]["sample"]
    assert data["header"]["lines"][0].startswith("monitor folder ")
    assert data["header"]["fits"][0]["label"] == "law from the realized terms"


def test_a_long_run_is_binned_and_the_page_says_so(folders):
    folder = folders["terms"]
    data = monitor_page_data(folder, steps=7, series=2)
    norms = matrix(folder, "norm")
    parts = np.array_split(np.arange(STEPS // EVERY), 7)
    assert len(data["steps"]["x"]) == 7 and data["steps"]["bin"] == 6
    k = data["series"]["item"].index(data["series"]["item"][0])
    i = data["series"]["item"][k]
    np.testing.assert_allclose(data["series"]["norm"][k], [norms[p, i].mean() for p in parts], rtol=1e-4)
    assert len(data["series"]["item"]) == 5  # the 5 shown items (more than series=2)
    assert data["items"]["n"] == ITEMS  # the table keeps every item
    assert "each the mean over 6 consecutive recorded steps (of 40)" in data["header"]["sample"]
    assert "the trajectories of 5 of the 12 items" in data["header"]["sample"]


def test_norms_only(folders):
    data = monitor_page_data(folders["norms"])
    assert not data["terms"] and "r_eq" not in data["series"] and list(data["items"]["q"]) == ["observed"]
    assert "recorded norms only" in data["header"]["reading"]


def test_view_writes_the_monitor_page(folders, tmp_path, capsys):
    folder = folders["terms"]
    assert main(["view", str(folder)]) == 0
    out = folder / "monitor.html"
    assert f"wrote {out}" in capsys.readouterr().out and embedded(out)["page"] == "monitor"
    html = out.read_text("utf-8")  # one file that loads nothing
    assert not re.search(r"<(link|img|iframe|object|embed)\b", html, re.I)
    assert not re.search(r"\b(src|href)\s*=", html, re.I)
    assert main(["view", str(folder / "monitor.parquet"), "--out", str(tmp_path / "m.html"), "--steps", "5"]) == 0
    assert len(embedded(tmp_path / "m.html")["steps"]["x"]) == 5
    capsys.readouterr()
    for argv, message in (
        (["--stat", "D"], "--stat colors a probe run's text"),
        (["--steps", "0"], "expected steps to be a positive int, got 0"),
        (["--window", "2"], "expected 0 < window <= 1"),
    ):
        assert main(["view", str(folder), "--out", str(tmp_path / "x.html"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("normfast view: error: ") and message in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match="ending in .html"):
        write_monitor_page(folder, tmp_path / "page.txt")


# ---------------------------------------------------------------------------
# in a real browser


@pytest.fixture(scope="module")
def browser():
    yield from launch()


@pytest.fixture(scope="module")
def page(folders, tmp_path_factory) -> Path:
    return write_monitor_page(folders["terms"], tmp_path_factory.mktemp("monitor-html") / "monitor.html")


def test_the_page_loads_and_shows_the_folders_numbers(browser, page, folders):
    result = analyze(folders["terms"])
    observed = result["items"]["observed"]
    tab = Tab(browser)
    try:
        p = tab.open(page)
        assert p.locator("#nf-fig-norms path[stroke-dasharray='5 3']").count() == 5  # R_eq of the 5 shown items
        assert p.locator(".nf-pick").count() == 5 and p.locator("#nf-fig-budget path").count() > 4
        assert p.locator("#nf-fig-law path").count() > 0
        assert "Norm R over training, 5 items" in p.locator("#nf-fig-norms .nf-title").text_content()
        p.click("#nf-items th[data-key='observed']")  # the largest window-mean norm first
        first = p.locator("#nf-items tbody tr").first
        top = int(np.argmax(observed))
        assert first.locator("td").nth(1).inner_text().strip() == f"item-{top}"
        cell = first.locator("td[data-key='observed']")
        assert float(cell.get_attribute("data-value")) == pytest.approx(observed[top], rel=1e-4)
        assert cell.inner_text().startswith(f"{observed[top]:.4g}"[:5]) and "±" in cell.inner_text()
        # tick an item that is not plotted: its line joins the figure and the chosen list
        box = p.locator("#nf-items input[type=checkbox]:not(:checked)").first
        box.click()  # the table is drawn again, the box with it
        assert p.locator(".nf-pick").count() == 6
        assert p.locator("#nf-fig-norms path[stroke-dasharray='5 3']").count() == 6
        p.locator(".nf-pick button").first.click()  # and drop one
        assert p.locator(".nf-pick").count() == 5
        p.select_option("#nf-budget-of", index=1)  # the budget of one chosen item
        assert "Where R² goes each step: item item-" in p.locator("#nf-fig-budget .nf-title").text_content()
        assert tab.errors == []
    finally:
        tab.page.close()


def test_the_screenshot_is_not_blank(browser, page):
    assert_screenshot_not_blank(page, "monitor", browser)
