"""rigup's alert rules under promtool's own rule tests: every alert fires on the series that should
fire it, with its labels and rendered annotations, and clears when they recover. The series use the
real metric names and labels of vLLM, DCGM's exporter, node_exporter, LiteLLM and rigup's textfile,
as the fleet's Prometheus labels them (job, instance, host, pod, variant, model)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.desired.knobs import KnobError, check_knob, load_defaults
from rigup.desired.monitoring import ALERT_FOR_S, prometheus_duration, rules_text
from rigup_testbed import debarchive

POD = {"job": "vllm", "instance": "10.0.0.11:8000", "host": "rig-1", "pod": "dual", "variant": "dual", "model": "qwen"}
GPU = {"job": "gpu", "instance": "10.0.0.11:9400", "host": "rig-1", "gpu": "0", "UUID": "GPU-5d3c1f0e",
       "modelName": "NVIDIA GeForce RTX 3090", "Hostname": "rig-1"}
NODE = {"job": "node", "instance": "10.0.0.11:9100", "host": "rig-1"}
GATEWAY = {"job": "gateway-gw", "instance": "127.0.0.1:4000", "host": "gw"}
UNIT = {**NODE, "name": "rigup-dual.service"}
RIG1, RIG2 = ("rig-1/rigup-dual.service", "http://10.0.0.11:8000"), ("rig-2/rigup-dual.service", "http://10.0.0.12:8000")


def worker(route: tuple[str, str]) -> dict[str, str]:
    """The labels of vllm-router 0.1.17's per-pod health in the entrance's /metrics/ (the front adds model)."""
    return {"model": "qwen", "worker": route[1]}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def alert(name: str, fire_at: str, clear_at: str, labels: dict[str, str], summary: str, runbook: str, *,
          quiet_at: str | None = None) -> list[dict[str, Any]]:
    """promtool checks: nothing at quiet_at (before), the alert with these labels and annotations at
    fire_at, nothing at clear_at (after recovery)."""
    checks = [
        {"eval_time": fire_at, "alertname": name,
         "exp_alerts": [{"exp_labels": labels, "exp_annotations": {"summary": summary, "runbook": runbook}}]},
        {"eval_time": clear_at, "alertname": name, "exp_alerts": []},
    ]
    if quiet_at is not None:
        checks.insert(0, {"eval_time": quiet_at, "alertname": name, "exp_alerts": []})
    return checks


def fires_once_at(name: str, times: list[str], labels: dict[str, str], annotations: dict[str, str]) -> list[dict[str, Any]]:
    """promtool checks: exactly one alert `name`, with these labels and annotations, at each of these times."""
    return [{"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}]}
            for at in times]


QUARANTINE = {"pod": "dual", "variant": "dual", "model": "qwen", "probe": "arithmetic", "answer": "'!!!!!!!!...'",
              "expected": "lexical variety 0.00 over the first 200 words (verify-full fails < 0.30)"}
QUARANTINED_SUMMARY = ("rig-1/dual (dual) is QUARANTINED: probe arithmetic answered '!!!!!!!!...' (lexical variety 0.00 "
                       "over the first 200 words (verify-full fails < 0.30))")
QUARANTINED_RUNBOOK = ("rigup status --limit rig-1 shows the evidence; club-3090 #922's '!!!!' is a broken peer path: on "
                       "the rig check the driver, the P2P module and vLLM's P2P cache (docs/sentinel.md), then converge; "
                       "the pod returns after right answers")
ROUTER = {"job": "gateway-gw", "instance": "gw:4000", "host": "gw", "model": "qwen"}
CRASH_LOOP = {**UNIT, "severity": "critical"}, {
    "summary": "rig-1: rigup-dual.service keeps restarting or has failed",
    "runbook": "on the rig: journalctl -u rigup-dual.service -n 100 (boot OOM, context that does not fit, a missing model file)"}
ROUTE_FAILING = {"host": "gw", "api_base": "http://10.0.0.11:8000/v1", "requested_model": "qwen", "severity": "warning"}, {
    "summary": "gateway gw: the route of qwen to http://10.0.0.11:8000/v1 is failing",
    "runbook": "the model's router keeps a failing route out of rotation; a model with no healthy route answers 503: "
               "check the rig behind api_base (rigup status --limit it)"}


CASES: dict[str, tuple[list[dict[str, str]], list[dict[str, Any]]]] = {
    "RigupPodDown": (
        [series("up", POD, "1 1 0 0 0 0 0 1 1 1")],
        alert("RigupPodDown", "4m", "8m", {**POD, "severity": "critical"},
              "rig-1/dual (qwen) does not answer /metrics",
              "rigup status --limit rig-1; on the rig: systemctl status rigup-dual, journalctl -u rigup-dual; "
              "the next converge restarts it", quiet_at="1m"),
    ),
    "RigupGateFailed": (
        # a gate fails at minute 2 and is rolled back; at 4 the operator reverts the fleet file and converges:
        # no gate runs (the last gate stays failed), the converge supersedes the failure, the alert clears
        [series("rigup_gate_last_passed", {**NODE, "pod": "dual", "variant": "dual"}, "1 1 0 0 0 0"),
         series("rigup_release_failed_gate", {**NODE, "pod": "dual", "variant": "dual"}, "0 0 1 1 0 0")],
        alert("RigupGateFailed", "2m", "4m", {**NODE, "pod": "dual", "variant": "dual", "severity": "critical"},
              "rig-1/dual: the release the fleet asks for failed its health gate (dual)",
              "rigup status --limit rig-1 shows the rollback and its reason; fix or revert the fleet file or pins "
              "and converge", quiet_at="1m"),
    ),
    "RigupPodQuarantined": (
        # the rig's sentinel quarantines the pod at minute 2 (evidence in the labels) and releases it at 5; its
        # model's other pod (rig-2) answers right: the entrance takes rig-1's out, and the summary says no more
        [series("rigup_sentinel_quarantined", {**NODE, "pod": "dual", "variant": "dual", "model": "qwen", "probe": "",
                                               "answer": "", "expected": ""}, "0 0 stale _ _ 0 0 0"),
         series("rigup_sentinel_quarantined", {**NODE, **QUARANTINE}, "_ _ 1 1 1 stale _ _"),
         series("rigup_sentinel_quarantined", {**NODE, "host": "rig-2", "instance": "10.0.0.12:9100", "pod": "dual",
                                               "variant": "dual", "model": "qwen", "probe": "", "answer": "",
                                               "expected": ""}, "0x8"),
         series("vllm_router_active_workers", ROUTER, "2 2 1 1 1 2 2 2")],
        alert("RigupPodQuarantined", "3m", "6m", {**NODE, **QUARANTINE, "severity": "critical"},
              QUARANTINED_SUMMARY, QUARANTINED_RUNBOOK, quiet_at="1m"),
    ),
    "RigupPodOutvoted": (
        # three replicas of one identity agree, then rig-3's answer differs from minute 2 to 5; two replicas
        # of another identity disagree throughout: neither is outvoted (their known answers judge them)
        [*[series("rigup_sentinel_answer_info", {**NODE, "host": h, "pod": "dual", "variant": "dual", "identity": "id1",
                                                  "probe": "arithmetic", "answer": "aaaa"}, "1x10") for h in ("rig-1", "rig-2")],
         series("rigup_sentinel_answer_info", {**NODE, "host": "rig-3", "pod": "dual", "variant": "dual",
                                               "identity": "id1", "probe": "arithmetic", "answer": "aaaa"},
                "1 1 stale _ _ _ 1 1 1 1"),
         series("rigup_sentinel_answer_info", {**NODE, "host": "rig-3", "pod": "dual", "variant": "dual",
                                               "identity": "id1", "probe": "arithmetic", "answer": "bbbb"},
                "_ _ 1 1 1 1 stale _ _ _"),
         *[series("rigup_sentinel_answer_info", {**NODE, "host": h, "pod": "solo", "variant": "solo", "identity": "id2",
                                                  "probe": "arithmetic", "answer": a}, "1x10")
           for h, a in (("rig-4", "cccc"), ("rig-5", "dddd"))]],
        alert("RigupPodOutvoted", "4m", "8m", {"host": "rig-3", "pod": "dual", "variant": "dual", "identity": "id1",
                                               "probe": "arithmetic", "answer": "bbbb", "severity": "critical"},
              "rig-3/dual (dual) is outvoted by its replicas on probe arithmetic (answer bbbb)",
              "its greedy answer differs from the majority of its release identity id1: compare the rigs' drivers, "
              "GPUs and P2P (rigup status); converge or take the rig out", quiet_at="2m"),
    ),
    "RigupSpecDecodeAcceptanceCollapsed": (
        # the pod drafts all along; it accepts draft tokens for 10 min, none from 10 to 30, then again
        [series("vllm:spec_decode_num_draft_tokens_total", {**POD, "engine": "0", "model_name": "qwen"}, "0+30x50"),
         series("vllm:spec_decode_num_accepted_tokens_total", {**POD, "engine": "0", "model_name": "qwen"},
                "0+20x10 200x20 200+20x20")],
        alert("RigupSpecDecodeAcceptanceCollapsed", "28m", "35m",
              {"host": "rig-1", "pod": "dual", "model": "qwen", "severity": "critical"},
              "rig-1/dual (qwen) drafts but accepts no draft token, after accepting before",
              "a silent wrong-output sign (club-3090 #922): rigup status --limit rig-1 shows the sentinel's answers; "
              "check the peer path, the driver and a recent image or nightly bump", quiet_at="15m"),
    ),
    "RigupPodLengthFinishSurge": (
        # vLLM's vllm:request_success_total (vllm/v1/metrics/loggers.py, v0.27.1): rig-1's pod finishes 30 requests a
        # minute, a tenth at their token limit, for 40 min; from 40 to 60 every one ends at it (#922's '!!!!' for
        # 60 of 60 tokens), then it answers as before. rig-2's clients always ask for more than they allow: every
        # request ends at its limit, which is its own history, so it never fires
        [series("vllm:request_success_total", {**POD, "engine": "0", "model_name": "qwen", "finished_reason": "stop"},
                "0+27x40 1080x19 1107+27x19"),
         series("vllm:request_success_total", {**POD, "engine": "0", "model_name": "qwen", "finished_reason": "length"},
                "0+3x40 150+30x19 723+3x19"),
         series("vllm:request_success_total", {**POD, "engine": "0", "model_name": "qwen", "finished_reason": "repetition"},
                "0x80"),
         series("vllm:request_success_total", {**POD, "instance": "10.0.0.12:8000", "host": "rig-2", "engine": "0",
                                               "model_name": "qwen", "finished_reason": "stop"}, "0x80"),
         series("vllm:request_success_total", {**POD, "instance": "10.0.0.12:8000", "host": "rig-2", "engine": "0",
                                               "model_name": "qwen", "finished_reason": "length"}, "0+30x80")],
        alert("RigupPodLengthFinishSurge", "55m", "72m", {"host": "rig-1", "pod": "dual", "model": "qwen", "severity": "warning"},
              "rig-1/dual (qwen): 100% of its requests end at their token limit, three times its share over the day before",
              "answers that run to max_tokens can be garbage that still looks fast (club-3090 #922's '!!!!'): rigup "
              "status --limit rig-1 shows the sentinel's answers; else a client asking for longer answers than it "
              "allows", quiet_at="40m"),
    ),
    "RigupPodDegenerateAnswers": (
        # The entrance's hop scores 3 of rig-1's pod's completions a minute (rigup_entrance_completions_*_total, rig
        # and pod naming the pod); from 20 to 35 min each is degenerate ('!!!!': rule variety) and every request
        # ends at its token limit (vLLM's finished_reason), then it answers as before: it fires, and clears. rig-2's
        # clients ask for repetitive text that ends at a stop (degenerate, not at the limit), rig-3's for long
        # answers (at the limit, not degenerate): either half alone never fires.
        [series("rigup_entrance_completions_scored_total", {**GATEWAY, "rig": "rig-1", "pod": "dual", "model": "qwen"},
                "0+3x60"),
         series("rigup_entrance_completions_degenerate_total",
                {**GATEWAY, "rig": "rig-1", "pod": "dual", "model": "qwen", "rule": "variety"}, "0x20 3+3x14 45x24"),
         series("vllm:request_success_total", {**POD, "engine": "0", "model_name": "qwen", "finished_reason": "stop"},
                "0+27x20 540x14 567+27x24"),
         series("vllm:request_success_total", {**POD, "engine": "0", "model_name": "qwen", "finished_reason": "length"},
                "0+3x20 90+30x14 513+3x24"),
         series("rigup_entrance_completions_scored_total", {**GATEWAY, "rig": "rig-2", "pod": "dual", "model": "qwen"},
                "0+3x60"),
         series("rigup_entrance_completions_degenerate_total",
                {**GATEWAY, "rig": "rig-2", "pod": "dual", "model": "qwen", "rule": "repeats"}, "0+3x60"),
         series("vllm:request_success_total", {**POD, "instance": "10.0.0.12:8000", "host": "rig-2", "engine": "0",
                                               "model_name": "qwen", "finished_reason": "stop"}, "0+30x60"),
         series("rigup_entrance_completions_scored_total", {**GATEWAY, "rig": "rig-3", "pod": "dual", "model": "qwen"},
                "0+3x60"),
         series("rigup_entrance_completions_degenerate_total",
                {**GATEWAY, "rig": "rig-3", "pod": "dual", "model": "qwen", "rule": "variety"}, "0x60"),
         series("vllm:request_success_total", {**POD, "instance": "10.0.0.13:8000", "host": "rig-3", "engine": "0",
                                               "model_name": "qwen", "finished_reason": "length"}, "0+30x60")],
        [*alert("RigupPodDegenerateAnswers", "30m", "45m",
                {"host": "rig-1", "pod": "dual", "model": "qwen", "severity": "critical"},
                "rig-1/dual (qwen): 100% of its sampled answers are degenerate text, and most of its requests end at "
                "their token limit",
                "its clients get garbage now (club-3090 #922's '!!!!'): rigup status --limit rig-1 shows the sentinel's "
                "answers; take the pod out (rigup's sentinel quarantines one whose probes fail), check the peer path, "
                "the driver and a recent image or nightly bump", quiet_at="20m"),
         *[{"eval_time": at, "alertname": "RigupPodDegenerateAnswers", "exp_alerts": []} for at in ("5m", "15m", "55m")]],
    ),
    "RigupUnitCrashLooping": (
        # rigup-dual crashes from minute 6, hits its start limit at 10 (failed) and a converge starts it at
        # 15: one alert while either cause holds (both at 10-14), none the minute the converge's start
        # shows (NRestarts flushed to 0), not 15 minutes of restart count later
        [series("node_systemd_service_restart_total", UNIT, "0x5 1 2 3 4 4x4 0x20"),
         series("node_systemd_unit_state", {**UNIT, "state": "failed", "type": "exec"}, "0x9 1x4 0x20"),
         series("node_systemd_unit_state", {**UNIT, "state": "active", "type": "exec"}, "1x5 0 1 0 1 0x4 1x20"),
         series("node_systemd_unit_start_time_seconds", UNIT, "0x5 0 420 0 540 0x4 900x20")],
        [*alert("RigupUnitCrashLooping", "8m", "16m", CRASH_LOOP[0], **CRASH_LOOP[1], quiet_at="5m"),
         *fires_once_at("RigupUnitCrashLooping", ["9m", "12m", "14m"], *CRASH_LOOP),
         {"eval_time": "30m", "alertname": "RigupUnitCrashLooping", "exp_alerts": []}],
    ),
    "RigupKvCacheFull": (
        [series("vllm:kv_cache_usage_perc", {**POD, "engine": "0", "model_name": "qwen"}, "0.5 0.5 0.99x10 0.5x5"),
         series("vllm:num_requests_waiting", {**POD, "engine": "0", "model_name": "qwen"}, "0 0 3x10 0x5")],
        alert("RigupKvCacheFull", "9m", "16m", {"host": "rig-1", "pod": "dual", "model": "qwen", "severity": "warning"},
              "rig-1/dual: KV cache above 95% with requests waiting",
              "requests queue behind a full cache: add a rig serving qwen, lower max_num_seqs or max_model_len in "
              "variant_overrides, or route fewer clients here", quiet_at="5m"),
    ),
    "RigupTtftHigh": (
        # 60 requests a minute: under 1 s for 10 min, then between 5 and 20 s for 30 min, then fast again
        [series("vllm:time_to_first_token_seconds_bucket", {**POD, "le": le}, values)
         for le, values in (("1.0", "0+60x10 600+0x29 660+60x19"), ("5.0", "0+60x10 600+0x29 660+60x19"),
                            ("20.0", "0+60x59"), ("+Inf", "0+60x59"))],
        alert("RigupTtftHigh", "30m", "55m", {"host": "rig-1", "pod": "dual", "model": "qwen", "severity": "warning"},
              "rig-1/dual: time to first token p95 is 19.25s (alert_ttft_p95_s: 10.0 s)",
              "long prompts or a queue: check vllm:num_requests_waiting and prefix-cache hits for dual; "
              "rigup bench --limit rig-1", quiet_at="5m"),
    ),
    "RigupGpuHot": (
        [series("DCGM_FI_DEV_GPU_TEMP", GPU, "70x2 88x10 70x5")],
        alert("RigupGpuHot", "10m", "16m", {**GPU, "severity": "warning"},
              "rig-1 GPU 0 (NVIDIA GeForce RTX 3090) at 88 C (alert_gpu_temp_c: 83.0)",
              "airflow, fan curve and dust first; a lower gpu_power_cap_watts trades a little throughput for heat",
              quiet_at="5m"),
    ),
    "RigupGpuThrottled": (
        # 64: HW thermal slowdown; 4: the software power cap alone, which is no alarm
        [series("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", GPU, "0x2 64x8 4x10")],
        alert("RigupGpuThrottled", "9m", "16m", {**GPU, "severity": "warning"},
              "rig-1 GPU 0: clocks held down by heat or a power brake",
              "on the rig: nvidia-smi -q -d PERFORMANCE -i 0; a PSU at its limit shows as power brake (rigs that "
              "power off under load)", quiet_at="5m"),
    ),
    "RigupGpuXid": (
        [series("DCGM_FI_DEV_XID_ERRORS", GPU, "0x5 79x30")],
        alert("RigupGpuXid", "7m", "25m", {**GPU, "severity": "critical"}, "rig-1 GPU 0: XID 79",
              "on the rig: journalctl -k | grep -i xid; 79 (fallen off the bus) means power or riser; 13/31/43 "
              "usually the engine: restart the pod", quiet_at="4m"),
    ),
    "RigupGpuAtPowerCap": (
        [series("DCGM_FI_DEV_POWER_USAGE", GPU, "100x2 229x20 100x5"),
         series("DCGM_FI_DEV_POWER_MGMT_LIMIT", GPU, "230x30")],
        alert("RigupGpuAtPowerCap", "20m", "26m", {**GPU, "severity": "info"}, "rig-1 GPU 0 runs at its power limit",
              "expected under sustained load with a cap (gpu_power_cap_by_model); if throughput matters more than "
              "heat, raise the cap", quiet_at="10m"),
    ),
    "RigupExporterDown": (
        [series("up", {**GPU, "job": "gpu"}, "1 1 0x8 1x3")],
        alert("RigupExporterDown", "8m", "11m", {**GPU, "severity": "warning"},
              "rig-1: the gpu exporter does not answer",
              "on the rig: systemctl status rigup-gpu-exporter prometheus-node-exporter; the next converge restarts "
              "them", quiet_at="5m"),
    ),
    "RigupModelDiskFull": (
        [series("node_filesystem_avail_bytes", {**NODE, "mountpoint": "/srv", "device": "/dev/nvme0n1p2", "fstype": "ext4"},
                "500x2 50x10 500x5"),
         series("node_filesystem_size_bytes", {**NODE, "mountpoint": "/srv", "device": "/dev/nvme0n1p2", "fstype": "ext4"},
                "1000x20"),
         # the root filesystem is nearly full too, but the models are not there: no alert for it
         series("node_filesystem_avail_bytes", {**NODE, "mountpoint": "/", "device": "/dev/nvme0n1p1", "fstype": "ext4"},
                "10x20"),
         series("node_filesystem_size_bytes", {**NODE, "mountpoint": "/", "device": "/dev/nvme0n1p1", "fstype": "ext4"},
                "1000x20"),
         series("rigup_model_filesystem", {**NODE, "mountpoint": "/srv", "path": "/srv/models"}, "1x20")],
        alert("RigupModelDiskFull", "10m", "16m",
              {**NODE, "mountpoint": "/srv", "device": "/dev/nvme0n1p2", "fstype": "ext4", "severity": "warning"},
              "rig-1: /srv (the models) is 5% free",
              "old model revisions and images of earlier generations go first; a new variant's download needs its "
              "whole size free", quiet_at="5m"),
    ),
    "RigupDriverDrift": (
        [series("rigup_driver_loaded_branch", NODE, "580x4 0x20 580x5"),
         series("rigup_driver_wanted_branch", NODE, "580x35")],
        alert("RigupDriverDrift", "22m", "27m", {**NODE, "severity": "warning"},
              "rig-1: NVIDIA driver branch 0 is loaded, not the wanted one",
              "a kernel or driver update without a reboot, or a reboot pending: converge rig-1 (driver_reboot decides)",
              quiet_at="15m"),
    ),
    "RigupReleaseDrift": (
        [series("rigup_release_drift", {**NODE, "pod": "dual"}, "0x1 1x20 0x3")],
        alert("RigupReleaseDrift", "20m", "24m", {**NODE, "pod": "dual", "severity": "warning"},
              "rig-1/dual does not serve the release its files pin (lock)",
              "the last converge's release did not pass its gate or was not applied: rigup status --limit rig-1",
              quiet_at="10m"),
    ),
    "RigupGatewayDown": (
        [series("up", GATEWAY, "1 0x5 1x3")],
        alert("RigupGatewayDown", "4m", "7m", {**GATEWAY, "severity": "critical"},
              "the gateway on gw does not answer /metrics",
              "on gw: systemctl status nginx 'rigup-router@*'; journalctl -u nginx -u 'rigup-router@*'", quiet_at="2m"),
    ),
    "RigupGatewayRouteUnhealthy": (
        # rig-1's pod fails its router's health checks from minute 5 to 12 and is back in rotation from 13;
        # rig-2's pod serves throughout. The alert fires once the pod has been out for the hold and clears
        # when it is back.
        [series("vllm_router_worker_health", {**GATEWAY, **worker(RIG1)}, "1x4 0x8 1x28"),
         series("vllm_router_worker_health", {**GATEWAY, **worker(RIG2)}, "1x41")],
        [*alert("RigupGatewayRouteUnhealthy", "7m", "15m", ROUTE_FAILING[0], **ROUTE_FAILING[1], quiet_at="5m"),
         *fires_once_at("RigupGatewayRouteUnhealthy", ["12m"], *ROUTE_FAILING),
         {"eval_time": "40m", "alertname": "RigupGatewayRouteUnhealthy", "exp_alerts": []}],
    ),
}

# More scenarios of the alerts above, run in the same promtool test.
SCENARIOS: dict[str, tuple[list[dict[str, str]], list[dict[str, Any]]]] = {
    "RigupPodQuarantined says when the entrance kept a model's last routes": (
        # every pod of qwen is quarantined: with gateway_quarantine_removes_last_route false its router keeps
        # them (active workers 1), and the summary says so
        [series("rigup_sentinel_quarantined", {**NODE, **QUARANTINE}, "1x4"),
         series("vllm_router_active_workers", ROUTER, "1x4")],
        [*fires_once_at("RigupPodQuarantined", ["2m"], {**NODE, **QUARANTINE, "severity": "critical"},
                        {"summary": QUARANTINED_SUMMARY + "; every pod of qwen is quarantined and the entrance KEEPS "
                                    "ROUTING to them, its last routes (gateway_quarantine_removes_last_route is false): "
                                    "its clients get these answers",
                         "runbook": QUARANTINED_RUNBOOK})],
    ),
    "RigupPodQuarantined says when a model has no route left": (
        # the same with gateway_quarantine_removes_last_route true: the router holds no worker
        [series("rigup_sentinel_quarantined", {**NODE, **QUARANTINE}, "1x4"),
         series("vllm_router_active_workers", ROUTER, "0x4")],
        [*fires_once_at("RigupPodQuarantined", ["2m"], {**NODE, **QUARANTINE, "severity": "critical"},
                        {"summary": QUARANTINED_SUMMARY + "; every pod of qwen is quarantined: the entrance has no "
                                    "route left for it (gateway_quarantine_removes_last_route)",
                         "runbook": QUARANTINED_RUNBOOK})],
    ),
    "RigupGpuXid as dcgm-exporter labels it": (
        # the field carries the XID's code and text: XID 79 is a new series, the "No Error" one goes stale
        [series("DCGM_FI_DEV_XID_ERRORS", {**GPU, "err_code": "0", "err_msg": "No Error"}, "0x5"),
         series("DCGM_FI_DEV_XID_ERRORS", {**GPU, "err_code": "79", "err_msg": "GPU has fallen off the bus"},
                "_x6 79x30")],
        [{"eval_time": "4m", "alertname": "RigupGpuXid", "exp_alerts": []},
         *fires_once_at("RigupGpuXid", ["7m", "20m"],
                        {**GPU, "err_code": "79", "err_msg": "GPU has fallen off the bus", "severity": "critical"},
                        {"summary": "rig-1 GPU 0: XID 79",
                         "runbook": "on the rig: journalctl -k | grep -i xid; 79 (fallen off the bus) means power or "
                                    "riser; 13/31/43 usually the engine: restart the pod"}),
         {"eval_time": "25m", "alertname": "RigupGpuXid", "exp_alerts": []}],
    ),
    "RigupUnitCrashLooping heals by itself": (
        # three automatic restarts (minutes 6-8), then the unit stays up from 8: it resolves once it has
        # been active for 5 minutes (13), though the 15-minute restart count still says 3
        [series("node_systemd_service_restart_total", UNIT, "0x5 1 2 3x30"),
         series("node_systemd_unit_state", {**UNIT, "state": "failed", "type": "exec"}, "0x37"),
         series("node_systemd_unit_state", {**UNIT, "state": "active", "type": "exec"}, "1x5 0 0 1x30"),
         series("node_systemd_unit_start_time_seconds", UNIT, "0x5 0 0 480x30")],
        [*fires_once_at("RigupUnitCrashLooping", ["8m", "12m"], *CRASH_LOOP),
         {"eval_time": "13m", "alertname": "RigupUnitCrashLooping", "exp_alerts": []},
         {"eval_time": "20m", "alertname": "RigupUnitCrashLooping", "exp_alerts": []}],
    ),
    "RigupUnitCrashLooping does not fire on a unit restarted by converges": (
        # explicit restarts (NRestarts stays 0): no crash loop
        [series("node_systemd_service_restart_total", UNIT, "0x20"),
         series("node_systemd_unit_state", {**UNIT, "state": "active", "type": "exec"}, "1 0 1 0 1 0 1x15"),
         series("node_systemd_unit_start_time_seconds", UNIT, "0 0 120 0 240 0 360x15")],
        [{"eval_time": t, "alertname": "RigupUnitCrashLooping", "exp_alerts": []} for t in ("3m", "5m", "10m")],
    ),
}


def promtool_test(tmp_path: Path, cases: dict[str, tuple[list[dict[str, str]], list[dict[str, Any]]]],
                  **knobs: Any) -> subprocess.CompletedProcess[str]:
    rules = tmp_path / "rigup-alerts.yml"
    rules.write_text(rules_text({**load_defaults(), **knobs}))
    tests = [{"name": name, "interval": "1m", "input_series": inputs, "alert_rule_test": checks}
             for name, (inputs, checks) in cases.items()]
    spec = tmp_path / "rigup-alerts.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False))
    return subprocess.run([str(debarchive.promtool()), "test", "rules", spec.name], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_every_alert_rule_has_a_case() -> None:
    alerts = {rule["alert"] for group in yaml.safe_load(rules_text(load_defaults()))["groups"] for rule in group["rules"]}
    assert alerts == set(CASES)


def test_every_alert_fires_and_clears(tmp_path: Path) -> None:
    result = promtool_test(tmp_path, {**CASES, **SCENARIOS})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    ("alert_name", "knobs"),
    [("RigupGpuHot", {"alert_gpu_temp_c": 95}), ("RigupTtftHigh", {"alert_ttft_p95_s": 30.0}),
     ("RigupModelDiskFull", {"alert_disk_free_ratio": 0.04})],
)
def test_the_thresholds_are_the_knobs(tmp_path: Path, alert_name: str, knobs: dict[str, Any]) -> None:
    # the same series under a looser knob: the alert does not fire, and promtool says so
    result = promtool_test(tmp_path, {alert_name: CASES[alert_name]}, **knobs)
    assert result.returncode != 0
    assert f'alertname: {alert_name}' in result.stdout + result.stderr and "got:[]" in result.stdout + result.stderr


def test_how_long_a_condition_holds_before_it_fires_is_the_alert_for_s_knob(tmp_path: Path) -> None:
    # rig-1's release file drifts from minute 1 to 21: under rigup's 15 minutes the alert is quiet at 10m
    # (the case above); with RigupReleaseDrift held 2 minutes it fires at 4m and clears after the heal
    drift = [series("rigup_release_drift", {**NODE, "pod": "dual"}, "0x1 1x20 0x3")]
    checks = alert("RigupReleaseDrift", "4m", "24m", {**NODE, "pod": "dual", "severity": "warning"},
                   "rig-1/dual does not serve the release its files pin (lock)",
                   "the last converge's release did not pass its gate or was not applied: rigup status --limit rig-1",
                   quiet_at="2m")
    assert "for: 2m" in rules_text({**load_defaults(), "alert_for_s": {"RigupReleaseDrift": 120}})
    result = promtool_test(tmp_path, {"drift held 2 min": (drift, checks)}, alert_for_s={"RigupReleaseDrift": 120})
    assert result.returncode == 0, result.stdout + result.stderr
    result = promtool_test(tmp_path, {"drift held 15 min": (drift, checks)})
    assert result.returncode != 0 and "got:[]" in result.stdout + result.stderr


def test_every_alert_that_waits_is_in_alert_for_s_and_a_mistyped_name_is_refused() -> None:
    rules = [r for g in yaml.safe_load(rules_text(load_defaults()))["groups"] for r in g["rules"]]
    assert {r["alert"]: r["for"] for r in rules if "for" in r} == {
        name: prometheus_duration(s) for name, s in ALERT_FOR_S.items()}
    with pytest.raises(KnobError) as refused:
        check_knob("alert_for_s", {"RigupReleaseDrif": 60})
    assert str(refused.value).startswith("'alert_for_s': 'RigupReleaseDrif' is not a rigup alert that waits before it "
                                         "fires (did you mean 'RigupReleaseDrift'? those that do: RigupPodDown, ")
    with pytest.raises(KnobError, match="'RigupGpuHot': must be whole seconds, 0 or more, got '5m'"):
        check_knob("alert_for_s", {"RigupGpuHot": "5m"})
