"""The synchronizer's contract (intellect/diloco/sync.py), two members over the real rendezvous in this
process, each reducing on gloo from its own thread: start returns while the reduction runs, one
member's failure makes should_commit False for both, and a failed finish changes nothing; and the AND
over a worker's local ranks on a real 2-rank gloo group."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from intellect.diloco.config import DilocoConfig
from intellect.diloco.faults import NoFaults
from intellect.diloco.membership import Membership, MembershipTimeout, scope
from intellect.diloco.outer import OuterState
from intellect.diloco.protocol import OUTCOME, Quorum
from intellect.diloco.rendezvous import RendezvousServer
from intellect.diloco.siblings import ALONE, Siblings
from intellect.diloco.sync import Synchronizer

SECRET = bytes(range(32))
NAMES = ["a", "b"]


class Gate(NoFaults):
    """Holds this member's reduction (once every member is ready) until the test opens it."""

    def __init__(self):
        self.open = threading.Event()

    def before_allreduce(self, step: int, attempt: int, worker: str) -> None:
        assert self.open.wait(30), "the test never opened the gate"


@pytest.fixture
def board():
    server = RendezvousServer(SECRET, "run", policy=scope)
    members = [Membership("127.0.0.1", server.port, w, SECRET, "run", heartbeat_interval=0.2, heartbeat_timeout=1.5,
                          store_timeout=10, startup_grace=2.5) for w in NAMES]
    for m in members:
        m.start_heartbeat()
        m.set(f"arrive/0/{m.worker}", "1")
    assert Quorum(members[0], "a", 0).propose_members(0, NAMES) == NAMES
    yield members
    for m in members:
        m.close()
    server.stop()


def synchronizers(members, roots=(b"r" * 32, b"r" * 32), faults=(NoFaults(), NoFaults()), max_attempts=5):
    """Both members' synchronizers, the same theta_sync and momentum, each model trained apart from it."""
    cfg = DilocoConfig(algorithm="direct", heartbeat_interval=0.2, heartbeat_timeout=1.5, collective_timeout=5,
                       boundary_timeout=5, max_attempts=max_attempts, outer_momentum=0.9)
    out = []
    for i, (m, root, f) in enumerate(zip(members, roots, faults)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        outer = OuterState(model, cfg.outer_lr, cfg.outer_momentum)
        outer.step([torch.full_like(p, 0.01) for p in outer.params])  # momentum to keep, or to roll back to
        outer.load_into(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)), alpha=0.1)
        out.append(Synchronizer(m, model, outer, cfg, "run", root, f))
    return out


def snapshot(s: Synchronizer) -> list[torch.Tensor]:
    return [t.clone() for t in [*s.model.parameters(), *s.outer.params, *s.outer.momentum_buffers()]]


def test_start_returns_while_the_reduction_runs_and_finish_commits(board):
    gate = Gate()
    a, b = synchronizers(board, faults=(gate, NoFaults()))
    before = snapshot(a)
    handles = [s.start(0, NAMES) for s in (a, b)]
    assert not handles[0].done() and not handles[1].done()  # a is held inside its reduction, b waits on it
    gate.open.set()
    with ThreadPoolExecutor(2) as pool:
        committed = list(pool.map(lambda s: s.finish(), (a, b)))
    assert committed == [NAMES, NAMES] and all(h.done() for h in handles)
    assert a.outer.digest() == b.outer.digest()  # replicas agree after the commit
    for s in (a, b):  # theta_sync moved and the model holds it
        assert all(torch.equal(p, q) for p, q in zip(s.model.parameters(), s.outer.params))
    assert not all(torch.equal(x, y) for x, y in zip(before, snapshot(a)))
    assert board[0].get(OUTCOME(0, 0)) == "commit"


def test_one_failed_vote_makes_should_commit_false_for_every_member(board):
    a, b = synchronizers(board)
    before = [snapshot(s) for s in (a, b)]
    handles = [s.start(0, NAMES) for s in (a, b)]
    assert all(h.wait().ok for h in handles)  # both reductions succeeded ...
    with ThreadPoolExecutor(2) as pool:  # ... but b votes fail
        verdicts = list(pool.map(lambda sv: sv[0].should_commit(sv[1]), ((a, True), (b, False))))
    assert verdicts == [False, False]
    assert board[0].get(OUTCOME(0, 0)) == "abort"
    for s, saved in zip((a, b), before):  # nothing applied
        assert all(torch.equal(x, y) for x, y in zip(saved, snapshot(s)))


def test_a_failed_finish_leaves_model_and_outer_state_as_before_start(board):
    # b seals with another all-reduce root: every message fails its MAC, both vote fail, 1 attempt only
    a, b = synchronizers(board, roots=(b"r" * 32, b"x" * 32), max_attempts=1)
    before = [snapshot(s) for s in (a, b)]
    for s in (a, b):
        s.start(0, NAMES)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(s.finish) for s in (a, b)]
        for f in futures:
            with pytest.raises(MembershipTimeout, match="did not commit in 1 attempts"):
                f.result()
    assert board[0].get(OUTCOME(0, 0)) == "abort"
    for s, saved in zip((a, b), before):
        after = snapshot(s)
        assert len(after) == len(saved) and all(torch.equal(x, y) for x, y in zip(saved, after))


def test_siblings_share_the_leaders_value_gather_every_ranks_and_and_their_flags():
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]  # public, re-exported from torch._C

    def rank(r: int, oks: tuple[bool, bool]):
        sib = Siblings.on(store, f"local/{oks}", r, 2, timeout=10)
        shared = sib.share({"members": ["w0", "w1"], "attempt": 2} if sib.leader else None)
        return shared, sib.gather({"rank": r, "pad": "x" * 100 * r}), sib.all(oks[r]), sib.sum([r, 0.5])

    with ThreadPoolExecutor(2) as pool:
        for oks, want in (((True, True), True), ((True, False), False), ((False, False), False)):
            out = list(pool.map(rank, (0, 1), (oks, oks)))
            assert [o[0] for o in out] == [{"members": ["w0", "w1"], "attempt": 2}] * 2
            assert out[0][1] == [{"rank": 0, "pad": ""}, {"rank": 1, "pad": "x" * 100}] and out[1][1] is None
            assert [o[2] for o in out] == [want, want] and [o[3] for o in out] == [[1.0, 1.0]] * 2
    assert ALONE.all(False) is False and ALONE.share(7) == 7 and ALONE.gather(7) == [7]
