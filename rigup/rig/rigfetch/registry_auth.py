"""A registry hub's anonymous bearer tokens (hub_auth "registry"), got as `docker pull` gets them: on a 401
with a Bearer challenge, from the challenge's realm (the distribution token spec); asked again when one that
worked expires, never when a fresh one was refused. Never the HF token."""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
import urllib.request

from .web import USER_AGENT, SourceRefused, TransientError, open_url

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    from .disk import Item
    from .log import Log


def hub_dir(item: Item) -> str:
    """The hub URL the item's file is under (a registry repository's blob endpoint): models of one
    repository share its token."""
    return item.url_hub.rsplit("/", 1)[0]


class RegistryTokens:
    """The tokens this run got, shared by the files of each repository."""

    def __init__(self, timeout: float, log: Log) -> None:
        self.timeout = timeout
        self.log = log
        self.tokens: dict = {}  # (realm, service, scope) -> [token, whether the hub took it]
        self.scope: dict = {}  # a hub's blob endpoint -> the (realm, service, scope) it last asked for
        self.lock = threading.Lock()

    def token(self, item: Item) -> str | None:
        """The token to send for `item`'s file: the one its repository's last challenge got, if any."""
        with self.lock:
            scope = self.scope.get(hub_dir(item))
            return self.tokens[scope][0] if scope in self.tokens else None

    def took(self, item: Item) -> None:
        """The hub answered `item`'s request: its token works, so a later 401 means it expired."""
        with self.lock:
            held = self.tokens.get(self.scope.get(hub_dir(item)))
            if held is not None:
                held[1] = True

    def renew(self, item: Item, challenge: str) -> None:
        """Get the anonymous bearer token a registry hub's 401 challenge points to (shared by the model's
        files); raise SourceRefused when there is none to get, or a fresh one was refused already."""
        scheme, _, rest = challenge.partition(" ")
        params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        realm = params.pop("realm", None)
        if scheme.lower() != "bearer" or not realm:
            raise SourceRefused("HTTP 401 without a bearer challenge (%r): rigfetch reads registries anonymously" % challenge)
        key = (realm, params.get("service", ""), params.get("scope", ""))
        with self.lock:
            self.scope[hub_dir(item)] = key
            held = self.tokens.get(key)
            if held is not None and not held[1]:  # one that never worked: refused, not expired
                raise SourceRefused("HTTP 401 with a fresh token from %s: the registry refuses anonymous pulls" % realm)
            query = urllib.parse.urlencode(sorted(params.items()))
            try:
                with open_url(urllib.request.Request(realm + ("&" if "?" in realm else "?") + query,
                                                     headers={"User-Agent": USER_AGENT}), self.timeout) as response:
                    body = json.loads(response.read())
            except (OSError, ValueError) as exc:
                raise TransientError("no token from %s: %s" % (realm, exc))
            token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
            if not isinstance(token, str) or not token:
                raise SourceRefused("%s answered without a token" % realm)
            self.tokens[key] = [token, False]
        self.log("%s: got a registry token from %s" % (item.label, realm))
