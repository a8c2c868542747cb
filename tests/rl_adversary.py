"""The adversarial RL worker of ``tests/integration/test_rl_adversary.py``: one process with a key of its
own that tries every move issue 17 lists against a running ``rl-train``, and writes what each move got.

It talks to the run as any worker can (signed requests to the submission service), and on top it is
given what no worker has: read and write access to the run's storage folder on the local file system,
to show that what it writes there is refused too (checkpoints by the ledger's digests). It never submits
honest work, so the run's accepted samples must be exactly the honest workers'.

    python tests/rl_adversary.py ARGS.json

``ARGS.json``: {"url", "key", "run_dir", "honest": [hex public keys], "steps", "max_body_bytes", "log"}.
Each line of ``log`` is ``{"step", "attack", "stored": path}`` (the service stored it: the ledger must
hold a reason) or ``{"step", "attack", "refused": reason}`` (the service's reason). Exits 0 after its
done record of the last step.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intellect.checkpoints import CHECKPOINTS, STEP_REPORT, fetch, publish  # noqa: E402
from intellect.rl.wire.rollouts import Rollout, encode_submission, rows_to_table, table_to_rows  # noqa: E402
from intellect.rl.worker.client import ServiceClient, ServiceError  # noqa: E402
from intellect.rl.worker.submission import sample_seed  # noqa: E402
from intellect.rl.worker.worker import run_name  # noqa: E402
from intellect.storage import RunStorage  # noqa: E402
from intellect.trust.keys import SigningKey  # noqa: E402
from intellect.trust.requests import KEY_HEADER, sign_request  # noqa: E402


class Adversary:
    def __init__(self, args: dict):
        self.args = args
        self.url = args["url"].rstrip("/")
        self.key = SigningKey.load(args["key"])
        self.id = self.key.public.id
        self.run = run_name(self.url)
        self.client = ServiceClient(self.url, self.key, audience=self.run, retries=0)
        self.http = httpx.Client(timeout=30)
        self.storage = RunStorage(f"file://{args['run_dir']}")
        self.out = open(args["log"], "a")

    def log(self, step: int, attack: str, **what) -> None:
        self.out.write(json.dumps({"step": step, "attack": attack, **what}) + "\n")
        self.out.flush()

    def submit(self, step: int, attack: str, k: int, data: bytes) -> None:
        try:
            rec = self.client.submit(step, k, data)
        except ServiceError as e:
            self.log(step, attack, refused=e.reason)
        else:
            self.log(step, attack, stored=rec.path)

    def raw(self, step: int, attack: str, method: str, path: str, body: bytes = b"", *, headers=None,
            sign_as: SigningKey | None = None, audience: str | None = None) -> dict:
        """One hand-made request; its refusal reason is logged (a 2xx is logged as ``accepted``)."""
        if headers is None:
            headers = sign_request(sign_as or self.key, method, path, body, audience=audience or self.run)
        r = self.http.request(method, self.url + path, content=body, headers=headers)
        try:
            doc = r.json()
        except ValueError:
            doc = {}
        if r.status_code < 300:
            self.log(step, attack, accepted=r.status_code)
        else:
            self.log(step, attack, refused=doc.get("reason", f"http_{r.status_code}"))
        return headers

    # ------------------------------------------------------------------ the moves

    def honest_files(self, step: int, timeout: float = 300) -> list[str]:
        """The honest workers' files of ``step``, once both are in run storage."""
        folder = Path(self.args["run_dir"]) / "rollouts" / f"step_{step}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = sorted(p.name for p in folder.glob("*.parquet") if not p.name.startswith(self.id))
            if len(got) >= len(self.args["honest"]):
                return [f"rollouts/step_{step}/{n}" for n in got]
            time.sleep(0.05)
        raise TimeoutError(f"no honest files for step {step}")

    def protocol_moves(self, step: int) -> None:
        """Requests the service must refuse: other routes, impersonation, replays, ahead of the run."""
        for path in (f"/v1/verdicts/{step}", f"/v1/checkpoints/{step + 1}", f"/v1/submissions/{step}/0/../../x",
                     f"/v1/done/{step}/{self.args['honest'][0]}"):
            self.raw(step, "route:" + path, "PUT", path, b"x")
        self.raw(step, "unsigned", "GET", f"/v1/status?step={step}", headers={})
        # squat: a request signed with this key but naming an honest worker's key
        headers = sign_request(self.key, "GET", f"/v1/status?step={step}", b"", audience=self.run)
        self.raw(step, "impersonate", "GET", f"/v1/status?step={step}",
                 headers={**headers, KEY_HEADER: self.args["honest"][0]})
        # a request signed for another run
        self.raw(step, "other_audience", "GET", f"/v1/status?step={step}", audience=self.run + "-other")
        # replay: a captured signed request sent again (same key, nonce and signature)
        captured = self.raw(step, "capture", "GET", f"/v1/status?step={step}")
        self.raw(step, "replay", "GET", f"/v1/status?step={step}", headers=captured)
        # ... and its signature on another path
        self.raw(step, "replay_other_path", "GET", f"/v1/status?step={step + 1}", headers=captured)
        self.submit(step, "four_bytes", 0, b"PAR1")
        self.submit(step + 5, "too_far_ahead", 0, b"PAR1")
        self.submit(step, "k_out_of_range", 10_000, b"PAR1")
        self.submit(step, "oversized", 5, os.urandom(self.args["max_body_bytes"] + 1))

    def copy_moves(self, step: int, honest: list[str]) -> None:
        """Duplicates of an honest worker's rollouts, and a second write under one name."""
        data = self.storage.read_bytes(honest[0])
        self.submit(step, "copy_as_is", 1, data)  # its rows name the honest worker: identity
        self.submit(step, "overwrite_own", 1, data + b"\0")  # the name is written once: exists
        rows = table_to_rows(pq.read_table(io.BytesIO(data)))
        mine = [replace(r, worker=self.id, submission=2) for r in rows]  # same samples, claimed as own
        self.submit(step, "copy_claimed", 2, encode_submission(mine))

    def junk_moves(self, step: int) -> None:
        self.submit(step, "malformed", 3, b"PAR1" + os.urandom(4000) + b"PAR1")
        self.submit(step, "parquet_bomb", 4, parquet_bomb(self.run, self.id, step))

    def handwritten_moves(self, step: int) -> None:
        """Completions written by hand (any tokens: the service sends no answers), with the assigned prompts and seeds: TOPLOC must refuse them, with no proof, with
        made-up proofs, and too long. Submissions 0, 1, 2 in turn: a key sees the prompts of ``k + 1``
        only once ``k`` is stored."""
        _, tok = fetch(self.storage, 0)
        sub = self.args["submission"]
        salt = self.client.salt or b""
        for k, proof, extra in ((0, b"", 0), (1, os.urandom(258), 0), (2, b"", 3)):
            tasks = self.client.assignment(step, k)
            rows = []
            for j, t in enumerate(tasks):
                prompt = tuple(tok(t["prompt"])["input_ids"])
                out = tuple(tok("42", add_special_tokens=False)["input_ids"])[: sub["max_tokens"] - 1]
                out = out + (tok.eos_token_id,) if not extra else out + (5,) * (sub["max_tokens"] + extra - len(out))
                for i in range(sub["group_size"]):
                    rows.append(Rollout(
                        run=self.run, step=step, policy_step=step, worker=self.id, submission=k,
                        seed=sample_seed(self.id, step, k, j, i, salt), prompt_id=t["id"], group_id=j,
                        prompt_tokens=prompt, output_tokens=out, finish_reason="length" if extra else "stop",
                        reward=1.0, task_reward=1.0, length_penalty=0.0, advantage=0.0, proof=proof))
            self.submit(step, "handwritten" if not extra else "too_long", k, encode_submission(rows))

    def prepublish(self, step: int) -> None:
        """Checkpoint ``step`` written straight into run storage, ``STABLE`` and a saved report included,
        before the trainer trains it: weights scaled by 1e3, so adopting them would change everything."""
        model, tok = fetch(self.storage, step - 1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1e3)
        report = {"policy_step": step - 1, "trained_samples": 999, "loss": -1e6, "clip_fraction": 0.0,
                  "ratio_max": 1.0, "grad_norm": 0.0, "tokens": 0, "train_seconds": 0.0}
        try:
            publish(model, tok, self.storage, step, {STEP_REPORT: report})
            self.log(step, "prepublish_checkpoint", wrote=self.storage.step_path(step, CHECKPOINTS))
        except FileExistsError:
            self.log(step, "prepublish_checkpoint", refused="exists")

    def finish(self, step: int, honest: list[str]) -> None:
        try:  # a done record listing the honest files: it is this worker's own record, and nothing more
            self.client.finish(step, honest, step)
            self.log(step, "done_naming_honest_files", accepted=201)
        except ServiceError as e:
            self.log(step, "done_naming_honest_files", refused=e.reason)
            self.client.finish(step, [], step)

    def run_all(self) -> None:
        self.client.register()
        for step in range(self.args["steps"]):
            honest = self.honest_files(step)
            if step == 0:
                self.protocol_moves(step)
                self.copy_moves(step, honest)
                self.junk_moves(step)
            if step == 1:
                self.handwritten_moves(step)
            self.prepublish(step + 1)
            self.finish(step, honest)


def parquet_bomb(run: str, worker: str, step: int) -> bytes:
    """A few KB of Parquet that decode to tens of MB: one row of 5M zero tokens."""
    row = Rollout(run=run, step=step, policy_step=step, worker=worker, submission=4, seed=1, prompt_id="p",
                  group_id=0, prompt_tokens=(1,), output_tokens=(0,) * 5_000_000, finish_reason="length",
                  reward=0.0, task_reward=0.0, length_penalty=0.0, advantage=0.0)
    buf = io.BytesIO()
    pq.write_table(rows_to_table([row]), buf, compression="zstd")
    return buf.getvalue()


def main() -> int:
    args = json.loads(Path(sys.argv[1]).read_text())
    Adversary(args).run_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
