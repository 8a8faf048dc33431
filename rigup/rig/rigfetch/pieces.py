"""A file in transit: the running hash of a part file (Partial), and how far it is verified and what its
pieces hash to, as this rig's fleet server sees it (Track); and how a piece from a peer can fail."""

from __future__ import annotations

import hashlib
import threading

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    from .disk import Item


class Partial:
    """A part file being downloaded: the running hash of its first `have` bytes, and the same at `mark`,
    the end of its last verified piece, where a rejected piece or a broken transfer rewinds to."""

    __slots__ = ("hasher", "have", "valid", "mark", "mark_hasher")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.hasher = hashlib.sha256()
        self.have = 0
        self.valid = False
        self.settle()

    def settle(self) -> None:
        """Everything so far is verified."""
        self.mark = self.have
        self.mark_hasher = self.hasher.copy()

    def rewind(self) -> None:
        self.have = self.mark
        self.hasher = self.mark_hasher.copy()


class PieceMismatch(Exception):
    """A peer sent a piece whose hash is not the authority's."""


class NoAuthority(Exception):
    """No upstream can vouch for a piece: this rig reads the rest of the file from the hub."""


class NotYet(Exception):
    """A peer has not started on the file yet (it answers 503): ask again shortly."""


class Track:
    """A file this rig fetches (or checks) in this run, as its fleet server sees it: how far the part file
    is verified (all that may be forwarded) and the hashes of its pieces."""

    def __init__(self, item: Item, piece_size: int) -> None:
        self.item = item
        self.piece_size = piece_size
        self.cond = threading.Condition()
        self.state = "waiting"  # waiting | active | done | failed
        self.verified = 0
        self.generation = 0  # bumped when the part file starts over: a reader of the old one must stop
        self.digests: dict = {}  # piece index -> SHA-256 of this rig's bytes up to that piece's end
        self.own: set = set()  # pieces read from the hub: their digests are the authority
        self.authority: dict = {}  # piece index -> digest an authority gave (used to check a peer's piece)
        self.hub_reader = not item.upstreams  # reads the file from the hub (the chain's head, or fallen back)

    @property
    def pieces(self) -> int:
        return (self.item.size + self.piece_size - 1) // self.piece_size

    def set_state(self, state: str) -> None:
        with self.cond:
            self.state = state
            self.cond.notify_all()

    def restart(self) -> None:
        with self.cond:
            if self.verified:
                self.generation += 1  # a reader holds the old part file open: it must stop
            self.verified = 0
            self.digests.clear()
            self.own.clear()
            self.cond.notify_all()

    def verified_to(self, offset: int, index: int, digest: str, own: bool) -> None:
        with self.cond:
            self.digests[index] = digest
            if own:
                self.own.add(index)
            self.verified = offset
            self.cond.notify_all()

    def authoritative_run(self, start: int) -> list | None:
        """The digests this rig vouches for from piece `start` on: all of them once the whole file
        matched the lock, else the run it read from the hub. None: the file is done but was verified on
        disk, not received, so its digests are to be hashed from disk."""
        with self.cond:
            if self.state == "done":
                if len(self.digests) < self.pieces:
                    return None
                return [self.digests[i] for i in range(start, self.pieces)]
            run = []
            index = start
            while index in self.own:
                run.append(self.digests[index])
                index += 1
            return run

    def may_vouch(self) -> bool:
        """Whether waiting on this rig can give a piece's authoritative digest."""
        with self.cond:
            return self.state == "done" or (self.hub_reader and self.state in ("waiting", "active"))
