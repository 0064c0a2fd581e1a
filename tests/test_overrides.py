"""The one KEY=VALUE grammar: ttr train's --section.key=VALUE and ttr eval's --set / --variant."""

import pytest

from ttr.overrides import parse_assignment, parse_value
from ttr.train.config import load_config


def test_values_are_toml_then_json_then_text():
    assert parse_value("64") == 64 and parse_value("3e-4") == 3e-4 and parse_value("true") is True
    assert parse_value('"a b"') == "a b" and parse_value('["attn", "gla"]') == ["attn", "gla"]
    assert parse_value("{hidden_size = 64}") == {"hidden_size": 64}
    assert parse_value('{"hidden_size": 64}') == {"hidden_size": 64}  # JSON, which TOML does not read
    assert parse_value("null") is None
    assert parse_value("cosine") == "cosine" and parse_value("") == ""


def test_assignment_needs_a_key():
    assert parse_assignment("rope_theta=1e4") == ("rope_theta", 1e4)
    assert parse_assignment("a=b=c") == ("a", "b=c")
    for bad in ("rope_theta", "=3"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_assignment(bad)


def test_train_overrides_take_json_tables():
    """A whole table as JSON on the command line merges into the recipe's [model] overrides."""
    cfg = load_config(None, ['--model.overrides={"hidden_size": 64, "layer_types": ["attn", "gla"]}',
                             "--model.overrides.num_hidden_layers=2"])
    assert cfg.model.overrides == {"hidden_size": 64, "layer_types": ["attn", "gla"], "num_hidden_layers": 2}
    with pytest.raises(TypeError, match="model.overrides"):
        load_config(None, ["--model.overrides=64"])
