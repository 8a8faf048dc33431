"""bench/entrance.py's pure parts (issue 44): the figures' arithmetic, which pod served a turn, the nginx
front's key map and config (the keys only in a 0600 include, the allowlist), and that everything the bench
starts is stopped, by process group, when the run fails. Loopback only; no venv, no router."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.responder import MODEL, responder

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_entrance", REPO / "bench" / "entrance.py")
assert _spec is not None and _spec.loader is not None
E = importlib.util.module_from_spec(_spec)
sys.modules["bench_entrance"] = E
_spec.loader.exec_module(E)

KEY_A = "A" * 20 + "_-" + "z" * 21  # 43 characters, as secrets.token_urlsafe(32)
KEY_B = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"


def test_percentile_interpolates_between_ranks():
    assert E.percentile([5.0], 95) == 5.0
    assert E.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert E.percentile(list(map(float, range(1, 21))), 95) == pytest.approx(19.05)
    assert E.percentile([3.0, 1.0, 2.0], 100) == 3.0
    with pytest.raises(ValueError):
        E.percentile([], 50)


def test_window_figures_and_what_a_path_adds_to_direct():
    direct = E.Window(seconds=2.0, tokens=10_000, ttfts=[0.001, 0.002, 0.003])
    routed = E.Window(seconds=2.0, tokens=9_000, ttfts=[0.004, 0.006, 0.011])
    assert direct.tokens_per_s == 5_000
    assert routed.ttft_median == 0.006
    median, p95 = E.added(routed, direct)
    assert median == pytest.approx(0.004)
    assert p95 == pytest.approx(E.percentile([0.004, 0.006, 0.011], 95) - E.percentile([0.001, 0.002, 0.003], 95))
    assert E.cpu_percent(1.5, 2.0) == 75.0
    assert E.cpu_percent(1.0, 0.0) == 0.0


def test_affinity_counts_turns_after_the_first_that_stay_on_the_previous_pod():
    assert E.affinity({"a": [0, 0, 0], "b": [1, 2, 2], "c": [3]}) == (3, 4)
    assert E.affinity({"a": [0, 1, 0, 1]}) == (0, 3)


def test_pod_loads_and_the_busiest_over_the_mean():
    landings = {"a": [0, 0, 0], "b": [1, 1], "c": [3]}
    assert E.pod_loads(landings, 4) == [3, 2, 0, 1]
    assert E.max_over_mean([3, 2, 0, 1]) == 2.0
    assert E.max_over_mean([5, 5, 5, 5]) == 1.0


def test_the_serving_pod_is_the_one_that_took_the_turns_prompt():
    # pods 0 and 2 also took a health check's few tokens
    assert E.serving_pod([30, 50, 10], [38, 1250, 19], at_least=1000) == 1
    with pytest.raises(RuntimeError, match=r"grew on pods \[\]"):
        E.serving_pod([3, 5], [9, 5], at_least=1000)
    with pytest.raises(RuntimeError, match=r"grew on pods \[0, 1\]"):
        E.serving_pod([3, 5], [2003, 2005], at_least=1000)


def test_prompt_tokens_reads_the_stand_ins_vllm_counter(tmp_path: Path):
    with responder(tmp_path) as pod:
        url = pod.url.removeprefix("http://")
        read = lambda: E.prompt_tokens(_get(url, "/metrics"))  # noqa: E731
        before = read()
        conn = http.client.HTTPConnection(url, timeout=10)
        body = {"model": MODEL, "messages": [{"role": "system", "content": "Follow the house rules. " * 200},
                                             {"role": "user", "content": "What is 2 * 3?"}], "max_tokens": 8}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
        assert read() - before >= E.SYSTEM_PROMPT_TOKENS


def _get(hostport: str, path: str) -> str:
    conn = http.client.HTTPConnection(hostport, timeout=10)
    conn.request("GET", path)
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def test_key_map_holds_each_clients_key_and_refuses_what_nginx_could_misread():
    text = E.key_map_text({"teammate": KEY_B, "bench": KEY_A})
    assert text.splitlines() == [
        "map $http_authorization $entrance_client {", '    default "";',
        f'    "Bearer {KEY_A}" bench;', f'    "Bearer {KEY_B}" teammate;', "}"]
    with pytest.raises(ValueError, match="client bench: a key is 16-128"):
        E.key_map_text({"bench": 'short"; }'})
    with pytest.raises(ValueError, match="client name 'Bench Team'"):
        E.key_map_text({"Bench Team": KEY_A})


def test_nginx_conf_allowlists_the_api_and_holds_no_key(tmp_path: Path):
    conf = E.nginx_conf(prefix=tmp_path, listen_port=8443, upstream_port=9000, cert=tmp_path / "c.crt",
                        key=tmp_path / "c.key", key_map=tmp_path / "clients.map")
    assert KEY_A not in conf and "Bearer" not in conf
    assert f"include {tmp_path / 'clients.map'};" in conf
    assert "proxy_buffering off;" in conf and 'proxy_set_header Authorization "";' in conf
    assert "listen 127.0.0.1:8443 ssl;" in conf and "server 127.0.0.1:9000;" in conf
    pattern = re.search(r"location ~ (\S+) \{", conf)
    assert pattern is not None
    allowed = re.compile(pattern.group(1))  # nginx's PCRE and Python's re agree on this one
    assert [p for p in ("/v1/chat/completions", "/v1/completions", "/v1/models") if allowed.match(p)] == list(E.ALLOWED_PATHS)
    for refused in ("/invocations", "/tokenize", "/pause", "/metrics", "/v1/models/x", "/v1/chat/completionsX", "/v2/models"):
        assert not allowed.match(refused), refused


def test_write_private_is_never_world_readable(tmp_path: Path):
    old = os.umask(0)
    try:
        path = tmp_path / "clients.map"
        E.write_private(path, E.key_map_text({"bench": KEY_A}))
        assert path.stat().st_mode & 0o777 == 0o600
        path.chmod(0o644)
        E.write_private(path, "again\n")
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_nginx_accepts_the_rendered_front(tmp_path: Path):
    """When the bench has unpacked Debian's nginx (.cache/entrance), the rendered front passes `nginx -t`."""
    binary = E.CACHE / "nginx-root" / "usr" / "sbin" / "nginx"
    if not binary.exists() or shutil.which("openssl") is None:
        pytest.skip("nginx not unpacked yet: bench/entrance.py unpacks it on its first run")
    (tmp_path / "tmp").mkdir()
    _ca, cert, key = E.make_tls(tmp_path)
    assert key.stat().st_mode & 0o777 == 0o600
    key_map = tmp_path / "clients.map"
    E.write_private(key_map, E.key_map_text({"bench": KEY_A, "teammate": KEY_B}))
    conf = tmp_path / "nginx.conf"
    conf.write_text(E.nginx_conf(prefix=tmp_path, listen_port=E.free_port(), upstream_port=9, cert=cert, key=key,
                                 key_map=key_map))
    check = subprocess.run([str(binary), "-t", "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(conf)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_processes_stops_every_group_it_started_when_the_run_fails(tmp_path: Path):
    pids_file = tmp_path / "pids"
    with pytest.raises(RuntimeError, match="the run failed"):
        with E.Processes(grace_s=0.5) as procs:
            # a parent that ignores SIGTERM and a child of it: the group is stopped, SIGKILL after the grace
            procs.start(["sh", "-c", f"sleep 300 & echo $! > {pids_file}; trap '' TERM; sleep 300 & wait"],
                        log=tmp_path / "log")
            deadline = time.monotonic() + 10
            while not (pids_file.exists() and pids_file.read_text().strip()) and time.monotonic() < deadline:
                time.sleep(0.05)
            child = int(pids_file.read_text())
            raise RuntimeError("the run failed")
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
