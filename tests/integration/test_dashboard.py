"""The dashboard shows a finished RL run and its artifacts: a real ``prefect server`` (``infra/cluster.py``),
``intellect rl --cluster`` against it, and headless Chromium (Debian's ``chromium``) rendering the UI,
driven over the DevTools protocol: without the auth string the UI shows no run ("Authentication
failed"); the test logs in by typing the cluster's auth string into the login page, as a person would.

Set ``SAVE_SCREENSHOTS=docs`` to keep the screenshots (docs/deploy.md's come from there)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from websockets.sync.client import connect

from infra import cluster
from intellect.config import ModelConfig
from intellect.diloco.coordinator import free_port
from intellect.model.checkpoint import build_model
from intellect.checkpoints import publish
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                  "--remote-debugging-port=0"]


class Browser:
    """One page of a fresh headless Chromium, driven over the DevTools protocol; every wait has a deadline."""

    def __init__(self, tmp_path: Path, timeout: float = 60.0):
        exe = shutil.which("chromium")
        if exe is None:
            pytest.skip("headless Chromium missing: apt-get install chromium (.ci/run does)")
        profile = tmp_path / "chromium-profile"
        self.log = open(tmp_path / "chromium.log", "ab")
        # its own temporary folders (org.chromium.*, with its singleton socket) in a short folder removed
        # at close, never in /tmp for good: a socket path over 107 bytes aborts Chromium, and an xdist
        # worker's tmp_path is longer than that
        self.tmp = tempfile.mkdtemp(prefix="chromium-", dir="/tmp")
        self.proc = subprocess.Popen([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TMPDIR": self.tmp})
        try:
            port_file = profile / "DevToolsActivePort"
            deadline = time.monotonic() + timeout
            while not (port_file.exists() and port_file.read_text().strip()):
                assert self.proc.poll() is None and time.monotonic() < deadline, "Chromium's DevTools never came up"
                time.sleep(0.2)
            port = port_file.read_text().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                page = next(t for t in json.load(r) if t["type"] == "page")
            self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=timeout)
        except BaseException:
            self.close()
            raise
        self.calls = 0

    def call(self, method: str, timeout: float = 60.0, **params) -> dict:
        self.calls += 1
        self.ws.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:  # events arrive between the answers; skip them
            msg = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if msg.get("id") == self.calls:
                assert "error" not in msg, (method, msg["error"])
                return msg["result"]

    def eval(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_until(self, expression: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.eval(expression):
            assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {expression}; page: {self.text()[:1500]}"
            time.sleep(0.5)

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def dom(self, *expected: str, timeout: float = 120.0) -> str:
        """The page's DOM once every string of ``expected`` is in it."""
        self.wait_until(" && ".join(f"document.documentElement.outerHTML.includes({json.dumps(e)})"
                                    for e in expected) or "true", timeout)
        return self.eval("document.documentElement.outerHTML")

    def login(self, secret: str) -> None:
        """Type the auth string into the UI's login page and submit it."""
        self.wait_until("location.pathname.endsWith('/login') && !!document.querySelector('input[type=password]')")
        self.eval("document.querySelector('input[type=password]').focus()")
        self.call("Input.insertText", text=secret)
        self.eval("document.querySelector('form button[type=submit]').click()")
        self.wait_until("!location.pathname.endsWith('/login')")

    def screenshot(self, path: Path) -> None:
        time.sleep(2)  # let charts and the graph finish their transitions
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def test_the_dashboard_shows_a_finished_rl_run_and_its_artifacts(tmp_path):
    port = free_port()
    state = tmp_path / "cluster"
    env = cluster.up(state, port, pools=())
    try:
        model, tok = build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                                             intermediate_size=64))
        publish(model, tok, RunStorage(f"file://{tmp_path}/runs/base"), 0)
        run = subprocess.run(
            [str(Path(sys.executable).with_name("intellect")), "rl", "--cluster", str(state), "run_name=rl-dash",
             f"storage.url=file://{tmp_path}/runs", "init.from_run=base", "steps=3", "async_level=1",
             "tasks.size=64", "tasks.data.max_digits=1", "submission.prompts_per_submission=2",
             "submission.group_size=4", "submission.max_tokens=4", "eval.every=0", "eval.size=16",
             "trainer_threads=1", 'workers.names=["alice","bob"]', "toploc.k=16"],  # k <= hidden size
            cwd=ROOT, capture_output=True, text=True, timeout=600,
            env={**os.environ, "PREFECT_LOGGING_LEVEL": "INFO"})  # the run's logs show in the UI
        assert run.returncode == 0, run.stderr[-3000:]
        assert "Stopping temporary server" not in run.stderr  # it reported to the cluster, not its own server
        with cluster.api_settings(env), get_client(sync_client=True) as c:
            (flow_run,) = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl-train"])))
        assert flow_run.state.is_completed()
        ui = f"http://127.0.0.1:{port}"
        shots = tmp_path / "shots"
        shots.mkdir()
        browser = Browser(tmp_path)
        try:
            browser.goto(f"{ui}/runs/flow-run/{flow_run.id}")  # without the auth string: refused, no run
            browser.wait_until("document.body && document.body.innerText.includes('Authentication failed')")
            assert flow_run.name not in browser.text()
            browser.goto(f"{ui}/login")
            browser.login(env["PREFECT_API_AUTH_STRING"])
            browser.goto(f"{ui}/runs/flow-run/{flow_run.id}")
            page = browser.dom(flow_run.name, "Completed", "rl-train")
            assert flow_run.name in page and "Completed" in page and "rl-train" in page
            browser.screenshot(shots / "dashboard_run.png")
            browser.goto(f"{ui}/artifacts/key/rl-dash-rl-step")
            artifacts = browser.dom("rl-dash-rl-step", flow_run.name)
            assert "rl-dash-rl-step" in artifacts and flow_run.name in artifacts
            browser.screenshot(shots / "dashboard_artifacts.png")
        finally:
            browser.close()
        for name in ("dashboard_run.png", "dashboard_artifacts.png"):
            assert (shots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            if keep := os.environ.get("SAVE_SCREENSHOTS"):
                shutil.copy(shots / name, ROOT / keep / name)
    finally:
        cluster.down(state)
    assert cluster.running(state) == {}
