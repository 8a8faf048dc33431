"""Debian's own nginx and njs module, unpacked from the test bed's archive cache, serving a rendered entrance on
loopback: for tests that check the front as nginx runs it (nginx -t, or real requests)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rigup.desired.entrance import (
    POD_HOP_PORT,
    USAGE_PORT,
    Client,
    EntrancePaths,
    ModelRouter,
    dispatch_js,
    key_map_text,
    models_document,
    nginx_site,
    pod_key_text,
)

TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")  # nginx's defaults are under /var/lib/nginx
FOREGROUND = "daemon off; user root;"  # -g for a test's nginx: its own process, workers that read the test's files


def site_text(tmp_path: Path, routers: Sequence[ModelRouter], port: int, usage_port: int | None = None,
              hop_port: int | None = None, scored: Sequence[tuple[str, str, str]] = (),
              score_sample_rate: float = 0.0) -> str:
    """The front's site as the converge renders it for `routers` (EntrancePaths under tmp_path, plain HTTP on
    127.0.0.1:port), its logs in tmp_path; `usage_port`: where its /metrics/ finds rigup-entrance-usage, `hop_port`:
    where the routers' hop listens (default: the entrance's own); `scored`, `score_sample_rate`: the hop's scoring
    (nginx_site's)."""
    site = nginx_site(list(routers), EntrancePaths(str(tmp_path)), bind_address="127.0.0.1", port=port, tls=None,
                      scored=scored, score_sample_rate=score_sample_rate)
    if usage_port is not None:
        site = site.replace(f"127.0.0.1:{USAGE_PORT}", f"127.0.0.1:{usage_port}")
    if hop_port is not None:
        site = site.replace(f"127.0.0.1:{POD_HOP_PORT};", f"127.0.0.1:{hop_port};")
    return site.replace("/var/log/nginx", str(tmp_path))


def write_front(tmp_path: Path, routers: list[ModelRouter], clients: list[Client], port: int,
                pod_keys: dict[str, str] | None = None, hop_port: int | None = None,
                usage_port: int | None = None, scored: Sequence[tuple[str, str, str]] = (),
                score_sample_rate: float = 0.0) -> list[str]:
    """The rendered front (site, dispatch, key includes, /v1/models' answer) under tmp_path and an nginx.conf
    including it; the nginx command line that runs it with that configuration (append -t to only check it, or
    -g FOREGROUND to serve). `pod_keys`: each pod's host:port -> its key (pod_key_text); `hop_port`, `usage_port`:
    `scored`, `score_sample_rate`: see site_text."""
    from rigup_testbed.debarchive import DebianArchive

    archive = DebianArchive()
    nginx = archive.program("nginx")
    (njs_deb,) = archive.debs(["libnginx-mod-http-js"])
    subprocess.run(["dpkg-deb", "-x", str(njs_deb), str(tmp_path / "njs")], check=True)
    module = tmp_path / "njs/usr/lib/nginx/modules/ngx_http_js_module.so"
    paths = EntrancePaths(str(tmp_path))
    Path(paths.key_map).write_text(key_map_text(clients))
    Path(paths.pod_key).write_text(pod_key_text(pod_keys))
    Path(paths.dispatch_js).write_text(dispatch_js(routers))
    Path(paths.models_json).write_text(models_document(routers))
    (tmp_path / "site.conf").write_text(site_text(tmp_path, routers, port, usage_port, hop_port, scored, score_sample_rate))
    (tmp_path / "nginx.conf").write_text(
        f"load_module {module};\npid {tmp_path}/nginx.pid;\nevents {{}}\n"
        f"http {{\n" + "".join(f"    {kind}_temp_path {tmp_path}/{kind};\n" for kind in TEMP_PATHS)
        + f"    include {tmp_path}/site.conf;\n}}\n")
    return [str(nginx), "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(tmp_path / "nginx.conf")]


@contextmanager
def serving(argv: Sequence[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    """nginx started as `argv` (in the foreground) until it listens on 127.0.0.1:port; stopped afterwards."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "nginx ended"
                assert time.monotonic() < deadline, "nginx did not listen within 20 s"
                time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)
