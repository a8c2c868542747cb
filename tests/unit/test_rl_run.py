"""The RL run config, the filter core, the eval record and the task pool."""

import doctest
import stat

import pytest
import torch
from pydantic import ValidationError

from intellect.config import ConfigError, ModelConfig, load_config
from intellect.inference.torch_engine import TorchEngine
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl import config as rl_config
from intellect.rl.trainer import filter as F
from intellect.rl.trainer import report, setup
from intellect.rl.config import FilterConfig, InitConfig, RLRunConfig, TaskPoolConfig
from intellect.rl.trainer.step import DoneMarker, done_marker, read_done_marker
from intellect.storage import RunStorage
from tasks import rl as T


@pytest.mark.parametrize("module", [rl_config, F, report, setup])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_bad_fields_name_the_field():
    with pytest.raises(ConfigError, match=r"async_level"):
        load_config(RLRunConfig, overrides=["async_level=-1"], environ={})
    with pytest.raises(ConfigError, match=r"workers\.nmes.*allowed"):
        load_config(RLRunConfig, overrides=["workers.nmes=[]"], environ={})
    with pytest.raises(ValueError, match="min_rate"):
        FilterConfig(min_rate=0.6, max_rate=0.5)
    with pytest.raises(ValueError, match="from_run or path"):
        InitConfig(from_run=None)


def test_window_is_exact_for_eighths_and_other_k():
    assert [FilterConfig(k=8).keeps(n) for n in (0, 1, 4, 5)] == [False, True, True, False]
    assert [FilterConfig(k=3, min_rate=1 / 3, max_rate=2 / 3).keeps(n) for n in range(4)] == [False, True, True, False]


def test_task_pool_never_holds_heldout_and_is_distinct():
    cfg = TaskPoolConfig(size=500)
    pool = setup.task_pool(cfg)
    ids = [t.id for t in pool]
    assert len(ids) == len(set(ids)) == 500
    assert not {p.id for p in setup.heldout_tasks(cfg, 512)} & set(ids)
    small = setup.task_pool(TaskPoolConfig(size=10_000, data={"max_digits": 1, "ops": ["+"]}))
    assert len(small) < 100  # the whole (small) space, not an endless loop


def test_missing_init_checkpoint_says_what_to_run(tmp_path):
    cfg = RLRunConfig(storage={"url": f"file://{tmp_path}"}, init={"from_run": "nothing"})
    with Ledger(tmp_path / "l.duckdb") as ledger, pytest.raises(FileNotFoundError, match="intellect smoke"):
        setup.seed_checkpoint(cfg, setup.run_storage(cfg), ledger)
    with pytest.raises(FileNotFoundError, match="init.path"):
        setup.initial_weights(InitConfig(path=str(tmp_path)), cfg)


def test_solve_counts_do_not_depend_on_chunking():
    torch.manual_seed(0)
    model, tok = build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                                         intermediate_size=64))
    eng = TorchEngine.for_tokenizer(model, tok, capture_hidden=False)
    tasks = setup.task_pool(TaskPoolConfig(size=12, data={"max_digits": 1}))
    cfg = FilterConfig(k=4, max_tokens=3)

    def reward(text, task):  # noqa: ARG001 - the reward signature; an untrained model never solves a sum; this reward it hits about half the time
        return float(sum(map(ord, text)) % 2)

    whole = F.solve_counts(eng, tok, tasks, cfg, reward)
    parts = F.solve_counts(eng, tok, tasks[:5], cfg, reward) + F.solve_counts(eng, tok, tasks[5:], cfg, reward)
    assert whole == parts and 0 < sum(whole) < 48
    table = F.scores_table(tasks, whole, cfg)
    assert F.from_parquet(F.to_parquet(table)).equals(table)
    assert F.kept_tasks_jsonl(table).count("\n") == sum(cfg.keeps(n) for n in whole)
    with pytest.raises(ValueError, match="not a filter score file"):
        F.from_parquet(F.to_parquet(table.drop(["kept"])))


def test_toploc_is_on_unless_workers_are_trusted():
    assert RLRunConfig().toploc is not None and not RLRunConfig().trusted_workers
    with pytest.raises(ConfigError, match="trusted_workers"):
        load_config(RLRunConfig, overrides=["toploc=false"], environ={})
    off = load_config(RLRunConfig, overrides=["toploc=false", "trusted_workers=true"], environ={})
    assert off.toploc is None
    assert load_config(RLRunConfig, "configs/rl-tiny.toml", environ={}).toploc is not None


def test_the_trainer_secret_and_key_are_private_and_stable(tmp_path):
    cfg = RLRunConfig(storage={"url": f"file://{tmp_path}"})
    secret, key = setup.trainer_secret(cfg), setup.trainer_key(cfg)
    assert setup.trainer_secret(cfg) == secret and len(secret) == 32
    assert setup.trainer_key(cfg).public == key.public
    for f in ("secret", "trainer.key"):
        assert stat.S_IMODE((setup.trainer_dir(cfg) / f).stat().st_mode) == 0o600
    (setup.trainer_dir(cfg) / "secret").chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        setup.trainer_secret(cfg)


def test_tasks_act_on_the_run_their_flow_opened(tmp_path):
    """Tasks find the run the flow opened (``open_run``); a stage flow inside the orchestrator's process
    gets that same run and releases its ledger connection when it ends; nothing is cached after."""
    cfg = RLRunConfig(storage={"url": f"file://{tmp_path}"}, tasks={"size": 8, "data": {"max_digits": 1}})
    with pytest.raises(RuntimeError, match="not open here"):
        T.stop_waiting(cfg)
    with T.open_run(cfg) as run:
        run.ledger.committed_steps()  # connects
        with T.open_run(RLRunConfig.model_validate(cfg.model_dump())) as again:
            assert again is run
        assert run.ledger._con is None and not run.stopping.is_set()
        T.stop_waiting(cfg)
        assert run.stopping.is_set()
    with pytest.raises(RuntimeError, match="not open here"):
        T.release_ledger(cfg)


def test_the_done_marker_is_written_and_read_in_one_format(tmp_path):
    storage = RunStorage(f"file://{tmp_path}/run")
    assert read_done_marker(storage, 0, "alice") is None
    storage.write_text(done_marker(0, "alice"), DoneMarker(files=["a"], policy_step=0).model_dump_json())
    assert read_done_marker(storage, 0, "alice") == DoneMarker(files=["a"], policy_step=0)
    storage.write_text(done_marker(1, "alice"), '{"files": [], "policy_step": -1}')
    with pytest.raises(ValidationError, match="policy_step"):
        read_done_marker(storage, 1, "alice")
