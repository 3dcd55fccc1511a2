#!/bin/bash
# What the Slurm backend (pytest_sky/backends/slurm.py) asks of a Slurm site's login node,
# reached over SSH (or this machine, where sbatch is on its PATH): bash -c SCRIPT slurm-login
# COMMAND ARGS...  Each command prints lines the backend reads, one fact a line:
#
#   check                         the commands it lacks ("missing sbatch ..."), then "user NAME"
#   submit BATCH NODE DIR WAIT DIGEST SBATCH-ARGS...
#                                 (BATCH and NODE in base64: they span lines)
#                                 sbatch with the batch script BATCH; "job ID", then "state
#                                 STATE REASON" at each change until the job runs ("state
#                                 RUNNING"), ends, or WAIT seconds pass; once it runs, the
#                                 files on stdin to every node's step (NODE, slurm_node.sh,
#                                 run as "deliver DIR DIGEST"), each node's "node ID NAME PORT",
#                                 "nodelist LIST", "addr NAME NODEADDR" for each, "ready"
#   put JOB NODES DIR             a tar on stdin, unpacked in DIR on each of the job's nodes
#   gres PARTITION                the GRES each node of PARTITION ("" any) offers, one a line
#   list USER                     USER's jobs: "ID|NAME|STATE|COMMENT", one a line
#   show JOB                      scontrol's account of JOB
#   cancel JOB GRACE LIMIT        SIGTERM to the job, SIGKILL after GRACE seconds; returns
#                                 once squeue no longer lists it ("gone"), or says "left
#                                 STATE" when it still does LIMIT seconds after the SIGKILL
#
# A submit's stdin is the tar of the node step's files; srun hands it to every node's task.
set -uo pipefail
cmd=${1:?}
shift

states() { squeue -h -j "$1" -o '%T %r' 2>/dev/null </dev/null; }
gone() {  # whether squeue stops listing job $1 within $2 seconds
  i=0
  while [ -n "$(states "$1")" ]; do
    [ "$i" -lt "$(($2 * 10))" ] || return 1
    sleep 0.1
    i=$((i + 1))
  done
}

case "$cmd" in
  check)
    for c in sbatch srun squeue scancel scontrol sinfo; do command -v "$c" >/dev/null || echo "missing $c"; done
    echo "user $(id -un)" ;;
  submit)
    batch=$(printf %s "$1" | base64 -d) node=$(printf %s "$2" | base64 -d) dir=$3 wait=$4 digest=$5
    shift 5
    out=$(printf '%s' "$batch" | sbatch --parsable "$@" 2>&1) || { echo "refused ${out//$'\n'/ }"; exit 1; }
    job=${out%%;*}
    echo "job $job"
    last='' waited=0
    while :; do
      now=$(states "$job")
      [ "$now" = "$last" ] || { echo "state ${now:-GONE}"; last=$now; }
      case $now in RUNNING*) break ;; PENDING* | CONFIGURING* | '') ;; *) exit 1 ;; esac
      [ -n "$now" ] || exit 1
      [ "$waited" -lt "$((wait * 2))" ] || exit 1
      sleep 0.5
      waited=$((waited + 1))
    done
    nodes=$(squeue -h -j "$job" -o '%D' </dev/null)
    srun --jobid="$job" --overlap --nodes="$nodes" --ntasks-per-node=1 --quiet --kill-on-bad-exit=1 \
      bash -c "$node" slurm-node deliver "$dir" "$digest" || exit 1
    list=$(squeue -h -j "$job" -o '%N' </dev/null)
    echo "nodelist $list"
    names=$(scontrol show hostnames "$list" | paste -sd,)
    scontrol -o show node "$names" </dev/null | tr ' ' '\n' | awk -F= '$1=="NodeName"{n=$2} $1=="NodeAddr"{print "addr", n, $2}'
    echo ready ;;
  put)
    # shellcheck disable=SC2016  # expanded by the task's bash, from its own arguments
    srun --jobid="$1" --overlap --nodes="$2" --ntasks-per-node=1 --quiet --kill-on-bad-exit=1 \
      bash -c 'cd "$1" && umask 077 && tar xf -' slurm-put "$3" ;;
  gres)
    sinfo -h ${1:+-p "$1"} -N -o '%G' </dev/null | sort -u ;;
  list)
    squeue -h -u "$1" -o '%i|%j|%T|%k' </dev/null ;;
  show)
    scontrol show job "$1" </dev/null ;;
  cancel)
    job=$1
    scancel "$job" </dev/null 2>/dev/null
    gone "$job" "$2" && { echo gone; exit 0; }
    scancel --signal=KILL --full "$job" </dev/null 2>/dev/null
    gone "$job" "$3" && { echo gone; exit 0; }
    echo "left $(states "$job")" ;;
  *) echo "slurm-login: unknown command $cmd" >&2; exit 2 ;;
esac
