"""Issue 42's probe test, for any bed: what the fleet's boundary lets through, read from the same table the
firewall and docs/security.md's port table are rendered from (rigup.desired.boundary.SERVICES and holes).

From outside (the bed's hub namespace: on the fleet's network, no member, not the control machine), every TCP
port of every fleet host is scanned and each service's requests tried (tests/e2e/portscan.py): only the ports
the table opens to anyone (SSH, the entrance) may answer, and no request without credentials may succeed;
the entrance with a valid key does. From a member the firewall admits, each service that asks who is
calling (a row's `asks`) refuses a caller without credentials (401 or 403), and each that takes no writes (a
row's `read_only`: the image registries) refuses them (405). A bed whose firewall is not under test as a whole
asks some rows alone (check_services_from_outside: no port scan).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigup.desired.boundary import CONTROL, SERVICES, Service, holes
from rigup.desired.fleet import load_fleet
from rigup.desired.fleet_plan import FleetPlan, fleet_entries, plan_fleet
from rigup.desired.knobs import load_defaults

SCANNER = Path(__file__).with_name("portscan.py")
SCAN_TIMEOUT_S = 1.0  # a SYN-ACK on the bed's bridge comes in well under a millisecond
SCAN_WIDTH = 12000  # connections in flight (the scanner raises its open-files limit to the hard one)


@dataclass(frozen=True)
class Request:
    host: str
    port: int
    service: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        auth = " (with a key)" if self.headers else ""
        return f"{self.method} {self.host}:{self.port}{self.path} [{self.service}]{auth}"


def plan_of(fleet_file: Path) -> FleetPlan:
    """The FleetPlan the bed's converge renders its boundary from."""
    return plan_fleet(fleet_entries(load_fleet(fleet_file)))


def _numbers(specs: list[str] | tuple[str, ...]) -> list[int]:
    """nftables port specs as single ports ('1-65535' ranges are the scan's business, not a request's)."""
    return [int(spec) for spec in specs if spec.isdigit()]


def _expand(specs: tuple[str, ...]) -> set[int]:
    out: set[int] = set()
    for spec in specs:
        first, _, last = spec.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def open_to_anyone(fleet: FleetPlan, host: str) -> set[int]:
    """The ports the table opens to anyone on `host` (SSH, the entrance)."""
    return {port for hole in holes(fleet, host) if hole.sources is None for port in _expand(hole.ports)}


def _default_port(service: Service) -> list[int]:
    """Where a service no host of this fleet runs would listen: its port knob's default."""
    knob_name = service.port.split()[0]
    value = load_defaults().get(knob_name)
    if isinstance(value, str) and ":" in value:  # a listen address (prometheus_listen_address)
        value = value.rpartition(":")[2]
    return [int(value)] if isinstance(value, int) or (isinstance(value, str) and value.isdigit()) else []


def _split(probe: str) -> tuple[str, str]:
    method, _, path = probe.rpartition(" ")
    return method or "GET", path


def outsider_requests(fleet: FleetPlan, keys: Mapping[tuple[str, int], str]) -> list[Request]:
    """Every service's requests at every port it has on every host (a service no host runs: at its default port
    on every host, or where its HTTP APIs would listen); `keys`: (host, port) -> a valid bearer key, tried once
    more with it on the first request."""
    out = []
    hosts = [h.name for h in fleet.hosts]
    for service in SERVICES:
        runs = {h: service.ports(fleet, h) for h in hosts}
        anywhere = any(runs.values())
        for host in hosts:
            if runs[host]:
                ports = _numbers(service.probe_ports) if service.probe_ports else _numbers(runs[host])
            elif not anywhere:
                ports = _numbers(service.probe_ports) or _default_port(service)
            else:
                continue
            for port in ports:
                for probe in service.probes:
                    out.append(Request(host, port, service.name, *_split(probe)))
                if (host, port) in keys and service.probes:
                    key = keys[(host, port)]
                    out.append(Request(host, port, service.name, *_split(service.probes[0]),
                                       (("Authorization", f"Bearer {key}"),)))
    return out


def scan_from(netns: str, addresses: list[str], requests: list[tuple[str, Request]], again: bool = True) -> dict[str, Any]:
    """Run tests/e2e/portscan.py inside network namespace `netns`: (address, request) pairs to try (`again`: with no
    address to scan, a second time)."""
    body = {"addresses": addresses, "timeout_s": SCAN_TIMEOUT_S, "width": SCAN_WIDTH, "again": again,
            "probes": [[address, r.port, r.method, r.path, dict(r.headers)] for address, r in requests],
            "keyed": [index for index, (_, r) in enumerate(requests) if r.headers]}
    proc = subprocess.run(["ip", "netns", "exec", netns, sys.executable, str(SCANNER)], input=json.dumps(body),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


# What an entrance host says about itself when its keyed request got no 200: nginx's own errors, what listens,
# and the firewall as loaded (rigup's boundary table among the rest)
EXPLAIN = ("tail -n 20 /var/log/nginx/error.log; echo '--- ss -ltn'; ss -ltn; echo '--- nft list ruleset'; "
           "nft list ruleset")


def check_from_outside(fleet: FleetPlan, ip: Callable[[str], str], netns: str,
                       keys: Mapping[tuple[str, int], str],
                       run_on: Callable[[str, str], str] | None = None) -> dict[str, Any]:
    """The outsider's scan and requests, asserted: on each host exactly the ports open to anyone answer (so the
    scan cannot pass by seeing nothing), no request without a key succeeds (2xx or 3xx, over TLS or plain
    HTTP), and the entrance's first request with a valid key does (once it answered it before the probes: the
    scanner waits for that, bounded, and tries a keyed request that got no answer at all again). `run_on(host,
    command)`: its output, for what an entrance host said when its keyed request failed. Returns the scanner's
    answer."""
    hosts = [h.name for h in fleet.hosts]
    requests = outsider_requests(fleet, keys)
    answer = scan_from(netns, [ip(h) for h in hosts], [(ip(r.host), r) for r in requests])
    scanned = {h: answer["scan"][ip(h)] for h in hosts}
    assert all(not s["errors"] for s in scanned.values()), {h: s["errors"] for h, s in scanned.items()}
    seen = {h: set(s["open"]) for h, s in scanned.items()}
    wanted = {h: open_to_anyone(fleet, h) for h in hosts}
    assert seen == wanted, f"open from outside: {seen}; the table opens to anyone: {wanted}"
    for when in ("probes", "probes_after"):
        answered = [(r, [code for code in codes if code is not None]) for r, codes in zip(requests, answer[when])]
        let_in = [f"{r}: {codes}" for r, codes in answered if not r.headers and any(code < 400 for code in codes)]
        assert not let_in, f"requests an outsider got through: {let_in}"
        keyed = [(r, codes) for r, codes in answered if r.headers]
        entrance = [f"{r}: {codes}" for r, codes in answered if r.port in {port for _, port in keys}]
        if len(keyed) == len(keys) and all(200 in codes for _, codes in keyed):
            continue
        said = {host: run_on(host, EXPLAIN) for host in sorted({host for host, _ in keys})} if run_on else {}
        raise AssertionError(
            f"{when}: the entrance with its key: {keyed}; all its answers: {entrance}; keyed requests answered 200 "
            f"before the probes after {answer['ready_seconds']} s (None: not within the bound); keyed retries "
            f"{answer['retries']} before the scan, {answer['retries_after']} after; conntrack entries in the "
            f"outsider's namespace {answer['tracked_before']} -> {answer['tracked_after']}; what the entrance hosts "
            f"said: {said}")
    return answer


def refused_from_members(fleet: FleetPlan, ip: Callable[[str], str],
                         run_on: Callable[[str | None, str], str]) -> tuple[dict[str, list[int]], list[str]]:
    """From a member the firewall admits (a host among the hole's sources, else the control machine: `run_on`
    None), each service that asks who is calling answers its `asks` paths with 401 or 403 to a caller without
    credentials (over TLS without checking the certificate, and in plain HTTP: one of them is its scheme).
    Returns what each answered, by request, and the requests nothing answered (no listener: the caller says
    which may have none, e.g. a cluster worker's pod port)."""
    answers: dict[str, list[int]] = {}
    for host in (h.name for h in fleet.hosts):
        for service in (s for s in SERVICES if s.asks):
            ports = _numbers(service.ports(fleet, host))
            if not ports:
                continue
            sources = service.sources(fleet, host)
            member = next((s for s in sources or () if s not in (CONTROL, host)), None)
            for port in ports:
                for path in service.asks:
                    ask = " ".join(f"curl -sk -o /dev/null -w '%{{http_code}}\\n' -m 5 {scheme}://{ip(host)}:{port}{path};"
                                   for scheme in ("https", "http"))
                    codes = [int(code) for code in run_on(member, ask).split()]
                    answers[f"{service.name} on {host}:{port}{path} from {member or 'the control machine'}"] = codes
    silent = sorted(what for what, codes in answers.items() if not any(codes))  # curl's 000: no HTTP answer
    let_in = {what: codes for what, codes in answers.items() if any(codes) and not {401, 403} & set(codes)}
    assert answers and not let_in, f"services that did not ask who is calling: {let_in}"
    return answers, silent


def _let_in(requests: list[Request], answers: list[list[int | None]]) -> list[str]:
    """The unkeyed requests that got a 2xx or 3xx answer, over TLS or in plain HTTP."""
    return [f"{r}: {codes}" for r, codes in zip(requests, answers)
            if not r.headers and any(code is not None and code < 400 for code in codes)]


def check_services_from_outside(fleet: FleetPlan, ip: Callable[[str], str], netns: str, services: set[str],
                                again: bool = False) -> tuple[list[Request], dict[str, Any]]:
    """The outsider's requests to the rows named (`services`: Service.name) alone, without the port scan (a few
    seconds: a dropped connection costs the scanner's CONNECT_TIMEOUT_S, in parallel), asserted: none succeeds.
    Returns the requests and the scanner's answer."""
    requests = [r for r in outsider_requests(fleet, {}) if r.service in services]
    assert {r.service for r in requests} == services, (services, requests)
    answer = scan_from(netns, [], [(ip(r.host), r) for r in requests], again)
    for when in ("probes", "probes_after"):
        let_in = _let_in(requests, answer[when])
        assert not let_in, f"{when}: requests an outsider got through: {let_in}"
    return requests, answer


def writes_refused_from_members(fleet: FleetPlan, ip: Callable[[str], str],
                                run_on: Callable[[str | None, str], str]) -> dict[str, list[int]]:
    """From a member the firewall admits (as refused_from_members picks it), each service that takes no writes (a
    row's `read_only`) answers each of them 405, over TLS or in plain HTTP, and lets none through. Returns what
    each answered, by request."""
    answers: dict[str, list[int]] = {}
    for host in (h.name for h in fleet.hosts):
        for service in (s for s in SERVICES if s.read_only):
            ports = _numbers(service.ports(fleet, host))
            member = next((s for s in service.sources(fleet, host) or () if s not in (CONTROL, host)), None)
            for port in ports:
                for write in service.read_only:
                    method, path = _split(write)
                    ask = " ".join(f"curl -sk -o /dev/null -w '%{{http_code}}\\n' -m 5 -X {method} "
                                   f"{scheme}://{ip(host)}:{port}{path};" for scheme in ("https", "http"))
                    codes = [int(code) for code in run_on(member, ask).split()]
                    answers[f"{write} on {host}:{port} [{service.name}] from {member or 'the control machine'}"] = codes
    wrong = {what: codes for what, codes in answers.items() if 405 not in codes or any(0 < c < 400 for c in codes)}
    assert answers and not wrong, f"writes not refused with 405: {wrong}"
    return answers
