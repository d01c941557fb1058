"""Cloud TPU launch scripts: --dry-run prints every command; bad input (slice arithmetic:
tapas_jax.hardware.tpu_slice, tested in tests/tapas/test_collectives.py)."""

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


def test_install_ships_the_tree_to_every_worker():
    proc = _dry("tpu_install.sh", "--name", "gan", "--accelerator", "v3-32")
    assert proc.returncode == 0, proc.stderr
    cmds = _commands(proc.stdout)
    assert cmds[0][:3] == ["git", "-C", str(ROOT)] and "archive" in cmds[0]
    assert cmds[1][3:5] == ["tpu-vm", "scp"] and "--worker=all" in cmds[1]
    ssh = cmds[2]
    assert ssh[3:5] == ["tpu-vm", "ssh"] and "--worker=all" in ssh
    remote = ssh[ssh.index("--command") + 1]
    assert "pip install -q -e . 'jax[tpu]'" in remote


def test_run_starts_training_on_all_workers_with_distributed_init():
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
    remote = shlex.split(ssh[ssh.index("--command") + 1])
    i = remote.index("train-multihost")
    assert remote[i - 2 : i] == ["-m", "paragan_jax"]  # the internal command of the registry
    assert remote[i + 1 : i + 5] == ["--config", "biggan128_tpu", "--workdir", "gs://bucket/run 1"]


def test_bad_arguments_are_errors():
    bad = _dry("tpu_create.sh", "--accelerator", "v9-8")
    assert bad.returncode != 0 and "unknown accelerator" in bad.stderr
    bad = _dry("tpu_create.sh", "--name", "Bad_Name")
    assert bad.returncode == 2 and "invalid --name" in bad.stderr
    bad = _dry("tpu_delete.sh", "--frobnicate")
    assert bad.returncode == 2 and "unknown option" in bad.stderr
