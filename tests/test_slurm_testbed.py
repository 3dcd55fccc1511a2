"""The Slurm testbed is a real Slurm: jobs run on its nodes as the user who submitted them, its
fake GPUs are GRES a job is given, an impossible request is refused by Slurm itself, and
stopping it leaves nothing of it on this machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from slurm_helpers import REPO, running_testbed, skip_without_slurm, stop

pytestmark = pytest.mark.long(20)


def test_testbed_runs_steps_on_every_node_hands_out_fake_gpus_and_leaves_nothing(tmp_path, home):
    skip_without_slurm()
    with running_testbed(tmp_path, "--nodes", "2", "--gpus-per-node", "2", "--gpu-type", "t4") as tb:
        nodes = tb.ssh("sinfo -h -N -o '%N %T %G'")
        assert nodes.returncode == 0, nodes.stderr
        assert [line.split()[1:] for line in nodes.stdout.splitlines()] == [["idle", "gpu:t4:2"]] * 2

        steps = tb.ssh("srun -N2 --gres=gpu:t4:2 bash -c 'echo $SLURM_NODEID $CUDA_VISIBLE_DEVICES'")
        assert steps.returncode == 0, steps.stderr
        assert sorted(steps.stdout.split("\n")[:-1]) == ["0 0,1", "1 0,1"]

        # Jobs run as the user who submitted them, with a home of their own on each node.
        from slurm_testbed.config import ORDINARY_USER

        who = tb.ssh("srun -N2 bash -c 'echo $(id -un) $HOME'", user=ORDINARY_USER)
        assert who.returncode == 0, who.stderr
        assert who.stdout.splitlines() == [f"{ORDINARY_USER} /home/{ORDINARY_USER}"] * 2

        refused = tb.ssh("srun -N1 --gres=gpu:t4:3 true")
        assert refused.returncode != 0
        assert "Requested node configuration is not available" in refused.stderr

        said = stop(tb.process)
        assert tb.process.returncode == 0, said
    assert not tb.config.exists()
    assert not list((home / "slurm-testbed" / "clusters").iterdir())  # its nodes are gone, with every daemon


def test_a_testbed_that_cannot_start_says_why_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "slurm_testbed", "--slurm-config", str(tmp_path / "c"), "--nodes", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == ["slurm testbed: --nodes must be between 1 and 64, got 0"]
    assert not (tmp_path / "c").exists()
