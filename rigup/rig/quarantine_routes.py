#!/usr/bin/env python3
"""rigup's quarantine routes on the entrance host (issue 43, standard library only): a pod that the sentinel of its
rig quarantined leaves its model's vllm-router within a second, and returns when the sentinel releases it.

    rigup-quarantine-routes run CONFIG      every poll_s: read each rig's quarantines, set each router's workers
    rigup-quarantine-routes once CONFIG     one pass, then exit (what `run` does each time), its account on stdout

CONFIG (written by the converge, no secret: rigup.operations.gateway.entrance_routes) is JSON:
    {"poll_s": 1, "removes_last_route": false, "ca_file": "...", "user": "rigup-prometheus",
     "sentinels": {"rig-02": "https://10.0.0.3:9100/metrics?collect%5B%5D=textfile", ...},
     "routers": [{"model": "m", "admin": "http://127.0.0.1:30100",
                  "workers": [{"url": "http://10.0.0.3:8000", "host": "rig-02", "pod": "dual"}, ...]}, ...]}
The metrics password is read from $CREDENTIALS_DIRECTORY/metrics-password (systemd's LoadCredential= hands it
from a 0600 root file; it is never on a command line).

Where the quarantine is read: each rig's node_exporter, which serves the sentinel's textfile
(rigup_sentinel_quarantined{pod=...} 1 while the pod is held: rigup/rig/servingctl.py), over TLS from the fleet
CA with the monitor's basic auth; only the textfile collector is asked (node_exporter's collect[] filter). A
rig that cannot be read keeps the state last read from it (a pod once quarantined stays out until its rig says
otherwise); a pod without a series is not quarantined.

What a router is told: vllm-router 0.1.17's admin API on its loopback port, checked against the pinned wheel:
`GET /list_workers` ({"urls": [...]}), `POST /remove_worker?url=U` and `POST /add_worker?url=U` ("already
exists" is 400). A removed worker gets no new request (requests already on it finish); the router's
--worker-urls (the converge's routes) come back whole when it restarts, so every pass compares the router's
workers with what they should be and corrects them. Workers the config does not list are left alone.

The rule (decide): a model's quarantined pods leave its router while at least one of its pods is not
quarantined. When every pod of a model is quarantined, removes_last_route (gateway_quarantine_removes_last_route)
decides: false keeps them all routed (the model keeps answering, wrongly: RigupPodQuarantined says the entrance
kept them), true takes them all out (the model's router has no worker and answers 503).
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import sys
import time
import urllib.parse
from base64 import b64encode
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

QUARANTINED = "rigup_sentinel_quarantined"  # the sentinel's series (servingctl.sentinel_metrics)
TIMEOUT_S = 2.0  # one read of a rig's textfile, one call of a router


def decide(workers: Sequence[Tuple[str, bool]], removes_last_route: bool) -> Tuple[List[str], bool]:
    """The workers a model's router should have, from its pods' (url, quarantined) in the config's order, and
    whether that keeps quarantined pods only because every pod of the model is quarantined (the last routes kept)."""
    serving = [url for url, quarantined in workers if not quarantined]
    if serving or not workers:
        return serving, False
    if removes_last_route:
        return [], False
    return [url for url, _ in workers], True


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def _labels(text: str) -> Dict[str, str]:
    """A sample's labels ('pod="a",probe="b"' without the braces), values unescaped."""
    labels, i = {}, 0
    while i < len(text):
        eq = text.index("=", i)
        name = text[i:eq].strip().lstrip(",").strip()
        j, value = eq + 2, []  # after ="
        while text[j] != '"':
            if text[j] == "\\":
                value.append(text[j:j + 2])
                j += 2
            else:
                value.append(text[j])
                j += 1
        labels[name] = _unescape("".join(value))
        i = j + 1
    return labels


def quarantined_pods(exposition: str) -> Dict[str, bool]:
    """Each pod's quarantine from the sentinel's series in a Prometheus text exposition: pod -> held or not."""
    pods: Dict[str, bool] = {}
    for line in exposition.splitlines():
        if not line.startswith(QUARANTINED + "{"):
            continue
        close = line.rindex("}")
        labels = _labels(line[len(QUARANTINED) + 1:close])
        if "pod" in labels:
            pods[labels["pod"]] = float(line[close + 1:].split()[0]) >= 1
    return pods


class Connections:
    """One kept-alive connection per scheme, host and port, and one TLS context: a pass every second would
    otherwise open a TCP connection and a TLS handshake per rig and router call, on both ends (node_exporter's
    server keeps connections alive, as vllm-router's does). A request on a kept connection that the other end
    closed meanwhile is sent once more on a new one; any other failure drops the connection and is raised."""

    def __init__(self, ca_file: Optional[str]) -> None:
        self.ca_file = ca_file
        self.context: Optional[ssl.SSLContext] = None
        self.open: Dict[Tuple[str, str, int], http.client.HTTPConnection] = {}

    def _connection(self, parts: urllib.parse.SplitResult) -> Tuple[Tuple[str, str, int], http.client.HTTPConnection]:
        https = parts.scheme == "https"
        key = (parts.scheme, parts.hostname or "", parts.port or (443 if https else 80))
        conn = self.open.get(key)
        if conn is None:
            if https:
                if self.context is None:
                    self.context = ssl.create_default_context(cafile=self.ca_file)
                conn = http.client.HTTPSConnection(key[1], key[2], timeout=TIMEOUT_S, context=self.context)
            else:
                conn = http.client.HTTPConnection(key[1], key[2], timeout=TIMEOUT_S)
            self.open[key] = conn
        return key, conn

    def request(self, method: str, url: str, headers: Dict[str, str]) -> Tuple[int, str, str]:
        """(status, reason, body) of one request; OSError when there is no answer."""
        parts = urllib.parse.urlsplit(url)
        try:
            return self._send(parts, method, headers)
        except _ClosedMeanwhile:
            return self._send(parts, method, headers)  # on a new connection: what fails now is raised

    def _send(self, parts: urllib.parse.SplitResult, method: str, headers: Dict[str, str]) -> Tuple[int, str, str]:
        key, conn = self._connection(parts)
        reused = conn.sock is not None
        try:
            conn.request(method, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                         body=b"" if method == "POST" else None, headers=headers)
            reply = conn.getresponse()
            body = reply.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            del self.open[key]
            if reused and isinstance(exc, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                raise _ClosedMeanwhile() from exc
            if isinstance(exc, OSError):
                raise
            raise OSError(f"not HTTP ({type(exc).__name__}: {exc})") from exc
        if reply.will_close:
            conn.close()
            del self.open[key]
        return reply.status, reply.reason, body


class _ClosedMeanwhile(OSError):
    """A kept connection the other end had closed: the request is sent once more on a new one."""


class Watcher:
    """One entrance host's routers kept in step with its rigs' quarantines."""

    def __init__(self, config: Dict[str, Any], password: Optional[str],
                 fetch: Optional[Callable[[str], str]] = None, call: Optional[Callable[[str, str], Tuple[int, str]]] = None,
                 out: Callable[[str], None] = print) -> None:
        self.config = config
        self.password = password
        self.fetch = fetch or self._fetch
        self.call = call or self._call
        self.out = out
        self.known: Dict[Tuple[str, str], bool] = {}  # (rig, pod) -> quarantined, as last read
        self.unreadable: Dict[str, str] = {}  # rig -> why it could not be read (said once)
        self.told: Dict[str, str] = {}  # model -> the account last printed for it
        self.connections = Connections(config.get("ca_file"))

    def _fetch(self, url: str) -> str:
        headers = {}
        if self.password is not None:
            token = b64encode(f"{self.config.get('user', '')}:{self.password}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        status, reason, body = self.connections.request("GET", url, headers)
        if status != 200:
            raise OSError(f"HTTP Error {status}: {reason}")
        return body

    def _call(self, method: str, url: str) -> Tuple[int, str]:
        status, _, body = self.connections.request(method, url, {})
        return status, body

    def read_rigs(self) -> None:
        for rig, url in sorted(self.config.get("sentinels", {}).items()):
            try:
                pods = quarantined_pods(self.fetch(url))
            except (OSError, ValueError) as exc:
                why = str(getattr(exc, "reason", exc))
                if self.unreadable.get(rig) != why:
                    self.out(f"rigup-quarantine-routes: {rig}: its sentinel's series cannot be read ({why}); "
                             "its pods keep the state last read")
                self.unreadable[rig] = why
                continue
            if self.unreadable.pop(rig, None) is not None:
                self.out(f"rigup-quarantine-routes: {rig}: its sentinel's series are read again")
            for key in [k for k in self.known if k[0] == rig and k[1] not in pods]:
                del self.known[key]
            for pod, held in pods.items():
                self.known[(rig, pod)] = held

    def settle(self, router: Dict[str, Any]) -> Optional[str]:
        """Set one router's workers to what decide() says; the account of it (None: the router cannot be asked)."""
        workers = router["workers"]
        states = [(w["url"], self.known.get((w["host"], w["pod"]), False)) for w in workers]
        wanted, kept = decide(states, bool(self.config.get("removes_last_route")))
        admin = router["admin"]
        status, body = self.call("GET", f"{admin}/list_workers")
        if status != 200:
            return None
        try:
            present = set(json.loads(body).get("urls") or [])
        except ValueError:
            return None
        for w in workers:
            url, quoted = w["url"], urllib.parse.quote(w["url"], safe="")
            if url in wanted and url not in present:
                self.call("POST", f"{admin}/add_worker?url={quoted}")
            elif url not in wanted and url in present:
                self.call("POST", f"{admin}/remove_worker?url={quoted}")
        out = [f"{w['host']}/{w['pod']}" for w in workers if w["url"] not in wanted]
        held = [f"{w['host']}/{w['pod']}" for (url, q), w in zip(states, workers) if q and url in wanted]
        if kept:
            return (f"{router['model']}: every pod is quarantined ({', '.join(held)}); the entrance keeps routing to "
                    "them (gateway_quarantine_removes_last_route is false)")
        if out and not wanted:
            return f"{router['model']}: every pod is quarantined; no route left (gateway_quarantine_removes_last_route)"
        if out:
            return f"{router['model']}: out of its routes (quarantined): {', '.join(out)}"
        return f"{router['model']}: every pod routed"

    def once(self) -> List[str]:
        self.read_rigs()
        told = []
        for router in self.config.get("routers", []):
            account = self.settle(router)
            if account is not None and self.told.get(router["model"]) != account:
                self.told[router["model"]] = account
                self.out(f"rigup-quarantine-routes: {account}")
                told.append(account)
        return told


def load(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return dict(json.load(handle))


def password() -> Optional[str]:
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory or not os.path.exists(os.path.join(directory, "metrics-password")):
        return None
    with open(os.path.join(directory, "metrics-password"), encoding="utf-8") as handle:
        return handle.read().strip()


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("run", "once"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    config = load(args[1])
    watcher = Watcher(config, password(), out=lambda line: print(line, flush=True))
    if args[0] == "once":
        watcher.once()
        return 0
    poll_s = float(config.get("poll_s", 1))
    while True:
        started = time.monotonic()
        watcher.once()
        time.sleep(max(0.0, poll_s - (time.monotonic() - started)))


if __name__ == "__main__":
    sys.exit(main())
