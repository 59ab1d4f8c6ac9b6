"""Checks of a multi-node job that every node runs before the nodes meet, whatever started them (torchrun, srun,
mpirun, `trainer launch --hosts`, or the Trainer's own launcher with NODE_RANK set).

- The master address resolves on this node, and its port answers (`check_master`): an error names this host and
  says what to fix there, instead of the rendezvous's "gai error -3" or a wait until the collective timeout.
- Every node runs the same Python, torch and torchyard, and the same script and recipe files (`compare_nodes`,
  over the job's TCPStore before the process group forms): rank 0 prints one table of what differs, and every
  rank stops before training.
- Rank 0 prints the network interface each node's gloo or nccl will use, and the variable that changes it.

Test hook: TORCHYARD_FAKE_VERSION="torch=0.0.0,python=3.0" makes this process report those values instead of
its own, so a test can start a job whose nodes seem to differ.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import importlib.metadata
import ipaddress
import json
import os
import platform
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.errors import MisconfigurationError

#: The test hook (see the module's docstring).
FAKE_VERSION_VARIABLE = "TORCHYARD_FAKE_VERSION"
#: Seconds a name lookup may take: a resolver that does not answer fails the job here, not after minutes.
RESOLVE_TIMEOUT_S = 5.0
#: Seconds a node keeps trying a master port that drops its packets (a firewall, no route) before it gives up.
#: A refused connection only means the master has not started yet: that is waited for as long as the rendezvous.
UNREACHABLE_TIMEOUT_S = 30.0
#: The variables that choose the interface each backend's traffic goes through.
INTERFACE_VARIABLES = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
#: Script and recipe files among the command's arguments, whose contents every node must share.
RUN_FILE_SUFFIXES = (".py", ".yaml", ".yml", ".json")
#: The framework's packages (torchyard.trainer and its sibling torchyard.callbacks), whose files every node shares.
FRAMEWORK_FOLDERS = (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent / "callbacks")


# --------------------------------------------------------------------------- the master address and port


def resolve_master(addr: str, port: int, source: str = "MASTER_ADDR", timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
    """Raise a one-line error naming this host when `addr` (given by `source`) does not resolve here within
    `timeout_s`."""
    host = socket.gethostname()
    fix = (f"fix DNS or /etc/hosts on {host} so that {addr} resolves there, or set MASTER_ADDR to the IP address "
           "of the node that runs rank 0")
    failures: list[socket.gaierror] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            failures.append(err)

    # A daemon thread: a lookup still hanging in the resolver must not keep the failing process alive.
    thread = threading.Thread(target=lookup, name="resolve-master", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise MisconfigurationError(f"{host} got no answer resolving the master address {addr!r} (from {source}) "
                                    f"within {timeout_s:g} s; {fix}.")
    if failures:
        raise MisconfigurationError(f"{host} cannot resolve the master address {addr!r} (from {source}: "
                                    f"{failures[0].strerror}); {fix}.")


def wait_for_master(addr: str, port: int, wait_s: float, who: str = "this node",
                    unreachable_s: float = UNREACHABLE_TIMEOUT_S) -> None:
    """Return once something listens at addr:port. A refused connection (the master is still starting) is tried
    again for up to `wait_s`; packets that go unanswered (a firewall, no route) fail after `unreachable_s`."""
    host, start = socket.gethostname(), time.monotonic()
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, unreachable_s)):
                return
        except ConnectionRefusedError:
            if time.monotonic() - start > wait_s:
                raise MisconfigurationError(
                    f"{who} could not reach the master at {addr}:{port} within {wait_s:g} s from {host} (connection "
                    "refused: nothing listens there); start node 0 (rank 0), and check MASTER_ADDR and MASTER_PORT "
                    "on every node.") from None
        except OSError as err:  # timed out, no route to host, network unreachable
            if time.monotonic() - start > unreachable_s:
                raise MisconfigurationError(
                    f"{who} could not reach the master at {addr}:{port} within {unreachable_s:g} s from {host} "
                    f"({err.strerror or 'timed out'}); open that port between the nodes (firewall, security "
                    "group) or set MASTER_ADDR to an address this node can reach.") from None
        time.sleep(0.5)


def check_master(addr: str, port: int, serves: bool, wait_s: float, who: str, source: str = "MASTER_ADDR") -> None:
    """The master address resolves here, and (unless this node serves it) its port answers."""
    resolve_master(addr, port, source)
    if not serves:
        wait_for_master(addr, port, wait_s, who)


# --------------------------------------------------------------------------- what a node runs


def node_facts(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """{item: value} every node of a job must share: versions, the framework's source, the run's files."""
    facts = {
        "python": platform.python_version(),
        "torch": _installed_version("torch"),
        "torchyard": _installed_version("torchyard"),
        "torchyard source": _framework_digest(),
    }
    for position, argument in enumerate(sys.argv):
        path = Path(argument)
        if path.suffix in RUN_FILE_SUFFIXES and path.is_file():
            # Keyed by position, so a script at another path on another node is still compared to this one.
            facts[f"argument {position} ({path.name})"] = _digest(path.read_bytes())
    facts.update(_fake_versions(os.environ if env is None else env))
    return facts


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _framework_digest() -> str:
    """A digest of the framework's own files: nodes on one version number may still run different code."""
    digest = hashlib.sha256()
    for folder in FRAMEWORK_FOLDERS:
        for path in sorted(folder.rglob("*.py")):
            digest.update(str(path.relative_to(folder.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _digest(data: bytes) -> str:
    return "sha256 " + hashlib.sha256(data).hexdigest()[:12]


def _fake_versions(env: Mapping[str, str]) -> dict[str, str]:
    raw = env.get(FAKE_VERSION_VARIABLE, "")
    pairs = [item.split("=", 1) for item in raw.split(",") if "=" in item]
    return {name.strip(): value.strip() for name, value in pairs}


# --------------------------------------------------------------------------- the network interface


def network_interface(backend: str, env: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """(the interface `backend` will use on this node, as 'name address', whether it is the loopback)."""
    env = os.environ if env is None else env
    variable = INTERFACE_VARIABLES.get(backend, "GLOO_SOCKET_IFNAME")
    if env.get(variable):
        names = env[variable].split(",")
        return f"{env[variable]} ({variable}) {_ipv4_address(names[0].lstrip('^=')) or ''}".rstrip(), False
    if backend == "nccl":
        return _nccl_default_interface()
    return _gloo_default_interface()


def _gloo_default_interface() -> tuple[str, bool]:
    """gloo's choice: the first address of this host's name that it can bind, else the loopback."""
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        for family, kind, _, _, address in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
            with contextlib.suppress(OSError), socket.socket(family, kind) as probe:
                probe.bind((address[0], 0))
                loopback = ipaddress.ip_address(address[0]).is_loopback
                return f"{_interface_of(address[0], loopback)} {address[0]} (the address of {host})", loopback
    return "lo 127.0.0.1 (the host name does not resolve)", True


def _nccl_default_interface() -> tuple[str, bool]:
    """NCCL's choice: an InfiniBand interface (ib*) first, then any but docker* and lo, else lo."""
    named = [(name, _ipv4_address(name)) for _, name in socket.if_nameindex()]
    usable = [(name, address) for name, address in named if address]
    for preferred in (lambda n: n.startswith("ib"), lambda n: not n.startswith(("docker", "lo"))):
        for name, address in usable:
            if preferred(name):
                return f"{name} {address}", False
    return "lo 127.0.0.1", True


def _interface_of(address: str, loopback: bool) -> str:
    for _, name in socket.if_nameindex():
        if _ipv4_address(name) == address:
            return name
    return "lo" if loopback else "?"


def _ipv4_address(interface: str) -> str | None:
    """The interface's IPv4 address, through Linux's SIOCGIFADDR ioctl: the standard library has no call for
    it (psutil has, but is not a dependency). None where it has none, or on another system."""
    siocgifaddr = 0x8915
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        packed = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", interface[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    return None


# --------------------------------------------------------------------------- all nodes, compared on rank 0


def is_multi_node(environment: ClusterEnvironment) -> bool:
    """Whether the job spans several nodes (the checks of this module are for those)."""
    return environment.world_size > environment.local_world_size


def compare_nodes(store: Any, environment: ClusterEnvironment, backend: str, timeout_s: float) -> None:
    """Every rank posts its node's facts to the job's store; rank 0 prints the network interfaces and the table of
    differences, and posts a verdict; every rank raises a one-line error when the nodes differ."""
    prefix = f"trainer/attempt_{environment.restart_count}/node_checks/"
    interface, loopback = network_interface(backend)
    report = {"node": environment.node_rank, "host": socket.gethostname(), "facts": node_facts(),
              "interface": interface, "loopback": loopback}
    store.set(f"{prefix}rank_{environment.global_rank}", json.dumps(report))
    if environment.global_rank == 0:
        keys = [f"{prefix}rank_{rank}" for rank in range(environment.world_size)]
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        reports = [json.loads(store.get(key)) for key in keys]
        nodes = list({report["node"]: report for report in reports}.values())  # one report per node
        print_interfaces(nodes, backend)
        rows = mismatch_rows(nodes)
        if rows:
            print_mismatch_table(rows)
        store.set(f"{prefix}verdict", json.dumps(mismatch_summary(rows)))
    summary = json.loads(store.get(f"{prefix}verdict"))  # waits for rank 0's verdict
    if summary:
        raise MisconfigurationError(
            f"the nodes do not run the same software: {summary}; install the same environment and files on every "
            "node (rank 0 printed a table of every difference). The job stopped before training.")


def mismatch_rows(reports: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(nodes, item, value) for every item whose value is not the same on every node, nodes grouped by value."""
    items = list(dict.fromkeys(item for report in reports for item in report["facts"]))
    rows = []
    for item in items:
        by_value: dict[str, list[str]] = {}
        for report in reports:
            by_value.setdefault(report["facts"].get(item, "missing"), []).append(_node_name(report))
        if len(by_value) > 1:
            rows += [(", ".join(nodes), item, value) for value, nodes in by_value.items()]
    return rows


def mismatch_summary(rows: list[tuple[str, str, str]]) -> str:
    """One line of the differences: 'torch (2.13.0 on node 0 (a), 0.0.0 on node 1 (b))'."""
    items: dict[str, list[str]] = {}
    for nodes, item, value in rows:
        items.setdefault(item, []).append(f"{value} on {nodes}")
    return "; ".join(f"{item} ({', '.join(values)})" for item, values in items.items())


def print_mismatch_table(rows: list[tuple[str, str, str]]) -> None:
    """The table rank 0 prints: node(s), item, value."""
    table = Table("node", "item", "value")
    for row in rows:
        table.add_row(*row)
    console = Console(stderr=True, width=max(100, Console(stderr=True).width))
    console.print("The nodes of this job differ; it stops before training:", highlight=False)
    console.print(table)


def print_interfaces(reports: list[dict[str, Any]], backend: str) -> None:
    """One line per interface choice: which nodes use it, and the variable that picks another."""
    variable = INTERFACE_VARIABLES.get(backend, "GLOO_SOCKET_IFNAME")
    by_interface: dict[str, list[str]] = {}
    for report in reports:
        by_interface.setdefault(report["interface"], []).append(_node_name(report))
    for interface, nodes in by_interface.items():
        print(f"trainer: {backend} uses network interface {interface} on {', '.join(nodes)}; set {variable} on "
              "every node to choose another", file=sys.stderr, flush=True)
    hosts = {report["host"] for report in reports}
    on_loopback = [_node_name(report) for report in reports if report["loopback"]]
    if len(hosts) > 1 and on_loopback:
        print(f"trainer: warning: {', '.join(on_loopback)} would use the loopback interface, which the other hosts "
              f"cannot reach; set {variable} to the interface that connects the nodes (e.g. eth0) or fix /etc/hosts "
              "so that the host name resolves to that interface's address", file=sys.stderr, flush=True)


def _node_name(report: dict[str, Any]) -> str:
    return f"node {report['node']} ({report['host']})"
