"""curl's verdict on the TLS servers a rig will reach (rigup.facts.network.HttpsTrust): one line per origin,

    ==> https://10.213.0.1:8080 60 curl: (60) SSL certificate problem: unable to get local issuer certificate
    ==> https://github.com 0

(the origin, curl's exit status, its stderr on one line), or `==> no-curl` where curl is not installed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rigup.parsers.common import JsonDataclass, ParseError, split_lines

NO_CURL = "==> no-curl"
# curl's exit statuses for a certificate it refused: 60 (the peer's certificate could not be checked against the
# known CAs; newer curl also for a name that does not match), 51 (its name or address does not match, older
# curl), 83 (issuer check failed), 77 (the CA bundle could not be read)
UNTRUSTED_STATUSES = frozenset({51, 60, 77, 83})


@dataclass(frozen=True)
class TlsProbe(JsonDataclass):
    """What the rig's curl said of one origin: its exit status and stderr on one line ('' when fine)."""

    origin: str
    status: int
    message: str = ""

    @property
    def untrusted(self) -> bool:
        """The handshake failed on the certificate (unreachable is other checks' business)."""
        return self.status in UNTRUSTED_STATUSES

    @property
    def reason(self) -> str:
        """curl's words without its "curl: (60) " prefix."""
        text = self.message
        if text.startswith("curl: ("):
            text = text.split(") ", 1)[-1]
        return text.strip()


def parse_tls_probes(output: str | Iterable[str]) -> dict[str, TlsProbe] | None:
    """{origin: TlsProbe} from HttpsTrust's output; None when the rig has no curl (nothing was checked)."""
    probes: dict[str, TlsProbe] = {}
    for line in split_lines(output):
        if not line.strip():
            continue
        if line.strip() == NO_CURL:
            return None
        if not line.startswith("==> "):
            raise ParseError(f"unexpected line in the TLS probes: {line!r}")
        origin, _, rest = line[4:].partition(" ")
        status, _, message = rest.partition(" ")
        if not origin.startswith("https://") or not status.isdigit():
            raise ParseError(f"unexpected line in the TLS probes: {line!r}")
        probes[origin] = TlsProbe(origin, int(status), " ".join(message.split()))
    return probes
