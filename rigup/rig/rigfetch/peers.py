"""The fleet chain as one rig sees it: which of its upstreams serve (the nearest live one is read), which
vouch for a piece's digest, and telling them when this rig is done."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error

from .manifest import SHA256_RE
from .web import open_url, request

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    from .disk import Item
    from .log import Counters, Log
    from .pieces import Track

PEER_GRACE = 5.0  # seconds an upstream that does not answer yet keeps this rig from looking further up


class Upstreams:
    """This rig's upstreams across its files: whether each serves, and whether it answers piece questions."""

    def __init__(self, token: str | None, piece_size: int, peer_wait: float, timeout: float, log: Log,
                 counters: Counters) -> None:
        self.token = token  # the fleet token every peer asks for
        self.piece_size = piece_size
        self.peer_wait = peer_wait
        self.timeout = timeout
        self.log = log
        self.counters = counters
        self.lock = threading.Lock()
        self.ok: dict = {}  # peer base URL -> True (answered ping) / False (given up)
        self.silent: set = set()  # peers that never answered a ping
        self.first_try: dict = {}  # peer base URL -> when this rig first pinged it
        self.vouch_dead: set = set()  # upstreams that did not answer a piece-hash question

    def live(self, upstreams: tuple) -> str | None:
        """The nearest upstream that serves. Fleet peers start serving in the same pyinfra operation, so one
        that does not answer yet gets PEER_GRACE seconds (within --peer-wait) before this rig looks further
        up the chain: the chain keeps its shape when a peer starts late, and a dead peer does not keep this
        rig from a live one."""
        deadline = time.monotonic() + self.peer_wait
        while True:
            waiting = False
            for base in reversed(upstreams):
                with self.lock:
                    known = self.ok.get(base)
                    first = self.first_try.setdefault(base, time.monotonic())
                if known is False:
                    continue
                if known or self.ping(base):
                    with self.lock:
                        if base not in self.ok:
                            self.ok[base] = True
                            self.log("fleet peer %s is serving" % base)
                        if self.ok[base]:
                            return base
                    continue
                if self.in_grace(first) and time.monotonic() < deadline:
                    waiting = True
                    break
                with self.lock:
                    if base not in self.ok:
                        self.ok[base] = False
                        self.silent.add(base)
                        self.log("fleet peer %s did not answer" % base)
            if not waiting:
                return None
            time.sleep(0.3)

    def in_grace(self, first: float) -> bool:
        """Whether an upstream first tried at `first` (time.monotonic) is still within its grace to answer."""
        return time.monotonic() - first < min(PEER_GRACE, self.peer_wait)

    def ping(self, base: str) -> bool:
        try:
            with open_url(request(base + "_rigfetch/ping", self.token), timeout=3) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return False

    def drop(self, base: str, why: str) -> None:
        with self.lock:
            if self.ok.get(base):
                self.log("fleet peer %s dropped (%s)" % (base, why))
                self.counters.add("peers_dropped")
            self.ok[base] = False

    def tell_done(self, items: list) -> None:
        """Tell each upstream of a file this rig needed that it is finished (an upstream stops serving
        once every peer it expects said so)."""
        bases = {base for item in items for base in item.upstreams}
        with self.lock:
            silent = set(self.silent)
        for base in sorted(bases - silent):
            try:
                req = request(base + "_rigfetch/done", self.token, method="POST")
                with open_url(req, timeout=5) as response:
                    response.read()
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass

    def authority_digest(self, item: Item, track: Track, index: int) -> str | None:
        """The digest piece `index` must have, from the first upstream (head first) that vouches for it:
        one that read it from the hub, or holds the whole file verified against the lock."""
        with track.cond:
            known = track.authority.get(index)
        if known is not None:
            return known
        for base in item.upstreams:
            with self.lock:
                if base in self.vouch_dead:
                    continue
                first = self.first_try.setdefault(base, time.monotonic())
            digests = self.ask_digests(base, item, index)
            # An upstream that starts later than this rig (one pyinfra operation starts them all, in no set
            # order) gets the same grace as for serving before this rig stops asking it.
            while digests is None and self.in_grace(first):
                time.sleep(0.3)
                digests = self.ask_digests(base, item, index)
            if digests is None:
                with self.lock:
                    self.vouch_dead.add(base)
                continue
            if digests:
                with track.cond:
                    for offset, digest in enumerate(digests):
                        track.authority[index + offset] = digest
                return digests[0]
        return None

    def ask_digests(self, base: str, item: Item, index: int) -> list | None:
        """The digests `base` vouches for from piece `index` on ([] when it cannot), None if it did not answer."""
        url = "%s_rigfetch/pieces/%s?from=%d&size=%d" % (base, item.key, index, self.piece_size)
        while True:
            try:
                with open_url(request(url, self.token), timeout=self.timeout) as response:
                    answer = json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as exc:
                exc.close()
                return []
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError):
                return None
            if not (isinstance(answer, dict) and answer.get("pending")):
                break
            # It reads that piece from the hub and has not got there yet: ask again (it waited already).
        digests = answer.get("digests")
        if not isinstance(digests, list) or not all(isinstance(d, str) and SHA256_RE.match(d) for d in digests):
            return []
        return digests
