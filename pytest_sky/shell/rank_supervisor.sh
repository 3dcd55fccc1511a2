#!/bin/bash
# One rank on one node: bash -c "$(cat rank_supervisor.sh)" psky-rank [MARK [CGROUP [OWN]]],
# run by the agent on the head (pytest_sky/agent/rank.py) locally for rank 0, and for the
# others by their node's agent server (pytest_sky/agent/server.py, which passes MARK) or over
# head-to-worker SSH.  CGROUP is the job's cgroup when the caller made it ("-": there is none
# to make), OWN says that this script removes it; without CGROUP the script makes one.
# A Python supervisor cost ~30 ms of interpreter start per node per run, this costs ~3.
#
# PROGRAM, the rank's whole program, is never an argument (every user of the machine reads
# every command line, and it holds the task's secrets): it comes in the environment
# (PSKY_PROGRAM), or, over SSH, which passes no variable of ours, first on stdin up to a NUL
# byte (a program cannot hold one).  PROGRAM's bash takes it from its environment, removed
# before it runs, so ps shows the task's own commands, as on a SkyPilot cluster.
#
# PROGRAM runs in a process group of its own, which prints its pid before anything else,
# even when told to stop at once (a SIGTERM before that line is held until it is out, then
# honoured); the supervisor waits and exits with PROGRAM's status.
#
# The job owns every process it starts, on every node, whatever sessions they make and
# whoever their parent is.  The kernel keeps that account: PROGRAM enters a cgroup of its
# own (a child of the node's, where cgroup2 is mounted writable, as on local nodes) before
# it runs.  Where cgroups are read-only (a Kubernetes pod), every process is told apart by a
# token in its environment, inherited across setsid, daemonising and reparenting alike.
#
# stdin is the lifeline: when the head closes it (the run failed elsewhere, timed out, was
# cancelled, or the client went away) every process of the job gets SIGTERM, a grace to
# stop its own children (torchrun stops its workers), then SIGKILL: cgroup.kill, one write.
# The lifeline's reader does that itself, so it happens however early the head lets go
# (even before the supervisor waits); it tells the supervisor first (USR1), which then
# leaves the stopping to it.  Whatever PROGRAM leaves running when it ends is killed at once.
#
# The names shared with Python (the pid line, the token's variable, the cgroup's name) are
# pytest_sky.shell's constants; tests/test_shell.py checks the spelling here.
[ -n "${PSKY_PROGRAM+set}" ] || { IFS= read -r -d '' PSKY_PROGRAM || exit 143; export PSKY_PROGRAM; }
exec 3<&0
# The supervisor says nothing of its own: what bash would print (job control's notices that
# a job is done) would reach a user's terminal through an exec'd run's channel, or an error
# line that ssh's stderr carries.  PROGRAM's stderr goes to a reader of its own, which
# writes each line to stdout behind the mark that tells the head it is stderr's
# (pytest_sky.shell.STDERR_MARK); its last line is out before the exit status is.
exec 2>/dev/null
exec 4> >(exec 3<&-; while IFS= read -r l || [ -n "$l" ]; do printf '\036PSKY-ERR %s\n' "$l"; done)
marker=$!
stop=
trap stop=1 USR1
cg=${2:-} own=${3:-} r=''
if [ "$cg" = - ]; then cg='' own=''
elif [ -z "$cg" ]; then  # nobody made it (Python makes it without a process of its own)
  while read -r _ m t _; do [ "$t" = cgroup2 ] && r=$m; done </proc/self/mounts
  [ -n "$r" ] && mkdir "$r/psky-job-$$" 2>/dev/null && cg=$r/psky-job-$$ own=1
fi
tag=psky-$$-$RANDOM$RANDOM
members() {  # the job's live processes, the script's own first (even before it has exec'd)
  m=
  if [ -d "$cg" ]; then IFS= read -r -d '' m <"$cg/cgroup.procs"
  else
    for d in /proc/[0-9]*; do
      while IFS= read -r -d '' kv; do
        [ "$kv" = "PSKY_JOB_SCOPE=$tag" ] && { m="$m ${d#/proc/}"; break; }
      done 2>/dev/null <"$d/environ"
    done
  fi
  case " $m " in *" $pid "*) ;; *) ! kill -0 "$pid" 2>/dev/null || m="$pid $m" ;; esac
}
signal() {  # each process once (a second SIGTERM would cut its handler short)
  [ "$1" = KILL ] && [ -d "$cg" ] && echo 1 >"$cg/cgroup.kill" && return
  members
  # shellcheck disable=SC2086  # $m is a list of pids, one word each
  [ -z "$m" ] || kill -"$1" $m
  [ "$1" != KILL ] || kill -KILL -- -"$pid"
}
settle() {  # wait up to $1 ticks for the job to be gone; with $2, send it again each tick: a
  # process forked or exec'd while a scan of /proc read past it is caught by the next scan
  i=0
  while members; [ -n "$m" ] && [ $i -lt "$1" ]; do
    # shellcheck disable=SC2086  # $m is a list of pids, one word each
    [ -z "$2" ] || kill -"$2" $m
    sleep 0.05; i=$((i+1))
  done
}
started() {  # PROGRAM's group is past its pid line, or gone.  Until it exec'd PROGRAM's bash
  # its arguments hold this shell's $0 (it is still our fork), and a TERM could end it before
  # the trap that holds TERM is set: no pid line, no exit status.  (Arguments that cannot be
  # read yet count as not yet.)
  i=0
  while [ $i -lt 200 ] && kill -0 "$pid" 2>/dev/null; do
    a='' n=0
    while IFS= read -r -d '' a && [ "$a" != "$0" ]; do n=$((n + 1)); done <"/proc/$pid/cmdline" 2>/dev/null
    [ "$a" = "$0" ] || [ "$n" -eq 0 ] || return 0
    sleep 0.01; i=$((i+1))
  done
}
# The rank's process group: a fork of this shell, made with job control on (which gives a
# background job a group of its own, led by it, before this shell goes on; no setsid
# process: its exec cost each rank ~5% of a run's CPU), joins the job's cgroup and says its
# pid, then becomes PROGRAM, with the job's token in its environment.
set -m
(
  trap t=1 TERM
  exec 3<&- 4>&- </dev/null
  [ -z "$cg" ] || { echo "$BASHPID" >"$cg/cgroup.procs" || rmdir "$cg"; } 2>/dev/null
  echo "PSKY-PID $BASHPID"; trap - TERM; [ -z "$t" ] || exit 143
  # shellcheck disable=SC2016  # PROGRAM's bash expands the variable, not this one
  PSKY_JOB_SCOPE=$tag exec /bin/bash -c 'eval "unset PSKY_PROGRAM; $PSKY_PROGRAM"'
) 2>&4 &
pid=$!
unset PSKY_PROGRAM
set +m
exec 4>&-
[ -z "$cg" ] || echo "$pid" 2>/dev/null >"$cg/cgroup.procs"  # in before the lifeline can act
{ while read -r _; do :; done; kill -USR1 $$; started; signal TERM; settle 50; signal KILL; settle 100 KILL; } <&3 >/dev/null 2>&1 &
life=$!
exec 3<&-
{
wait "$pid"; code=$?
if [ -n "$stop" ]; then
  wait "$life"
  [ "$code" -le 128 ] || { wait "$pid"; code=$?; }
else
  signal KILL; settle 100 KILL; kill "$life"
fi
} >/dev/null 2>&1
wait "$marker"
# Started by a worker's agent server, which has no exit status to pass on: the output ends
# with the mark it was given, then the status (every process of the job is gone by now).
[ -z "$1" ] || printf '\n%s %s\n' "$1" "$((code & 255))"
# The empty cgroup goes last, after the mark: the head need not wait for it.
[ -z "$own" ] || rmdir "$cg" 2>/dev/null
exit "$code"
