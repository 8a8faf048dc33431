"""bench/entrance.py's pure parts (issue 44): the figures' arithmetic, the agent trace and the routing
policies' comparison (hits, first-token ratio, pod loads; the trace read from a real stand-in pod), the nginx
front's key map and config (the keys only in a 0600 include, the allowlist), and that everything the bench
starts is stopped, by process group, when the run fails. Loopback only; no venv, no router."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.responder import responder

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


def test_the_busiest_pod_over_the_mean():
    assert E.max_over_mean([3, 2, 0, 1]) == 2.0
    assert E.max_over_mean([5, 5, 5, 5]) == 1.0
    assert E.max_over_mean([0, 0]) == 0.0


def test_counter_sum_adds_a_counters_label_sets_and_nothing_else():
    text = ('# TYPE vllm:request_success_total counter\n'
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 7.0\n'
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0\n'
            'vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e+09\n'
            'vllm:request_success_totalx{engine="0"} 99.0\n')
    assert E.counter_sum(text, "vllm:request_success_total") == 10.0
    assert E.counter_sum(text, "vllm:prompt_tokens_total") == 0.0


def test_the_agent_trace_shares_the_harness_prompt_and_grows_each_session_apart():
    shape = E.TraceShape(sessions=3, turns=4, shared_tokens=50, task_tokens=20, turn_tokens=30)
    trace = E.agent_trace(shape)
    assert list(trace) == ["session-00", "session-01", "session-02"]
    systems = {opening[0]["content"] for opening, _ in trace.values()}
    tasks = {opening[1]["content"] for opening, _ in trace.values()}
    assert len(systems) == 1 and len(next(iter(systems))) == 50 * E.CHARS_PER_TOKEN
    assert len(tasks) == 3 and all(len(t) == 20 * E.CHARS_PER_TOKEN for t in tasks)
    results = [r for _, turns in trace.values() for r in turns]
    assert len(results) == 12 and len(set(results)) == 12 and {len(r) for r in results} == {30 * E.CHARS_PER_TOKEN}
    assert E.agent_trace(shape) == trace  # every policy is given the same trace


def test_a_turn_hits_its_prefix_only_when_every_full_block_of_the_previous_prompt_was_cached():
    assert E.prefix_hit(cached_tokens=496, previous_prompt_tokens=500)  # 31 full blocks of 16
    assert E.prefix_hit(cached_tokens=512, previous_prompt_tokens=500)
    assert not E.prefix_hit(cached_tokens=480, previous_prompt_tokens=500)
    assert not E.prefix_hit(cached_tokens=0, previous_prompt_tokens=20)
    assert E.prefix_hit(cached_tokens=0, previous_prompt_tokens=15)  # no full block to find


def test_the_pool_in_blocks_is_the_kv_budget_scaled_plus_vllms_null_block():
    assert E.pool_blocks(618_660, 20) == 1_935  # 30,933 tokens: 1,933.3 blocks, rounded up, + 1
    assert E.pool_blocks(1_600, 1) == 101
    assert E.REFERENCE_KV_TOKENS == 618_660  # 2.36 x 262,144


def test_a_policys_hits_mean_first_token_and_ratio_against_a_baseline():
    routed = E.TraceResult(turns=[E.Turn("b", 0, 0.4, 300, 0), E.Turn("a", 1, 0.1, 400, 288),
                                  E.Turn("a", 0, 0.4, 300, 0), E.Turn("b", 1, 0.1, 400, 0)],
                           loads=[2, 2], seconds=1.0)
    assert routed.hits == (1, 2)  # a's second turn found its first prompt's 18 blocks; b's found none
    assert routed.hit_share == 0.5
    assert routed.ttft_mean == pytest.approx(0.25)
    assert routed.cached_share == pytest.approx(288 / 1400)
    baseline = E.TraceResult(turns=[E.Turn("a", 0, 0.5, 300, 0), E.Turn("a", 1, 1.0, 400, 0)], loads=[1, 1],
                             seconds=1.0)
    assert E.ttft_ratio(baseline, routed) == pytest.approx(3.0)
    assert E.TraceResult(turns=[E.Turn("a", 0, 0.1, 300, 0)], loads=[1], seconds=1.0).hit_share == 0.0


def test_the_trace_reads_each_turns_cached_tokens_and_the_pods_requests(tmp_path: Path):
    shape = E.TraceShape(sessions=2, turns=3, shared_tokens=64, task_tokens=16, turn_tokens=32, answer_tokens=4)
    with responder(tmp_path, "--enable-prompt-tokens-details") as pod:
        port = int(pod.url.rsplit(":", 1)[1])
        result = E.run_trace(E.Target("direct", [port]), [port], shape, session_header=True)
    assert result.failures == 0 and len(result.turns) == 6
    assert result.hits == (4, 4)  # one pod: every later turn finds its session's previous prompt
    assert result.loads == [6.0]
    firsts = [t for t in result.turns if t.index == 0]
    assert sorted(t.cached_tokens for t in firsts)[0] == 0  # the first session's first turn found nothing


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


def test_the_front_and_the_router_alone_send_a_session_header_as_the_entrance_does(tmp_path: Path):
    # the entrance's template: the client's X-Session-ID, else the request's own id (consistent_hash spreads them)
    conf = E.nginx_conf(prefix=tmp_path, listen_port=8443, upstream_port=9000, cert=tmp_path / "c.crt",
                        key=tmp_path / "c.key", key_map=tmp_path / "clients.map")
    assert "proxy_set_header X-Session-ID $entrance_session;" in conf
    assert re.search(r'map \$http_x_session_id \$entrance_session \{\s*"" \$request_id;\s*default \$http_x_session_id;', conf)
    router = E.Target("vllm-router consistent_hash", [9000], session_ids=True)
    assert router.headers()["X-Session-ID"] != router.headers()["X-Session-ID"]
    assert "X-Session-ID" not in E.Target("direct", [9001]).headers()


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
    """Debian's nginx (unpacked once per machine into the test bed's cache) passes the rendered front with `nginx -t`."""
    binary, version = E.nginx_binary()
    assert version.startswith("1.22.1-")
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


def _directives(block: str) -> list[str]:
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_bench_hop_is_the_entrances_pod_key_hop(tmp_path: Path):
    # the timed hop proxies as the site template's hop does (its plain location, directive for directive), routes
    # each pod by its host:port, takes each pod's key from the 0600 include only, and refuses any other host:port
    hop = E.hop_text(30401, tmp_path / "pod-key.conf", [9001, 9002])
    template = (REPO / "templates" / "rigup-entrance.nginx.conf.j2").read_text()
    start = template.index("proxy_pass http://$entrance_pod_upstream;")
    end = template.index("proxy_read_timeout 1800s;", start) + len("proxy_read_timeout 1800s;")
    wanted = _directives(template[start:end])
    got = _directives(hop)
    at = got.index(wanted[0])
    assert got[at:at + len(wanted)] == wanted
    assert f"include {tmp_path / 'pod-key.conf'};" in hop and "Bearer" not in hop
    assert re.search(r'"127\.0\.0\.1:9001" rigup_pod_0;\s*"127\.0\.0\.1:9002" rigup_pod_1;', hop)
    assert "default rigup_pod_none;" in hop and "server 127.0.0.1:1;" in hop and "listen 127.0.0.1:30401;" in hop
    conf = E.nginx_conf(prefix=tmp_path, listen_port=8443, upstream_port=9000, cert=tmp_path / "c.crt",
                        key=tmp_path / "c.key", key_map=tmp_path / "clients.map", hop=hop)
    assert hop in conf and conf.rstrip().endswith("}")
    assert "listen 127.0.0.1:30401" not in E.nginx_conf(
        prefix=tmp_path, listen_port=8443, upstream_port=9000, cert=tmp_path / "c.crt", key=tmp_path / "c.key",
        key_map=tmp_path / "clients.map")


def test_the_paced_verdicts_judge_the_front_and_the_hop_and_what_the_hop_adds():
    def row(tps: float, ttft_ms: float) -> dict[str, object]:
        return {"window": E.Window(seconds=1.0, tokens=int(tps), ttfts=[ttft_ms / 1000] * 3)}

    paced = {"direct": {8: row(1000, 1.0)}, "nginx+vllm-router": {8: row(990, 2.5)}, E.HOP: {8: row(960, 4.0)}}
    lines = E.paced_verdicts(paced)
    assert lines[0] == ("- paced, 8 streams, nginx+vllm-router: 0.990x direct (>= 0.97: met); median first token "
                        "+1.5 ms (<= 2 ms: met)")
    assert lines[1] == (f"- paced, 8 streams, {E.HOP}: 0.960x direct (>= 0.97: **not met**); median first token "
                        "+3.0 ms (<= 2 ms: **not met**)")
    assert lines[2] == (f"- paced, 8 streams, the hop alone ({E.HOP} minus nginx+vllm-router): median first token "
                        "+1.5 ms, p95 +1.5 ms, tokens/s 0.970x")
    assert len(lines) == 3
    del paced[E.HOP]
    assert len(E.paced_verdicts(paced)) == 1


def test_nginx_runs_the_hop_which_sends_each_pod_its_own_key(tmp_path: Path):
    """Debian's nginx with the bench's front and hop: a request through the hop, as a router sends it to its HTTP
    proxy (the absolute URL, the pod's host:port as Host), reaches a keyed stand-in that refuses it without its key;
    a host:port the hop does not route to gets 502."""
    from rigup.desired.entrance import pod_key_text

    binary, _ = E.nginx_binary()
    (tmp_path / "tmp").mkdir()
    _ca, cert, key = E.make_tls(tmp_path)
    key_map, pod_key = tmp_path / "clients.map", tmp_path / "pod-key.conf"
    E.write_private(key_map, E.key_map_text({"bench": KEY_A}))
    pod_secret = "f" * 64
    (tmp_path / "pod.key").write_text(pod_secret + "\n")
    with responder(tmp_path, "--api-key-file", str(tmp_path / "pod.key")) as pod:
        port = int(pod.url.rsplit(":", 1)[1])
        E.write_private(pod_key, pod_key_text({f"127.0.0.1:{port}": pod_secret}))
        hop_port = E.free_port()
        conf = tmp_path / "nginx.conf"
        conf.write_text(E.nginx_conf(prefix=tmp_path, listen_port=E.free_port(), upstream_port=9, cert=cert, key=key,
                                     key_map=key_map, hop=E.hop_text(hop_port, pod_key, [port])))
        with E.Processes(grace_s=5) as procs:
            procs.start([str(binary), "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(conf),
                         "-g", "daemon off;"], log=tmp_path / "nginx.log")

            def status(target_port: int, address: str | None) -> int:
                conn = E.http.client.HTTPConnection("127.0.0.1", target_port, timeout=10)
                path = f"http://{address}/v1/models" if address else "/v1/models"
                conn.request("GET", path, headers={"Host": address} if address else {})
                code = conn.getresponse().status
                conn.close()
                return code

            deadline, first = time.monotonic() + 20, 0
            while time.monotonic() < deadline:
                try:
                    first = status(hop_port, f"127.0.0.1:{port}")
                    break
                except OSError:
                    time.sleep(0.1)
            assert first == 200
            assert status(port, None) == 401  # the pod itself wants its key
            assert status(hop_port, f"127.0.0.1:{E.free_port()}") == 502
