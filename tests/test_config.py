"""Config loading: presets, dotted overrides, unknown keys and wrong types named with the source."""

import dataclasses

import pytest

from tapas_jax.commands import override_help
from tapas_jax.config import ConfigError, PlanConfig, load_config, preset_names, preset_path


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
    with pytest.raises(ConfigError, match="no preset 'nope' for tapas.*gpt_tiny_cpu"):
        preset_path("tapas", "nope")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(PlanConfig, bad)


def test_presets_ship_inside_each_package():
    cases = (("tapas", "gpt_tiny_cpu"), ("serve", "tiny_cpu"), ("paragan", "digits_cpu"))
    for package, name in cases:
        path = preset_path(package, name)
        assert path.parent.name == "presets" and path.parent.parent.name == f"{package}_jax"
        assert name in preset_names(package)
    assert preset_path("serve_jax", "tiny_cpu") == preset_path("serve", "tiny_cpu")


@pytest.mark.parametrize("name", ["../tapas/gpt_tiny_cpu", "/etc/shadow", "/etc/passwd", "presets"])
def test_preset_outside_the_package_is_refused(name):
    with pytest.raises(ConfigError, match="known presets: .*gpt_tiny_cpu") as info:
        preset_path("tapas", name)
    assert repr(name) in str(info.value)


def test_explicit_yaml_path(tmp_path):
    f = tmp_path / "mine.yml"
    f.write_text("layers: 5\n")
    assert preset_path("tapas", f) == f
    assert load_config(PlanConfig, preset_path("tapas", str(f))).layers == 5
    with pytest.raises(ConfigError, match="does not exist"):
        preset_path("tapas", tmp_path / "missing.yaml")


def test_file_contents_are_never_echoed(tmp_path):
    secret = "hunter2-secret-line"
    cases = {
        "keys.yaml": f"{secret}:x:0:0:{secret}:/root:/bin/bash\n",  # /etc/passwd-like
        "syntax.yaml": f"a: [{secret}\n",
        "tag.yaml": f"layers: !!python/object:os.system {secret}\n",
        "type.yaml": f"layers: {secret}\n",
        "binary.yaml": b"\xff\xfe" + secret.encode(),
    }
    for name, text in cases.items():
        f = tmp_path / name
        f.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ConfigError) as info:
            load_config(PlanConfig, f)
        assert secret not in str(info.value) and name in str(info.value)


def test_type_error_names_the_expected_type():
    with pytest.raises(ConfigError, match=r"key 'layers': expected int, got 'many'"):
        load_config(PlanConfig, None, ["layers=many"])


@pytest.mark.parametrize("item", ["x=!!python/object:os.system", "model=!!python/name:os.system"])
def test_yaml_tag_override_is_a_config_error(item):
    with pytest.raises(ConfigError, match="YAML tags are not allowed"):
        load_config(PlanConfig, None, [item])


@dataclasses.dataclass(frozen=True)
class _Section:
    cap: int = 256
    """Bytes."""


@dataclasses.dataclass(frozen=True)
class _Command:
    section: _Section = dataclasses.field(default_factory=lambda: _Section(cap=8))
    """A nested section whose default differs from its class defaults."""


def test_override_help_shows_a_sections_own_default():
    text = override_help(_Command)
    assert "section.cap (int = 8)" in text
    assert "= 256" not in text
