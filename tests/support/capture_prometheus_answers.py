"""Re-capture tests/fixtures/prometheus/api-query-2.42.0.json: a real Prometheus scrapes the fake vLLM,
dcgm-exporter and entrance (its vllm-routers' series, tests/support/router_routes.py) servers (rig-1 and rig-2 up,
rig-3's pod and GPU exporter down; gw-1's routes: rig-1's healthy, rig-2's healed, rig-3's out of rotation),
then answers each of rigup.client.fleet_metrics.prometheus_queries() (and two malformed queries) at one time.

    .venv/bin/python -m tests.support.capture_prometheus_answers PROMETHEUS_BINARY [OUT.json]

Debian 12's binary without installing it: dpkg-deb -x prometheus_2.42.0+ds-5+deb12u1_amd64.deb DIR (the
test bed's archive keeps the .deb in .cache/testbed/debian-archive/debs)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

from rigup.client.fleet_metrics import prometheus_queries
from tests.support.exporters import Gpu, MetricsServer, VllmPod, dcgm_text
from tests.support.router_routes import RouterRoute, entrance_text

MODEL = "qwen3.6-27b-autoround"
KEY = "sk-gw-capture"
SCRAPE_S = 5  # under the queries' 15 s step and 30 s increase window: enough samples in a minute
RUN_S = 65  # a minute of scrapes: rate()'s 1m window is full
DEAD = 9
OUT = Path(__file__).resolve().parents[1] / "fixtures" / "prometheus" / "api-query-2.42.0.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(binary: str, out: Path) -> None:
    started = time.time() - 120
    rig1 = VllmPod(MODEL, started=started)
    rig2 = VllmPod(MODEL, started=started, running=1, waiting=0, kv_usage=0.1, generation_tps=400.0)
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="capture-") as tmp:
        def serve(text, path: str = "/metrics", key: str | None = None) -> int:  # type: ignore[no-untyped-def]
            server = MetricsServer(text, path, key)
            stack.callback(server.close)
            return server.port

        pod1, pod2 = serve(rig1.text), serve(rig2.text)
        gpus1 = serve(lambda: dcgm_text("rig-1", [Gpu(0), Gpu(1, temp_c=71)]))
        gpus2 = serve(lambda: dcgm_text("rig-2", [Gpu(0, temp_c=58)]))
        routes = [
            RouterRoute(MODEL, f"http://127.0.0.1:{pod1}", success_per_s=2.0, earlier_successes=40),
            RouterRoute(MODEL, f"http://127.0.0.1:{pod2}", success_per_s=1.0, earlier_successes=20, earlier_failures=6),
            # its circuit half-opens now and then: one request tries the pod and fails
            RouterRoute(MODEL, f"http://127.0.0.1:{DEAD}", healthy=False, breaker=1, failure_per_s=0.5,
                        earlier_successes=30, earlier_failures=3),
        ]
        gateway = serve(lambda: entrance_text(routes, started), "/metrics/", KEY)
        pods = [("rig-1", pod1), ("rig-2", pod2), ("rig-3", DEAD)]
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "scrape_configs": [
                {"job_name": "vllm", "static_configs": [
                    {"targets": [f"127.0.0.1:{port}"], "labels": {"host": host, "pod": "dual", "variant": "dual",
                                                                 "model": MODEL}} for host, port in pods]},
                {"job_name": "gpu", "static_configs": [
                    {"targets": [f"127.0.0.1:{port}"], "labels": {"host": host}}
                    for host, port in (("rig-1", gpus1), ("rig-2", gpus2), ("rig-3", DEAD))]},
                {"job_name": "gateway-gw_1", "metrics_path": "/metrics/", "authorization": {"credentials": KEY},
                 "static_configs": [{"targets": [f"127.0.0.1:{gateway}"], "labels": {"host": "gw-1"}}]},
            ],
        }
        config_file = Path(tmp) / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        port = free_port()
        prometheus = subprocess.Popen([binary, f"--config.file={config_file}", f"--storage.tsdb.path={tmp}/data",
                                       f"--web.listen-address=127.0.0.1:{port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(RUN_S)
            url = f"http://127.0.0.1:{port}"
            version = requests.get(f"{url}/api/v1/status/buildinfo", timeout=5).json()["data"]["version"]
            at = round(time.time(), 3)
            responses = {}
            for query in [*prometheus_queries().values(), "rate(up)", "sum(up"]:
                reply = requests.get(f"{url}/api/v1/query", params={"query": query, "time": f"{at:.3f}"}, timeout=10)
                responses[query] = {"status_code": reply.status_code, "body": reply.json()}
        finally:
            prometheus.terminate()
            prometheus.wait(10)
    document = {
        "captured": f"Prometheus {version} (Debian 12's package) on 127.0.0.1, scraping tests/support/exporters.py's "
                    "fakes and tests/support/router_routes.py's entrance (vllm-router 0.1.17's series): rig-1 and rig-2 "
                    "up, rig-3's pod and GPU exporter down, gw-1's gateway with three routes (rig-1's healthy, rig-2's "
                    "healed, rig-3's out of rotation, its circuit open); by tests/support/capture_prometheus_answers.py",
        "time": at,
        "responses": responses,
    }
    out.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else OUT)
