"""Outside contributors join a DiLoCo run with their own keys, never the run secret, and a member of
the run cannot break the process groups of attempts it holds no rank in.

One real run: the coordinator starts 3 workers; a contributor joins as an outside process
(``intellect diloco-join``, its own Ed25519 key on ``diloco.contributors``); a second admitted
contributor, the saboteur, announces its own exit and writes garbage into gloo's keys (``pg/``,
``bw/``) for every step, group and rank of the run all along. Every honest worker and the
contributor exit 0, the run commits every step with the contributor among the members, and none
of the saboteur's gloo writes is taken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from diloco_runs import logs, run_cfg

from intellect.diloco.admission import JoinError, join
from intellect.diloco.coordinator import EXIT_DONE, Coordinator, worker_launcher
from intellect.diloco.rendezvous_client import RendezvousStore, StoreError
from intellect.trust.keys import SigningKey

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def sabotage(store: RendezvousStore, me: str, steps: int, stop: threading.Event, tally: dict) -> None:
    """Garbage in every gloo key of the run (each step, attempt, boundary group and rank), until ``stop``."""
    store.set(f"dead/{me}", "1")  # gone: nobody waits for it at a boundary
    keys = [f"pg/{t}/{g}//0/{r}" for t in range(steps) for g in ("onboard", "bw", 0, 1, 2) for r in range(5)]
    keys += [f"bw/{t}/col/{r}" for t in range(steps) for r in range(5)]
    while not stop.wait(0.2):
        for k in keys:
            try:
                store.set(k, os.urandom(64))
                tally["accepted"] += 1
            except StoreError as e:
                tally[e.reason] = tally.get(e.reason, 0) + 1


def test_a_contributor_joins_without_the_secret_and_a_gloo_saboteur_breaks_nothing(tmp_path):
    contributor, saboteur, stranger = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    key_file = contributor.save(tmp_path / "contributor.key")
    cfg = run_cfg(tmp_path, run_name="admitted", **{"diloco.workers": 3})
    cfg = cfg.model_copy(update={"diloco": cfg.diloco.model_copy(
        update={"contributors": [contributor.public.hex, saboteur.public.hex]})})
    c = Coordinator(cfg, worker_launcher(tmp_path / "logs"))
    host, port = c.address.rsplit(":", 1)
    stop, tally, proc = threading.Event(), {"accepted": 0}, None
    try:
        # a key off the allowlist is refused; an answer is trusted only under the pinned coordinator key
        with pytest.raises(JoinError) as e:
            join(host, int(port), cfg.run_name, stranger, c.identity)
        assert e.value.reason == "not_admitted"
        with pytest.raises(JoinError) as e:
            join(host, int(port), cfg.run_name, saboteur, stranger.public)
        assert e.value.reason == "bad_signature"
        c.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("INTELLECT_DILOCO")}
        with open(tmp_path / "logs" / "contributor.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "diloco-join", "--store", c.address,
                                     "--run", cfg.run_name, "--key", str(key_file),
                                     "--coordinator-key", c.identity.hex], env=env, cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT)
        bad = join(host, int(port), cfg.run_name, saboteur, c.identity)
        sab = RendezvousStore(host, int(port), None, cfg.run_name, peer=bad.worker, timeout=5, key=bad.key)
        thread = threading.Thread(target=sabotage, args=(sab, bad.worker, cfg.diloco.outer_steps, stop, tally))
        thread.start()
        codes = c.watch(timeout=400)
        assert proc.wait(timeout=120) == EXIT_DONE, logs(tmp_path)
        stop.set()
        thread.join(30)
        assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE, "w2": EXIT_DONE}, logs(tmp_path)
        assert json.loads(c.store.get("progress")) == cfg.diloco.outer_steps
        last = cfg.diloco.outer_steps - 1
        members = json.loads(c.store.get(f"members/{last}/0"))
        assert contributor.public.id in members and bad.worker not in members, members
        assert len({c.store.get(f"digest/{last}/{w}") for w in members}) == 1  # one model, the contributor's too
        assert tally["accepted"] == 0 and tally.get("scope", 0) > 100, tally
        # the contributor holds its own key only: it speaks as itself and writes only its own keys
        again = join(host, int(port), cfg.run_name, contributor, c.identity)
        assert again.worker == contributor.public.id and c.admitted().count(again.worker) == 1
        mine = RendezvousStore(host, int(port), None, cfg.run_name, peer=again.worker, timeout=5, key=again.key)
        for k, v in (("launched/0", "mallory"), ("banned/w0", "{}"), ("progress", "999"), ("start", "0")):
            with pytest.raises(StoreError) as e:
                mine.set(k, v)
            assert e.value.reason == "scope"
        with pytest.raises(StoreError):
            RendezvousStore(host, int(port), None, cfg.run_name, peer="coordinator", timeout=5, key=again.key).num_keys()
        assert c._secret.hex() not in (tmp_path / "logs" / "contributor.log").read_text()
    finally:
        stop.set()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        c.close()
