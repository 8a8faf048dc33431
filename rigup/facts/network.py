"""Facts about the host's network: how it reaches the other members of its cluster, and whether it trusts the
HTTPS servers it will reach."""

from __future__ import annotations

import shlex
import time

from pyinfra.api import FactBase

from rigup.facts.util import parse_fact_output
from rigup.parsers.curl import NO_CURL, TlsProbe, parse_tls_probes
from rigup.parsers.iproute import PeerRoutes, parse_peer_routes

PROBE_CONNECT_S = 3  # HttpsTrust: a handshake per origin, all at once: an unreachable one costs this much, once
PROBE_MAX_S = 8


class ClusterPeerRoutes(FactBase[PeerRoutes]):
    """
    For each peer (a fleet host's address or name): its IPv4 address as this host resolves it, and the
    route the kernel picks to it (``ip -j route get``); the ephemeral port range (where NCCL, Gloo and
    vLLM's own sockets listen); then every interface's MTU and speed, and the host's clock (compared
    with the control machine's as the output arrives: rigup.desired.cluster.clock_skew). The cluster
    member's interface, address and the head's address are decided from it
    (rigup.desired.cluster.member_net).

    + peers: {name: address or hostname}
    """

    def command(self, peers: dict[str, str]) -> str:
        parts = []
        for name, address in peers.items():
            q = shlex.quote(address)
            parts.append(
                f"a=$(getent ahostsv4 {q} | awk 'NR==1{{print $1}}'); "
                f"printf '==> peer %s %s\\n' {shlex.quote(name)} \"${{a:--}}\"; "
                'if [ -n "$a" ]; then ip -j route get "$a" 2>&1 || true; fi'
            )
        parts.append("printf '==> local_ports %s %s\\n' $(cat /proc/sys/net/ipv4/ip_local_port_range)")
        parts.append(
            "echo '==> links'; for d in /sys/class/net/*; do "
            'printf \'%s %s %s\\n\' "${d##*/}" "$(cat "$d/mtu")" "$(cat "$d/speed" 2>/dev/null || echo -1)"; done'
        )
        parts.append("printf '==> clock %s\\n' \"$(date +%s.%N)\"")  # last: the output arrives right after
        return "; ".join(parts)

    def process(self, output: list[str]) -> PeerRoutes:
        received_at = time.time()
        return parse_fact_output(output, lambda lines: parse_peer_routes(lines, received_at))


class HttpsTrust(FactBase):
    """
    Whether this host trusts the certificate of each https origin it will reach (rigup.desired.trust.https_urls:
    the apt repositories, the Hugging Face endpoint, the git remotes, the registry): one TLS handshake per
    origin with curl and the system's trust store, as apt, git and Docker's engine check it, all at once
    (an unreachable origin costs PROBE_CONNECT_S, and is not judged here). None where curl is not installed.

    + origins: ["https://host[:port]", ...]

    .. code:: python

        {"https://10.213.0.1:8080": TlsProbe(origin=..., status=60, message="curl: (60) SSL certificate problem: ...")}
    """

    def command(self, origins: list[str]) -> str:
        if not origins:
            return "true"
        probes = " ".join(
            f"( e=$(curl -sS -o /dev/null --head --connect-timeout {PROBE_CONNECT_S} --max-time {PROBE_MAX_S} "
            f"{shlex.quote(o + '/')} 2>&1); s=$?; printf '==> %s %s %s\\n' {shlex.quote(o)} \"$s\" \"$(printf '%s\\n' \"$e\" | head -n 1)\" ) &"
            for o in origins
        )
        return f"if ! command -v curl >/dev/null 2>&1; then echo '{NO_CURL}'; else {probes} wait; fi"

    def process(self, output: list[str]) -> dict[str, TlsProbe] | None:
        return parse_fact_output(output, parse_tls_probes)
