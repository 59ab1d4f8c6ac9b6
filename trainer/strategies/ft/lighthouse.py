"""torchft's lighthouse (the server every replica group asks for each step's quorum): started in-process where no
address is given, checked before any process starts where one is; and torchft itself, an optional dependency."""

from __future__ import annotations

import os
import socket
from typing import Any

from torchyard.trainer.errors import MisconfigurationError

#: How long the lighthouse waits, once it could form a quorum, for replicas that are alive (heartbeating) but have
#: not asked yet: a replica that validates, writes a checkpoint or sets up a little longer than its peers is waited
#: for, rather than left a step behind (which would end it, to heal when restarted). torchft's default.
JOIN_TIMEOUT_MS = 60_000
#: A replica whose heartbeats (every 100 ms) stop this long is dead to the lighthouse: the survivors' pause when a
#: replica dies is about this long.
HEARTBEAT_TIMEOUT_MS = 2000
#: Seconds a given lighthouse has to accept a connection in the check before the launch.
CONNECT_TIMEOUT_S = 3.0


def require_torchft() -> Any:
    """The torchft package, or the one-line error that names the extra which installs it."""
    # torchft's Rust side logs every quorum of every step at INFO on stderr, from its import on; RUST_LOG=info
    # shows them again.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as err:
        raise MisconfigurationError(
            f"strategy fault_tolerance needs torchft, which is not installed ({err}); install it with "
            "pip install 'torchyard[ft]'."
        ) from None
    return torchft


def start_lighthouse(min_replicas: int, host: str = "127.0.0.1") -> Any:
    """A lighthouse served by this process on a free port (`.address()`, `.shutdown()`)."""
    from torchft._torchft import LighthouseServer  # torchft's Rust server, no public alias in 0.2

    return LighthouseServer(bind=f"{host}:0", min_replicas=min_replicas, join_timeout_ms=JOIN_TIMEOUT_MS,
                            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or 'http://host:port', as torchft prints it) -> (host, port); a clear error for anything else."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise MisconfigurationError(
            f"fault_tolerance lighthouse={address!r} is not host:port; give the address torchft_lighthouse printed "
            "(for example 'head-node:29510'), or leave it unset and the Trainer starts one."
        )
    return host.strip("[]"), int(port)


def check_lighthouse(address: str) -> str:
    """The lighthouse address as torchft's clients take it ('http://host:port'), once something accepts a
    connection there; else the one-line error, before any process starts."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise MisconfigurationError(
            f"fault_tolerance lighthouse={address!r} does not answer ({err}); start it first (torchft_lighthouse "
            "--min_replicas N --bind [::]:PORT) or leave lighthouse unset and the Trainer starts one."
        ) from None
    return f"http://{host}:{port}"
