#!/bin/bash
# A node of a Slurm cluster of pytest-sky's (pytest_sky/backends/slurm.py), as one task of a
# job step: bash -c SCRIPT slurm-node serve DIR [SHARED HOLD], or ... deliver DIR DIGEST, where
# DIR is the cluster's directory on each node (node-local scratch, the same path on every
# node), SHARED the site's shared directory the cluster asked for (--slurm-shared-dir), if it
# did, and DIGEST the sha256 of the node's files.
#
#   serve    the step the allocation's batch script starts on every node, for its whole life:
#            waits for the node's files (a tar the client sends through "deliver": nothing of
#            them, the keys included, is in the batch script Slurm keeps), keeps its own host
#            key, starts pytest-sky's sshd on a free port, waits for its banner, says where
#            it listens ("node ID NAME PORT"), and on SIGTERM (a cancelled allocation) stops
#            it and removes DIR.  With SHARED, node 0 first holds it for this allocation
#            (waiting up to HOLD seconds for another allocation to let go, or for squeue to no
#            longer list the one whose hold a killed launch left) and empties it; it empties
#            and lets go of it on SIGTERM
#   deliver  a short step the login node runs once the allocation runs: its stdin (the tar)
#            into DIR, checked against DIGEST, then what "serve" said, on its stdout
#
# The two meet at two FIFOs in DIR, each made by whichever step comes first: "in" says
# whether the files arrived whole, "out" carries the answer.  (Not the tar itself through a
# FIFO: tar may stop reading at the archive's end marks, before the padding after them, and
# the writer then dies of SIGPIPE.)  A session's HOME is DIR/home (the user's own home, which a site
# often shares between nodes, is never written); its PATH is the step's, after DIR/bin,
# whose ssh reads DIR/home/.ssh/config (OpenSSH reads ~/.ssh from the account's home, not
# $HOME).  sshd listens on every address (the login node and the other nodes dial NodeAddr).
mode=${1:?} d=${2:?}
mkdir -m 700 "$d" 2>/dev/null || [ -d "$d" ] || exit 1
for f in in out; do
  [ -p "$d/$f" ] || mkfifo -m 600 "$d/$f" 2>/dev/null || [ -p "$d/$f" ] || exit 1
done

if [ "$mode" = deliver ]; then
  arrived=short
  if cat >"$d/files.tar" && [ "$(sha256sum <"$d/files.tar")" = "${3:?}  -" ]; then arrived=whole; fi
  echo "$arrived" >"$d/in"
  IFS= read -r said <"$d/out"
  echo "$said"
  case $said in node\ *) exit 0 ;; *) exit 1 ;; esac
fi

shared=${3:-} hold=${4:-0}
report() { printf '%s\n' "$1" >"$d/out"; }
fail() { report "error $SLURMD_NODENAME: $1"; rm -rf "$d"; exit 1; }
holder=$shared/.pytest-sky-holder
take_shared() {  # a hold is a directory made at once (atomic on NFS too) naming its job
  for _ in $(seq "$((hold * 10))"); do
    if mkdir "$holder" 2>/dev/null; then
      echo "$SLURM_JOB_ID" >"$holder/job"
      find "$shared" -mindepth 1 -maxdepth 1 ! -name .pytest-sky-holder -exec rm -rf {} +
      return 0
    fi
    other=$(cat "$holder/job" 2>/dev/null)
    if [ -n "$other" ] && [ -z "$(squeue -h -j "$other" -o %T 2>/dev/null </dev/null)" ]; then
      rm -rf "$holder"  # its allocation is gone: a killed launch's
    else
      sleep 0.1
    fi
  done
  return 1
}
let_go() {
  [ "$(cat "$holder/job" 2>/dev/null)" = "$SLURM_JOB_ID" ] || return 0
  find "$shared" -mindepth 1 -maxdepth 1 ! -name .pytest-sky-holder -exec rm -rf {} +
  rm -rf "$holder"
}
pid=''
# Going: the allocation's other processes get the same SIGTERM (every session and rank is
# below this step's sshd), and one still writing in DIR (a job's agent recording its end)
# can make one removal miss what it writes meanwhile: removed until gone, for up to 5 s.
leave() {
  [ -z "$pid" ] || { kill "$pid" 2>/dev/null; wait "$pid"; }
  for _ in $(seq 50); do rm -rf "$d" 2>/dev/null; [ -e "$d" ] || break; sleep 0.1; done
  [ -z "$shared" ] || let_go
  exit 0
}
trap leave TERM INT HUP
IFS= read -r arrived <"$d/in"
[ "$arrived" = whole ] || fail "its files arrived cut short"
tar xf "$d/files.tar" -C "$d" 2>/dev/null || fail "its files did not unpack"
rm -f "$d/files.tar"
[ -z "$shared" ] || [ "${SLURM_NODEID:?}" != 0 ] || take_shared ||
  fail "the shared directory $shared stayed held by Slurm job $(cat "$holder/job" 2>/dev/null) for $hold s"
id=${SLURM_NODEID:?}
if ! mv "$d/host_keys/$id" "$d/host_key"; then fail "no host key $id"; fi
rm -rf "$d/host_keys"
mkdir -p "$d/bin"
real=$(command -v ssh) || fail "no ssh client on PATH"
printf '#!/bin/sh\nexec %s -F %s "$@"\n' "$real" "$d/home/.ssh/config" >"$d/bin/ssh" && chmod 755 "$d/bin/ssh"
# Every session starts in its HOME, as on every other backend (sshd would start it in the
# account's home, which it is not: \`ssh worker 'cat > f'\` would write there), then runs
# what the client asked in the account's shell, as sshd would.
# shellcheck disable=SC2016  # expanded by the session
printf '#!/bin/sh\ncd "$HOME" || exit 1\n[ -z "${SSH_ORIGINAL_COMMAND+set}" ] || exec "$SHELL" -c "$SSH_ORIGINAL_COMMAND"\nexec "$SHELL" -l\n' \
  >"$d/bin/enter" && chmod 755 "$d/bin/enter"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])') ||
  fail "no python3 on PATH"
# What every session gets: its home, the PATH, the PYTHONPATH that names the home's
# sitecustomize (every Python process armed to say where it waits, the ranks srun starts
# from a session too), the allocation's own Slurm variables (so srun in an ssh session acts
# on this allocation; not SLURM_JOBID: slurm_step.sh says why) and its GPUs on this node (a
# rank that comes over ssh sees what a step would).  sshd takes the first Port and SetEnv it
# reads.
env="\"HOME=$d/home\" \"PATH=$d/bin:$PATH\" \"PYTHONPATH=$d/home/.sky/python\""
for v in SLURM_JOB_ID SLURM_CLUSTER_NAME SLURM_CONF SLURM_JOB_PARTITION SLURM_JOB_ACCOUNT CUDA_VISIBLE_DEVICES; do
  [ -z "${!v:-}" ] || env="$env \"$v=${!v}\""
done
{ echo "Port $port"; echo "SetEnv $env"; echo "ForceCommand $d/bin/enter"; cat "$d/sshd_config"; } >"$d/sshd.conf"
sshd=$(command -v sshd || echo /usr/sbin/sshd)
"$sshd" -D -e -f "$d/sshd.conf" 2>>"$d/sshd.log" &
pid=$!
up=
for _ in $(seq 600); do
  kill -0 "$pid" 2>/dev/null || break
  line=$(exec 3<>"/dev/tcp/127.0.0.1/$port" && IFS= read -r -t 5 l <&3 && echo "$l") 2>/dev/null
  case $line in SSH-*) up=1; break ;; esac
  sleep 0.05
done
[ -n "$up" ] || { kill "$pid" 2>/dev/null; fail "sshd did not answer: $(tail -n 1 "$d/sshd.log" 2>/dev/null)"; }
report "node $id $SLURMD_NODENAME $port"
wait "$pid"
leave
