"""`trainer launch`: one node of a multi-node job on each host of a list, started over ssh from this machine.

    trainer launch --hosts HOST,HOST[,...] | --hostfile FILE  [--nproc-per-node N] [--master-addr A]
                   [--master-port P] [--ssh-config FILE] [--ssh-port P]  [STAGE] RECIPE [RECIPE ...] [key=value ...]
    trainer launch --hosts ... SCRIPT.py [the script's own arguments]

Every host runs the node process in this machine's working directory with this machine's Python, so every host
needs the same environment at the same paths (as with pdsh or DeepSpeed's launcher). For a recipe, the node
process is `trainer <stage>` (fit by default) with trainer.num_nodes and trainer.devices set, and MASTER_ADDR,
MASTER_PORT and NODE_RANK in its environment: the Trainer's own launcher starts the node's processes. For a
script, it is torchrun with --nnodes, --node-rank, --nproc-per-node, --master-addr and --master-port. Node 0 runs
on the first host, the master (--master-addr names it otherwise, e.g. by an address the other hosts reach).

On each host a small guard runs the node (`python -m torchyard.trainer.launch.ssh_hosts`, see `node_main`): it checks
the master address (trainer/cluster/node_checks.py), starts the node in a process group of its own, passes on the
signals this launcher writes to ssh's stdin (Ctrl-C and SIGTERM here reach every node), and ends that whole group when
the node exits or ssh's stdin closes (this launcher ended, or the connection dropped): nothing is left on a
host. Node 0's output is shown here; the others' goes to files, whose end is shown when a node fails, and then
the other nodes are stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torchyard.trainer.cluster import node_checks
from torchyard.trainer.cluster.environment import node_rendezvous
from torchyard.trainer.errors import MisconfigurationError

STAGES = ("fit", "validate", "test", "predict")
#: ssh's ConnectTimeout, in seconds: an unreachable host fails the launch this soon.
CONNECT_TIMEOUT_S = 10
#: Seconds a node may wait for node 0's port to open (its host may be slower to start it).
NODE_START_WAIT_S = 600.0
#: Seconds the nodes get to stop after a signal or another node's failure (a checkpoint is saved on SIGTERM)
#: before their guards end their process groups, and then before ssh itself is killed here.
STOP_GRACE_S = 60.0
KILL_GRACE_S = 10.0
#: Variables of this process passed on to every node (ssh passes on none by itself).
FORWARDED_PREFIXES = ("TORCHYARD_", "NCCL_", "GLOO_", "TORCH_", "OMP_", "PYTHONPATH", "CUDA_VISIBLE_DEVICES")
#: Lines of a failed node's output shown here (after torchrun's report of the failure, the worker's own error).
FAILURE_TAIL_LINES = 80
SIGNAL_WORDS = {signal.SIGINT: "INT", signal.SIGTERM: "TERM", signal.SIGHUP: "TERM"}
#: A probe run on every host before the launch: it imports the framework and asks for a free port (node 0's).
PROBE = "import socket, torchyard.trainer; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `trainer launch`."""
    parser.description = ("Start one node of a multi-node job on each host over ssh (docs/cluster.md). The options "
                          "may stand anywhere among a recipe and its overrides; after a script, the rest is the "
                          "script's own arguments.")
    parser.add_argument("--hosts", help="comma-separated hosts, one node each; the first runs node 0")
    parser.add_argument("--hostfile", help="a file of `HOST slots=N` lines (DeepSpeed's and MPI's format)")
    parser.add_argument("--nproc-per-node", type=int,
                        help="processes (devices) per node; default: the hostfile's slots, else 1")
    parser.add_argument("--master-addr", help="the address of the first host as the others reach it (default: its "
                        "name in the host list)")
    parser.add_argument("--master-port", type=int, help="node 0's rendezvous port (default: a free port there)")
    parser.add_argument("--ssh-config", help="an ssh client config file (ssh -F)")
    parser.add_argument("--ssh-port", type=int, help="the port of sshd on every host (ssh -p)")
    parser.add_argument("sources", nargs="*", metavar="[STAGE] RECIPE ... | SCRIPT.py ARGS",
                        help="recipe files and key=value overrides (after an optional stage, fit by default), "
                             "or a Python script and its arguments")
    parser.set_defaults(handler=launch_command)


def launch_command(args: argparse.Namespace) -> int:
    """Check the input and every host, start one node per host, wait for them; the job's exit status."""
    for flag, port in (("--master-port", args.master_port), ("--ssh-port", args.ssh_port)):
        if port is not None and not 1 <= port <= 65535:
            raise MisconfigurationError(f"{flag} {port}: give a port number from 1 to 65535.")
    hosts, slots = read_hosts(args.hosts, args.hostfile)
    nproc = processes_per_node(args.nproc_per_node, slots)
    node_argv = node_command(args.sources, len(hosts), nproc)
    ssh = ssh_base(args.ssh_config, args.ssh_port)
    free_port = probe_hosts(hosts, ssh)
    master_addr, master_port = args.master_addr or hosts[0], args.master_port or free_port
    commands = []
    for rank, host in enumerate(hosts):
        argv = node_argv(rank, master_addr, master_port)
        env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "NODE_RANK": str(rank)}
        commands.append((host, [*ssh, host, remote_command(env, argv)]))
    print(f"trainer launch: {len(hosts)} nodes x {nproc} processes; master {master_addr}:{master_port}; "
          f"node 0's output follows", file=sys.stderr, flush=True)
    return run_nodes(commands)


# --------------------------------------------------------------------------- the input


def read_hosts(hosts: str | None, hostfile: str | None) -> tuple[list[str], list[int]]:
    """(the hosts in order, the hostfile's slots of each, if it gave them); duplicates and empty lists refused."""
    if (hosts is None) == (hostfile is None):
        raise MisconfigurationError("give the hosts with --hosts h1,h2 or --hostfile FILE (one of the two).")
    if hosts is not None:
        names, slots = [name.strip() for name in hosts.split(",")], []
        if not all(names):
            raise MisconfigurationError(f"--hosts {hosts!r} has an empty name; write the hosts as h1,h2.")
    else:
        entries = read_hostfile(Path(hostfile))
        names, slots = [name for name, _ in entries], [count for _, count in entries if count is not None]
    seen: dict[str, str] = {}
    for name in names:
        if name.lower() in seen:
            raise MisconfigurationError(f"host {name!r} is listed twice; each host runs one node (give it more "
                                        "processes with --nproc-per-node, or slots=N in a hostfile).")
        seen[name.lower()] = name
    return names, slots


def read_hostfile(path: Path) -> list[tuple[str, int | None]]:
    """The hostfile's (host, slots) pairs: `HOST [slots=N] [max_slots=M]` lines, # comments, blank lines."""
    if not path.is_file():
        raise MisconfigurationError(f"hostfile {str(path)!r} does not exist.")
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        host, *fields = text.split()
        slots = None
        for field in fields:
            key, _, value = field.partition("=")
            if key == "slots" and value.isdigit() and int(value) >= 1:
                slots = int(value)
            elif key not in ("max_slots", "max-slots"):  # MPI's cap on oversubscription: nothing to do here
                raise MisconfigurationError(f"{path}:{number}: cannot read {field!r}; a hostfile line is "
                                            "`HOST slots=N` with N at least 1 (as DeepSpeed and MPI read it).")
        entries.append((host, slots))
    if not entries:
        raise MisconfigurationError(f"hostfile {str(path)!r} names no host; write one `HOST slots=N` line per host.")
    return entries


def processes_per_node(given: int | None, slots: list[int]) -> int:
    """--nproc-per-node, else the hostfile's slots (the same on every host: every node runs as many), else 1."""
    if given is not None:
        if given < 1:
            raise MisconfigurationError(f"--nproc-per-node {given}: give 1 or more.")
        return given
    if len(set(slots)) > 1:
        raise MisconfigurationError(f"the hostfile gives different slots ({', '.join(map(str, slots))}), but every "
                                    "node runs the same number of processes; give --nproc-per-node.")
    return slots[0] if slots else 1


def node_command(sources: list[str], num_nodes: int, nproc: int) -> Callable[[int, str, int], list[str]]:
    """A function (node rank, master address, master port) -> the command one node runs; the recipe is checked
    here, once, before any host is contacted."""
    if not sources:
        raise MisconfigurationError("give a recipe (and overrides) or a script.py to launch.")
    if Path(sources[0]).suffix == ".py":
        script = sources[0]
        if not Path(script).is_file():
            raise MisconfigurationError(f"script {script!r} does not exist.")
        return lambda rank, addr, port: [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={num_nodes}", f"--node-rank={rank}",
            f"--nproc-per-node={nproc}", f"--master-addr={addr}", f"--master-port={port}", script, *sources[1:]]
    stage, recipe = (sources[0], sources[1:]) if sources[0] in STAGES else ("fit", sources)
    shape = [f"trainer.num_nodes={num_nodes}", f"trainer.devices={nproc}"]
    checked = _checked_recipe(recipe + shape)
    return lambda rank, addr, port: [sys.executable, "-m", "torchyard.trainer", stage, *checked]


def _checked_recipe(sources: list[str]) -> list[str]:
    """The recipe's sources with absolute paths, after loading it here (its mistakes are one-line errors here)."""
    # Imports torch: `trainer --help` must not wait for it.
    from torchyard.trainer.cli.recipe import is_override, load_recipe_to_run_elsewhere

    if all(is_override(source) for source in sources):
        raise MisconfigurationError("give a recipe file before the key=value overrides.")
    return load_recipe_to_run_elsewhere(sources)[1]


# --------------------------------------------------------------------------- ssh


def ssh_base(config: str | None, port: int | None) -> list[str]:
    """The ssh client's command up to the host: no password prompts, a bounded connect, no terminal."""
    if shutil.which("ssh") is None:
        raise MisconfigurationError("ssh is not on PATH: install an OpenSSH client (Debian: openssh-client).")
    if config is not None and not Path(config).is_file():
        raise MisconfigurationError(f"--ssh-config {config!r} does not exist.")
    options = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", "-o", "ServerAliveInterval=15",
               "-o", "ServerAliveCountMax=4"]
    return ["ssh", "-T", *options, *(["-F", config] if config else []), *(["-p", str(port)] if port else [])]


def remote_command(env: dict[str, str], argv: list[str]) -> str:
    """The shell line one host runs: this working directory, the variables, the guard around the node."""
    forwarded = {key: value for key, value in os.environ.items() if key.startswith(FORWARDED_PREFIXES)}
    assignments = [f"{key}={shlex.quote(value)}" for key, value in {**forwarded, **env}.items()]
    guard = [sys.executable, "-m", "torchyard.trainer.launch.ssh_hosts", "--"]
    return " ".join(["cd", shlex.quote(os.getcwd()), "&&", "exec", "env", *assignments,
                     *map(shlex.quote, guard + argv)])


def probe_hosts(hosts: list[str], ssh: list[str]) -> int:
    """Log in to every host at once and run PROBE there; a one-line error for the first that fails; the free
    port the first host found."""
    line = f"cd {shlex.quote(os.getcwd())} || exit 3; {shlex.quote(sys.executable)} -c {shlex.quote(PROBE)}"
    probes = [subprocess.Popen([*ssh, host, line], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for host in hosts]
    answers = []
    try:
        for host, probe in zip(hosts, probes):
            try:
                out, err = probe.communicate(timeout=CONNECT_TIMEOUT_S + 30)
            except subprocess.TimeoutExpired:
                raise MisconfigurationError(f"{host} did not answer over ssh within {CONNECT_TIMEOUT_S + 30} s.") \
                    from None
            answers.append(_probe_answer(host, probe.returncode, out, err))
    finally:
        for probe in probes:
            if probe.poll() is None:
                probe.kill()
                probe.wait()
    return answers[0]


def _probe_answer(host: str, code: int, out: str, err: str) -> int:
    said = ([line.strip() for line in err.splitlines() if line.strip()] or [f"exit status {code}"])[-1]
    if code == 255:
        raise MisconfigurationError(f"cannot log in to {host} over ssh ({said}); check the host name, that sshd runs "
                                    f"there, and that key-based login works: ssh -o BatchMode=yes {host} true")
    if code == 3:
        raise MisconfigurationError(f"the working directory {os.getcwd()} does not exist on {host}; the nodes run "
                                    "there (a shared file system, or the same files at the same path).")
    if code == 127:
        raise MisconfigurationError(f"{sys.executable} does not exist on {host}; every host needs this environment "
                                    "at the same path.")
    if code != 0 or not out.strip().isdigit():
        raise MisconfigurationError(f"{sys.executable} on {host} cannot import torchyard ({said}); install the same "
                                    "environment on every host.")
    return int(out.strip())


# --------------------------------------------------------------------------- the nodes, from here


@dataclass
class Node:
    """One host's ssh process, which runs its node; `log` holds its output unless it is shown here (node 0)."""

    rank: int
    host: str
    process: subprocess.Popen
    log: Path | None

    def tell(self, word: str) -> None:
        """Send the guard a line on ssh's stdin (raw write: a signal handler may call this)."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.write(self.process.stdin.fileno(), f"{word}\n".encode())

    def hang_up(self) -> None:
        """Close ssh's stdin: the guard then ends the node's process group."""
        with contextlib.suppress(OSError, ValueError):
            self.process.stdin.close()


def run_nodes(commands: list[tuple[str, list[str]]]) -> int:
    """Start every node, forward signals, stop the rest when one fails; the job's exit status."""
    log_dir = Path(tempfile.mkdtemp(prefix="trainer-launch-"))
    nodes: list[Node] = []
    try:
        for rank, (host, command) in enumerate(commands):
            log = None if rank == 0 else log_dir / f"node{rank}-{host}.log"
            output = None if log is None else open(log, "wb")  # noqa: SIM115 - the child holds it; closed below
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT
                                       if output else None, bufsize=0, start_new_session=True)
            if output is not None:
                output.close()
            nodes.append(Node(rank, host, process, log))
        with _forwarded_signals(nodes) as received:
            failed = _watch(nodes, received)
    finally:
        _kill_ssh(nodes)
    if received:
        return 128 + int(received[0])
    if failed is not None:
        _report_failure(failed)
        return failed.process.returncode
    shutil.rmtree(log_dir, ignore_errors=True)
    return nodes[0].process.returncode


@contextlib.contextmanager
def _forwarded_signals(nodes: list[Node]) -> Iterator[list[signal.Signals]]:
    """Ctrl-C, SIGTERM and SIGHUP here go to every node's guard; a second one stops the nodes at once."""
    received: list[signal.Signals] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum))
        what = "every node was told to stop; another one stops them at once" if len(received) == 1 else "stopping now"
        # os.write, not print: the handler may run while the main thread is inside a print.
        os.write(2, f"\ntrainer launch: {received[-1].name}: {what}\n".encode())
        for node in nodes:
            if len(received) == 1:
                node.tell(SIGNAL_WORDS[signal.Signals(signum)])
            else:
                node.hang_up()

    saved = {sig: signal.signal(sig, forward) for sig in SIGNAL_WORDS}
    try:
        yield received
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _watch(nodes: list[Node], received: list[signal.Signals]) -> Node | None:
    """Wait for every node; the first that failed (the others were then told to stop), if any."""
    failed, stop_since, hung_up = None, None, False
    while any(node.process.poll() is None for node in nodes):
        if failed is None and not received:
            failed = next((node for node in nodes if node.process.poll() not in (None, 0)), None)
            if failed is not None:
                for node in nodes:
                    node.tell("TERM")
        if stop_since is None and (failed is not None or received):
            stop_since = time.monotonic()
        if stop_since is not None and not hung_up and time.monotonic() - stop_since > STOP_GRACE_S:
            hung_up = True
            for node in nodes:
                node.hang_up()
        if stop_since is not None and time.monotonic() - stop_since > STOP_GRACE_S + KILL_GRACE_S * 2:
            break  # the guards had their time; _kill_ssh ends what is left here
        time.sleep(0.1)
    if failed is None and not received:
        failed = next((node for node in nodes if node.process.returncode not in (None, 0)), None)
    return failed


def _kill_ssh(nodes: list[Node]) -> None:
    """Hang up on every guard and end every ssh process that is still running."""
    for node in nodes:
        node.hang_up()
    deadline = time.monotonic() + KILL_GRACE_S
    for node in nodes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        if node.process.poll() is None:
            node.process.kill()
            node.process.wait()


def _report_failure(node: Node) -> None:
    where = "" if node.log is None else f"; the end of its output ({node.log}):"
    print(f"trainer launch: node {node.rank} ({node.host}) exited with status {node.process.returncode}; the other "
          f"nodes were stopped{where}", file=sys.stderr)
    if node.log is not None and node.log.is_file():
        print("\n".join(node.log.read_text(errors="replace").splitlines()[-FAILURE_TAIL_LINES:]), file=sys.stderr)


# --------------------------------------------------------------------------- the guard, on each host


def node_main(argv: list[str] | None = None) -> int:
    """On a host: check the master, run the node (`argv`) in a process group of its own, obey the launcher's
    lines on stdin (INT, TERM; end of input: stop), and leave no process of that group behind."""
    command = list(sys.argv[1:] if argv is None else argv)
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        print("usage: python -m torchyard.trainer.launch.ssh_hosts -- COMMAND [ARGS ...] (what `trainer launch` runs "
              "on each host, with MASTER_ADDR, MASTER_PORT and NODE_RANK set)", file=sys.stderr)
        return 2
    guard = _Guard()
    threading.Thread(target=guard.obey_launcher, name="launcher", daemon=True).start()
    try:
        addr, port, node_rank = node_rendezvous()
        node_checks.check_master(addr, port, serves=node_rank == 0, wait_s=NODE_START_WAIT_S, who=f"node {node_rank}")
    except MisconfigurationError as err:
        print(f"trainer launch: error: {err}", file=sys.stderr, flush=True)
        return 2
    return guard.run(command)


class _Guard:
    """The node process and what may stop it: a line from the launcher, a signal, the end of the launcher's input."""

    def __init__(self) -> None:
        self.node: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def run(self, command: list[str]) -> int:
        with self.lock:
            # Its own input is empty: the launcher's lines on ours are for this guard.
            self.node = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
        for sig in SIGNAL_WORDS:
            signal.signal(sig, lambda signum, _frame: self.signal_node(signal.Signals(signum)))
        code = self.node.wait()
        end_process_group(self.node.pid, grace_s=1.0)  # what the node left behind (a worker it did not reap)
        return code if code >= 0 else 128 - code

    def signal_node(self, sig: signal.Signals) -> None:
        with self.lock:
            if self.node is None:
                os._exit(128 + int(sig))  # nothing started yet: nothing to stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.node.pid, sig)  # its elastic agent passes it on to the workers, once

    def obey_launcher(self) -> None:
        for line in sys.stdin:
            word = line.strip()
            if word in ("INT", "TERM"):
                self.signal_node(signal.SIGINT if word == "INT" else signal.SIGTERM)
        with self.lock:  # the launcher is gone, or the connection: stop everything
            if self.node is None:
                os._exit(143)
        end_process_group(self.node.pid, grace_s=KILL_GRACE_S)


def end_process_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to every process of the group, then SIGKILL to what is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # raises ProcessLookupError once the group is empty
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(node_main())
