#!/bin/bash
# Run as a task on every node between two tests that share a cluster, after every job was
# cancelled (pytest_sky/cluster.py, reset_for_next_test): what is left of an earlier job is
# killed, then whatever still lives is printed ("left: ...") and the check exits 1.
#
# "Of a job" is the account the rank supervisor keeps (rank_supervisor.sh): a process
# carrying a job's PSKY_JOB_SCOPE token, a process in a psky-job-* cgroup, a rank
# supervisor (psky-rank) or an agent process (agent.pyz).  The check's own stay: its token,
# its cgroup, its ancestors, and the children of the two ancestors that run it, its rank
# supervisor (the reader of its lifeline is a fork of it) and the agent of this run (a
# rank it is starting is a fork of it until it execs, with the agent's arguments; on the
# head, where the node's server runs the rank, that agent is no ancestor: PSKY_RUN_AGENT
# names it).  sshd,
# the node's agent server and the head's SSH masters to the workers are the cluster's own
# and stay; the server's forks for other runs do not.
#
# On a Slurm allocation (SLURM_JOB_ID set: the check is one of its job steps) the node is the
# site's, shared with other jobs, the user's other clusters among them: only a process that
# carries this allocation's SLURM_JOB_ID is of this cluster (every rank is a step of it, and
# every ssh session into it gets it), and no cgroup is ours (ranks make none there).
#
# The names shared with Python are pytest_sky.shell's constants; tests/test_shell.py checks
# the spelling here.
me=$PSKY_JOB_SCOPE own=$(sed -n 's/^0:://p' /proc/self/cgroup) r='' job=${SLURM_JOB_ID:-}
[ -n "$job" ] || while read -r _ m t _; do [ "$t" = cgroup2 ] && r=$m; done </proc/self/mounts
server=''
[ ! -r ~/.sky/agent.pid ] || read -r server <~/.sky/agent.pid
mine=" $server " kin=" " sup='' run='' p=$$
while [ -n "$p" ] && [ "$p" != 0 ]; do
  mine="$mine$p "
  while IFS= read -r -d '' a; do
    case $a in
      psky-rank) [ -n "$sup" ] || { sup=$p; kin="$kin$p "; }; break ;;
      *agent.pyz) [ -n "$run" ] || { run=$p; [ "$p" = "$server" ] || kin="$kin$p "; }; break ;;
    esac
  done 2>/dev/null <"/proc/$p/cmdline"
  p=$(sed -n 's/^PPid:\s*//p' "/proc/$p/status" 2>/dev/null)
done
[ -z "${PSKY_RUN_AGENT:-}" ] || mine="$mine$PSKY_RUN_AGENT " kin="$kin$PSKY_RUN_AGENT "
leftovers() {
  pids='' groups=''
  for d in /proc/[0-9]*; do
    p=${d#/proc/}; case "$mine" in *" $p "*) continue ;; esac
    hit='' ours=${job:+no}
    while IFS= read -r -d '' kv; do
      case $kv in
        PSKY_JOB_SCOPE=*) [ "$kv" = "PSKY_JOB_SCOPE=$me" ] || hit=1; [ -n "$ours" ] || break ;;
        SLURM_JOB_ID=*) [ "$kv" != "SLURM_JOB_ID=$job" ] || ours='' ;;
      esac
    done 2>/dev/null <"$d/environ"
    [ -z "$ours" ] || continue  # another allocation's, on a shared Slurm node
    while IFS= read -r -d '' a; do
      case $a in psky-rank | *agent.pyz) hit=1; break ;; esac
    done 2>/dev/null <"$d/cmdline"
    if [ -n "$hit" ]; then
      pp=-; while read -r k v; do [ "$k" = PPid: ] && { pp=$v; break; }; done 2>/dev/null <"$d/status"
      case "$kin" in *" $pp "*) hit= ;; esac
    fi
    [ -z "$hit" ] || pids="$pids $p"
  done
  [ -n "$r" ] || return 0
  for cg in "$r"/psky-job-*; do
    if [ ! -d "$cg" ] || [ "/${cg#"$r"/}" = "$own" ]; then continue; fi
    if grep -q 'populated 1' "$cg/cgroup.events" 2>/dev/null; then groups="$groups $cg"
    else rmdir "$cg" 2>/dev/null; fi
  done
}
leftovers
[ -n "$pids$groups" ] || exit 0
for cg in $groups; do echo 1 >"$cg/cgroup.kill"; done 2>/dev/null
# shellcheck disable=SC2086  # $pids is a list of pids, one word each
[ -z "$pids" ] || kill -KILL $pids 2>/dev/null
i=0; while leftovers; [ -n "$pids$groups" ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done
[ -n "$pids$groups" ] || exit 0
for p in $pids; do echo "left: pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)"; done
for cg in $groups; do echo "left: cgroup ${cg#"$r"/} still holds processes"; done
exit 1
