"""Small HTTP services of the hub: a static file server (the stand-in apt repositories) and the
manifest side of a container registry (Registry HTTP API v2).

    python -m rigup_testbed.hubserve static   --root DIR --bind IP --port N --ready-file F
    python -m rigup_testbed.hubserve registry --bind IP --port N --ready-file F [--config JSON] [--images JSON]

Registry: `HEAD|GET /v2/<repository>/manifests/<tag>` answers 200 with Docker-Content-Digest equal
to the digest the stand-in Docker engine gives that image when it "pulls" it
(rigup_testbed/standins/dockerclient.py: fake_digest), so a digest pinned from this registry is the one
the rigs end up running. --config names a JSON file read on every request, in the stand-in's
registry.json format: {"missing": [refs], "digests": {ref: digest}} (refs as "repo:tag", without the
registry host). There are no blobs: nothing pulls layers from here.

--images names the images the registry holds by digest, {"repo:tag": "sha256:..."} (the hub writes the
catalog's digest-pinned images there: rigup_testbed/hub.py). Such a tag answers that digest, and for
its repository the registry is exact like a real one: a manifest by digest answers only the digests it
holds (these, and the --config digests of that repository), any other one is MANIFEST_UNKNOWN. Those
digests are what the registry is told to serve, not hashes of content it has: a stand-in holds no image
content, so no digest of a real image could be the hash of anything it serves. In the other
repositories a manifest by digest answers whatever digest is asked (a test pins any digest it likes).

Each server writes its ready file ({"url": ..., "pid": ...}) once it serves and stops on SIGTERM
(rigup_testbed/service.py); with --tls-cert/--tls-key it serves HTTPS (the static server's URL is then
https://; the registry's value stays host:port, which a client reaches over HTTPS unless told it is
insecure, as Docker does). Standard library only.
"""

from __future__ import annotations

import argparse
import http.server
import json
import re
import sys
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from rigup_testbed.service import BackgroundServer, add_tls_arguments, run_service, tls_of
from rigup_testbed.standin_modules import load_standin

STANDINS = Path(__file__).resolve().parent / "standins"
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
MANIFEST_PATH = re.compile(r"^/v2/(?P<repo>[a-z0-9._/-]+)/manifests/(?P<ref>[A-Za-z0-9_.:-]+)$")


class StaticHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"{self.client_address[0]} {format % args}\n")


class RegistryHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    host_port = ""  # registry host as clients name it, e.g. 10.213.0.1:5000
    config_file: Path | None = None
    images_file: Path | None = None  # {"repo:tag": digest}: what the registry holds by digest
    dockerclient: ModuleType | None = None

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"{self.client_address[0]} {format % args}\n")

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Docker-Distribution-Api-Version", "registry/2.0")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"errors": [{"code": code, "message": message}]}).encode()
        self._send(status, body, {"Content-Type": "application/json"})

    def do_HEAD(self) -> None:  # noqa: N802 (http.server naming)
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        if self.path in ("/v2", "/v2/"):
            self._send(200, b"{}", {"Content-Type": "application/json"})
            return
        m = MANIFEST_PATH.match(self.path.split("?", 1)[0])
        if m is None:
            self._error(404, "NAME_UNKNOWN", "repository name not known to registry")
            return
        repo, ref = m["repo"], m["ref"]
        config: dict[str, Any] = {}
        if self.config_file is not None and self.config_file.exists():
            config = json.loads(self.config_file.read_text() or "{}")
        held: dict[str, str] = {}
        if self.images_file is not None and self.images_file.exists():
            held = json.loads(self.images_file.read_text() or "{}")
        short = f"{repo}@{ref}" if ref.startswith("sha256:") else f"{repo}:{ref}"
        if short in config.get("missing", []):
            self._error(404, "MANIFEST_UNKNOWN", "manifest unknown")
            return
        assert self.dockerclient is not None
        full = f"{self.host_port}/{short}"
        pinned = config.get("digests", {})
        if ref.startswith("sha256:"):
            # A manifest stays there by digest when its tag moves on (a --config digest for the same tag).
            known = {d for name, d in [*held.items(), *pinned.items()] if name.rsplit(":", 1)[0] == repo}
            if any(name.rsplit(":", 1)[0] == repo for name in held) and ref not in known:
                self._error(404, "MANIFEST_UNKNOWN", f"manifest unknown: {repo}@{ref}")
                return
            digest = ref
        else:
            digest = pinned.get(short) or held.get(short) or self.dockerclient.fake_digest(full)
        manifest = json.dumps(
            {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": {}, "layers": [], "rigup_testbed": full},
            sort_keys=True,
        ).encode()
        self._send(200, manifest, {"Content-Type": MANIFEST_TYPE, "Docker-Content-Digest": digest})


def serve(server: BackgroundServer, ready_file: Path, url: str) -> int:
    def start() -> tuple[dict[str, Any], list[str]]:
        server.start()
        return {"url": url}, [url]

    return run_service(ready_file, start, server.stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rigup_testbed.hubserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    static = sub.add_parser("static")
    static.add_argument("--root", required=True, type=Path)
    registry = sub.add_parser("registry")
    registry.add_argument("--config", type=Path, help="registry.json: missing refs and pinned digests")
    registry.add_argument("--images", type=Path, help="JSON {repo:tag: digest}: images held by digest (exact repositories)")
    for p in (static, registry):
        p.add_argument("--bind", default="127.0.0.1")
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--ready-file", required=True, type=Path)
        add_tls_arguments(p)
    args = parser.parse_args(argv)
    tls = tls_of(args)
    if args.what == "static":
        server = BackgroundServer(args.bind, args.port, partial(StaticHandler, directory=str(args.root)), "static", tls=tls)
        return serve(server, args.ready_file, f"{server.scheme}://{args.bind}:{server.port}")
    handler = type("Handler", (RegistryHandler,), {"config_file": args.config, "images_file": args.images,
                                                  "dockerclient": load_standin("dockerclient")})
    server = BackgroundServer(args.bind, args.port, handler, "registry", tls=tls)
    handler.host_port = f"{args.bind}:{server.port}"
    return serve(server, args.ready_file, handler.host_port)


if __name__ == "__main__":
    sys.exit(main())
