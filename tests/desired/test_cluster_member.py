"""A cluster member's share of its variant as rendered (the `cluster` transform), the fleet file's
`clusters` reaching each member's data, and rigup's member script run against stand-in `ray`/`vllm`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup import REPO_ROOT
from rigup.desired.catalog import CATALOG_DIR, CATALOG_FILE, CatalogError, load_catalog, load_catalog_file
from rigup.desired.fleet import FleetError, load_fleet
from rigup.desired.knobs import load_defaults
from rigup.desired.plan import host_plans
from rigup.desired.recipe import RecipeError, pods_of
from rigup.desired.secrets import SecretError
from rigup.desired.transforms import KEY_WRAPPER_WORDS, MEMBER_SCRIPT_TARGET

VARIANT = "qwen-multi4-autoround-int4-mtp"  # TP 4, upstream's entrypoint script ends in `exec vllm serve`
NET = {"ifname": "lan0", "address": "10.0.0.12", "head_address": "10.0.0.11"}
MEMBER_SCRIPT = REPO_ROOT / "files" / "cluster" / "rigup-cluster-member"


def _fleet(tmp_path: Path, clusters: str, extra: str = "") -> Path:
    path = tmp_path / "rigs.yaml"
    path.write_text(
        "groups:\n  rigs:\n    hosts:\n"
        "      rig-a: {ssh_hostname: 10.0.0.11}\n"
        f"      rig-b: {{ssh_hostname: 10.0.0.12{extra}}}\n"
        "      rig-c: {ssh_hostname: 10.0.0.13}\n"
        f"clusters:\n{clusters}"
    )
    return path


def _member(tmp_path: Path, name: str, net: dict[str, str] | None = None) -> dict[str, Any]:
    fleet = load_fleet(_fleet(tmp_path, f"  - {{name: big, variant: {VARIANT}, hosts: [rig-a, rig-b], port: 8030}}\n"))
    data = fleet.resolved_data(name)
    if net is not None:
        data["cluster"] = {**data["cluster"], "net": net}
    return data


def _service(data: dict[str, Any]) -> dict[str, Any]:
    (plan,) = host_plans(data, require_lock=False, read_secrets=False)
    (service,) = yaml.safe_load(plan.compose.content)["services"].values()
    return {"plan": plan, **service}


def _env(service: dict[str, Any]) -> dict[str, str]:
    return dict(str(item).partition("=")[::2] for item in service["environment"])


def _flag(service: dict[str, Any], flag: str) -> str:
    command = [str(w) for w in service["command"]]
    return command[command.index(flag) + 1]


def test_the_fleet_files_clusters_give_each_member_its_entry_and_rank(tmp_path: Path) -> None:
    fleet = load_fleet(_fleet(tmp_path, f"  - {{name: big, variant: {VARIANT}, hosts: [rig-b, rig-a]}}\n"))
    assert [c.name for c in fleet.clusters] == ["big"]
    assert fleet.resolved_data("rig-b")["cluster"]["rank"] == 0  # the first listed is the head
    assert fleet.resolved_data("rig-a")["cluster"]["rank"] == 1
    assert fleet.resolved_data("rig-c")["cluster"] is None
    (pod,) = pods_of(fleet.resolved_data("rig-a"))
    assert (pod.name, pod.variant, pod.gpus, pod.listed, pod.unit) == ("big", VARIANT, (0, 1), True, "rigup-big.service")


def test_a_cluster_entry_rigup_cannot_use_names_the_file_and_entry(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match=r"rigs.yaml: clusters\[0\] \(big\): hosts: 'rig-z' not a host of the fleet file"):
        load_fleet(_fleet(tmp_path, f"  - {{name: big, variant: {VARIANT}, hosts: [rig-a, rig-z]}}\n"))
    pods = ", pods: [{name: p, variant: single, gpus: [0]}]"
    with pytest.raises(FleetError, match=r"host 'rig-b': 'pods' is set, but the host is a member of clusters\[0\] \(big\)"):
        load_fleet(_fleet(tmp_path, f"  - {{name: big, variant: {VARIANT}, hosts: [rig-a, rig-b]}}\n", pods))
    with pytest.raises(FleetError, match=r"host 'rig-b': .*'cluster' .*set from the fleet file's top-level `clusters` list"):
        load_fleet(_fleet(tmp_path, f"  - {{name: big, variant: {VARIANT}, hosts: [rig-a, rig-c]}}\n",
                          ", cluster: {name: big}"))


def test_the_head_serves_its_share_on_the_hosts_network_and_starts_ray_first(tmp_path: Path) -> None:
    head = _service(_member(tmp_path, "rig-a", {**NET, "address": "10.0.0.11"}))
    recipe = head["plan"].recipe
    assert (recipe.tensor_parallel_size, recipe.gpu_count) == (2, 2)  # this host's share: TP 2 of the TP 4 recipe
    assert _flag(head, "--tensor-parallel-size") == "2" and _flag(head, "--pipeline-parallel-size") == "2"
    assert _flag(head, "--distributed-executor-backend") == "ray"
    assert head["network_mode"] == "host" and "ports" not in head and head["ipc"] == "host"
    assert _flag(head, "--port") == "8030" and _flag(head, "--host") == "0.0.0.0"
    assert head["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0", "1"]
    env = _env(head)
    assert env["VLLM_HOST_IP"] == env["RAY_NODE_IP_ADDRESS"] == "10.0.0.11"
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"], env["TP_SOCKET_IFNAME"]) == ("=lan0", "lan0", "lan0")
    assert env["NCCL_IB_DISABLE"] == "1" and env["RIGUP_CLUSTER_ROLE"] == "head"
    assert env["RIGUP_CLUSTER_HEAD"] == "10.0.0.11:6379" and env["RIGUP_RAY_PORTS"] == "6379 6380 6381 52365 10002 10100"
    assert head["entrypoint"][:4] == list(KEY_WRAPPER_WORDS)  # rigup's key wrapper, then upstream's script
    script = head["entrypoint"][6]
    assert f"exec {MEMBER_SCRIPT_TARGET} vllm serve" in script and "exec vllm serve" not in script
    assert {"type": "bind", "source": "/opt/rigup/cluster/rigup-cluster-member", "target": MEMBER_SCRIPT_TARGET,
            "read_only": True, "bind": {"create_host_path": False}} in head["volumes"]
    explained = [c for c in recipe.changes if c.transform == "cluster"]
    assert explained and any("run_cluster.sh" in c.why for c in explained)  # `render --explain` names the transform


def test_a_worker_joins_the_heads_ray_at_the_address_it_reaches_it_by(tmp_path: Path) -> None:
    worker = _service(_member(tmp_path, "rig-b", NET))
    env = _env(worker)
    assert env["RIGUP_CLUSTER_ROLE"] == "worker" and env["VLLM_HOST_IP"] == "10.0.0.12"
    assert env["RIGUP_CLUSTER_HEAD"] == "10.0.0.11:6379"
    assert worker["network_mode"] == "host" and worker["ipc"] == "host"


def test_a_preview_without_the_network_read_names_it_by_variables(tmp_path: Path) -> None:
    env = _env(_service(_member(tmp_path, "rig-b")))
    assert env["VLLM_HOST_IP"] == "${RIGUP_CLUSTER_ADDRESS}"
    assert env["RIGUP_CLUSTER_HEAD"] == "${RIGUP_CLUSTER_HEAD_ADDRESS}:6379"


def _run_member(tmp_path: Path, role: str, *args: str, ray_version: str | None = "2.58.0",
                shebang: str = f"#!{sys.executable}") -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The member script with `ray` and `vllm` on PATH that record their argv (one line each); `ray` a console script
    on `shebang`'s Python, whose package metadata says `ray_version` (None: no Ray package at all)."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "calls"
    (bin_dir / "vllm").write_text(f'#!/bin/sh\necho "vllm $*" >> {log}\n')
    (bin_dir / "ray").write_text(f'{shebang}\nimport sys\nwith open({str(log)!r}, "a") as log:\n'
                                 '    log.write(" ".join(["ray", *sys.argv[1:]]) + "\\n")\n')
    for tool in ("ray", "vllm"):
        (bin_dir / tool).chmod(0o755)
    site.mkdir(exist_ok=True)
    if ray_version is not None:  # what pip leaves beside the package: its dist-info
        (site / f"ray-{ray_version}.dist-info").mkdir(exist_ok=True)
        (site / f"ray-{ray_version}.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: ray\nVersion: {ray_version}\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "VLLM_HOST_IP": "10.0.0.12", "RIGUP_CLUSTER_ROLE": role,
           "RIGUP_CLUSTER_HEAD": "10.0.0.11:6379", "RIGUP_CLUSTER_GPUS": "2",
           "RIGUP_RAY_PORTS": "6379 6380 6381 52365 10002 10100",
           # the fake package alone: -I would drop PYTHONPATH, -S keeps the venv's real Ray out of sight
           "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    proc = subprocess.run(["bash", str(MEMBER_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30)
    return proc, log.read_text().splitlines() if log.exists() else []


NODE_FLAGS = ("--node-ip-address=10.0.0.12 --num-gpus=2 --node-manager-port=6380 --object-manager-port=6381 "
              "--dashboard-agent-grpc-port=52365 --dashboard-agent-listen-port=52366 --runtime-env-agent-port=52367 "
              "--metrics-export-port=52368 --min-worker-port=10002 --max-worker-port=10100 --disable-usage-stats")


def test_the_member_script_starts_the_ray_head_then_the_server(tmp_path: Path) -> None:
    proc, calls = _run_member(tmp_path, "head", "vllm", "serve", "--model", "/m")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"ray start --head --port=6379 --include-dashboard=false {NODE_FLAGS}", "vllm serve --model /m"]


def test_the_member_script_joins_a_worker_and_never_serves(tmp_path: Path) -> None:
    proc, calls = _run_member(tmp_path, "worker", "vllm", "serve", "--model", "/m")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"ray start --block --address=10.0.0.11:6379 {NODE_FLAGS}"]


def test_the_member_script_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    proc, calls = _run_member(tmp_path, "head", "python3", "-m", "something")
    assert proc.returncode == 2 and "the head runs `vllm serve ...`" in proc.stderr and calls == []
    proc, calls = _run_member(tmp_path, "observer")
    assert proc.returncode == 2 and "must be head or worker" in proc.stderr and calls == []
    assert os.access(MEMBER_SCRIPT, os.X_OK)


@pytest.mark.parametrize(("version", "shebang"), [("2.51.2", None), ("1.13.0", None), (None, None),
                                                   ("2.58.0", "#!/bin/sh")])
def test_the_member_script_refuses_a_ray_without_token_auth_before_any_port_opens(
    tmp_path: Path, version: str | None, shebang: str | None
) -> None:
    """Ray older than 2.52 ignores RAY_AUTH_MODE and answers anyone: the member script reads the Ray `ray` runs (its
    package's metadata, by its console script's interpreter) and refuses an older one, or one it cannot read (no
    package, a `ray` that is no Python console script), in one line, before `ray start`; 2.52 itself starts."""
    for role in ("head", "worker"):
        proc, calls = _run_member(tmp_path, role, "vllm", "serve", "--model", "/m", ray_version=version,
                                  shebang=shebang or f"#!{sys.executable} -S")
        assert proc.returncode == 2 and calls == [], (role, proc.stderr)
        (line,) = proc.stderr.splitlines()
        assert line == (f"rigup cluster member: the image's Ray is {version if not shebang and version else 'unknown'}; "
                        "the cluster's Ray asks every caller for its token (RAY_AUTH_MODE=token), which Ray reads from "
                        "2.52 on, and an older one would answer anyone: not starting; serve a variant whose image "
                        "carries Ray 2.52 or later"), line
    proc, calls = _run_member(tmp_path / "new", "worker", ray_version="2.52.0", shebang="#!/usr/bin/env python3")
    assert proc.returncode == 0 and calls == [f"ray start --block --address=10.0.0.11:6379 {NODE_FLAGS}"], proc.stderr


def test_a_cluster_whose_image_carries_an_older_ray_is_refused_at_plan_time_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catalog image that records its Ray (ray_version) older than 2.52 cannot run a cluster: the fleet file is
    refused before anything connects, in one line naming the file, the entry, its hosts, the key and what it takes;
    2.52 and a Ray the catalog does not record (the member script checks it at start) are not refused."""
    catalog = load_catalog()
    image = catalog["variants"][VARIANT]["image"]
    listed = f"  - {{name: big, variant: {VARIANT}, hosts: [rig-a, rig-b]}}\n"
    monkeypatch.setitem(catalog["images"], image, {**catalog["images"][image], "ray_version": "2.48.0"})
    with pytest.raises(FleetError) as caught:
        load_fleet(_fleet(tmp_path, listed))
    (line,) = str(caught.value).splitlines()
    assert line == (f"{tmp_path / 'rigs.yaml'}: clusters[0] (big): variant: {VARIANT!r} runs image {image}, whose Ray is "
                    f"2.48.0 (the catalog's images.{image}.ray_version), but every member of a cluster (here rig-a, "
                    "rig-b) runs Ray with token authentication (RAY_AUTH_MODE=token), which Ray reads from 2.52 on: an "
                    "older Ray ignores it and answers anyone; variant takes a variant whose image carries Ray 2.52 or later")
    for fine in ("2.52", "2.58.0"):
        monkeypatch.setitem(catalog["images"], image, {**catalog["images"][image], "ray_version": fine})
        assert [c.name for c in load_fleet(_fleet(tmp_path, listed)).clusters] == ["big"]
    monkeypatch.setitem(catalog["images"], image, {k: v for k, v in catalog["images"][image].items() if k != "ray_version"})
    assert [c.name for c in load_fleet(_fleet(tmp_path, listed)).clusters] == ["big"]


def test_the_catalog_takes_an_images_ray_version_as_a_quoted_version(tmp_path: Path) -> None:
    text = CATALOG_FILE.read_text()
    image = load_catalog()["variants"][VARIANT]["image"]
    marker = f"  {image}:\n"
    assert marker in text
    for bad in ("2.52", "'latest'", "'2'"):  # 2.52 unquoted is YAML's float
        path = tmp_path / "catalog.yaml"
        path.write_text(text.replace(marker, f"{marker}    ray_version: {bad}\n", 1))
        with pytest.raises(CatalogError, match=rf"images.{image}.ray_version: a quoted MAJOR.MINOR\[.PATCH\] string"):
            load_catalog_file(path, CATALOG_DIR.glob("*.yaml"))
    path.write_text(text.replace(marker, f"{marker}    ray_version: '2.58.0'\n", 1))
    assert load_catalog_file(path, CATALOG_DIR.glob("*.yaml"))["images"][image]["ray_version"] == "2.58.0"


def test_the_ray_ports_are_knobs_declared_once() -> None:
    defaults = load_defaults()
    assert (defaults["cluster_ray_port"], defaults["cluster_ray_worker_ports"]) == (6379, [10002, 10100])


def test_a_speculative_method_only_upstreams_command_names_is_refused_when_the_member_renders(tmp_path: Path) -> None:
    # dual-dflash's DFlash is in upstream's compose command, not in the catalog: the fleet file passes, the
    # member's recipe does not
    fleet = load_fleet(_fleet(tmp_path, "  - {name: duo, variant: dual-dflash, hosts: [rig-a, rig-b]}\n"))
    with pytest.raises(RecipeError, match=r"clusters\[0\] \(duo\): vLLM cannot serve variant 'dual-dflash' across "
                                          r"hosts: speculative decoding with DFlash"):
        host_plans(fleet.resolved_data("rig-b"), require_lock=False, read_secrets=False)


def test_a_members_share_keeps_the_variants_measured_envelope(tmp_path: Path) -> None:
    # TP 2 on each of 2 hosts spreads the model over 4 GPUs, as the catalog measured it at TP 4
    recipe = _service(_member(tmp_path, "rig-b", NET))["plan"].recipe
    assert (recipe.tensor_parallel_size, recipe.pipeline_parallel_size, recipe.shards) == (2, 2, 4)
    assert recipe.envelope_is_documented


def test_every_member_runs_ray_with_token_auth_and_the_token_comes_from_its_file(tmp_path: Path) -> None:
    for name in ("rig-a", "rig-b"):
        service = _service(_member(tmp_path, name, NET))
        env = _env(service)
        assert env["RAY_AUTH_MODE"] == "token"
        # Ray reads it from the file RAY_AUTH_TOKEN_PATH names: never a value of the container's environment
        assert env["RAY_AUTH_TOKEN_PATH"] == "/run/rigup/secrets/RAY_AUTH_TOKEN" and "RAY_AUTH_TOKEN" not in env
        plan = service["plan"]
        assert "RAY_AUTH_TOKEN" in plan.secret_names
        assert plan.secret_files["RAY_AUTH_TOKEN"] == "/opt/rigup/variants/big/secrets/RAY_AUTH_TOKEN"
    alone = load_fleet(_fleet(tmp_path, "  - {name: big, variant: " + VARIANT + ", hosts: [rig-a, rig-b]}\n"))
    (plan,) = host_plans(alone.resolved_data("rig-c"), require_lock=False, read_secrets=False)
    assert "RAY_AUTH" not in plan.compose.content and "RAY_AUTH_TOKEN" not in plan.secret_names


def test_the_clusters_token_is_made_once_0600_beside_the_fleet_ca_and_every_member_gets_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    texts = {}
    for name in ("rig-a", "rig-b", "rig-a"):
        (plan,) = host_plans(_member(tmp_path, name, NET), require_lock=False, base_dir=tmp_path)
        texts[name] = plan.secret_text("RAY_AUTH_TOKEN")
    made = tmp_path / "fleet-ca" / "ray-big.token"
    assert made.stat().st_mode & 0o777 == 0o600 and (tmp_path / "fleet-ca").stat().st_mode & 0o777 == 0o700
    token = made.read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0  # as Ray's own generator: secrets.token_hex(32)
    for name, text in texts.items():
        assert text == token + "\n", name
        assert token not in _service(_member(tmp_path, name, NET))["plan"].compose.content
    made.chmod(0o644)
    with pytest.raises(SecretError, match="readable by group or others"):
        host_plans(_member(tmp_path, "rig-a", NET), require_lock=False, base_dir=tmp_path)
