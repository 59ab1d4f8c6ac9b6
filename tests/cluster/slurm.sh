#!/usr/bin/env bash
# A one-node SLURM on this machine for the tests that submit real jobs (tests/cluster/conftest.py).
#   slurm.sh start   install slurm-wlm and munge if missing, write slurm.conf, start munged, slurmctld, slurmd
#                    and wait until the node is idle; prints SLURM_CONF=<path> (and "started" or "running")
#   slurm.sh stop    cancel this cluster's jobs and stop its daemons (munged only if start started it)
# Everything but munged's socket lives in $TRAINER_SLURM_DIR (default /tmp/trainer-slurm), and the daemons
# listen on their own ports, so a real SLURM configured on the same host is neither read nor disturbed.
# No systemd: the daemons are started directly, as root. A failure prints one line saying why, exit 1.
set -euo pipefail

STATE=${TRAINER_SLURM_DIR:-/tmp/trainer-slurm}
export SLURM_CONF=$STATE/slurm.conf
CTLD_PORT=${TRAINER_SLURMCTLD_PORT:-16817}
SLURMD_PORT=${TRAINER_SLURMD_PORT:-16818}

fail() { echo "slurm.sh: $*" >&2; exit 1; }

install_missing() {
    local missing=()
    for tool in slurmctld slurmd srun sbatch sinfo munged; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || fail "${missing[*]} missing and not root, so apt-get cannot install slurm-wlm and munge"
    command -v apt-get >/dev/null || fail "${missing[*]} missing and no apt-get to install slurm-wlm and munge"
    # Without recommends: 9 packages instead of 43 (mail and X libraries the daemons do not need).
    apt-get update -q >"$STATE/apt.log" 2>&1 || fail "apt-get update failed (see $STATE/apt.log)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge \
        >>"$STATE/apt.log" 2>&1 || fail "apt-get install slurm-wlm munge failed (see $STATE/apt.log)"
}

write_conf() {
    # The node is this host under its own name when that resolves (job node lists then read as on a
    # real cluster), else localhost; slurmd is told which one it is with -N.
    NODE=$(hostname -s)
    getent hosts "$NODE" >/dev/null || NODE=localhost
    mkdir -p "$STATE/ctld" "$STATE/d"
    cat >"$SLURM_CONF" <<CONF
ClusterName=trainer-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits out the credential lifetime before it starts again: 120 s by default; 10 s is still
# ample for a step to reach slurmd on one host.
AuthInfo=cred_expire=10
# Then it waits for the next backfill pass, every 30 s by default, and a job submitted right after another one ends
# for the main loop's: both every second here, where the queue holds a job or two.
SchedulerParameters=bf_interval=1,sched_interval=1
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
# No cgroups or systemd here: processes are tracked through /proc, tasks are not bound to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# Two CPUs whatever the host has, so a test sees the same node on any machine.
SlurmdParameters=config_overrides
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    munge_works && return 0
    [ -f /etc/munge/munge.key ] || { mungekey --create >/dev/null 2>&1 || fail "cannot create /etc/munge/munge.key"; }
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge /etc/munge/munge.key 2>/dev/null || true
    # As the munge user, as Debian's service runs it (munged refuses a key owned by another user).
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- munged >"$STATE/munged.out" 2>&1 9>&- || fail "munged did not start: $(tail -1 "$STATE/munged.out")"
    else
        munged --force >"$STATE/munged.out" 2>&1 9>&- || fail "munged did not start: $(tail -1 "$STATE/munged.out")"
    fi
    touch "$STATE/munged.started"
    for _ in $(seq 50); do munge_works && return 0; sleep 0.1; done
    fail "munged started but munge -n | unmunge fails"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

node_state() { sinfo -h -N -o %T 2>/dev/null | head -1; }

start() {
    mkdir -p "$STATE"
    exec 9>"$STATE/lock"
    flock 9  # two test sessions starting at once start one cluster
    install_missing
    if alive "$STATE/slurmctld.pid" && alive "$STATE/slurmd.pid" && [ "$(node_state)" = idle ]; then
        echo "SLURM_CONF=$SLURM_CONF"; echo running; return 0
    fi
    stop_daemons
    write_conf
    start_munge
    # -c: a clean controller state, so no job of an earlier session is pending or requeued.
    # 9>&-: a daemon that kept the lock's descriptor would hold the lock for its whole life.
    slurmctld -c >"$STATE/slurmctld.out" 2>&1 9>&- || fail "slurmctld did not start: $(tail -1 "$STATE/slurmctld.out")"
    slurmd -N "$NODE" >"$STATE/slurmd.out" 2>&1 9>&- || fail "slurmd did not start: $(tail -1 "$STATE/slurmd.out")"
    for _ in $(seq 150); do
        [ "$(node_state)" = idle ] && { echo "SLURM_CONF=$SLURM_CONF"; echo started; return 0; }
        sleep 0.2
    done
    fail "node not idle after 30 s (state: $(node_state || true)); see $STATE/slurmctld.log and $STATE/slurmd.log"
}

stop_daemons() {
    if alive "$STATE/slurmctld.pid"; then
        squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
    fi
    for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
        if alive "$pidfile"; then
            kill "$(cat "$pidfile")"
            for _ in $(seq 50); do alive "$pidfile" || break; sleep 0.1; done
        fi
        rm -f "$pidfile"
    done
}

stop() {
    mkdir -p "$STATE"
    stop_daemons
    if [ -f "$STATE/munged.started" ] && [ -f /run/munge/munged.pid ]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$STATE/munged.started"
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) fail "usage: slurm.sh start|stop" ;;
esac
