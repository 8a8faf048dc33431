"""An outsider's probe of the fleet (issue 42's probe test), run inside the test bed's hub namespace: a host on
the fleet's network that is no member. Standard library only: `ip netns exec <hub> python3 portscan.py`, with
a JSON request on stdin and a JSON answer on stdout.

Request: {"addresses": [...], "timeout_s": 1.0, "width": 8000, "probes": [[address, port, method, path,
{header: value}], ...], "keyed": [indices of the probes that carry a valid key and must answer], "again": whether, with no address to
scan, the probes are tried a second time (default true)}. Answer:
{"scan": {address: {"open": [ports], "reset": n, "silent": n, "errors": {errno name: n}}}, "ready_seconds"
(how long the keyed probes took to answer 200 before the probes began; null: not within READY_DEADLINE_S),
"probes": [[https status or null, http status or null], ...] (before the scan), "probes_after" (the same, after
it), "retries"/"retries_after" (keyed probes tried again), "tracked_before"/"tracked_after" (this namespace's
conntrack count, or null), "probe_seconds"/"probe_seconds_after", "seconds"}.

The scan: a non-blocking connect() to every TCP port 1-65535 of every address, `width` at a time; a port is
open when the connection completes within `timeout_s`, reset when the host answers with RST, silent when
nothing comes back (the boundary drops it). Any other outcome (EMFILE, EADDRNOTAVAIL, ...) is counted under
errors, never as closed, so a scan that could not look cannot pass for one that saw nothing.
The probes: one HTTP/1.1 request each, over TLS (no certificate check: an outsider trusts nothing) and in
plain HTTP, each answer's status code (null: no connection or no HTTP answer). A keyed probe with no answer at
all is tried again alone (KEYED_RETRIES); an unkeyed one never is, so any answer it gives counts.
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


def tls_context() -> ssl.SSLContext:
    """One client context for every TLS probe, checking no certificate (an outsider trusts nothing): without the CA
    store that ssl.create_default_context() loads (17 ms of CPU each, here), which, made once per probe inside the
    event loop, held it for seconds while the first probes' timers ran (issue 42)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


async def status(address: str, port: int, method: str, path: str, headers: dict[str, str],
                 context: ssl.SSLContext | None) -> int | None:
    """The status code of one request (over TLS with `context`, else plain HTTP); None: no connection within
    CONNECT_TIMEOUT_S, or no HTTP answer within ANSWER_TIMEOUT_S after it."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return None

    async def ask() -> int | None:
        if context is not None:
            await writer.start_tls(context, server_hostname=address)
        lines = [f"{method} {path} HTTP/1.1", f"Host: {address}:{port}", "Connection: close", "Content-Length: 0"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        words = (await reader.readline()).decode("latin-1").split()
        return int(words[1]) if len(words) >= 2 and words[0].startswith("HTTP/") and words[1].isdigit() else None

    try:
        return await asyncio.wait_for(ask(), ANSWER_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError, ssl.SSLError, ValueError):
        return None
    finally:
        writer.close()


async def both(probe: list, context: ssl.SSLContext) -> list[int | None]:
    """A probe's [over TLS, in plain HTTP] status codes."""
    address, port, method, path, headers = probe
    return list(await asyncio.gather(status(address, port, method, path, headers, context),
                                     status(address, port, method, path, headers, None)))


async def probe_all(probes: list[list], keyed: list[int]) -> tuple[list[list[int | None]], int]:
    """Every probe at once, then each keyed probe (`keyed`: their indices, requests that must answer) that got no
    answer at all tried again alone, up to KEYED_RETRIES times: a keyed request that never answers still shows
    [None, None]. Unkeyed probes are never retried: any answer they give counts. Returns the answers and the
    retries made."""
    context = tls_context()
    answers = list(await asyncio.gather(*(both(probe, context) for probe in probes)))
    retries = 0
    for index in keyed:
        for _ in range(KEYED_RETRIES):
            if answers[index] != [None, None]:
                break
            retries += 1
            answers[index] = await both(probes[index], context)
    return answers, retries


async def wait_keyed(probes: list[list], keyed: list[int], deadline_s: float) -> float | None:
    """Wait (at most deadline_s) until every keyed probe is answered 200 over TLS or plain HTTP, asking again every
    second: the entrance is ready before the outsider's probes count. Seconds it took, None: not within the bound."""
    context, started = tls_context(), time.monotonic()
    while True:
        answers = await asyncio.gather(*(both(probes[index], context) for index in keyed))
        if all(200 in codes for codes in answers):
            return round(time.monotonic() - started, 1)
        if time.monotonic() - started > deadline_s:
            return None
        await asyncio.sleep(1.0)


def tracked() -> int | None:
    """The connections this namespace's conntrack holds (None: it tracks none)."""
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_count") as count:
            return int(count.read())
    except OSError:
        return None


# The connection is the kernel's business (a SYN-ACK on the bed's bridge comes in well under a millisecond, the
# scan gives it 1 s), so a filtered port costs its probe CONNECT_TIMEOUT_S, in parallel with the rest; what answers
# then has ANSWER_TIMEOUT_S for its TLS handshake and first line, on a loaded 2-core machine.
CONNECT_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 20.0
KEYED_RETRIES = 2  # more tries of a keyed probe that got no answer at all
READY_DEADLINE_S = 60.0  # the keyed probes' readiness wait before the outsider's probes


def main() -> None:
    request = json.load(sys.stdin)
    probes, started = request.get("probes", []), time.monotonic()
    keyed = request.get("keyed", [])
    answer: dict = {"tracked_before": tracked(), "ready_seconds": asyncio.run(wait_keyed(probes, keyed, READY_DEADLINE_S))}
    probing = time.monotonic()
    answer["probes"], answer["retries"] = asyncio.run(probe_all(probes, keyed))
    answer["probe_seconds"] = round(time.monotonic() - probing, 1)
    answer["scan"] = scan(request["addresses"], float(request.get("timeout_s", 1.0)), int(request.get("width", 8000)))
    answer["tracked_after"] = tracked()
    # after the scan: the probes again, so a scan that broke the network shows (without a scan: not asked again)
    probing = time.monotonic()
    again = request["addresses"] or request.get("again", True)
    answer["probes_after"], answer["retries_after"] = asyncio.run(probe_all(probes, keyed)) if again else ([], 0)
    answer["probe_seconds_after"] = round(time.monotonic() - probing, 1)
    answer["seconds"] = round(time.monotonic() - started, 1)
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
