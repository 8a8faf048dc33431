"""Debian's own nginx and njs module, unpacked from the test bed's archive cache, serving a rendered entrance on
loopback: for tests that check the front as nginx runs it (nginx -t, or real requests)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rigup.desired.entrance import Client, EntrancePaths, ModelRouter, dispatch_js, key_map_text, nginx_site, pod_key_text

TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")  # nginx's defaults are under /var/lib/nginx


def write_front(tmp_path: Path, routers: list[ModelRouter], clients: list[Client], port: int) -> list[str]:
    """The rendered front (site, dispatch, key includes) under tmp_path and an nginx.conf including it; the
    nginx command line that runs it with that configuration (append -t to only check it)."""
    from rigup_testbed.debarchive import DebianArchive

    archive = DebianArchive()
    nginx = archive.program("nginx")
    (njs_deb,) = archive.debs(["libnginx-mod-http-js"])
    subprocess.run(["dpkg-deb", "-x", str(njs_deb), str(tmp_path / "njs")], check=True)
    module = tmp_path / "njs/usr/lib/nginx/modules/ngx_http_js_module.so"
    paths = EntrancePaths(str(tmp_path))
    Path(paths.key_map).write_text(key_map_text(clients))
    Path(paths.pod_key).write_text(pod_key_text("pod-secret"))
    Path(paths.dispatch_js).write_text(dispatch_js(routers))
    site = nginx_site(routers, paths, bind_address="127.0.0.1", port=port, tls=None)
    (tmp_path / "site.conf").write_text(site.replace("/var/log/nginx", str(tmp_path)))
    (tmp_path / "nginx.conf").write_text(
        f"load_module {module};\npid {tmp_path}/nginx.pid;\nevents {{}}\n"
        f"http {{\n" + "".join(f"    {kind}_temp_path {tmp_path}/{kind};\n" for kind in TEMP_PATHS)
        + f"    include {tmp_path}/site.conf;\n}}\n")
    return [str(nginx), "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(tmp_path / "nginx.conf")]
