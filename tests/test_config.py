"""Config loading: presets, dotted overrides, unknown keys and wrong types named with the source."""

import dataclasses

import pytest

from tapas_jax.config import ConfigError, PlanConfig, load_config, preset_path


def test_defaults_without_file():
    cfg = load_config(PlanConfig)
    assert cfg == PlanConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.layers = 3


def test_preset_by_name_and_overrides():
    path = preset_path("tapas", "gpt_tiny_cpu")
    cfg = load_config(PlanConfig, path, ["layers=3", "memory_limit_gib=1.5"])
    assert (cfg.layers, cfg.d_model, cfg.hardware) == (3, 64, "cpu")
    assert cfg.memory_limit_gib == 1.5
    cfg2 = load_config(PlanConfig, path, {"mesh": "data=4,model=2"})
    assert cfg2.mesh == "data=4,model=2"


def test_every_tapas_preset_loads():
    for name in ("gpt_tiny_cpu", "gpt_demo_cpu", "gpt3_1024_tpu"):
        assert isinstance(load_config(PlanConfig, preset_path("tapas", name)), PlanConfig)


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("layers: 2\nlayres: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: key 'layres'"):
        load_config(PlanConfig, f)


def test_wrong_type_names_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("layers: many\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: key 'layers'"):
        load_config(PlanConfig, f)


def test_unknown_override_names_key():
    with pytest.raises(ConfigError, match=r"command line: key 'depth'"):
        load_config(PlanConfig, None, ["depth=3"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(PlanConfig, None, ["layers"])


def test_missing_file_and_unknown_preset(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(PlanConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="no preset 'nope' for tapas"):
        preset_path("tapas", "nope")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(PlanConfig, bad)
