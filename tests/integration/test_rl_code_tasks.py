"""Code tasks end to end through the trust boundary: the run's task kind reaches the pool, the
service's assignments, the worker's reward and the validator, which scores every row in the
bubblewrap sandbox pool. A worker that claims a pass for code that fails, or hand-writes the
reference solution without TOPLOC proofs, is what each test below tries."""

import dataclasses
import json

import pytest

from intellect.config import ModelConfig
from intellect.data.code_tasks import code_tasks
from intellect.data.loaders import CodeTask, TaskFileError, load_code_tasks, task_of_row, task_row
from intellect.inference import TorchEngine
from intellect.model.bpe import save_tokenizer, train_bpe
from intellect.model.checkpoint import build_model
from intellect.rl.config import RLRunConfig, TaskPoolConfig
from intellect.rl.rewards import CodeRewardConfig, sandbox_status
from intellect.rl.rewards.code import code_rewards
from intellect.rl.wire.rollouts import RolloutLimits, write_submission
from intellect.rl.trainer.setup import heldout_task_file, task_pool
from intellect.rl.worker.submission import CodeTaskReward, generate_submission, math_task_reward, task_reward_fn
from intellect.rl.service.validator import validate_submission
from intellect.rl.worker.worker import WorkerRunInfo
from intellect.storage import RunStorage

ROWS = code_tasks(24, seed=1)
TASKS = [CodeTask(r["id"], r["prompt"], tuple(r["tests"])) for r in ROWS]
SOLUTION = {r["id"]: r["solution"] for r in ROWS}
CODE = CodeRewardConfig(workers=2)


@pytest.fixture(scope="module")
def bwrap():
    status = sandbox_status(CODE.sandbox)
    if not status.startswith("bwrap sandbox works"):
        pytest.skip(f"no bubblewrap sandbox on this machine: {status}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok") / "code"
    save_tokenizer(train_bpe([r["prompt"] + "\n" + r["solution"] for r in code_tasks(72)] * 3, vocab_size=400), folder)
    model, tok = build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                                         intermediate_size=64, tokenizer=str(folder)))
    return model, tok


def test_code_task_files_load_by_kind_and_tests_must_parse(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]) + json.dumps(
        {"id": "bad", "prompt": "Write f.", "tests": ["assert f(1) == 2", "assert f(2) = 3"]}) + "\n")
    with pytest.raises(TaskFileError, match=r"code.jsonl row 4: test 2 is not Python: "):
        load_code_tasks(path)
    cfg = TaskPoolConfig(kind="code", file=str(path), heldout_percent=50, lenient=True)
    assert {t.id for t in task_pool(cfg) + heldout_task_file(cfg)} == {r["id"] for r in ROWS[:3]}
    assert all(isinstance(t, CodeTask) for t in task_pool(cfg))
    assert task_of_row(task_row(TASKS[0]), "code") == TASKS[0] == task_of_row(ROWS[0], "code")
    with pytest.raises(ValueError, match="needs a task file"):
        TaskPoolConfig(kind="code")
    with pytest.raises(ValueError, match="evaluated on its file"):
        TaskPoolConfig(kind="code", file=str(path), heldout="arithmetic")


def test_the_kind_decides_the_reward_everywhere():
    cfg = RLRunConfig.model_validate({"tasks": {"kind": "code", "file": "code.jsonl", "code": {"workers": 3}}})
    assert isinstance(cfg.tasks.reward_fn(), CodeTaskReward) and cfg.tasks.reward_fn().cfg.workers == 3
    info = WorkerRunInfo.of(cfg, -1, ["http://127.0.0.1:1"])
    assert info.task_kind == "code" and info.code_reward.workers == 3  # what a worker claims its rewards with
    assert task_reward_fn("math") is math_task_reward


@pytest.mark.usefixtures("bwrap")
def test_reference_solutions_pass_and_the_file_budget_bounds_a_file():
    got = code_rewards([SOLUTION[t.id] for t in TASKS], [t.tests for t in TASKS], CODE)
    assert [r.reason for r in got] == ["ok"] * len(TASKS)
    hang = "```python\nwhile True:\n    pass\n```"
    slow = CODE.model_copy(update={"workers": 1, "file_budget_s": 0.5,
                                   "sandbox": CODE.sandbox.model_copy(update={"timeout_s": 2.0, "cpu_s": 1})})
    got = code_rewards([hang] * 4, [TASKS[0].tests] * 4, slow)
    assert got[0].reward == 0 and got[0].reason != "budget"  # the row's own limit ended it
    assert [r.reason for r in got[1:]] == ["budget"] * 3  # the file's budget was spent


@pytest.mark.usefixtures("bwrap")
def test_the_validator_scores_code_in_the_sandbox_and_rejects_claimed_passes(tiny, tmp_path):
    model, tok = tiny
    engine = TorchEngine.for_tokenizer(model, tok, capture_hidden=False)
    sub = RLRunConfig().submission.model_copy(update={"prompts_per_submission": 3, "group_size": 2, "max_tokens": 96})
    storage, limits, reward = RunStorage(f"file://{tmp_path}/run"), RolloutLimits(vocab_size=len(tok)), CodeTaskReward(CODE)

    def rows(worker):
        return generate_submission(engine, tok, TASKS, worker, 0, 0, 0, sub, run="r", reward_fn=reward)

    def solved(worker, claim):
        """``worker``'s rows with the reference solution as output (what a worker without proofs could
        hand in), claiming ``claim``."""
        out = []
        for r in rows(worker):
            ids = tuple(tok(SOLUTION[r.prompt_id], add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,)
            out.append(dataclasses.replace(r, output_tokens=ids, finish_reason="stop", reward=claim, task_reward=claim))
        return out

    cases = {
        "honest": (rows("honest"), {None}),
        "liar": ([dataclasses.replace(r, reward=1.0, task_reward=1.0) for r in rows("liar")], {"reward_mismatch"}),
        "solver": (solved("solver", 1.0), {None}),
        "modest": (solved("modest", 0.0), {"reward_mismatch"}),
    }
    for worker, (got, want) in cases.items():
        rel = write_submission(storage, 0, worker, 0, got)
        verdicts = validate_submission(storage, rel, tasks=TASKS, tokenizer=tok, step=0, async_level=1, limits=limits,
                                       cfg=sub, run="r", reward_fn=reward)
        assert {v.reason for v in verdicts} == want, (worker, verdicts[:2])
        if worker == "solver":  # the validator's own rewards, from running the code: every row passes
            assert [v.reward for v in verdicts] == [1.0] * len(verdicts)


@pytest.mark.usefixtures("bwrap")
def test_the_pass_at_k_filter_scores_code_tasks_and_writes_them_back(tiny, tmp_path):
    from intellect.rl.trainer import filter as F  # noqa: PLC0415 - this test's import
    from intellect.rl.config import FilterConfig  # noqa: PLC0415

    model, tok = tiny
    engine = TorchEngine.for_tokenizer(model, tok, capture_hidden=False)
    cfg = FilterConfig(k=2, max_tokens=8, min_rate=0, max_rate=1)
    counts = F.solve_counts(engine, tok, TASKS[:3], cfg, CodeTaskReward(CODE))
    assert counts == [0, 0, 0]  # a random model writes no code block
    table = F.from_parquet(F.to_parquet(F.scores_table(TASKS[:3], counts, cfg)))
    path = tmp_path / "kept.jsonl"
    path.write_text(F.kept_tasks_jsonl(table))
    assert load_code_tasks(path).tasks == TASKS[:3]  # the kept file is a code task file again


def test_a_malformed_assignment_is_the_services_bad_answer_not_a_worker_crash():
    from intellect.rl.worker.client import ServiceError  # noqa: PLC0415 - this test's imports
    from intellect.rl.worker.worker import _tasks  # noqa: PLC0415

    # the service sends no tests (nor math answers): the worker's tasks carry none
    assert _tasks([{"id": TASKS[0].id, "prompt": TASKS[0].prompt}], "code") == [
        dataclasses.replace(TASKS[0], tests=())]
    for bad, kind in (([{"id": "a"}], "math"), ([{"id": "a", "prompt": ""}], "code"),
                      ([{"id": 3, "prompt": "p"}], "code"), (["not an object"], "math")):
        with pytest.raises(ServiceError) as err:
            _tasks(bad, kind)
        assert err.value.reason == "bad_answer"
