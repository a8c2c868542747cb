"""Ledger rows shared by the ledger tests (tests/unit/test_ledger.py, test_ledger_trust.py and the
process tests of tests/integration/test_ledger_processes.py): rollouts, their verdicts, and queries."""

from __future__ import annotations

from intellect.rl.wire.rollouts import Rollout
from intellect.verdict import Verdict


def rollout(i, step=1, worker="w1", k=0, seed=None, output=None):
    return Rollout(run="r", step=step, policy_step=step, worker=worker, submission=k,
                   seed=i if seed is None else seed, prompt_id=f"p{i // 2}", group_id=i // 2,
                   prompt_tokens=(1, 2), output_tokens=output or (3, i % 5 + 4), finish_reason="stop",
                   reward=float(i % 2), task_reward=float(i % 2), length_penalty=0.0, advantage=0.5)


def verdicts(n=4, step=1, worker="w1", k=0, reject=(), seed0=0):
    file = f"rollouts/step_{step}/{worker}-{k}.parquet"
    return [Verdict.of(rollout(i, step, worker, k, seed=seed0 + i), file, i, "toploc" if i in reject else None)
            for i in range(n)]


def counts(ledger):
    return [(r["step"], r["status"], r["reason"], r["n"]) for r in ledger.summary()]


def worker_rows(ledger):
    """The ``workers`` table that ``record_verdicts`` keeps, with each worker's sample counts."""
    return ledger._query(
        "SELECT w.worker, w.first_seen, w.last_seen, w.info, "
        "count(r.file) FILTER (WHERE r.status = 'accepted') AS accepted, "
        "count(r.file) FILTER (WHERE r.status = 'rejected') AS rejected "
        "FROM workers w LEFT JOIN rollouts r USING (worker) GROUP BY ALL ORDER BY w.worker"
    )


def accepted_elsewhere(ledger, content_hash, file=None, row=None):
    """Whether ``content_hash`` is accepted other than at ``(file, row)``: the ledger's duplicate rule."""
    return bool(ledger._query(
        "SELECT 1 FROM rollouts WHERE content_hash = ? AND status = 'accepted' "
        "AND NOT (file IS NOT DISTINCT FROM ? AND row_index IS NOT DISTINCT FROM ?) LIMIT 1",
        [content_hash, file, row],
    ))
