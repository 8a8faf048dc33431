"""Facts for the fleet's boundary (rigup.desired.boundary): the addresses the host admits, as it sees them."""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass, field

from pyinfra.api import FactBase

# The control machine's address as this host sees it: sshd sets SSH_CONNECTION ("client port server port")
# for the session; through sudo (env_reset) it is read from the nearest ancestor that still has it.
_CONTROL = (
    'c="${SSH_CONNECTION%% *}"; p=$PPID; n=0; '
    'while [ -z "$c" ] && [ "$p" -gt 1 ] && [ $n -lt 8 ]; do '
    "c=$(tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null | sed -n 's/^SSH_CONNECTION=\\([^ ]*\\) .*/\\1/p'); "
    "p=$(awk '{print $4}' /proc/$p/stat 2>/dev/null || echo 1); n=$((n + 1)); done; "
    "printf '==> control %s\\n' \"${c:--}\""
)


@dataclass(frozen=True)
class BoundaryAddresses:
    """The control machine's address (None: not over SSH) and each peer's addresses ([]: does not resolve)."""

    control: str | None
    peers: dict[str, list[str]] = field(default_factory=dict)


def parse_boundary_addresses(lines: list[str]) -> BoundaryAddresses:
    control, peers = None, {}
    for line in lines:
        words = line.split()
        if words[:2] == ["==>", "control"] and len(words) == 3 and words[2] != "-":
            control = words[2]
        elif words[:2] == ["==>", "peer"] and len(words) >= 3:
            peers[words[2]] = sorted({a for a in words[3:] if _is_address(a)})
    if control is not None and not _is_address(control):
        control = None
    return BoundaryAddresses(control, peers)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class BoundaryView(FactBase[BoundaryAddresses]):
    """
    The addresses the host's boundary admits: the control machine's (where this SSH session comes from)
    and each peer's (a fleet host's ssh_hostname) as the host resolves it (getent ahosts: IPv4 and IPv6).

    + peers: {name: address or hostname}
    """

    def command(self, peers: dict[str, str]) -> str:
        parts = [_CONTROL]
        for name, address in sorted(peers.items()):
            parts.append(f"printf '==> peer %s %s\\n' {shlex.quote(name)} "
                         f"\"$(getent ahosts {shlex.quote(address)} | awk '{{print $1}}' | sort -u | tr '\\n' ' ')\"")
        return "; ".join(parts)

    def process(self, output: list[str]) -> BoundaryAddresses:
        return parse_boundary_addresses(output)
