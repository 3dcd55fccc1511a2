#!/bin/bash
# The batch script of a Slurm allocation of pytest-sky's (pytest_sky/backends/slurm.py),
# after the lines the backend puts first ("node=" the text of slurm_node.sh, "dir=" the
# cluster's directory on each node, "shared=" and "hold=" the site's shared directory the
# cluster holds, and how long it waits for it).  It runs on the allocation's first node and keeps the
# allocation alive: one step, a task on every node, each serving that node's sshd
# (slurm_node.sh serve).  When the allocation is cancelled, Slurm stops that step and this
# script, and with them the allocation.
# shellcheck disable=SC2154  # node, dir, shared and hold are the backend's first lines
exec srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --quiet \
  bash -c "$node" slurm-node serve "$dir" "$shared" "$hold"
