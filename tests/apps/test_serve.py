"""``normfast serve`` end to end (issue 35): the service started on a free loopback port in this
process (a 2-layer BERT with MiniLM's tokenizer), its JSON API against the Prober's own rows and
against its documented JSON Schema, the refusals (400, 404, 405, 413, 422, one line each), no file
written by a request; the interactive page in headless Chromium (type a text, see its tokens
colored by heat, hover one for its numbers: those of the JSON API); and the command itself, started
as a process and stopped. Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

from normfast.encoders import HFEncoder
from normfast.engine.config import ProbeConfig
from normfast.engine.prober import Prober
from tests._models import tiny_bert
from tests.conftest import REQUIRE_DATA

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from normfast.apps.serve.app import ProbeService, create_app  # noqa: E402
from normfast.apps.serve.command import make_server  # noqa: E402
from normfast.apps.serve.schema import ERROR_SCHEMA, REQUEST_SCHEMA, RESPONSE_SCHEMA  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [
    "the river rose after the storm",
    "a quantum of solace",
    "music for the blue hour",
    "prices fell in the morning",
    "she sang an old song",
    "the committee voted twice",
    "green apples and red stones",
    "a long walk by the sea",
]
TEXT = "democracy is a fragile idea"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(**kw) -> ProbeConfig:
    base = dict(params=r"encoder\.layer\.1\.", mode="jvp", output="tokens", batches=4, drift_batches=8, groups=2)
    return ProbeConfig(**{**base, "batch_size": 4, "seed": 3, **kw})


@pytest.fixture(scope="module")
def service(minilm_tokenizer):
    encoder = HFEncoder(tiny_bert(minilm_tokenizer), minilm_tokenizer, max_length=32)
    prober = Prober(encoder, "simcse", pairs=PAIRS, config=config(), progress=False, model_name="tiny-bert")
    return ProbeService(prober.prepare(), max_texts=4, max_chars=200)


@pytest.fixture(scope="module")
def url(service, tmp_path_factory):
    """The service on a free loopback port, served from a thread; stopped after the module's tests."""
    server = make_server(create_app(service, example=TEXT), "127.0.0.1", free_port())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the service did not start within 30 s"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=10)
    assert not thread.is_alive(), "the service did not stop within 10 s"


def call(url: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def conforms(value, schema: dict, where: str = "$") -> None:
    """A small JSON Schema check: type, enum, required, properties, additionalProperties, items, minItems."""
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        types = {
            "object": dict,
            "array": list,
            "string": str,
            "boolean": bool,
            "null": type(None),
            "integer": int,
            "number": (int, float),
        }
        ok = any(
            isinstance(value, types[k]) and not (k in ("integer", "number") and isinstance(value, bool)) for k in kinds
        )
        assert ok, f"{where}: {value!r} is not {kinds}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            assert key in value, f"{where}: missing {key!r}"
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{where}: unknown keys {set(value) - set(props)}"
        for key, sub in props.items():
            if key in value:
                conforms(value[key], sub, f"{where}.{key}")
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), where
        for i, item in enumerate(value):
            conforms(item, schema.get("items", {}), f"{where}[{i}]")


# ---------------------------------------------------------------------------
# the JSON API


def test_a_probe_answers_the_probers_rows_in_the_documented_schema(url, service):
    conforms({"texts": [TEXT]}, REQUEST_SCHEMA)
    status, body = call(url, "/api/probe", json.dumps({"texts": [TEXT, "bread was warm"]}).encode())
    assert status == 200, body
    got = json.loads(body)
    conforms(got, RESPONSE_SCHEMA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = service.prober.probe([TEXT, "bread was warm"], progress=False).table.to_pylist()
    rows = [r for t in got["texts"] for r in t["rows"]]
    assert len(rows) == len(want) and [t["text"] for t in got["texts"]] == [TEXT, "bread was warm"]
    for r, w in zip(rows, want):
        assert (r["position"], r["token"], r["is_special"], r["regime"]) == (
            w["position"],
            w["token"],
            w["is_special"],
            w["regime"],
        )
        for key in ("norm", "V2", "se_V2", "D", "se_D", "kappa", "r_eq", "r_eq_lo", "r_eq_hi", "r_eq_heat"):
            if w[key] is None or w[key] != w[key]:  # NaN: null in JSON
                assert r[key] is None, key
            else:
                assert r[key] == w[key], key  # JSON numbers round-trip a float exactly
    assert got["M"] == 4 and got["M_D"] == 8 and got["K"] == 2 and got["model"] == "tiny-bert"
    assert got["regime"]["regime"] in ("law applicable", "heat-dominated", "not applicable")


@pytest.mark.parametrize(
    "body, status, says",
    [
        (b"not json", 400, r"not JSON"),
        (b"[1, 2]", 400, r"not an object"),
        (b"{}", 422, r"\"texts\" must be a non-empty list"),
        (b'{"texts": []}', 422, r"non-empty list"),
        (b'{"texts": [7]}', 422, r"texts\[0\] is int"),
        (b'{"texts": ["  "]}', 422, r"texts\[0\] is empty"),
        (b'{"texts": ["a"], "out": "/tmp/x.parquet"}', 422, r"unknown field\(s\) \['out'\]"),
        (json.dumps({"texts": ["a" * 201]}).encode(), 413, r"201 characters, the limit is 200"),
        (json.dumps({"texts": ["a"] * 5}).encode(), 413, r"5 texts in one request, the limit is 4"),
        (b"x" * 100_000, 413, r"the limit is"),
    ],
)
def test_bad_requests_get_one_line_json_errors(url, body, status, says):
    import re

    got_status, got = call(url, "/api/probe", body)
    assert got_status == status, got
    error = json.loads(got)
    conforms(error, ERROR_SCHEMA)
    assert re.search(says, error["error"]) and "\n" not in error["error"], error


def test_unknown_routes_and_methods_are_json_errors(url):
    status, body = call(url, "/etc/passwd")
    assert status == 404 and "no such route" in json.loads(body)["error"]
    status, body = call(url, "/api/probe")  # GET
    assert status == 405 and json.loads(body)["error"]


def test_info_schema_and_no_file_written(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, body = call(url, "/api/info")
    info = json.loads(body)
    assert status == 200 and info["limits"]["max_texts"] == 4 and info["M"] == 4 and info["directions"] == "computed"
    status, body = call(url, "/api/schema")
    assert json.loads(body) == {"request": REQUEST_SCHEMA, "response": RESPONSE_SCHEMA, "error": ERROR_SCHEMA}
    for path in ("/api/probe", "/api/view"):
        assert call(url, path, json.dumps({"texts": ["../../etc/passwd"]}).encode())[0] == 200
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# the interactive page in a real browser


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    from normfast.apps.view import chromium_executable

    if chromium_executable() is None:
        return "no Chromium for the browser tests (Debian: apt install chromium)"
    return None


@pytest.fixture(scope="module")
def browser():
    reason = _browser_missing()
    if reason is not None:
        if REQUIRE_DATA:
            pytest.fail(f"NORMFAST_REQUIRE_DATA=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    from normfast.apps.view import chromium_executable

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium_executable(), args=["--no-sandbox"])
        yield b
        b.close()


def test_the_page_colors_typed_text_and_shows_numbers_on_hover(url, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(30_000)
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    try:
        page.goto(url + "/")
        page.wait_for_selector("body[data-ready='idle']")
        page.fill("#nf-input", "")
        page.locator("#nf-input").type("the violin sounded sad")
        page.click("#nf-go")
        page.wait_for_selector("body[data-ready='1']")
        frame = page.frame_locator("#nf-result")
        tokens = frame.locator(".nf-tok:not(.nf-special)")
        assert tokens.count() == 4  # the, violin, sounded, sad: each a word piece of MiniLM's vocabulary
        colors = tokens.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
        assert all(c.startswith("rgb(") and c not in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)") for c in colors)
        assert len(set(colors)) > 1, colors  # a scale, not one flat color
        status = page.inner_text("#nf-live-status")
        assert status.startswith("probed 1 text in "), status
        # hover "violin": its numbers are the JSON API's
        _, body = call(url, "/api/probe", json.dumps({"texts": ["the violin sounded sad"]}).encode())
        row = next(r for r in json.loads(body)["texts"][0]["rows"] if r["token"] == "violin")
        frame.locator(".nf-tok", has_text="violin").hover()
        tip = frame.locator("#nf-tip")
        assert tip.is_visible()
        for q in ("V2", "D", "norm", "r_eq", "kappa"):
            shown = float(tip.locator(f"td[data-q='{q}']").get_attribute("data-value"))
            assert shown == pytest.approx(row[q], rel=1e-3), q
        assert "±" in tip.inner_text() and row["regime"] in tip.inner_text()
        # a refused request shows its error on the page
        page.fill("#nf-input", "\n".join(["x"] * 5))
        page.click("#nf-go")
        assert "at most 4" in page.inner_text("#nf-live-status")
        shot = tmp_path / "serve.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 20_000  # not a blank page
        assert errors == [], errors
        assert all(u.startswith(url) or u.startswith("about:") for u in requests), requests
    finally:
        page.close()


# ---------------------------------------------------------------------------
# the command


def test_the_command_serves_and_stops(tiny_bert_folder, tmp_path):
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("\n".join(PAIRS) + "\n")
    port = free_port()
    argv = [sys.executable, "-m", "normfast", "serve", str(tiny_bert_folder), "--pairs", str(pairs)]
    argv += ["--params", r"encoder\.layer\.1\.", "--batches", "4", "--drift-batches", "8", "--groups", "2"]
    argv += ["--batch-size", "4", "--device", "cpu", "--port", str(port), "--directions", str(tmp_path / "d")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "serving http://127.0.0.1" in line or proc.poll() is not None:
                break
        assert "serving http://127.0.0.1" in lines[-1], "".join(lines)
        while True:  # the line comes just before the server listens
            try:
                status, body = call(f"http://127.0.0.1:{port}", "/api/info")
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the service did not listen in time"
                time.sleep(0.1)
        assert status == 200 and json.loads(body)["directions"] == "computed"
        status, body = call(f"http://127.0.0.1:{port}", "/api/probe", json.dumps({"texts": [TEXT]}).encode())
        assert status == 200 and json.loads(body)["texts"][0]["rows"]
        assert (tmp_path / "d" / "manifest.json").is_file()  # computed at the start, saved for the next time
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode is not None


def test_the_command_says_what_to_install(monkeypatch, capsys):
    import builtins

    from normfast.cli import main

    real = builtins.__import__

    def no_fastapi(name, *a, **k):
        if name in ("fastapi", "uvicorn"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    assert main(["serve", "minilm", "--directions", "nowhere"]) == 2
    err = capsys.readouterr().err.strip()
    want = 'needs fastapi and uvicorn: pip install "normfast[serve]" (or pip install fastapi uvicorn)'
    assert err == f"normfast serve: error: {want}"
