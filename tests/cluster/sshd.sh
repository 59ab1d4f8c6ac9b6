#!/usr/bin/env bash
# An sshd on this machine for the tests of `trainer launch --hosts` (tests/cluster/conftest.py): two "hosts",
# localhost and 127.0.0.1, are two ssh logins to it.
#   sshd.sh start   install openssh-server if missing, make a host key and a login key for the tests, start sshd
#                   on its own port with key-based login only, and wait until a login works; prints
#                   SSH_CONFIG=<path> (a client config for `ssh -F`: port, key, known host keys) and "started" or
#                   "running"
#   sshd.sh stop    stop that sshd
# Everything lives in $TRAINER_SSHD_DIR (default /tmp/trainer-sshd) and sshd listens on its own port, so the
# machine's own ssh set-up (/etc/ssh, ~/.ssh) is neither read nor changed. A failure prints one line, exit 1.
set -euo pipefail

STATE=${TRAINER_SSHD_DIR:-/tmp/trainer-sshd}
PORT=${TRAINER_SSHD_PORT:-16822}
SSHD=/usr/sbin/sshd

fail() { echo "sshd.sh: $*" >&2; exit 1; }

install_missing() {
    [ -x "$SSHD" ] && command -v ssh >/dev/null && command -v ssh-keygen >/dev/null && return 0
    command -v apt-get >/dev/null || fail "no sshd, and no apt-get to install openssh-server"
    apt-get update -q >"$STATE/apt.log" 2>&1 || fail "apt-get update failed (see $STATE/apt.log)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-server openssh-client \
        >>"$STATE/apt.log" 2>&1 || fail "apt-get install openssh-server failed (see $STATE/apt.log)"
}

write_keys_and_configs() {
    [ -f "$STATE/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$STATE/host_ed25519"
    [ -f "$STATE/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$STATE/id_ed25519"
    cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
    chmod 600 "$STATE/host_ed25519" "$STATE/id_ed25519" "$STATE/authorized_keys"
    local host_key
    host_key=$(cut -d' ' -f1-2 "$STATE/host_ed25519.pub")
    cat >"$STATE/sshd_config" <<CONF
Port $PORT
ListenAddress 127.0.0.1
HostKey $STATE/host_ed25519
PidFile $STATE/sshd.pid
AuthorizedKeysFile $STATE/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
# The keys live under /tmp, which is world-writable: the ownership checks of StrictModes would refuse them.
StrictModes no
UsePAM no
MaxStartups 50:30:100
MaxSessions 50
LogLevel ERROR
CONF
    cat >"$STATE/ssh_config" <<CONF
# For ssh -F: the test sshd's port, the login key and its host key, for the two names of this machine.
Host localhost 127.0.0.1
    HostName 127.0.0.1
    Port $PORT
    User $(id -un)
    IdentityFile $STATE/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $STATE/known_hosts
    StrictHostKeyChecking yes
    HostKeyAlias localhost-test-sshd
    LogLevel ERROR
CONF
    # One alias for both names: their known host key is the same key.
    printf 'localhost-test-sshd %s\n' "$host_key" >"$STATE/known_hosts"
}

alive() { [ -f "$STATE/sshd.pid" ] && kill -0 "$(cat "$STATE/sshd.pid" 2>/dev/null)" 2>/dev/null; }

login_works() { ssh -F "$STATE/ssh_config" -o BatchMode=yes -o ConnectTimeout=5 localhost true 2>/dev/null; }

start() {
    mkdir -p "$STATE"
    exec 9>"$STATE/lock"
    flock 9  # two test sessions starting at once start one sshd
    install_missing
    if alive && login_works; then
        echo "SSH_CONFIG=$STATE/ssh_config"; echo running; return 0
    fi
    stop_daemon
    write_keys_and_configs
    mkdir -p /run/sshd  # sshd's privilege separation directory
    # Another sshd on the port would answer the logins with another host key.
    if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
        fail "port $PORT is taken by another process; set TRAINER_SSHD_PORT to a free one"
    fi
    : >"$STATE/sshd.log"
    "$SSHD" -f "$STATE/sshd_config" -E "$STATE/sshd.log" 9>&- || fail "sshd did not start: $(tail -1 "$STATE/sshd.log")"
    for _ in $(seq 100); do
        login_works && { echo "SSH_CONFIG=$STATE/ssh_config"; echo started; return 0; }
        # It forks into the background before it binds its port: a failure shows in its log only.
        grep -q "Cannot bind" "$STATE/sshd.log" && fail "sshd did not start: $(tail -2 "$STATE/sshd.log" | head -1)"
        sleep 0.1
    done
    fail "sshd started but a key-based login to localhost fails: $(ssh -F "$STATE/ssh_config" -o BatchMode=yes localhost true 2>&1 | tail -1)"
}

stop_daemon() {
    if alive; then
        kill "$(cat "$STATE/sshd.pid")"
        for _ in $(seq 50); do alive || break; sleep 0.1; done
    fi
    rm -f "$STATE/sshd.pid"
}

stop() {
    mkdir -p "$STATE"
    stop_daemon
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) fail "usage: sshd.sh start|stop" ;;
esac
