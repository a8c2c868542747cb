from pathlib import Path
from typing import get_args

import pytest

from intellect import config as C
from intellect.diloco import config as DC
from intellect.diloco.quantize import CODECS
from intellect.pipeline import DemoConfig
from intellect.rl.config import FilterRunConfig, RLRunConfig

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))
# Each shipped TOML names its run type in a leading comment: "# run: smoke".
RUN_TYPES = {"smoke": C.SmokeConfig, "diloco": DC.DilocoRunConfig, "rl": RLRunConfig, "filter": FilterRunConfig,
             "demo": DemoConfig}


def run_type(path: Path) -> type:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# run: "), f"{path.name} must start with '# run: <type>'"
    return RUN_TYPES[first.removeprefix("# run: ").strip()]


def test_configs_exist():
    assert CONFIGS, "no configs shipped"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    cfg = C.load_config(run_type(path), path, environ={})
    assert cfg.model_dump()


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lr=-1", "train.lr: Input should be greater than 0 (got -1)"),
        ("train.lerning_rate=1", "train.lerning_rate: unknown field; allowed: batch_size,"),
        ("data.ops=['/']", "data.ops.0: Input should be '+', '-' or '*' (got '/')"),
        ("model.hidden_size=102", "hidden_size (102) must be a multiple of num_heads (4)"),
        ("data.max_digits=9", "data.max_digits: Input should be less than or equal to 6 (got 9)"),
        ("storage.url=ftp://x", "storage: url must start with file:// or s3://"),
        ("run_name=a b", "run_name: String should match pattern"),
    ],
)
def test_bad_values_give_one_line_naming_the_field(override, needle):
    with pytest.raises(C.ConfigError) as info:
        C.load_config(C.SmokeConfig, overrides=[override], environ={})
    msg = str(info.value)
    assert "\n" not in msg
    assert needle in msg


def test_precedence_file_env_cli(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nlr = 0.01\nsteps = 5\n[data]\nmax_digits = 2\n")
    cfg = C.load_config(C.SmokeConfig, f, environ={"INTELLECT_TRAIN__LR": "0.02", "INTELLECT_RUN_NAME": "envrun"})
    assert (cfg.train.lr, cfg.train.steps, cfg.data.max_digits, cfg.run_name) == (0.02, 5, 2, "envrun")
    cfg = C.load_config(C.SmokeConfig, f, ["train.lr=0.03"], environ={"INTELLECT_TRAIN__LR": "0.02"})
    assert cfg.train.lr == 0.03


def test_unrelated_env_vars_are_ignored():
    cfg = C.load_config(C.SmokeConfig, environ={"INTELLECT_SOMETHING_ELSE": "x", "HOME": "/"})
    assert cfg.run_name == "smoke"


def test_file_errors_are_one_line(tmp_path):
    with pytest.raises(C.ConfigError, match="config file not found"):
        C.load_config(C.SmokeConfig, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(C.ConfigError, match="invalid TOML"):
        C.load_config(C.SmokeConfig, bad)
    with pytest.raises(C.ConfigError, match="must look like section.field=value"):
        C.load_config(C.SmokeConfig, overrides=["train.lr"])


def test_every_field_is_documented_and_configs_are_strict():
    def walk(model):
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description or isinstance(field.annotation, type) and issubclass(field.annotation, C.StrictModel), (
                f"{model.__name__}.{name} has no description"
            )
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, C.StrictModel):
                walk(ann)

    for cls in RUN_TYPES.values():
        walk(cls)


def test_diloco_wire_codec_is_strict_and_reaches_the_codec_list():
    assert DC.DilocoConfig().wire_codec == "zstd"
    assert set(get_args(DC.DilocoConfig.model_fields["wire_codec"].annotation)) == set(CODECS)
    cfg = C.load_config(DC.DilocoRunConfig, overrides=["diloco.wire_codec=none"], environ={})
    assert cfg.diloco.wire_codec == "none"
    with pytest.raises(C.ConfigError, match="diloco.wire_codec: Input should be 'none' or 'zstd'"):
        C.load_config(DC.DilocoRunConfig, overrides=["diloco.wire_codec=lz4"], environ={})


def test_diloco_outer_momentum_follows_the_start_unless_set():
    """0.5 from scratch, 0.7 from a checkpoint (the ablation's winners); a value the run sets is kept, and
    the chosen one survives the dump a coordinator sends its workers."""
    text = next(p for p in CONFIGS if p.name == "diloco-text.toml")
    scratch = C.load_config(DC.DilocoRunConfig, text, environ={})
    assert scratch.diloco.outer_momentum == 0.5
    warm = C.load_config(DC.DilocoRunConfig, text, overrides=["model.pretrained=/ckpt"], environ={})
    assert warm.diloco.outer_momentum == DC.WARM_OUTER_MOMENTUM == 0.7
    sent = DC.DilocoRunConfig.model_validate_json(warm.model_dump_json())
    assert sent.diloco.outer_momentum == 0.7
    assert C.load_config(DC.DilocoRunConfig, overrides=["model.pretrained=/ckpt", "diloco.outer_momentum=0.5"],
                         environ={}).diloco.outer_momentum == 0.5
    shared = DC.DilocoConfig()
    assert DC.DilocoRunConfig(model={"pretrained": "/ckpt"}, diloco=shared).diloco.outer_momentum == 0.7
    assert shared.outer_momentum == 0.5  # the caller's object is left as it was
    assert C.load_config(DC.DilocoRunConfig, environ={"INTELLECT_DILOCO__OUTER_MOMENTUM": "0.9",
                                                      "INTELLECT_MODEL__PRETRAINED": "/ckpt"}).diloco.outer_momentum == 0.9


def test_the_submission_service_follows_the_run_unless_set():
    """``service.ahead`` and ``service.max_submissions_per_step`` come from async_level and
    workers.max_submissions when left unset, and a value the run sets is what the service gets, also
    after the dump a deployment run receives."""
    derived = RLRunConfig(async_level=3, workers={"max_submissions": 6})
    svc = RLRunConfig.model_validate_json(derived.model_dump_json()).service_config()
    assert (svc.ahead, svc.max_submissions_per_step) == (4, 6)
    chosen = C.load_config(RLRunConfig, overrides=["async_level=3", "service.ahead=1",
                                                   "service.max_submissions_per_step=9"], environ={})
    svc = RLRunConfig.model_validate_json(chosen.model_dump_json()).service_config()
    assert (svc.ahead, svc.max_submissions_per_step) == (1, 9)
    assert chosen.service.ahead == 1 and RLRunConfig().service.ahead is None  # the run's own config is left as is
    with pytest.raises(ValueError, match="admits no step"):
        RLRunConfig(service={"ahead": 0})
    with pytest.raises(ValueError, match="workers would be refused"):
        RLRunConfig(workers={"max_submissions": 8}, service={"max_submissions_per_step": 4})
