"""The dashboard shows a finished RL run and its artifacts: a real ``prefect server`` (``infra/cluster.py``),
``intellect rl --cluster`` against it, and headless Chromium (Debian's ``chromium``) rendering the UI.

Set ``SAVE_SCREENSHOTS=docs`` to keep the screenshots (the README's come from there)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infra import cluster
from intellect.config import ModelConfig
from intellect.diloco.coordinator import free_port
from intellect.model.checkpoint import build_model
from intellect.pretrain import publish_checkpoint
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                  "--virtual-time-budget=20000"]


def chromium(tmp_path: Path, url: str, *args: str) -> str:
    """Render ``url`` in a fresh headless Chromium profile; its stdout (the DOM with ``--dump-dom``)."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("headless Chromium missing: apt-get install chromium (.ci/run does)")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    r = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url], capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_dashboard_shows_a_finished_rl_run_and_its_artifacts(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    port = free_port()
    state = tmp_path / "cluster"
    env = cluster.up(state, port, pools=())
    try:
        model, tok = build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                                             intermediate_size=64))
        publish_checkpoint(model, tok, RunStorage(f"file://{tmp_path}/runs/base"), 0)
        run = subprocess.run(
            [str(Path(sys.executable).with_name("intellect")), "rl", "--cluster", str(state), "run_name=rl-dash",
             f"storage.url=file://{tmp_path}/runs", "init.from_run=base", "steps=3", "async_level=1",
             "tasks.size=64", "tasks.data.max_digits=1", "submission.prompts_per_submission=2",
             "submission.group_size=4", "submission.max_tokens=4", "eval.every=0", "eval.size=16",
             "trainer_threads=1", 'workers.names=["alice","bob"]'],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
            env={**os.environ, "PREFECT_LOGGING_LEVEL": "INFO"})  # the run's logs show in the UI
        assert run.returncode == 0, run.stderr[-3000:]
        assert "Stopping temporary server" not in run.stderr  # it reported to the cluster, not its own server
        with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as c:
            (flow_run,) = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl-train"])))
        assert flow_run.state.is_completed()
        ui = f"http://127.0.0.1:{port}"
        shots = tmp_path / "shots"
        shots.mkdir()
        page = chromium(tmp_path, f"{ui}/runs/flow-run/{flow_run.id}", "--dump-dom")
        assert flow_run.name in page and "Completed" in page and "rl-train" in page
        artifacts = chromium(tmp_path, f"{ui}/artifacts/key/rl-dash-rl-step", "--dump-dom")
        assert "rl-dash-rl-step" in artifacts and flow_run.name in artifacts
        for name, url in [("dashboard_run.png", f"{ui}/runs/flow-run/{flow_run.id}"),
                          ("dashboard_artifacts.png", f"{ui}/artifacts/key/rl-dash-rl-step")]:
            chromium(tmp_path, url, f"--screenshot={shots / name}")
            assert (shots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            if keep := os.environ.get("SAVE_SCREENSHOTS"):
                shutil.copy(shots / name, ROOT / keep / name)
    finally:
        cluster.down(state)
    assert cluster.running(state) == {}
