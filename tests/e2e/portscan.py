"""An outsider's probe of the fleet (issue 42's probe test), run inside the test bed's hub namespace: a host on
the fleet's network that is no member. Standard library only: `ip netns exec <hub> python3 portscan.py`, with
a JSON request on stdin and a JSON answer on stdout.

Request: {"addresses": [...], "timeout_s": 1.0, "width": 8000, "probes": [[address, port, method, path,
{header: value}], ...]}. Answer: {"scan": {address: {"open": [ports], "reset": n, "silent": n, "errors":
{errno name: n}}}, "probes": [[https status or null, http status or null], ...] (before the scan),
"probes_after" (the same, after it), "tracked_before"/"tracked_after" (this namespace's conntrack count, or
null), "probe_seconds", "seconds"}.

The scan: a non-blocking connect() to every TCP port 1-65535 of every address, `width` at a time; a port is
open when the connection completes within `timeout_s`, reset when the host answers with RST, silent when
nothing comes back (the boundary drops it). Any other outcome (EMFILE, EADDRNOTAVAIL, ...) is counted under
errors, never as closed, so a scan that could not look cannot pass for one that saw nothing.
The probes: one HTTP/1.1 request each, over TLS (no certificate check: an outsider trusts nothing) and in
plain HTTP, each answer's status code (null: no connection or no HTTP answer).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import json
import resource
import selectors
import socket
import ssl
import sys
import time


def scan(addresses: list[str], timeout_s: float, width: int) -> dict[str, dict]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    width = min(width, hard - 64)
    result = {a: {"open": [], "reset": 0, "silent": 0, "errors": collections.Counter()} for a in addresses}
    todo = collections.deque((a, p) for a in addresses for p in range(1, 65536))
    selector = selectors.DefaultSelector()
    waiting: collections.deque = collections.deque()  # (deadline, socket), in the order they started

    def outcome(address: str, port: int, code: int) -> None:
        if code == 0:
            result[address]["open"].append(port)
        elif code == errno.ECONNREFUSED:
            result[address]["reset"] += 1
        elif code in (errno.ETIMEDOUT, errno.EHOSTUNREACH):
            result[address]["silent"] += 1
        else:
            result[address]["errors"][errno.errorcode.get(code, str(code))] += 1

    while todo or waiting:
        while todo and len(selector.get_map()) < width:
            address, port = todo.popleft()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((address, port))
            if code == errno.EINPROGRESS:
                selector.register(sock, selectors.EVENT_WRITE, (address, port))
                waiting.append((time.monotonic() + timeout_s, sock))
            else:
                outcome(address, port, code)
                sock.close()
        for key, _ in selector.select(0.02):
            sock = key.fileobj
            outcome(*key.data, sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
            selector.unregister(sock)
            sock.close()
        now = time.monotonic()
        while waiting and (waiting[0][0] <= now or waiting[0][1].fileno() < 0):
            _, sock = waiting.popleft()
            if sock.fileno() >= 0:  # still connecting at its deadline: nothing came back
                address, port = selector.get_key(sock).data
                result[address]["silent"] += 1
                selector.unregister(sock)
                sock.close()
    for entry in result.values():
        entry["errors"] = dict(entry["errors"])
    return result


async def status(address: str, port: int, method: str, path: str, headers: dict[str, str], tls: bool,
                 timeout_s: float) -> int | None:
    context = None
    if tls:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address, port, ssl=context), timeout_s)
    except (OSError, asyncio.TimeoutError, ssl.SSLError):
        return None
    try:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {address}:{port}", "Connection: close", "Content-Length: 0"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        first = await asyncio.wait_for(reader.readline(), timeout_s)
        words = first.decode("latin-1").split()
        return int(words[1]) if len(words) >= 2 and words[0].startswith("HTTP/") and words[1].isdigit() else None
    except (OSError, asyncio.TimeoutError, ssl.SSLError, ValueError):
        return None
    finally:
        writer.close()


async def probe_all(probes: list[list], timeout_s: float) -> list[list[int | None]]:
    async def both(address: str, port: int, method: str, path: str, headers: dict[str, str]) -> list[int | None]:
        return list(await asyncio.gather(status(address, port, method, path, headers, True, timeout_s),
                                         status(address, port, method, path, headers, False, timeout_s)))
    return list(await asyncio.gather(*(both(*probe) for probe in probes)))


def tracked() -> int | None:
    """The connections this namespace's conntrack holds (None: it tracks none)."""
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_count") as count:
            return int(count.read())
    except OSError:
        return None


# Every probe starts at once (a few hundred connections, TLS handshakes among them, in one process): on a loaded
# 2-core machine an answering service needs more than a few seconds to get through them all; a filtered port
# costs its probe the whole wait, in parallel with the rest.
PROBE_TIMEOUT_S = 20.0


def main() -> None:
    request = json.load(sys.stdin)
    started = time.monotonic()
    answer: dict = {"tracked_before": tracked(), "probes": asyncio.run(probe_all(request.get("probes", []), PROBE_TIMEOUT_S))}
    answer["probe_seconds"] = round(time.monotonic() - started, 1)
    answer["scan"] = scan(request["addresses"], float(request.get("timeout_s", 1.0)), int(request.get("width", 8000)))
    answer["tracked_after"] = tracked()
    # after the scan: the probes again, so a scan that broke the network shows
    answer["probes_after"] = asyncio.run(probe_all(request.get("probes", []), PROBE_TIMEOUT_S))
    answer["seconds"] = round(time.monotonic() - started, 1)
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
