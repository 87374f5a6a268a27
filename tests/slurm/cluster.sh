#!/bin/bash
# cluster.sh — a private one-node Slurm cluster for tests: munged, slurmctld and slurmd on 127.0.0.1,
# run as root from Debian's packages (scripts/setup.sh installs them; this script installs nothing).
#
#   cluster.sh start [DIR]   start a cluster in DIR (default: a new /tmp/dgt-slurm-XXXXXX); prints the
#                            environment to use it, for eval:  export SLURM_CONF=DIR/slurm.conf ...
#                            exit 77 (with the reason on stderr) when Slurm cannot start here
#                            (tests/slurm/lib.sh: a skip outside CI, a failure under CI=true).
#   cluster.sh stop [DIR]    cancel every job, stop the daemons (by their pid files), remove DIR
#   cluster.sh status [DIR]  daemons, nodes, queue
# DIR defaults to $DGT_SLURM_DIR for stop/status.
#
# Everything lives in DIR: slurm.conf, the munge key and socket, slurmctld state, slurmd spool, logs.
# Ports are picked free at random, so several clusters (and a system Slurm) can coexist. The config is
# the minimum that works without systemd or cgroups: proctrack/linuxproc, task/none,
# select/cons_tres; cred_expire=5 and a 1 s scheduler interval so a requeued job restarts in seconds,
# not minutes; KillWait=30 (Slurm's default) so that a cancelled job's checkpoint has the time a site gives
# it even on a loaded machine (processes that exit on SIGTERM end at once anyway). The node claims CPUS (default 8) CPUs
# (SlurmdParameters=config_overrides) so that small multi-task test jobs can run side by side on a
# 2-core machine; they are oversubscribed, which is fine for tests. Job ids start at a random
# FirstJobId: Slurm's PMIx namespace, and from it Open MPI's job id and the names of its shared-memory
# segments in /dev/shm, derive from the Slurm job id, and a killed job leaves its segments behind; with
# ids restarting at 1 in every fresh test cluster, a later job would attach to a dead job's segment
# and crash in the shared-memory transport.
set -u
CMD=${1:-}
DIR=${2:-${DGT_SLURM_DIR:-}}
CPUS=${DGT_SLURM_CPUS:-8}

say() { echo "cluster.sh: $*" >&2; }
# Exit 77 with the reason: the caller (lib.sh) turns it into a skip outside CI and a failure under CI.
# Whatever this start already brought up (munged, slurmctld) is stopped first.
skip() {
    say "Slurm cannot start here: $*"
    [ -n "${DIR:-}" ] && [ -d "$DIR" ] && stop_cluster >/dev/null 2>&1
    exit 77
}

pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pid_from() { [ -f "$1" ] && cat "$1" 2>/dev/null; }

# processes started for this cluster that are not tracked by pid files (slurmstepd and its children
# inherit SLURM_CONF from slurmd): match on the exact config path in their environment
stray_pids() {
    local conf=$1 p
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = $$ ] && continue
        case "$(cat /proc/$p/comm 2>/dev/null)" in
        slurmstepd) ;;
        *) continue ;;
        esac
        if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$conf"; then echo "$p"; fi
    done
}

free_port() {
    local p
    for _ in $(seq 1 50); do
        p=$((20000 + RANDOM % 40000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            echo "$p"
            return 0
        fi
    done
    return 1
}

wait_for() { # wait_for SECONDS CMD... : poll CMD every 0.2 s
    local limit=$1 t
    shift
    for ((t = 0; t < limit * 5; t++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    return 1
}

stop_cluster() {
    [ -n "$DIR" ] || {
        say "stop: no cluster dir (give DIR or set DGT_SLURM_DIR)"
        return 2
    }
    [ -d "$DIR" ] || return 0
    local conf=$DIR/slurm.conf p
    local jobs=
    if [ -f "$conf" ] && pid_alive "$(pid_from "$DIR/slurmctld.pid")"; then
        jobs=$(SLURM_CONF=$conf scontrol show job -o 2>/dev/null | sed -n 's/^JobId=\([0-9]*\) .*/\1/p')
        SLURM_CONF=$conf scancel --quiet --full --user=root 2>/dev/null
        for ((p = 0; p < 50; p++)); do
            [ -z "$(SLURM_CONF=$conf squeue -h -t R,CG 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    for d in slurmd slurmctld; do
        p=$(pid_from "$DIR/$d.pid")
        pid_alive "$p" && kill -TERM "$p" 2>/dev/null
    done
    for p in $(stray_pids "$conf"); do kill -KILL "$p" 2>/dev/null; done
    [ -S "$DIR/munge/munge.sock" ] && munged -s --socket="$DIR/munge/munge.sock" >/dev/null 2>&1
    for d in slurmd slurmctld munge/munged; do
        p=$(pid_from "$DIR/$d.pid")
        for ((i = 0; i < 25; i++)); do pid_alive "$p" || break; sleep 0.2; done
        pid_alive "$p" && kill -KILL "$p" 2>/dev/null
    done
    # slurmstepd's PMIx scratch dirs of this cluster's jobs, left behind when a step is killed
    for p in $jobs; do rm -rf "/tmp/spmix_appdir_$(id -u)_$p".*; done
    case "$DIR" in
    /tmp/dgt-slurm-* | "${DGT_SLURM_DIR:-/nonexistent}") rm -rf "$DIR" ;;
    *) say "leaving $DIR in place (not a directory this script created)" ;;
    esac
    return 0
}

start_cluster() {
    [ "$(id -u)" = 0 ] || skip "not root (slurmd must run as root to launch job steps); run the tests as root"
    local c
    for c in munged slurmctld slurmd sbatch srun scontrol squeue sinfo scancel; do
        command -v "$c" >/dev/null 2>&1 || skip "'$c' is not installed (scripts/setup.sh installs slurmctld slurmd slurm-client munge)"
    done
    if [ -z "$DIR" ]; then
        DIR=$(mktemp -d /tmp/dgt-slurm-XXXXXX) || skip "cannot create a temp dir in /tmp"
    fi
    mkdir -p "$DIR"/{munge,state,spool,log} || skip "cannot create $DIR"
    chmod 755 "$DIR" "$DIR"/munge "$DIR"/spool "$DIR"/log
    chmod 700 "$DIR"/state
    local conf=$DIR/slurm.conf sock=$DIR/munge/munge.sock host
    host=$(hostname -s)

    # munge: private key, socket and daemon
    if command -v mungekey >/dev/null 2>&1; then
        mungekey -c -f -k "$DIR/munge/munge.key" >/dev/null 2>&1
    fi
    [ -s "$DIR/munge/munge.key" ] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$DIR/munge/munge.key"
    munged -f --socket="$sock" --key-file="$DIR/munge/munge.key" --log-file="$DIR/log/munged.log" \
        --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" </dev/null >/dev/null 2>&1 ||
        skip "munged failed to start: $(tail -n 3 "$DIR/log/munged.log" 2>/dev/null | tr '\n' ' ')"
    wait_for 10 bash -c "munge -n -S '$sock' | unmunge -S '$sock'" ||
        skip "munged does not answer on $sock: $(tail -n 3 "$DIR/log/munged.log" 2>/dev/null | tr '\n' ' ')"

    local ctld_port slurmd_port
    ctld_port=$(free_port) || skip "no free TCP port"
    slurmd_port=$(free_port) || skip "no free TCP port"
    [ "$ctld_port" = "$slurmd_port" ] && slurmd_port=$((ctld_port + 1))
    local first_job=$((100000 + (RANDOM * 1000 + RANDOM % 1000) % 60000000))
    : >"$DIR/plugstack.conf"
    cat >"$conf" <<EOF
# Generated by tests/slurm/cluster.sh for a private one-node test cluster; see that script.
ClusterName=dgtest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
PlugStackConfig=$DIR/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId=$first_job
JobRequeue=1
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1024 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF=$conf
    # setsid + closed stdio: the daemons must not hold the caller's (ctest's) pipes open
    setsid slurmctld -c </dev/null >/dev/null 2>&1
    wait_for 20 scontrol ping ||
        skip "slurmctld did not come up: $(tail -n 5 "$DIR/log/slurmctld.log" 2>/dev/null | tr '\n' ' ')"
    setsid slurmd -N "$host" </dev/null >/dev/null 2>&1
    node_idle() { sinfo -h -N -o %T | grep -qx idle; }
    if ! wait_for 30 node_idle; then
        local state
        state=$(sinfo -h -N -o '%T %E' 2>&1)
        stop_cluster >/dev/null 2>&1
        skip "node did not become idle (state: $state): $(tail -n 5 "$DIR/log/slurmd.log" 2>/dev/null | tr '\n' ' ')"
    fi
    say "one-node cluster up in $DIR (node $host, $CPUS CPUs, slurmctld port $ctld_port, slurmd port $slurmd_port)"
    echo "export SLURM_CONF=$conf"
    echo "export DGT_SLURM_DIR=$DIR"
}

case "$CMD" in
start) start_cluster ;;
stop) stop_cluster ;;
status)
    [ -n "$DIR" ] && [ -f "$DIR/slurm.conf" ] || {
        say "status: no cluster in '${DIR}'"
        exit 1
    }
    export SLURM_CONF=$DIR/slurm.conf
    for d in munge/munged slurmctld slurmd; do
        p=$(pid_from "$DIR/$d.pid")
        if pid_alive "$p"; then echo "${d#munge/}: running (pid $p)"; else echo "${d#munge/}: not running"; fi
    done
    sinfo -N 2>&1
    squeue 2>&1
    ;;
*)
    echo "usage: $0 start|stop|status [DIR]" >&2
    exit 2
    ;;
esac
