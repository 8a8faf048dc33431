"""rigfetch as an HTTP client: its requests, redirects that keep a token on its own origin only, and how a
source's answer can fail. Imported only by a rig that downloads or serves (http and urllib.request are most
of a start-up that `--check`, run on every converged re-run, does not need)."""

from __future__ import annotations

import re
import urllib.parse
import urllib.request

from .manifest import SCRIPT_VERSION

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    from typing import Any

USER_AGENT = "rigup-rigfetch/%d" % SCRIPT_VERSION


class TransientError(Exception):
    """Network trouble worth resuming after (connection reset, short read, 5xx)."""


class SourceRefused(Exception):
    """A source answered with an error that retrying will not fix (401/403/404)."""


class Reauthorized(Exception):
    """A registry hub asked for a (new) bearer token, and this rig got one: ask again at once."""


def request(url: str, token: str | None, method: str = "GET", offset: int = 0) -> urllib.request.Request:
    """A request of rigfetch's: its user agent, no content encoding, from byte `offset` on, with `token`."""
    req = urllib.request.Request(url, method=method)
    req.add_header("User-Agent", USER_AGENT)
    req.add_header("Accept-Encoding", "identity")
    if offset:
        req.add_header("Range", "bytes=%d-" % offset)
    if token:
        # Kept across a redirect on the same origin, dropped on one to another (OriginRedirects): the
        # hub redirects LFS files to a CDN whose signed URLs must not see the token.
        req.add_header("Authorization", "Bearer %s" % token)
    return req


def origin(url: str) -> tuple:
    """(scheme, host, port) of a URL, the scheme's default port filled in: what a browser calls its origin."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


class OriginRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect to another origin drops the Authorization header and one on the same origin keeps it, as
    huggingface_hub and curl do: the Hub answers an LFS file with a 302 to a CDN (signed URLs; the token must
    not leave the Hub), and a renamed repository with a redirect on the Hub itself, where a gated repository
    still needs the token. urllib alone either forwards it to every host (add_header) or to none
    (add_unredirected_header)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and origin(newurl) != origin(req.full_url):
            new.remove_header("Authorization")
        return new


OPENER = urllib.request.build_opener(OriginRedirects)


def open_url(req: Any, timeout: float) -> Any:
    """urllib's urlopen, with OriginRedirects."""
    return OPENER.open(req, timeout=timeout)


def content_range(value: str | None) -> tuple:
    """(first byte, total size or None) of a Content-Range header."""
    match = re.match(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", value or "")
    if not match:
        raise TransientError("bad Content-Range %r" % (value,))
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), total
