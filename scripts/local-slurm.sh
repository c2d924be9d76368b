#!/usr/bin/env bash
# scripts/local-slurm.sh -- a throw-away, single-host Slurm 22.05 cluster for gpujobs tests.
#
# Debian 12, run as root, no systemd needed.
#
#   local-slurm.sh up     [DIR]  install packages if missing, write configs, start munged, mariadbd,
#                                slurmdbd, slurmctld and one slurmd per fake node; wait until every
#                                node is usable and sacct answers; print "export SLURM_CONF=..."
#   local-slurm.sh down   [DIR]  cancel all jobs, stop the daemons (by PID file, plus strays of DIR)
#   local-slurm.sh status [DIR]  report; exit 0 only when all daemons run, nodes are usable and
#                                sacct answers
#   local-slurm.sh env    [DIR]  print "export SLURM_CONF=DIR/etc/slurm.conf"
#   local-slurm.sh reset  [DIR]  down, delete DIR, drop DIR's /etc/hosts line
#
# Only the "export SLURM_CONF=..." line goes to stdout (up/env); progress goes to stderr, so
#   eval "$(scripts/local-slurm.sh up)"
# works. Everything lives under DIR (default /tmp/gpujobs-slurm, or $GPUJOBS_SLURM_DIR): configs,
# controller state, spool, logs, PID files, the MariaDB datadir, the munge key and socket, and the
# fake GPU device links. Outside DIR the script touches only: apt packages, one marked line in
# /etc/hosts (node names -> 127.0.0.1), with GPUJOBS_SLURM_OCI=1 the cgroup v1 mounts crun needs on a
# hybrid host (scripts/crun-cgroups.sh; left mounted) and, only if GPUJOBS_SLURM_LINK_ETC=1, the symlink
# /etc/slurm/slurm.conf (removed again by down/reset). By default no /etc/slurm/slurm.conf is made:
# clients find the cluster through SLURM_CONF only, so nothing points at a cluster that is down.
#
# Safe on a shared machine: the cluster is root's, and no other local user gets anything from it.
#   - DIR is made by this script with mkdir -m 700 (never wider, not even for a moment) and is
#     used only if it is a real directory of ours, mode 0700, with our marker inside; a DIR
#     someone else made (other owner, a symlink, writable by others, not empty and no marker,
#     below a directory others may rename entries of) is refused before anything starts. DIR's
#     parent is resolved once, so no symlink can redirect DIR later.
#   - the munge key is generated here (1 KiB from /dev/urandom, 0400) and reused only if the
#     marker says this script wrote it; a key it did not write is never used.
#   - MariaDB: root@localhost authenticates by unix socket only (peer uid 0; no password works,
#     and none over TCP), its socket is inside DIR; slurmdbd logs in as `slurm`@`127.0.0.1` with a
#     random password (DIR/etc/mariadb-slurm.pass and slurmdbd.conf, both 0600, never in argv),
#     which has rights on slurm_acct_db only (no FILE); secure-file-priv confines INTO OUTFILE and
#     LOAD DATA to DIR/mysql-files. mariadbd runs as root like the other daemons: the mysql user
#     could not enter DIR (0700).
#   - everything is created under umask 077; Slurm clients (sbatch, sacct...) therefore work for
#     root only. A DIR made by an earlier version of this script (world-readable, MariaDB root
#     without password) is stopped and re-created by `up` (its jobs and accounting are lost).
#
# Cluster layout (defaults):
#   nodes       node1, node2 on this host (one slurmd -N nodeX each, own port), each with
#               CPUs=4 (may exceed the real cores: SlurmdParameters=config_overrides),
#               RealMemory=8000 MB, DefMemPerCPU=RealMemory/CPUs, Gres=gpu:2 (fake GPUs: symlinks
#               DIR/dev/gpuN -> /dev/null, so --gpus-per-node is really scheduled and Slurm sets
#               CUDA_VISIBLE_DEVICES)
#   partitions  debug  (Default, PriorityTier=1, GraceTime=30, MaxTime=INFINITE)
#               urgent (PriorityTier=10; its jobs preempt jobs of debug and short: the victims get
#                       their --signal at once (preempt_send_user_signal), and are requeued
#                       GraceTime s later (seen: 36-40 s, Slurm checks about every 10 s);
#                       a requeued job may start again ~cred_expire+1 s after that)
#               short  (PriorityTier=1, GraceTime=30, MaxTime=00:10:00, MaxNodes=1)
#   accounting  slurmdbd + a private MariaDB on 127.0.0.1 (sacct works), JobRequeue=1, MinJobAge=300
#   containers  with GPUJOBS_SLURM_OCI=1: Slurm's OCI support (`srun --container=BUNDLE`), crun as its
#               runtime: DIR/etc/oci.conf beside slurm.conf (RunTimeRun, and RunTimeQuery/Kill/Delete, which
#               22.05 requires with it; crun's state in DIR/run/crun) and DIR/etc/oci-run, the RunTimeRun
#               command: 22.05 writes the step's argv and environment into the bundle's config.json but
#               not the variables of each task (SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID), which it adds
#               before it execs crun (22.05 runs one task per node in a container step: the rank is the
#               node's index in the step). slurmstepd reads oci.conf at each step: no restart needed
#   speed       fast scheduler passes, KillWait=10, cred_expire=10 (a requeued job may restart
#               after ~11 s instead of ~121 s), random FirstJobId per cluster instance
#
# Knobs (environment, read by every `up`: they are not remembered, and an `up` with other values
# rewrites the configs and restarts the daemons concerned; the defaults are in brackets):
#   GPUJOBS_SLURM_DIR [/tmp/gpujobs-slurm]   the positional DIR argument wins over it
#   GPUJOBS_SLURM_NODES [2]                  number of fake nodes node1..nodeN
#   GPUJOBS_SLURM_CPUS_PER_NODE [4]
#   GPUJOBS_SLURM_MEM_PER_NODE_MB [8000]
#   GPUJOBS_SLURM_GPUS_PER_NODE [2]          0: no GRES at all
#   GPUJOBS_SLURM_GRACE_TIME [30]            seconds between preemption signal and requeue
#   GPUJOBS_SLURM_CRED_EXPIRE [10]           Slurm default 120, minimum 5
#   GPUJOBS_SLURM_KILL_WAIT [10]             SIGTERM -> SIGKILL delay (Slurm default 30)
#   GPUJOBS_SLURM_MIN_JOB_AGE [300]          seconds a finished job stays visible to squeue/scontrol
#   GPUJOBS_SLURM_SCHED_PARAMS [batch_sched_delay=0,sched_interval=1,sched_min_interval=0,bf_interval=1]
#                                            empty: Slurm defaults (jobs start ~3 s after sbatch)
#   GPUJOBS_SLURM_CLUSTER [gpujobs]          ClusterName (fixed for the life of a DIR)
#   GPUJOBS_SLURM_CTLD_PORT [6817]  GPUJOBS_SLURM_DBD_PORT [6819]  GPUJOBS_SLURM_MYSQL_PORT [6820]
#   GPUJOBS_SLURM_SLURMD_PORT_BASE [6830]    nodeI listens on BASE+I
#   GPUJOBS_SLURM_ENFORCE_PART_LIMITS [NO]   NO (Slurm's default): sbatch accepts jobs over a
#                                            partition's MaxTime/MaxNodes, they pend forever (reason
#                                            PartitionTimeLimit/PartitionNodeLimit); ALL: sbatch rejects them
#   GPUJOBS_SLURM_TIMEOUT [120]              seconds `up` waits for the cluster to become healthy
#   GPUJOBS_SLURM_LINK_ETC [0]               1: also point /etc/slurm/slurm.conf at DIR's config
#   GPUJOBS_SLURM_OCI [1 where crun exists]  1: Slurm's OCI support with crun (above); 0: no oci.conf
#
# Facts this relies on (see SLURM.md): Debian's slurmd accepts -N NODE for several slurmds on one
# host; AccountingStoragePass carries the munge socket for connections to slurmdbd; GRES files
# must stat() as devices; `kill -0` is true for zombies here (so /proc/PID/status is read);
# daemons keep inherited fds open (so fds > 2 are closed before they are spawned).
set -euo pipefail
# Nothing this script creates is for other users (the package install sets its own umask).
umask 077

usage() { echo "usage: $0 {up|down|status|env|reset} [DIR]" >&2; exit 2; }
if [ $# -lt 1 ] || [ $# -gt 2 ]; then usage; fi
CMD=$1
[ "$CMD" = env ] || [ "$(id -u)" -eq 0 ] || { echo "local-slurm: must run as root" >&2; exit 1; }
# DIR's parent is resolved once here (and `up` creates it first, root's, 0755): every path used
# below is free of symlinks, so no one can redirect DIR between the checks and the daemons' writes.
# DIR itself must not be a symlink (check_dir).
DIR=$(realpath -s -m -- "${2:-${GPUJOBS_SLURM_DIR:-/tmp/gpujobs-slurm}}")
[ "$DIR" != / ] || { echo "local-slurm: DIR must not be /" >&2; exit 2; }
if [ "$CMD" = up ]; then ( umask 022; mkdir -p -- "${DIR%/*}/" ); fi
if parent=$(realpath -e -- "${DIR%/*}/" 2>/dev/null); then DIR=${parent%/}/${DIR##*/}; fi

NODES=${GPUJOBS_SLURM_NODES:-2}
CPUS=${GPUJOBS_SLURM_CPUS_PER_NODE:-4}
MEM=${GPUJOBS_SLURM_MEM_PER_NODE_MB:-8000}
GPUS=${GPUJOBS_SLURM_GPUS_PER_NODE:-2}
GRACE_TIME=${GPUJOBS_SLURM_GRACE_TIME:-30}
CRED_EXPIRE=${GPUJOBS_SLURM_CRED_EXPIRE:-10}
KILL_WAIT=${GPUJOBS_SLURM_KILL_WAIT:-10}
MIN_JOB_AGE=${GPUJOBS_SLURM_MIN_JOB_AGE:-300}
SCHED_PARAMS=${GPUJOBS_SLURM_SCHED_PARAMS-batch_sched_delay=0,sched_interval=1,sched_min_interval=0,bf_interval=1}
CLUSTER=${GPUJOBS_SLURM_CLUSTER:-gpujobs}
CTLD_PORT=${GPUJOBS_SLURM_CTLD_PORT:-6817}
DBD_PORT=${GPUJOBS_SLURM_DBD_PORT:-6819}
MYSQL_PORT=${GPUJOBS_SLURM_MYSQL_PORT:-6820}
SLURMD_PORT_BASE=${GPUJOBS_SLURM_SLURMD_PORT_BASE:-6830}
TIMEOUT=${GPUJOBS_SLURM_TIMEOUT:-120}
ENFORCE_PART_LIMITS=${GPUJOBS_SLURM_ENFORCE_PART_LIMITS:-NO}
LINK_ETC=${GPUJOBS_SLURM_LINK_ETC:-0}
OCI=${GPUJOBS_SLURM_OCI:-$(command -v crun >/dev/null && echo 1 || echo 0)}

for v in NODES:NODES CPUS:CPUS_PER_NODE MEM:MEM_PER_NODE_MB GPUS:GPUS_PER_NODE GRACE_TIME:GRACE_TIME \
         CRED_EXPIRE:CRED_EXPIRE KILL_WAIT:KILL_WAIT MIN_JOB_AGE:MIN_JOB_AGE CTLD_PORT:CTLD_PORT \
         DBD_PORT:DBD_PORT MYSQL_PORT:MYSQL_PORT SLURMD_PORT_BASE:SLURMD_PORT_BASE TIMEOUT:TIMEOUT; do
  var=${v%%:*}
  [[ ${!var} =~ ^[0-9]+$ ]] ||
    { echo "local-slurm: GPUJOBS_SLURM_${v#*:} must be a non-negative integer, got '${!var}'" >&2; exit 2; }
done
if [ "$NODES" -lt 1 ] || [ "$CPUS" -lt 1 ] || [ "$MEM" -lt "$CPUS" ]; then
  echo "local-slurm: need GPUJOBS_SLURM_NODES >= 1, _CPUS_PER_NODE >= 1, _MEM_PER_NODE_MB >= _CPUS_PER_NODE" >&2; exit 2
fi
[ "$CRED_EXPIRE" -ge 5 ] || { echo "local-slurm: GPUJOBS_SLURM_CRED_EXPIRE must be >= 5" >&2; exit 2; }
case $OCI in 0|1) ;; *) echo "local-slurm: GPUJOBS_SLURM_OCI must be 0 or 1, got '$OCI'" >&2; exit 2 ;; esac
if [ "$OCI" = 1 ] && ! command -v crun >/dev/null; then
  echo "local-slurm: GPUJOBS_SLURM_OCI=1 needs crun (Debian package crun), which is not installed" >&2; exit 2
fi
case $ENFORCE_PART_LIMITS in NO|ANY|ALL) ;; *) echo "local-slurm: GPUJOBS_SLURM_ENFORCE_PART_LIMITS must be NO, ANY or ALL" >&2; exit 2 ;; esac

ETC=$DIR/etc RUN=$DIR/run LOG=$DIR/log
SCRIPTS=$(cd "$(dirname "$0")" && pwd -P)
CONF=$ETC/slurm.conf
MUNGE_SOCK=$RUN/munge.sock
MY_CNF=$ETC/my.cnf
MARKER=$DIR/.gpujobs-local-slurm
MARKER_FORMAT="gpujobs-local-slurm format=2"   # an older script's marker is empty
MUNGE_KEY=$DIR/munge/munge.key
DB_PASS_FILE=$ETC/mariadb-slurm.pass
HOSTS_TAG="# gpujobs-local-slurm $DIR"
HOST=$(hostname -s)
NODE_NAMES=()
for ((i = 1; i <= NODES; i++)); do NODE_NAMES+=("node$i"); done
NODE_CSV=$(IFS=,; echo "${NODE_NAMES[*]}")
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server mariadb-client)

# Our own clients must talk to this cluster only, whatever the caller's environment says. (No `< <(...)`
# on the way to a refusal: its subshell, which has DIR in its environment, may outlive the script's exit.)
for v in $(compgen -e); do
  case $v in SLURM_*|SBATCH_*|SALLOC_*|SRUN_*|SQUEUE_*|SINFO_*|SACCT_*|SCONTROL_*) unset "$v" ;; esac
done
export SLURM_CONF=$CONF

T0=${EPOCHREALTIME/./}
log() {
  local t=$(( (${EPOCHREALTIME/./} - T0) / 100000 ))
  printf '[local-slurm %3d.%ds] %s\n' $((t / 10)) $((t % 10)) "$*" >&2
}
die() { log "ERROR: $*"; exit 1; }

# ------------------------------------------------------------------------------------ processes

# running PID: the process exists and is not a zombie (kill -0 succeeds on zombies; init reaps late)
running() {
  local state
  state=$(awk '$1 == "State:" {print $2; exit}' "/proc/$1/status" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# ours PID COMM: PID runs COMM and belongs to this DIR's cluster (guards against recycled PIDs and
# against same-named daemons of other clusters). Slurm daemons carry SLURM_CONF=$CONF (environment)
# or "-f $CONF" (argv); munged and mariadbd name a file of DIR in argv.
ours() {
  local pid=$1 comm=$2 c=""
  { read -r c < "/proc/$pid/comm"; } 2>/dev/null || return 1
  [ "$c" = "$comm" ] && running "$pid" || return 1
  { tr '\0' '\n' < "/proc/$pid/cmdline"; tr '\0' '\n' < "/proc/$pid/environ" || true; } 2>/dev/null |
    grep -xF -e "$CONF" -e "SLURM_CONF=$CONF" -e "--socket=$MUNGE_SOCK" -e "--defaults-file=$MY_CNF" >/dev/null
}

# pidof_daemon PIDFILE COMM: print the PID if PIDFILE names a live process of ours
pidof_daemon() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(tr -dc 0-9 < "$1") || return 1
  [ -n "$pid" ] && ours "$pid" "$2" && echo "$pid"
}

# sole_pid PIDFILE COMM: print the PID named by PIDFILE if it is ours and no other COMM of this DIR
# runs. Leftovers of an earlier instance are not just killed next to a live daemon: munged and
# mariadbd delete their socket files on exit, which are the live daemon's sockets too.
sole_pid() {
  local pid other
  pid=$(pidof_daemon "$1" "$2") || return 1
  for other in $(strays "$2"); do [ "$other" = "$pid" ] || return 1; done
  echo "$pid"
}

# strays COMM: PIDs of COMM processes of this DIR, PID file or not (e.g. an earlier instance)
strays() {
  local p pid
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    ours "$pid" "$1" && echo "$pid"
  done
  return 0
}

# stop_strays COMM [KEEP_PID...]: stop COMM processes of this DIR, except KEEP_PIDs
stop_strays() {
  local comm=$1 pid keep pids=(); shift
  for pid in $(strays "$comm"); do
    for keep; do [ "$pid" = "$keep" ] && continue 2; done
    pids+=("$pid")
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  log "stopping stray $comm (pid ${pids[*]})"
  terminate "${pids[@]}"
}

# terminate PID...: SIGTERM, wait up to 30 s, then SIGKILL
terminate() {
  local pid left i
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for ((i = 0; i < 300; i++)); do
    left=()
    for pid; do running "$pid" && left+=("$pid"); done
    [ ${#left[@]} -eq 0 ] && return 0
    sleep 0.1
  done
  log "still running after 30 s, SIGKILL: ${left[*]}"
  kill -KILL "${left[@]}" 2>/dev/null || true
  sleep 0.3
}

# stop_daemon PIDFILE COMM: stop the daemon of PIDFILE and any stray COMM of this DIR
stop_daemon() {
  local pids
  mapfile -t pids < <({ pidof_daemon "$1" "$2" || true; strays "$2"; } | sort -u)
  if [ ${#pids[@]} -gt 0 ]; then
    log "stopping $2 (pid ${pids[*]})"
    terminate "${pids[@]}"
  fi
  rm -f "$1"
}

# Spawned daemons get only fds 0-2, pointing at /dev/null and a log file, in a session of their own.
# Without this they keep inherited descriptors open forever: the caller's pipes (Python's
# subprocess.run(capture_output=True) would then never see EOF) and our lock.
close_extra_fds() {
  local f
  for f in /proc/self/fd/*; do
    f=${f##*/}
    if [ "$f" -gt 2 ]; then eval "exec $f>&-" 2>/dev/null || true; fi
  done
}
# start_forking OUTFILE CMD...: for daemons that fork into the background themselves
start_forking() {
  local out=$1; shift
  ( close_extra_fds; exec setsid "$@" </dev/null >>"$out" 2>&1 )
}
# start_foreground OUTFILE CMD...: for daemons that stay in the foreground
start_foreground() {
  local out=$1; shift
  ( close_extra_fds; exec setsid "$@" </dev/null >>"$out" 2>&1 ) &
}

# port_free PORT: nothing accepts connections on 127.0.0.1:PORT
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
need_port() { port_free "$1" || die "port $1 ($2) is in use by something else (another cluster?); see the *_PORT knobs"; }

# check_ports: before starting anything, every port that a daemon we are about to start needs
# must be free (a busy one is most likely another cluster: fail without a half-started cluster)
check_ports() {
  local i=0 n
  pidof_daemon "$RUN/mysqld.pid" mariadbd >/dev/null || [ -n "$(strays mariadbd)" ] || need_port "$MYSQL_PORT" mariadbd
  pidof_daemon "$RUN/slurmdbd.pid" slurmdbd >/dev/null || [ -n "$(strays slurmdbd)" ] || need_port "$DBD_PORT" slurmdbd
  pidof_daemon "$RUN/slurmctld.pid" slurmctld >/dev/null || [ -n "$(strays slurmctld)" ] || need_port "$CTLD_PORT" slurmctld
  if [ -z "$(strays slurmd)" ]; then
    for n in "${NODE_NAMES[@]}"; do i=$((i + 1)); need_port $((SLURMD_PORT_BASE + i)) "slurmd $n"; done
  fi
  return 0
}

# wait_until SECONDS WHAT CMD...: poll CMD until it succeeds
wait_until() {
  local secs=$1 what=$2 end; shift 2
  end=$(($(date +%s) + secs))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || { log "timed out after ${secs}s waiting for $what"; return 1; }
    sleep 0.2
  done
}

# show_logs FILE...: the tail of some logs, for error messages
show_logs() { local f; for f; do [ -s "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }; done; return 0; }

# ------------------------------------------------------------------------------------ install

install_packages() {
  local missing=() installed p
  installed=$(dpkg-query -W -f='${Package} ${Status}\n' "${PACKAGES[@]}" 2>/dev/null || true)
  for p in "${PACKAGES[@]}"; do
    grep -xF "$p install ok installed" <<<"$installed" >/dev/null || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]} (log: $LOG/apt.log)"
  # Without systemd, postinst scripts would try to start system-wide munge/slurm/mariadb through
  # invoke-rc.d; a policy-rc.d that exits 101 forbids it. Keep an existing one, else add ours.
  local guard=/usr/sbin/policy-rc.d added=0 ok=0 try
  if [ ! -e "$guard" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$guard"; chmod 755 "$guard"; added=1
  fi
  # the system's usual umask for apt: maintainer scripts create files other users must read
  local apt=(env DEBIAN_FRONTEND=noninteractive sh -c 'umask 022; exec "$@"' apt apt-get -y -q -o DPkg::Lock::Timeout=120)
  for try in 1 2 3; do
    if [ "$try" -gt 1 ]; then
      log "apt-get install failed; apt-get update and retry ($try/3)"
      [ "$try" -gt 2 ] && sleep 5
      "${apt[@]}" update >>"$LOG/apt.log" 2>&1 || true
    fi
    if "${apt[@]}" install --no-install-recommends "${missing[@]}" \
         >>"$LOG/apt.log" 2>&1 </dev/null; then ok=1; break; fi
  done
  [ "$added" = 1 ] && rm -f "$guard"
  [ "$ok" = 1 ] || { show_logs "$LOG/apt.log"; die "could not install ${missing[*]}"; }
  log "installed"
}

# ------------------------------------------------------------------------------------ configs

# put_file DEST [MODE]: replace DEST with stdin unless identical
put_file() {
  local dest=$1 mode=${2:-644}
  cat > "$dest.new"
  chmod "$mode" "$dest.new"
  if [ -f "$dest" ] && cmp -s "$dest.new" "$dest"; then rm -f "$dest.new"; else mv -f "$dest.new" "$dest"; fi
}

# Each daemon group records the checksum of the config it was started with in RUN/KIND.applied;
# `up` restarts a running group whose config differs (also after an interrupted `up`).
#   slurm: slurm.conf + gres.conf (slurmctld, slurmd)   dbd: slurmdbd.conf   mysql: my.cnf
conf_sum() {
  case $1 in
    slurm) cat "$CONF" "$ETC/gres.conf" 2>/dev/null | md5sum ;;
    dbd)   md5sum < "$ETC/slurmdbd.conf" ;;
    mysql) md5sum < "$MY_CNF" ;;
  esac
}
stale() { [ "$(cat "$RUN/$1.applied" 2>/dev/null)" != "$(conf_sum "$1")" ]; }
applied() { conf_sum "$1" > "$RUN/$1.applied"; }

write_slurm_conf() {
  # A fresh FirstJobId per cluster instance (kept across down/up, new after reset): job ids do not
  # restart at 1, so files like logs/%j.out from an earlier instance are not silently reused.
  [ -s "$ETC/first_job_id" ] || echo $(( (RANDOM << 15 | RANDOM) % 40000000 + 1000 )) > "$ETC/first_job_id"
  local node_gres="" i n
  [ "$GPUS" -gt 0 ] && node_gres=" Gres=gpu:$GPUS"
  {
    cat <<EOF
# Generated by gpujobs scripts/local-slurm.sh -- single-host test cluster; edits are overwritten.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$MUNGE_SOCK,cred_expire=$CRED_EXPIRE
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
MpiDefault=none
SwitchType=switch/none
# no cgroups here
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((MEM / CPUS))
# the node lines below are trusted (nodes may claim more CPUs than the host has)
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
FirstJobId=$(cat "$ETC/first_job_id")
MinJobAge=$MIN_JOB_AGE
# NO (Slurm's default): a job over a partition limit is accepted and stays PENDING with reason
# PartitionTimeLimit / PartitionNodeLimit; ALL: sbatch rejects it
EnforcePartLimits=$ENFORCE_PART_LIMITS
SchedulerType=sched/backfill
EOF
    [ -n "$SCHED_PARAMS" ] && echo "SchedulerParameters=$SCHED_PARAMS"
    cat <<EOF
KillWait=$KILL_WAIT
InactiveLimit=0
Waittime=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# connections to slurmdbd ignore AuthInfo=socket=...; their munge socket is given here
AccountingStoragePass=$MUNGE_SOCK
JobCompType=jobcomp/none
EOF
    if [ "$GPUS" -gt 0 ]; then
      echo "GresTypes=gpu"
      echo "AccountingStorageTRES=gres/gpu"
    fi
    i=0
    for n in "${NODE_NAMES[@]}"; do
      i=$((i + 1))
      echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT_BASE + i)) CPUs=$CPUS RealMemory=$MEM$node_gres State=UNKNOWN"
    done
    cat <<EOF
# Jobs in a higher PriorityTier partition preempt (requeue) jobs of lower tiers. The victims get
# their --signal at once (preempt_send_user_signal: the 22.05 spelling, PreemptParameters= is a
# fatal parse error there) and are requeued GraceTime seconds later.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=$GRACE_TIME
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10
PartitionName=short Nodes=ALL MaxTime=00:10:00 MaxNodes=1 State=UP PriorityTier=1 GraceTime=$GRACE_TIME
EOF
  } > "$CONF.gen"
  put_file "$CONF" < "$CONF.gen"; rm -f "$CONF.gen"

  if [ "$GPUS" -gt 0 ]; then
    # File= must stat() as a character/block device ("not a valid character or block device"
    # otherwise, and no CUDA_VISIBLE_DEVICES); symlinks to /dev/null do, without mknod.
    for ((i = 0; i < GPUS; i++)); do
      if [ "$(readlink "$DIR/dev/gpu$i")" != /dev/null ]; then
        rm -rf "$DIR/dev/gpu$i"; ln -s /dev/null "$DIR/dev/gpu$i"
      fi
    done
    local files=$DIR/dev/gpu0
    [ "$GPUS" -gt 1 ] && files="$DIR/dev/gpu[0-$((GPUS - 1))]"
    put_file "$ETC/gres.conf" < <(printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s\n' "$NODE_CSV" "$files")
  else
    rm -f "$ETC/gres.conf"
  fi
}

# write_oci_conf: with OCI=1, oci.conf and its RunTimeRun command oci-run (see the header); else neither.
# The container's id names node, user, job, step and task (unique on this host); crun keeps its state in
# RUN/crun, away from other clusters' and podman's. Slurm puts the values in unquoted (%b: a path in DIR).
write_oci_conf() {
  if [ "$OCI" != 1 ]; then rm -f "$ETC/oci.conf" "$ETC/oci-run"; return 0; fi
  local crun py scontrol id=%n.%u.%j.%s.%t
  crun=$(command -v crun) scontrol=$(command -v scontrol)
  # the system's python3 (a pyenv shim or a venv's may not run in slurmstepd's environment)
  py=/usr/bin/python3
  [ -x "$py" ] || py=$(command -v python3) || die "GPUJOBS_SLURM_OCI=1 needs python3 for $ETC/oci-run"
  put_file "$ETC/oci.conf" <<EOF
# Generated by gpujobs scripts/local-slurm.sh: Slurm 22.05's OCI support (srun --container=BUNDLE), crun.
RunTimeQuery="$crun --root=$RUN/crun state $id"
RunTimeKill="$crun --root=$RUN/crun kill -a $id"
RunTimeDelete="$crun --root=$RUN/crun delete --force $id"
# exec: the task is crun itself, which forwards the signals Slurm sends the task (dash would stay the
# task, and die of them)
RunTimeRun="exec $ETC/oci-run %b %n %t $id"
EOF
  put_file "$ETC/oci-run" 700 <<EOF
#!$py
"""oci-run BUNDLE NODE LOCAL_ID CONTAINER_ID: oci.conf's RunTimeRun (generated by scripts/local-slurm.sh).

slurmstepd 22.05 wrote BUNDLE/config.json with the step's argv and environment, but without the variables
of each task (SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID, SLURMD_NODENAME): they are added, then crun runs the
bundle in this process (crun forwards the signals Slurm sends the task to the container's process).
A container step of 22.05 has one task per node: a task's rank is its node's index in the step.
"""
import json
import os
import subprocess
import sys

bundle, node, local_id, container_id = sys.argv[1:5]
config_path = os.path.join(bundle, "config.json")
with open(config_path) as f:
    config = json.load(f)
env = config["process"]["env"]
step_nodes = next(item.split("=", 1)[1] for item in env if item.startswith("SLURM_STEP_NODELIST="))
nodes = subprocess.run(["$scontrol", "show", "hostnames", step_nodes], check=True, capture_output=True,
                       text=True).stdout.split()
rank = str(nodes.index(node))
env += [f"SLURM_PROCID={rank}", f"SLURM_NODEID={rank}", f"SLURM_LOCALID={local_id}", f"SLURMD_NODENAME={node}"]
with open(config_path + ".tmp", "w") as f:
    json.dump(config, f)
os.replace(config_path + ".tmp", config_path)
os.execv("$crun", ["crun", "--root=$RUN/crun", "run", "--bundle", bundle, container_id])
EOF
}

# db_password: the password of the `slurm` MariaDB account, random, made once per DIR. It lives in
# 0600 files only (this one and slurmdbd.conf) and reaches the server on stdin, never in argv,
# which every local user can read in /proc. TCP on 127.0.0.1 is open to all: hence no fixed one.
db_password() {
  if [ ! -f "$DB_PASS_FILE" ] || [ -L "$DB_PASS_FILE" ] || [ ! -s "$DB_PASS_FILE" ]; then
    rm -f "$DB_PASS_FILE"
    od -An -tx1 -N24 /dev/urandom | tr -d ' \n' > "$DB_PASS_FILE.new"
    mv -f "$DB_PASS_FILE.new" "$DB_PASS_FILE"
  fi
  chmod 600 "$DB_PASS_FILE"
  tr -dc 0-9a-f < "$DB_PASS_FILE"
}

write_dbd_confs() {
  local pass
  pass=$(db_password)
  # slurmdbd reads slurmdbd.conf next to $SLURM_CONF and insists on mode 0600, owned by SlurmUser
  put_file "$ETC/slurmdbd.conf" 600 <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
EOF
  # mariadbd runs as root like the other daemons (the mysql user could not enter DIR, 0700). Root's
  # FILE privilege stays root's: root@localhost authenticates by unix socket (peer uid 0) only and
  # the socket is inside DIR; and secure-file-priv keeps INTO OUTFILE / LOAD DATA inside DIR.
  put_file "$MY_CNF" 600 <<EOF
[mysqld]
user=root
datadir=$DIR/mysql
socket=$RUN/mysqld.sock
pid-file=$RUN/mysqld.pid
log-error=$LOG/mysqld.log
port=$MYSQL_PORT
bind-address=127.0.0.1
skip-name-resolve
secure-file-priv=$DIR/mysql-files
local-infile=0
innodb_buffer_pool_size=128M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
EOF
}

# The node names must resolve (submitit uses the first one as MASTER_ADDR); so must this host's
# name (slurmstepd looks it up), which goes on our line only if nothing else resolves it.
update_hosts() {
  local names=("${NODE_NAMES[@]}") line ours_has_host=0
  grep -F "$HOSTS_TAG" /etc/hosts | sed 's/#.*//' | grep -w -- "$HOST" >/dev/null && ours_has_host=1
  if [ "$ours_has_host" = 1 ] || ! getent hosts "$HOST" >/dev/null; then names+=("$HOST"); fi
  line="127.0.0.1 ${names[*]} $HOSTS_TAG"
  grep -qxF "$line" /etc/hosts && return 0
  { grep -vF "$HOSTS_TAG" /etc/hosts || true; echo "$line"; } > "$DIR/hosts.tmp"
  cat "$DIR/hosts.tmp" > /etc/hosts   # rewrite in place: /etc/hosts may be a bind mount
  rm -f "$DIR/hosts.tmp"
}

remove_hosts_line() {
  grep -qF "$HOSTS_TAG" /etc/hosts || return 0
  local tmp; tmp=$(mktemp)
  grep -vF "$HOSTS_TAG" /etc/hosts > "$tmp" || true
  cat "$tmp" > /etc/hosts; rm -f "$tmp"
}

# /etc/slurm/slurm.conf: only with GPUJOBS_SLURM_LINK_ETC=1; never left pointing at a stopped cluster
link_etc() {
  if [ "$LINK_ETC" = 1 ]; then
    ( umask 022; mkdir -p /etc/slurm )
    if [ -L /etc/slurm/slurm.conf ] || [ ! -e /etc/slurm/slurm.conf ]; then
      ln -sfn "$CONF" /etc/slurm/slurm.conf
    else
      log "WARNING: /etc/slurm/slurm.conf is a regular file; not replacing it"
    fi
  else
    unlink_etc
    [ -e /etc/slurm/slurm.conf ] && log "note: /etc/slurm/slurm.conf exists and is not ours; clients without SLURM_CONF use it"
  fi
  return 0
}
unlink_etc() {
  if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$CONF" ]; then
    rm -f /etc/slurm/slurm.conf
  fi
  return 0
}

# ------------------------------------------------------------------------------------ daemons

munge_ok() { munge -S "$MUNGE_SOCK" -n </dev/null 2>/dev/null | unmunge -S "$MUNGE_SOCK" >/dev/null 2>&1; }
mysql_ok() { mariadb-admin --socket="$RUN/mysqld.sock" -uroot ping; }
dbd_ok() { sacctmgr -n -P show cluster format=cluster; }
sacct_ok() { sacct -n -X -P -o JobID -S now; }

# munge_key_ours: the key is one this script generated (the marker says so) and is still root's, 0400
munge_key_ours() {
  [ -f "$MUNGE_KEY" ] && [ ! -L "$MUNGE_KEY" ] && [ "$(stat -c '%u %a' -- "$MUNGE_KEY")" = "0 400" ] &&
    grep -qxF munge_key=generated "$MARKER"
}

start_munged() {
  if ! munge_key_ours; then
    stop_daemon "$RUN/munged.pid" munged
    log "generating the munge key"
    install -d -m 700 "$DIR/munge"
    rm -f "$MUNGE_KEY" "$MUNGE_KEY.new"
    dd if=/dev/urandom of="$MUNGE_KEY.new" bs=1024 count=1 status=none
    chmod 400 "$MUNGE_KEY.new"; mv -f "$MUNGE_KEY.new" "$MUNGE_KEY"
    grep -qxF munge_key=generated "$MARKER" || echo munge_key=generated >> "$MARKER"
  fi
  if sole_pid "$RUN/munged.pid" munged >/dev/null && munge_ok; then return 0; fi
  stop_daemon "$RUN/munged.pid" munged
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  log "starting munged"
  # munged wants its socket reachable by every user ("Socket is inaccessible: execute permissions
  # for all required"); this one is for root only, on purpose (inside DIR, 0700). --force makes
  # that error a warning (so too its other permission checks, which our files pass anyway).
  start_forking "$LOG/munged.out" /usr/sbin/munged --force --socket="$MUNGE_SOCK" --key-file="$MUNGE_KEY" \
      --pid-file="$RUN/munged.pid" --seed-file="$DIR/munge/munged.seed" --log-file="$LOG/munged.log" ||
    { show_logs "$LOG/munged.out" "$LOG/munged.log"; die "munged failed to start"; }
  wait_until 15 munged munge_ok || { show_logs "$LOG/munged.log"; die "munged does not answer"; }
}

start_mariadbd() {
  if stale mysql || ! sole_pid "$RUN/mysqld.pid" mariadbd >/dev/null || ! mysql_ok >/dev/null 2>&1; then
    stop_daemon "$RUN/mysqld.pid" mariadbd
    need_port "$MYSQL_PORT" mariadbd
    if [ ! -d "$DIR/mysql/mysql" ]; then
      log "initialising the MariaDB datadir"
      rm -rf "$DIR/mysql"
      # socket: root@localhost is reachable only by OS root over the unix socket (no password works)
      mariadb-install-db --defaults-file="$MY_CNF" --auth-root-authentication-method=socket \
          --auth-root-socket-user=root --skip-test-db >"$LOG/mariadb-install-db.log" 2>&1 </dev/null ||
        { show_logs "$LOG/mariadb-install-db.log"; die "mariadb-install-db failed"; }
    fi
    log "starting mariadbd"
    start_foreground "$LOG/mysqld.out" /usr/sbin/mariadbd --defaults-file="$MY_CNF"
    wait_until 60 mariadbd mysql_ok || { show_logs "$LOG/mysqld.log"; die "mariadbd does not answer"; }
    applied mysql
  fi
  # every `up`: the password may be new. The SQL goes on stdin: argv is world-readable.
  local pass
  pass=$(db_password)
  mariadb --socket="$RUN/mysqld.sock" -uroot >&2 <<EOF || die "could not set up the slurm database user"
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
}

start_slurmdbd() {
  ! stale dbd && sole_pid "$RUN/slurmdbd.pid" slurmdbd >/dev/null && return 0
  stop_daemon "$RUN/slurmdbd.pid" slurmdbd
  need_port "$DBD_PORT" slurmdbd
  log "starting slurmdbd"
  start_forking "$LOG/slurmdbd.out" /usr/sbin/slurmdbd ||
    { show_logs "$LOG/slurmdbd.out" "$LOG/slurmdbd.log"; die "slurmdbd failed to start"; }
  wait_until 60 slurmdbd dbd_ok || { show_logs "$LOG/slurmdbd.log"; die "slurmdbd does not answer"; }
  applied dbd
  if ! sacctmgr -n -P show cluster format=cluster 2>/dev/null | grep -xF "$CLUSTER" >/dev/null; then
    sacctmgr -i add cluster "$CLUSTER" >>"$LOG/slurmdbd.out" 2>&1 || die "could not register cluster $CLUSTER with slurmdbd"
  fi
}

start_slurmctld() {
  sole_pid "$RUN/slurmctld.pid" slurmctld >/dev/null && return 0
  stop_daemon "$RUN/slurmctld.pid" slurmctld
  need_port "$CTLD_PORT" slurmctld
  log "starting slurmctld"
  start_forking "$LOG/slurmctld.out" /usr/sbin/slurmctld -f "$CONF" ||
    { show_logs "$LOG/slurmctld.out" "$LOG/slurmctld.log"; die "slurmctld failed to start"; }
  wait_until 30 slurmctld scontrol ping || { show_logs "$LOG/slurmctld.log"; die "slurmctld does not answer"; }
}

start_slurmds() {
  local n i=0 keep=() pid
  for n in "${NODE_NAMES[@]}"; do
    if pid=$(pidof_daemon "$RUN/slurmd-$n.pid" slurmd); then keep+=("$pid"); fi
  done
  # all nodes' slurmds run and no other slurmd of this DIR does: nothing to do
  [ ${#keep[@]} -eq "$NODES" ] && [ "$(strays slurmd | wc -l)" -eq "$NODES" ] && return 0
  stop_strays slurmd "${keep[@]}"   # e.g. of an earlier instance whose PID files are gone
  for n in "${NODE_NAMES[@]}"; do
    i=$((i + 1))
    pidof_daemon "$RUN/slurmd-$n.pid" slurmd >/dev/null && continue
    rm -f "$RUN/slurmd-$n.pid"
    need_port $((SLURMD_PORT_BASE + i)) "slurmd $n"
    mkdir -p "$DIR/spool/$n"
    log "starting slurmd -N $n"
    start_forking "$LOG/slurmd-$n.out" /usr/sbin/slurmd -f "$CONF" -N "$n" ||
      { show_logs "$LOG/slurmd-$n.out" "$LOG/slurmd-$n.log"; die "slurmd -N $n failed to start"; }
  done
}

# stop_slurm: the slurmds (also of nodes no longer configured), then slurmctld. Running jobs
# survive this (their slurmstepds carry on) unless they were cancelled before.
stop_slurm() {
  local f
  for f in "$RUN"/slurmd-*.pid; do [ -e "$f" ] && stop_daemon "$f" slurmd; done
  stop_strays slurmd
  stop_daemon "$RUN/slurmctld.pid" slurmctld
}

# node states that can run jobs ("*" = not responding, "~" = powered off, drain/down... don't)
node_states() { sinfo -h -N -p debug -o '%N %t' 2>/dev/null; }
nodes_usable() {
  local out
  out=$(node_states) || return 1
  [ "$(grep -cE ' (idle|mix|mixed|alloc|comp|plnd)$' <<<"$out")" -eq "$NODES" ]
}
# nudge_nodes: resume nodes left drained/down by an earlier instance; make slurmctld contact
# nodes it marked not responding ("*", e.g. after munged was restarted) now instead of at its
# next ping round (up to ~100 s)
nudge_nodes() {
  local n st reconf=0
  while read -r n st; do
    case $st in
      drain*|drng*|down*|fail*) log "resuming $n ($st)"
        scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true ;;
    esac
    case $st in *'*') reconf=1 ;; esac
  done < <(node_states)
  if [ "$reconf" = 1 ]; then log "nodes not responding: scontrol reconfigure"; scontrol reconfigure >&2 || true; fi
}

wait_healthy() {
  local start end nudged=0
  start=$(date +%s); end=$((start + TIMEOUT))
  until nodes_usable; do
    [ "$(date +%s)" -lt "$end" ] || { sinfo -N -l >&2 || true; show_logs "$LOG"/slurmd-*.log; die "nodes not usable after ${TIMEOUT}s"; }
    if [ "$nudged" = 0 ] && [ "$(date +%s)" -ge $((start + 3)) ]; then nudge_nodes; nudged=1; fi
    sleep 0.2
  done
  wait_until "$TIMEOUT" sacct sacct_ok || die "sacct does not answer"
}

# ------------------------------------------------------------------------------------ commands

take_lock() {
  exec {LOCK_FD}>>"$DIR/.lock"
  flock -w 300 "$LOCK_FD" || die "could not lock $DIR/.lock within 300 s"
}

# refuse REASON: one line, then exit 1 (nothing was started or written for DIR)
refuse() { log "ERROR: refusing $DIR: $*; use another DIR (or remove it)"; exit 1; }

# parents_safe: every directory above DIR (a resolved path: no symlinks) is root's, and no one else
# may rename or remove entries in it (not writable by group/others, or sticky as /tmp is), so no
# one else can swap DIR or a directory above it for one of theirs
parents_safe() {
  local p=${DIR%/*} uid mode
  while :; do
    [ -n "$p" ] || p=/
    read -r uid mode <<<"$(stat -c '%u %a' -- "$p" 2>/dev/null)" && [ -n "$mode" ] || return 1
    [ "$uid" = 0 ] || return 1
    (( (8#$mode & 8#022) == 0 || (8#$mode & 8#1000) != 0 )) || return 1
    [ "$p" = / ] && return 0
    p=${p%/*}
  done
}

# check_dir: set DIR_STATE to what DIR is, or refuse anything else
#   absent  nothing there
#   fresh   a real directory of ours, mode 0700, empty but for our .lock (our mkdir -m 700)
#   ours    made by this script: our marker of this format inside, mode 0700
#   old     made by an earlier version of this script: its (empty) marker, ours, writable by no one
#           else, but world-readable and with a MariaDB root anyone could log into
# Anything else was made, or can be changed, by someone else: a symlink, not a directory,
# another owner, writable by group/others, under a directory others may rename entries of, or
# not empty without our marker. Its files (a planted munge key, a slurm.conf loading plugins)
# are never used: `up` starts nothing, `down`/`status` run no Slurm client on its config,
# `reset` deletes nothing.
check_dir() {
  local uid mode
  if [ ! -e "$DIR" ] && [ ! -L "$DIR" ]; then DIR_STATE=absent; return 0; fi
  [ ! -L "$DIR" ] || refuse "it is a symbolic link"
  [ -d "$DIR" ] || refuse "it is not a directory"
  parents_safe || refuse "a directory above it is not root's, or others may rename its entries"
  read -r uid mode <<<"$(stat -c '%u %a' -- "$DIR")"
  [ "$uid" = "$(id -u)" ] || refuse "it belongs to uid $uid, not to us (uid $(id -u)): someone else made it"
  (( (8#$mode & 8#022) == 0 )) || refuse "others may write to it (mode $mode)"
  if [ -f "$MARKER" ] && [ ! -L "$MARKER" ] && [ "$(stat -c %u -- "$MARKER")" = "$uid" ]; then
    if grep -qxF "$MARKER_FORMAT" "$MARKER"; then
      [ "$mode" = 700 ] || refuse "its mode is $mode, not 700 (someone changed it; run reset)"
      DIR_STATE=ours
    else
      DIR_STATE=old
    fi
  elif [ "$mode" = 700 ] && [ -z "$(find "$DIR" -mindepth 1 -maxdepth 1 ! -name .lock -print -quit)" ]; then
    DIR_STATE=fresh
  else
    refuse "it was not made by this script (mode $mode, no marker)"
  fi
}

# make_dir: DIR as ours, locked. mkdir -m 700 creates it with that mode at once (no moment with
# wider permissions); if someone else's appears first, mkdir fails and check_dir refuses it.
make_dir() {
  check_dir
  if [ "$DIR_STATE" = absent ]; then
    parents_safe || refuse "a directory above it is not root's, or others may rename its entries"
    mkdir -m 700 -- "$DIR" 2>/dev/null || true
    check_dir
  fi
  take_lock
  check_dir   # again, under the lock: another `up` may have got there first
  if [ "$DIR_STATE" = old ]; then
    # Nothing in it is trusted (any local user was MariaDB root, with FILE): start afresh.
    log "$DIR was made by an older local-slurm.sh (world-readable, MariaDB root without password): stopping it and re-creating it; its jobs and accounting are lost"
    chmod 700 -- "$DIR"
    stop_all
    find "$DIR" -mindepth 1 -maxdepth 1 ! -name .lock -exec rm -rf -- {} +
    DIR_STATE=fresh
  fi
  [ "$DIR_STATE" = ours ] || printf '%s\n' "$MARKER_FORMAT" > "$MARKER"
}

cmd_up() {
  make_dir
  mkdir -p "$ETC" "$RUN" "$LOG" "$DIR/state" "$DIR/dev" "$DIR/mysql-files"
  install_packages
  write_slurm_conf
  write_dbd_confs
  if [ "$OCI" = 1 ]; then
    . "$SCRIPTS/crun-cgroups.sh"
    if ! prepare_cgroups; then
      [ -z "${GPUJOBS_SLURM_OCI:-}" ] || die "crun cannot run Slurm's containers here (GPUJOBS_SLURM_OCI=0 turns them off)"
      log "WARNING: crun cannot run here (cgroups): no oci.conf, srun --container is off"; OCI=0
    fi
  fi
  write_oci_conf
  update_hosts
  link_etc
  check_ports
  if stale slurm && pidof_daemon "$RUN/slurmctld.pid" slurmctld >/dev/null; then
    log "slurm.conf/gres.conf changed: restarting slurmctld and slurmd"
    stop_slurm
  fi
  start_munged
  start_mariadbd
  start_slurmdbd
  start_slurmctld
  start_slurmds
  applied slurm
  wait_healthy
  log "up: $(sinfo -h -o '%P:%D nodes %t' | tr '\n' ' ')"
}

# stop_all: cancel the jobs, stop every daemon of DIR (with the lock held)
stop_all() {
  if pidof_daemon "$RUN/slurmctld.pid" slurmctld >/dev/null; then
    local jobs end
    mapfile -t jobs < <(squeue -h -o %A 2>/dev/null | sort -u)
    if [ ${#jobs[@]} -gt 0 ]; then
      log "cancelling jobs ${jobs[*]}"
      scancel "${jobs[@]}" 2>/dev/null || true
      end=$(($(date +%s) + KILL_WAIT + 20))
      while [ -n "$(squeue -h -o %A 2>/dev/null)" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 0.3; done
    fi
  fi
  stop_slurm
  stop_strays slurmstepd   # only jobs that ignored the cancel
  stop_daemon "$RUN/slurmdbd.pid" slurmdbd
  stop_daemon "$RUN/mysqld.pid" mariadbd
  stop_daemon "$RUN/munged.pid" munged
}

cmd_down() {
  check_dir
  [ "$DIR_STATE" != absent ] || { log "$DIR does not exist; nothing to stop"; unlink_etc; return 0; }
  take_lock
  stop_all
  unlink_etc
  log "down"
}

cmd_status() {
  local rc=0 pid n
  show() {  # show NAME PIDFILE COMM
    if pid=$(pidof_daemon "$2" "$3"); then echo "$1: running (pid $pid)"; else echo "$1: NOT running"; rc=1; fi
  }
  check_dir
  echo "dir: $DIR"
  show munged "$RUN/munged.pid" munged
  show mariadbd "$RUN/mysqld.pid" mariadbd
  show slurmdbd "$RUN/slurmdbd.pid" slurmdbd
  show slurmctld "$RUN/slurmctld.pid" slurmctld
  for n in "${NODE_NAMES[@]}"; do show "slurmd $n" "$RUN/slurmd-$n.pid" slurmd; done
  if [ "$rc" = 0 ]; then
    sinfo -N -o '%N %9P %6t %4c %8m %G' || rc=1
    nodes_usable || { echo "nodes: NOT all usable"; rc=1; }
    sacct_ok >/dev/null 2>&1 || { echo "sacct: NOT answering"; rc=1; }
    squeue || true
  fi
  [ "$rc" = 0 ] && echo "healthy" || echo "NOT healthy"
  return $rc
}

cmd_reset() {
  check_dir
  if [ "$DIR_STATE" != absent ]; then
    cmd_down
    rm -rf -- "$DIR"
  fi
  remove_hosts_line
  log "removed $DIR"
}

case $CMD in
  up)     cmd_up; echo "export SLURM_CONF=$CONF" ;;
  down)   cmd_down ;;
  status) cmd_status ;;
  env)    echo "export SLURM_CONF=$CONF" ;;
  reset)  cmd_reset ;;
  *)      usage ;;
esac
