import pytest

from ttr.train.cli import default_config_path, split_overrides
from ttr.train.config import load_config, parse_override


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('run_dir = "x"\n[optim]\nlr = 1e-3\n[train]\nmax_steps = 7\n')
    cfg = load_config(path, ["--train.max_steps=9", "--optim.schedule=wsd", "--model.overrides.hidden_size=64",
                             "--seed=3"])
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 9 and cfg.optim.schedule == "wsd"
    assert cfg.model.overrides == {"hidden_size": 64} and cfg.seed == 3 and cfg.run_dir == "x"
    assert cfg.data.source == "embedded"


def test_int_accepted_for_float():
    cfg = load_config(None, ["--optim.lr=1"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("[optim]\nlearning_rate = 1e-3\n")
    with pytest.raises(ValueError, match=r"optim.learning_rate.*lr, betas, eps, weight_decay"):
        load_config(path)
    with pytest.raises(ValueError, match=r"unknown config key 'trian'.*model, data, tokenizer, optim, train"):
        load_config(None, ["--trian.max_steps=3"])


def test_type_and_choice_errors():
    with pytest.raises(TypeError, match="train.max_steps expects int"):
        load_config(None, ["--train.max_steps=ten"])
    with pytest.raises(ValueError, match="optim.schedule must be one of"):
        load_config(None, ["--optim.schedule=linear"])
    with pytest.raises(ValueError, match="train.seq_len must be >= 1"):
        load_config(None, ["--train.seq_len=0"])
    with pytest.raises(ValueError, match="does not exist"):
        load_config("/nonexistent.toml")
    with pytest.raises(ValueError, match="--section.key=value"):
        parse_override("train.max_steps=3")


def test_resume_flag_forms():
    from ttr.train.cli import parse_args

    args, overrides = parse_args(["--resume", "cfg.toml", "--train.max_steps=3"])
    assert (args.resume, args.config, overrides) == ("latest", "cfg.toml", ["--train.max_steps=3"])
    assert parse_args(["cfg.toml", "--resume=auto"])[0].resume == "auto"
    assert parse_args(["--resume", "auto", "cfg.toml"])[0].resume == "auto"
    args = parse_args(["--resume-from=step_00000010"])[0]
    assert args.resume_from == "step_00000010" and args.resume is None


def test_cli_split_and_default_config():
    rest, over = split_overrides(["cfg.toml", "--resume", "--train.max_steps=3", "--run_dir=a", "--nproc", "2"])
    assert rest == ["cfg.toml", "--resume", "--nproc", "2"] and over == ["--train.max_steps=3", "--run_dir=a"]
    assert load_config(default_config_path()).model.preset.startswith("gated_deltanet")


def test_every_recipe_parses_and_names_a_preset():
    from ttr.models.presets import list_presets
    from ttr.train.cli import CONFIG_DIR

    recipes = sorted(CONFIG_DIR.glob("*.toml"))
    assert len(recipes) >= 23
    for path in recipes:
        cfg = load_config(path)
        assert cfg.model.preset in list_presets(), path
        assert path.read_text().startswith("#"), f"{path} must say where its recipe comes from"
    names = {p.stem for p in recipes}
    assert {f"{p}" for p in list_presets()} <= names
