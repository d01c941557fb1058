"""Cloud TPU launch scripts: --dry-run prints every command (create with the runtime Google lists
for the accelerator, install with uv's Python 3.11 and the tpu extra, detached run with per-worker
logs, logs/status/stop); bad input (slice arithmetic: tapas_jax.hardware.tpu_slice, tested in
tests/tapas/test_collectives.py)."""

import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dry(script, *args):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), "--dry-run", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PY": sys.executable},
    )
    return proc


def _commands(out):
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]


def test_create_dry_run_prints_gcloud_commands_and_runs_none():
    proc = _dry(
        "tpu_create.sh",
        "--name",
        "gan",
        "--zone",
        "us-central1-a",
        "--accelerator",
        "v3-32",
        "--project",
        "proj",
    )
    assert proc.returncode == 0, proc.stderr
    assert "16 chips on 4 host(s)" in proc.stdout
    create = _commands(proc.stdout)[0]
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]
    assert {"gan", "--accelerator-type", "v3-32", "--project", "proj"} <= set(create)
    queued = _commands(_dry("tpu_create.sh", "--accelerator", "v3-1024", "--queued").stdout)
    assert queued[0][3:5] == ["queued-resources", "create"] and "--node-id" in queued[0]


def test_runtime_follows_the_accelerator_generation():
    for accelerator, runtime in (
        ("v3-8", "tpu-ubuntu2204-base"),
        ("v4-8", "tpu-ubuntu2204-base"),
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5p-8", "v2-alpha-tpuv5"),
        ("v6e-8", "v2-alpha-tpuv6e"),
    ):
        proc = _dry("tpu_create.sh", "--accelerator", accelerator)
        assert proc.returncode == 0, proc.stderr
        create = _commands(proc.stdout)[0]
        assert create[create.index("--version") + 1] == runtime
    proc = _dry("tpu_create.sh", "--accelerator", "v4-8", "--runtime", "custom-rt")
    create = _commands(proc.stdout)[0]
    assert create[create.index("--version") + 1] == "custom-rt"


def test_install_ships_the_tree_and_a_supported_python_to_every_worker():
    proc = _dry("tpu_install.sh", "--name", "gan", "--accelerator", "v3-32")
    assert proc.returncode == 0, proc.stderr
    cmds = _commands(proc.stdout)
    assert cmds[0][:3] == ["git", "-C", str(ROOT)] and "archive" in cmds[0]
    assert cmds[1][3:5] == ["tpu-vm", "scp"] and "--worker=all" in cmds[1]
    ssh = cmds[2]
    assert ssh[3:5] == ["tpu-vm", "ssh"] and "--worker=all" in ssh
    remote = ssh[ssh.index("--command") + 1]
    # The TPU images ship Python 3.10: uv installs 3.11 and the venv is made from it.
    assert "uv python install 3.11" in remote and "venv --python 3.11" in remote
    assert "pip install --python .venv/bin/python -e '.[gan,tpu]'" in remote
    assert "libtpu_releases" not in remote and " -f " not in remote  # libtpu is on PyPI
    assert "python3 -m venv" not in remote


def test_run_starts_detached_training_on_all_workers_with_per_worker_logs():
    proc = _dry(
        "tpu_run.sh",
        "--name",
        "gan",
        "--accelerator",
        "v3-32",
        "--",
        "--config",
        "biggan128_tpu",
        "--workdir",
        "gs://bucket/run 1",
    )
    assert proc.returncode == 0, proc.stderr
    ssh = _commands(proc.stdout)[0]
    assert "--worker=all" in ssh
    command = ssh[ssh.index("--command") + 1]
    remote = shlex.split(command)
    i = remote.index("train-multihost")
    assert remote[i - 2 : i] == ["-m", "paragan_jax"]  # the internal command of the registry
    assert remote[i + 1 : i + 5] == ["--config", "biggan128_tpu", "--workdir", "gs://bucket/run 1"]
    assert "nohup" in remote and "< /dev/null &" in command  # detached: ssh may drop
    assert "> ~/paragan_stack/logs/train-$(hostname).log 2>&1" in command
    assert "echo $! > ~/paragan_stack/logs/train.pid" in command


def test_logs_status_and_stop_reach_the_run_on_the_workers():
    logs = _commands(_dry("tpu_logs.sh", "--name", "gan").stdout)[0]
    assert "--worker=0" in logs
    assert "tail -n 50 ~/paragan_stack/logs/train-$(hostname).log" in logs[-1]
    follow = _commands(_dry("tpu_logs.sh", "--worker", "3", "--follow", "--lines", "5").stdout)
    assert "--worker=3" in follow[0] and "tail -n 5 -F" in follow[0][-1]
    assert _dry("tpu_logs.sh", "--worker", "all", "--follow").returncode == 2
    status = _commands(_dry("tpu_status.sh", "--accelerator", "v3-32").stdout)[0]
    assert "--worker=all" in status and "kill -0" in status[-1] and "train.pid" in status[-1]
    stop = _commands(_dry("tpu_stop.sh").stdout)[0]
    assert "--worker=all" in stop and "kill -TERM" in stop[-1]


def test_bad_arguments_are_errors():
    bad = _dry("tpu_create.sh", "--accelerator", "v9-8")
    assert bad.returncode != 0 and "unknown accelerator" in bad.stderr
    bad = _dry("tpu_create.sh", "--name", "Bad_Name")
    assert bad.returncode == 2 and "invalid --name" in bad.stderr
    bad = _dry("tpu_delete.sh", "--frobnicate")
    assert bad.returncode == 2 and "unknown option" in bad.stderr
    bad = _dry("tpu_status.sh", "--worker", "first")
    assert bad.returncode == 2 and "invalid --worker" in bad.stderr
