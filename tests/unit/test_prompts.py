"""Chat-template prompts end to end (worker, validator, evaluation) and the user's held-out split:
what a worker that renders its own prompt gets, and what a bad task file says."""

import doctest
import json
import logging

import pytest

from intellect.config import ModelConfig
from intellect.data import loaders
from intellect.data.loaders import MathTask, TaskFileError, split_heldout
from intellect.inference import TorchEngine
from intellect.model.bpe import TURN_END, save_tokenizer, train_bpe
from intellect.model.checkpoint import build_model, save_checkpoint
from intellect.model.tokenizer import load_tokenizer
from intellect import prompts
from intellect.rl.config import RLRunConfig, TaskPoolConfig
from intellect.rl.trainer.evaluation import HeldOut, score_tasks
from intellect.prompts import PromptConfig, PromptError, render_prompt
from intellect.rl.wire.rollouts import RolloutLimits, write_submission
from intellect.rl.trainer.setup import heldout_task_file, task_pool
from intellect.rl.worker.submission import SubmissionConfig, generate_submission
from intellect.rl.service.validator import validate_submission
from intellect.storage import RunStorage

TEXTS = [f"What is {a}+{b}? {a + b}" for a in range(30) for b in range(30)]
TASKS = [MathTask(f"t{a}-{b}", f"What is {a}+{b}?", str(a + b)) for a in range(4) for b in range(3)]
RAW, CHAT = PromptConfig(template="raw"), PromptConfig(template="chat", system="Answer with a number.")


def test_doctests():
    assert doctest.testmod(prompts).failed == 0
    assert doctest.testmod(loaders).failed == 0


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """A chat BPE tokenizer as a run has it: saved as an HF folder and loaded back."""
    folder = tmp_path_factory.mktemp("tok") / "chat"
    save_tokenizer(train_bpe(TEXTS, vocab_size=320, chat=True), folder)
    return load_tokenizer(folder), folder


@pytest.fixture(scope="module")
def chat_model(chat_tok):
    tok, folder = chat_tok
    model, tok = build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                                         intermediate_size=64, tokenizer=str(folder)))
    return model, tok


def test_a_saved_chat_tokenizer_keeps_its_template_and_turn_end(chat_tok):
    tok, _ = chat_tok
    assert tok.chat_template and tok.eos_token == TURN_END and tok.pad_token_id is not None
    ids = render_prompt(tok, "What is 2+3?", PromptConfig())
    assert ids == render_prompt(tok, "What is 2+3?", PromptConfig(template="chat"))
    assert tok.decode(ids).endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second
    assert render_prompt(tok, "What is 2+3?", RAW) == tok("What is 2+3?")["input_ids"]


def test_prompts_that_cannot_render_raise_prompt_error(chat_tok):
    plain = train_bpe(TEXTS[:50], vocab_size=300)
    with pytest.raises(PromptError, match="no chat template"):
        render_prompt(plain, "hi", PromptConfig(template="chat"))
    tok, _ = chat_tok
    broken = tok.__class__.from_pretrained(chat_tok[1])
    broken.chat_template = "{{ raise_exception('only English prompts') }}"
    with pytest.raises(PromptError, match="only English prompts"):
        render_prompt(broken, "hi", PromptConfig())
    with pytest.raises(ValueError):
        PromptConfig(system="")


def test_worker_prompts_are_the_chat_rendering_and_a_worker_that_renders_its_own_is_rejected(chat_model, tmp_path):
    model, tok = chat_model
    engine = TorchEngine.for_tokenizer(model, tok, capture_hidden=False)
    cfg = SubmissionConfig(prompts_per_submission=2, group_size=2, max_tokens=4, prompt=CHAT)
    storage = RunStorage(f"file://{tmp_path}/run")
    limits = RolloutLimits(vocab_size=len(tok))
    honest = generate_submission(engine, tok, TASKS, "honest", 0, 0, 0, cfg, run="r")
    by_id = {t.id: t for t in TASKS}
    assert all(list(r.prompt_tokens) == render_prompt(tok, by_id[r.prompt_id].prompt, CHAT) for r in honest)
    # the same assignment answered under a prompt of the worker's choosing: raw text, or another system turn
    raw = generate_submission(engine, tok, TASKS, "raw", 0, 0, 0, cfg.model_copy(update={"prompt": RAW}), run="r")
    other = cfg.model_copy(update={"prompt": PromptConfig(system="Ignore the task; answer 0.")})
    steered = generate_submission(engine, tok, TASKS, "steer", 0, 0, 0, other, run="r")
    for worker, rows, ok in (("honest", honest, True), ("raw", raw, False), ("steer", steered, False)):
        rel = write_submission(storage, 0, worker, 0, rows)
        verdicts = validate_submission(storage, rel, tasks=TASKS, tokenizer=tok, step=0, async_level=1,
                                       limits=limits, cfg=cfg, run="r")
        assert {v.reason for v in verdicts} == ({None} if ok else {"assignment"}), worker


def test_completion_text_ends_where_the_template_ends_the_turn(chat_model):
    model, tok = chat_model
    engine = TorchEngine.for_tokenizer(model, tok)
    assert tok.convert_tokens_to_ids(TURN_END) in engine.eos  # generation stops at the turn's end
    from intellect.rl.worker.submission import completion_text  # noqa: PLC0415 - next to its one use
    ids = tok("42", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(TURN_END)]
    assert completion_text(tok, ids) == "42"


# --------------------------------------------------------------------- the user's held-out tasks


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _math_rows(n):
    return [{"id": f"p{i}", "prompt": f"What is {i}+{i + 1}? Put the answer in \\boxed{{}}.", "answer": 2 * i + 1}
            for i in range(n)]


def test_heldout_source_defaults_and_bad_combinations():
    assert TaskPoolConfig().heldout_source == "arithmetic"
    assert TaskPoolConfig(file="t.jsonl").heldout_source == "split"
    assert TaskPoolConfig(file="t.jsonl", heldout_file="h.jsonl").heldout_source == "file"
    assert TaskPoolConfig(file="t.jsonl", heldout="arithmetic").heldout_source == "arithmetic"
    for bad in ({"heldout": "split"}, {"heldout": "file"}, {"file": "t", "heldout_file": "h", "heldout": "split"},
                {"file": "t", "heldout_percent": 0}, {"file": "t", "heldout_percent": 51}):
        with pytest.raises(ValueError):
            TaskPoolConfig(**bad)


def test_the_split_is_by_prompt_and_never_trained_on(tmp_path):
    rows = _math_rows(200)
    cfg = TaskPoolConfig(file=_write(tmp_path / "tasks.jsonl", rows), heldout_percent=20)
    train, held = task_pool(cfg), heldout_task_file(cfg)
    assert len(train) + len(held) == 200 and 20 < len(held) < 60
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    # reordered and renamed, the same prompts fall on the same side
    shuffled = [dict(r, id=f"x{j}") for j, r in enumerate(reversed(rows))]
    again = heldout_task_file(TaskPoolConfig(file=_write(tmp_path / "again.jsonl", shuffled), heldout_percent=20))
    assert {t.prompt for t in again} == {t.prompt for t in held}
    assert split_heldout(train, 20) == (train, [])


def test_a_heldout_file_keeps_its_prompts_out_of_training(tmp_path):
    rows = _math_rows(30)
    cfg = TaskPoolConfig(file=_write(tmp_path / "tasks.jsonl", rows), heldout_file=_write(tmp_path / "h.jsonl", rows[:5]))
    assert [t.id for t in heldout_task_file(cfg)] == [f"p{i}" for i in range(5)]
    assert [t.id for t in task_pool(cfg)] == [f"p{i}" for i in range(5, 30)]


def test_heldout_accuracy_scores_the_users_tasks_with_the_reward(chat_model, tmp_path):
    model, tok = chat_model
    cfg = TaskPoolConfig(file=_write(tmp_path / "tasks.jsonl", _math_rows(60)), heldout_percent=50)
    sub = SubmissionConfig(max_tokens=6, prompt=CHAT)
    held = HeldOut(cfg, 8)
    tasks = held.tasks(tok, sub)
    assert len(tasks) == 8 and all(t.prompt.startswith("What is") for t in tasks)
    engine = TorchEngine.for_tokenizer(model, tok)
    # a reward that knows the answer is what the metric counts: all solved, then none
    assert score_tasks(engine, tok, tasks, sub, reward_fn=lambda c, t: 1.0).accuracy == 1.0
    assert score_tasks(engine, tok, tasks, sub, reward_fn=lambda c, t: 0.5).accuracy == 0.0
    got = held.accuracy(save_checkpoint(model, tok, tmp_path / "model"), tok, sub)
    assert got == score_tasks(engine, tok, tasks, sub).accuracy


def test_run_config_with_a_users_file_evaluates_its_split():
    cfg = RLRunConfig.model_validate({"tasks": {"file": "tasks.jsonl"}})
    assert cfg.tasks.heldout_source == "split"


def test_a_prompt_the_template_cannot_render_names_its_row_or_is_skipped(chat_tok, tmp_path, caplog):
    tok = chat_tok[0].__class__.from_pretrained(chat_tok[1])
    tok.chat_template = ("{% for m in messages %}{% if 'forbidden' in m['content'] %}"
                         "{{ raise_exception('no forbidden words') }}{% endif %}{{ m['content'] }}{% endfor %}")
    rows = _math_rows(6)
    rows[3]["prompt"] = "a forbidden prompt"
    path = _write(tmp_path / "tasks.jsonl", rows)
    strict = TaskPoolConfig(file=path, heldout="arithmetic")
    with pytest.raises(TaskFileError) as err:
        task_pool(strict, tokenizer=tok, prompt=PromptConfig())
    assert str(err.value) == f"{path} row 4: prompt: the chat template cannot render it: no forbidden words"
    lenient = strict.model_copy(update={"lenient": True})
    with caplog.at_level(logging.WARNING, logger="intellect.rl.trainer.setup"):
        kept = task_pool(lenient, tokenizer=tok, prompt=PromptConfig())
    assert [t.id for t in kept] == ["p0", "p1", "p2", "p4", "p5"]
    assert "row 4 skipped: prompt: the chat template cannot render it" in caplog.text


def test_bad_rows_of_a_task_file_name_the_row(tmp_path):
    path = _write(tmp_path / "tasks.jsonl", _math_rows(3) + [{"prompt": "no answer"}])
    with pytest.raises(TaskFileError, match=r"row 4: missing field 'answer'$"):
        task_pool(TaskPoolConfig(file=path, heldout="arithmetic"))
    assert len(task_pool(TaskPoolConfig(file=path, heldout="arithmetic", lenient=True))) == 3


# --------------------------------------------------------------------- chat pretraining and shipped task files


def test_a_chat_document_encodes_as_the_prompt_the_answer_and_the_turn_end(chat_tok):
    from intellect.config import DataConfig  # noqa: PLC0415 - this section's imports
    from intellect.data.stream import open_stream  # noqa: PLC0415
    from intellect.prompts import chat_document, chat_tasks  # noqa: PLC0415
    from intellect.train import encode_texts  # noqa: PLC0415

    tok, _ = chat_tok
    head, doc = chat_document(tok, "12+34=", "46")
    ids = encode_texts(tok, [doc], 64)["input_ids"][0].tolist()
    want = render_prompt(tok, "12+34=", PromptConfig()) + tok("46", add_special_tokens=False)["input_ids"]
    assert ids == want + [tok.eos_token_id]
    assert tok(head)["input_ids"] == render_prompt(tok, "12+34=", PromptConfig())
    stream = open_stream(DataConfig(chat=True, seed=3), tok)
    plain = open_stream(DataConfig(seed=3), tok)
    for chat_doc, text in zip(stream.next_batch(20), plain.next_batch(20)):
        prompt, answer = text.split("=", 1)
        assert chat_doc == chat_document(tok, prompt + "=", answer)[1]
    (task,) = chat_tasks(tok, [MathTask("a", "1+2=", "3")])
    assert (task.prompt, task.answer, task.text) == (chat_document(tok, "1+2=", "3")[0], "3", chat_document(tok, "1+2=", "3")[1])


def test_a_template_that_does_not_end_the_turn_with_eos_cannot_pretrain(chat_tok):
    from intellect.prompts import chat_document  # noqa: PLC0415 - this section's imports

    tok = chat_tok[0].__class__.from_pretrained(chat_tok[1])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(PromptError, match="EOS"):
        chat_document(tok, "1+2=", "3")


def test_the_shipped_task_files_are_what_their_generators_write():
    from pathlib import Path  # noqa: PLC0415 - this section's imports

    from intellect.config import SmokeConfig, load_config  # noqa: PLC0415
    from intellect.data.arithmetic import heldout_problems, train_stream  # noqa: PLC0415
    from intellect.data.code_tasks import code_tasks, corpus_rows  # noqa: PLC0415

    root = Path(__file__).parents[2] / "configs"
    data = load_config(SmokeConfig, root / "smoke-chat.toml", []).data
    arith = [json.loads(line) for line in (root / "tasks/arith-chat.jsonl").read_text().splitlines()]
    # the chat model never saw these problems: they are its pretraining's held-out share, all of it
    assert arith == [loaders.task_row(p.to_task()) for p in heldout_problems(data, 100_000)]
    rl = load_config(RLRunConfig, root / "rl-chat.toml", [])
    assert rl.tasks.heldout_file == "configs/tasks/arith-chat.jsonl" and rl.submission.prompt.template == "chat"
    # RL trains on problems of the pretraining stream (rl-chat's pool seed), never on held-out ones
    train = [json.loads(line) for line in (root / "tasks/arith-chat-train.jsonl").read_text().splitlines()]
    stream, want = train_stream(data, seed=1234), {}
    while len(want) < len(train):
        p = next(stream)
        want.setdefault(p.id, loaders.task_row(p.to_task()))
    assert train == list(want.values()) and not {r["prompt"] for r in train} & {r["prompt"] for r in arith}
    code = [json.loads(line) for line in (root / "tasks/code-small.jsonl").read_text().splitlines()]
    assert code == code_tasks(72, 0)
    corpus = [json.loads(line) for line in (root / "tasks/code-small-corpus.jsonl").read_text().splitlines()]
    rl_code = load_config(RLRunConfig, root / "rl-code.toml", [])
    assert corpus == corpus_rows(code, rl_code.tasks.heldout_percent)
    held = {t.prompt for t in heldout_task_file(rl_code.tasks.model_copy(update={"file": str(root / "tasks/code-small.jsonl")}))}
    assert held and not any(doc["text"].split("\n", 1)[0] in held for doc in corpus)
