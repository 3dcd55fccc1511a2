#!/bin/bash
# What runs on each node of the Slurm testbed (slurm_testbed/testbed.py), as root, chosen by
# TB_STEP; each step is the run section of a pytest-sky task on the testbed's local cluster,
# whose rank 0 is the controller and login node and whose other ranks are compute nodes.
#
#   prepare     write the Slurm and munge files, the ordinary user, the fake GPUs, and open
#               the shared directory (if any) to every user
#   munged      munge's daemon, in the foreground (a detached job on every node)
#   slurmctld   the controller, in the foreground (a detached job on rank 0)
#   slurmd      a compute node's daemon, in the foreground (a detached job; rank 0 has none)
#   munge-ready wait until munge answers on this node
#   idle        on rank 0: wait until sinfo lists TB_NODES nodes, every one idle
#
# The daemons log to their job's output; the files they keep are the node's own (its root is
# a copy-on-write layer over this machine's: nothing of the host's /etc or /var changes).
set -euo pipefail
rank=${SKYPILOT_NODE_RANK:?}

prepare() {
  mkdir -p /etc/slurm "$(dirname "$TB_MUNGE_KEY_PATH")"
  printf '%s' "$TB_SLURM_CONF" >/etc/slurm/slurm.conf
  printf '%s' "$TB_CGROUP_CONF" >/etc/slurm/cgroup.conf
  printf '%s' "$TB_GRES_CONF" >/etc/slurm/gres.conf
  (umask 077 && printf '%s' "$TB_MUNGE_KEY" | base64 -d >"$TB_MUNGE_KEY_PATH")
  chown munge:munge "$TB_MUNGE_KEY_PATH"
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
  # The ordinary user: the same uid on every node (Slurm runs a job's steps by uid), a home of
  # its own on each (no node shares a filesystem with another), the testbed's key on each.
  grep -q "^$TB_USER:" /etc/passwd || printf '%s:x:%s:%s::/home/%s:/bin/bash\n' "$TB_USER" "$TB_UID" "$TB_UID" "$TB_USER" >>/etc/passwd
  grep -q "^$TB_USER:" /etc/group || printf '%s:x:%s:\n' "$TB_USER" "$TB_UID" >>/etc/group
  mkdir -p "/home/$TB_USER/.ssh"
  cp ~/.ssh/authorized_keys "/home/$TB_USER/.ssh/authorized_keys"
  chown -R "$TB_USER:$TB_USER" "/home/$TB_USER"
  chmod 700 "/home/$TB_USER/.ssh"
  # The site's shared directory (one directory of the testbed's, on every node), writable by
  # every user as a scratch filesystem is.
  [ -z "$TB_SHARED_DIR" ] || chmod 1777 "$TB_SHARED_DIR"
  if [ "$rank" = 0 ]; then
    mkdir -p /var/spool/slurmctld && chown slurm:slurm /var/spool/slurmctld
  else
    mkdir -p /var/spool/slurmd
    for link in $TB_GPU_LINKS; do ln -sfn "${link#*=}" "${link%%=*}"; done
  fi
}

case "${TB_STEP:?}" in
  prepare) prepare ;;
  munged) exec setpriv --reuid=munge --regid=munge --init-groups munged --foreground \
    --key-file="$TB_MUNGE_KEY_PATH" --log-file=/dev/stderr ;;
  slurmctld) exec slurmctld -D -c ;;
  slurmd) [ "$rank" = 0 ] || exec slurmd -D ;;
  munge-ready) until munge -n </dev/null >/dev/null 2>&1; do sleep 0.05; done ;;
  idle)
    # Every node registered and idle: what a user's first sbatch needs.
    until states=$(sinfo -h -N -o '%T' 2>/dev/null) && [ "$(grep -c '^idle$' <<<"$states")" -ge "$TB_NODES" ]; do
      sleep 0.1
    done
    sinfo ;;
  *) echo "node.sh: unknown step $TB_STEP" >&2; exit 2 ;;
esac
