"""The shared command convention: --version, hidden internal commands, one-line user errors, exit 2.

The dispatcher is exercised through the real command registries of the three packages, plus a
small command module written to a temporary directory for the behaviours no real command shows
(an internal command, an error that is not the user's).
"""

import importlib
import importlib.metadata
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from paragan_jax.__main__ import COMMANDS as PARAGAN_COMMANDS
from serve_jax.__main__ import COMMANDS as SERVE_COMMANDS
from tapas_jax.__main__ import COMMANDS as TAPAS_COMMANDS
from tapas_jax.commands import CONSOLE_SCRIPTS, Command, dispatch, error_line, version

ROOT = Path(__file__).resolve().parent.parent
REGISTRIES = {
    "tapas_jax": TAPAS_COMMANDS,
    "serve_jax": SERVE_COMMANDS,
    "paragan_jax": PARAGAN_COMMANDS,
}


def _one_line_error(capsys, prog: str, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    head = f"{prog} {command}: error: "
    assert err.startswith(head), err
    return err[len(head) :].strip()


@pytest.fixture
def toy_commands(tmp_path, monkeypatch):
    """A registry over a throwaway command module: public, internal and failing commands."""
    (tmp_path / "toy_cmds.py").write_text(
        textwrap.dedent(
            '''
            """Commands for the dispatcher test."""


            def main(argv):
                if argv[0] == "worker":
                    print("worker ran", argv[1:])
                    return 0
                if argv[0] == "missing":
                    open("/nonexistent/dir/file.txt")
                if argv[0] == "bug":
                    raise RuntimeError("an internal bug")
                if argv[0] == "optional":
                    import tensorboardX  # noqa: F401
                if argv[0] == "typo":
                    import tapas_jax.no_such_module  # noqa: F401
                raise ValueError("first line\\n  second line")
            '''
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return {
        "run": ("toy_cmds", "a public command"),
        "missing": ("toy_cmds", "opens a file that does not exist"),
        "bug": ("toy_cmds", "raises an error that is not the user's"),
        "optional": ("toy_cmds", "needs an optional dependency"),
        "typo": ("toy_cmds", "imports a module that does not exist"),
        "worker": Command("toy_cmds", "a worker entry point", internal=True),
    }


def test_version_is_the_distribution_version(capsys):
    for package, registry in REGISTRIES.items():
        assert dispatch(package, registry, ["--version"]) == 0
        out = capsys.readouterr().out
        assert out.strip().endswith(importlib.metadata.version("jax-parallel-stack"))
    assert version() == importlib.metadata.version("jax-parallel-stack")


def test_usage_lists_public_commands_only(toy_commands, capsys):
    assert dispatch("toy", toy_commands, ["--help"]) == 0
    out = capsys.readouterr().out
    assert "run" in out and "missing" in out and "--version" in out
    assert "worker" not in out
    assert dispatch("toy", toy_commands, []) == 2
    assert "worker" not in capsys.readouterr().err


def test_internal_command_still_runs(toy_commands, capsys):
    assert dispatch("toy", toy_commands, ["worker", "--rank", "1"]) == 0
    assert "worker ran ['--rank', '1']" in capsys.readouterr().out


def test_user_errors_are_one_line_and_exit_2(toy_commands, capsys):
    assert dispatch("toy", toy_commands, ["run"]) == 2
    assert _one_line_error(capsys, "python -m toy", "run") == "first line; second line"
    assert dispatch("toy", toy_commands, ["missing"]) == 2
    msg = _one_line_error(capsys, "python -m toy", "missing")
    assert msg == "/nonexistent/dir/file.txt: No such file or directory"


def test_debug_env_reraises_and_bugs_keep_their_traceback(toy_commands, monkeypatch):
    with pytest.raises(RuntimeError, match="an internal bug"):
        dispatch("toy", toy_commands, ["bug"])
    monkeypatch.setenv("JAXSTACK_DEBUG", "1")
    with pytest.raises(ValueError, match="first line"):
        dispatch("toy", toy_commands, ["run"])


def test_missing_optional_dependency_names_the_extra(toy_commands, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if the gan extra were missing
    assert dispatch("toy", toy_commands, ["optional"]) == 2
    msg = _one_line_error(capsys, "python -m toy", "optional")
    assert "needs tensorboardX" in msg and "pip install 'jax-parallel-stack[gan]'" in msg
    with pytest.raises(ModuleNotFoundError):  # not an optional dependency: a bug, traceback
        dispatch("toy", toy_commands, ["typo"])


def test_program_name_is_the_console_script_or_python_m(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/serve-jax", "nope"])
    dispatch("serve_jax", SERVE_COMMANDS, ["nope"])
    assert capsys.readouterr().err.startswith("serve-jax: error: unknown command 'nope'")
    for argv0 in ("/venv/bin/pytest", "/x/serve_jax/__main__.py", ""):
        monkeypatch.setattr(sys, "argv", [argv0])
        dispatch("serve_jax", SERVE_COMMANDS, ["nope"])
        assert capsys.readouterr().err.startswith("python -m serve_jax: error: unknown command")


def test_unknown_command(capsys):
    assert dispatch("tapas_jax", TAPAS_COMMANDS, ["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_error_line_of_os_errors():
    assert error_line(PermissionError(13, "Permission denied", "/root/x")) == (
        "/root/x: Permission denied"
    )
    assert error_line(ValueError("")) == "ValueError"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["plan", "--mesh", "bogus=3"], "mesh spec bogus=3"),
        (["plan", "--hardware", "bogus"], "unknown hardware 'bogus'"),
        (["plan", "--model", "bogus"], "unknown zoo model 'bogus'"),
        (["plan", "--config", "../tapas/gpt_tiny_cpu"], "no preset '../tapas/gpt_tiny_cpu'"),
        (["plan", "--config", "/etc/shadow"], "no preset '/etc/shadow'"),
        (["plan", "x=!!python/object:os.system"], "YAML tags are not allowed"),
        (["verify", "--num-devices", "64"], "drop --num-devices"),
    ],
)
def test_tapas_user_errors(argv, needle, capsys):
    assert dispatch("tapas_jax", TAPAS_COMMANDS, argv) == 2
    assert needle in _one_line_error(capsys, "python -m tapas_jax", argv[0])


@pytest.mark.parametrize(
    "package, argv, needle",
    [
        ("serve_jax", ["replay", "--config", "/etc/shadow"], "no preset '/etc/shadow'"),
        ("serve_jax", ["replay", "--config", "../tapas/gpt_tiny_cpu"], "known presets"),
        ("serve_jax", ["simulate", "--config", "/etc/shadow"], "no preset '/etc/shadow'"),
        ("serve_jax", ["replay", "x=!!python/object:os.system"], "YAML tags are not allowed"),
        ("paragan_jax", ["train", "--config", "/etc/passwd", "--workdir", "w"], "known presets"),
        ("paragan_jax", ["train", "--config", "../serve/tiny_cpu", "--workdir", "w"], "no preset"),
        (
            "serve_jax",
            ["replay", "--config", "tiny_cpu", "model.checkpoint=/etc/passwd"],
            "'/etc/passwd' is not a safetensors checkpoint",
        ),
        (
            "serve_jax",
            ["replay", "--config", "tiny_cpu", "model.tokenizer=/etc/passwd"],
            "'/etc/passwd' is not a tokenizer.json file",
        ),
        (
            "paragan_jax",
            ["train", "--config", "digits_cpu", "--steps", "1", "--workdir", "/etc/passwd"],
            "workdir '/etc/passwd'",
        ),
    ],
)
def test_user_errors_of_every_package(package, argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert dispatch(package, REGISTRIES[package], argv) == 2
    msg = _one_line_error(capsys, f"python -m {package}", argv[0])
    assert needle in msg
    assert "root:" not in msg  # never a line of the file


def test_config_file_contents_are_not_echoed(tmp_path, capsys):
    f = tmp_path / "passwd.yaml"
    f.write_text("root:x:0:0:root:/root:/bin/bash\n")
    assert dispatch("tapas_jax", TAPAS_COMMANDS, ["plan", "--config", str(f)]) == 2
    msg = _one_line_error(capsys, "python -m tapas_jax", "plan")
    assert "root" not in msg.replace(str(tmp_path), "") and "passwd.yaml" in msg


PUBLIC_COMMANDS = [
    (package, name)
    for package, registry in REGISTRIES.items()
    for name, entry in registry.items()
    if not Command(*entry).internal
]


@pytest.mark.parametrize("package, command", PUBLIC_COMMANDS)
def test_every_command_help_lists_its_overrides(package, command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        dispatch(package, REGISTRIES[package], [command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"python -m {package} {command}" in out
    assert "--config" in out and "key=value overrides" in out


def test_every_registered_command_has_a_main():
    for registry in REGISTRIES.values():
        for entry in registry.values():
            assert callable(importlib.import_module(Command(*entry).module).main), entry


def test_console_scripts_point_at_each_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {
        "tapas": "tapas_jax.__main__:main",
        "serve-jax": "serve_jax.__main__:main",
        "paragan": "paragan_jax.__main__:main",
    }
    assert {v.split(".")[0]: k for k, v in scripts.items()} == CONSOLE_SCRIPTS
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))


def test_python_m_bad_mesh_is_one_line_in_a_fresh_process():
    r = subprocess.run(
        [sys.executable, "-m", "tapas_jax", "plan", "--mesh", "bogus=3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("python -m tapas_jax plan: error: mesh spec bogus=3")
