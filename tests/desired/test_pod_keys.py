"""The pods' API keys (issues 42, 44): every pod is keyed by default with its own key, made once 0600 beside the
fleet CA and handed over in the pod's 0600 .env only (a cluster's members carry their head's); serving_api_key_file
still names the user's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.desired.knobs import load_defaults
from rigup.desired.plan import host_plans
from rigup.desired.pod_keys import key_owner, pod_api_key, pod_key, pod_key_file
from rigup.desired.secrets import SecretError

DUAL, SINGLE = "dual", "single"


def data(**extra: Any) -> dict[str, Any]:
    return {**load_defaults(), **extra}


def test_a_pods_key_is_made_once_0600_beside_the_fleet_ca_and_read_again(tmp_path: Path) -> None:
    key = pod_key(data(), "rig-01", "left", tmp_path)
    path = pod_key_file(data(), "rig-01", "left", tmp_path)
    assert path == tmp_path / "fleet-ca" / "pod-keys" / "rig-01" / "left.key"
    assert path.stat().st_mode & 0o777 == 0o600
    assert {p.stat().st_mode & 0o777 for p in (path.parent, path.parent.parent, tmp_path / "fleet-ca")} == {0o700}
    assert (tmp_path / "fleet-ca" / ".gitignore").read_text().splitlines()[-1] == "*"  # never committed
    assert len(key) == 64 and int(key, 16) >= 0  # secrets.token_hex(32)
    assert pod_key(data(), "rig-01", "left", tmp_path) == key  # made once
    others = {pod_key(data(), "rig-01", "right", tmp_path), pod_key(data(), "rig-02", "left", tmp_path)}
    assert key not in others and len(others) == 2  # every other pod has its own
    odd = pod_key_file(data(), "@local", "left", tmp_path)
    assert odd.parent.name.startswith("_local-") and odd.parent.parent == path.parent.parent
    path.chmod(0o644)
    with pytest.raises(SecretError, match="readable by group or others"):
        pod_key(data(), "rig-01", "left", tmp_path)


def test_without_make_a_missing_key_is_refused_and_nothing_is_made(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="the key of pod left on rig-01 .* is not there yet: the converge makes it"):
        pod_api_key(data(), "rig-01", "left", tmp_path, make=False)
    assert not (tmp_path / "fleet-ca").exists()


def test_serving_api_key_file_is_the_users_key_for_every_pod(tmp_path: Path) -> None:
    own = tmp_path / "api.key"
    own.write_text("sk-mine-0123456789abcdef\n")
    own.chmod(0o600)
    assert pod_api_key(data(serving_api_key_file=str(own)), "rig-01", "left", tmp_path) == "sk-mine-0123456789abcdef"
    assert not (tmp_path / "fleet-ca").exists()  # no pod key made for it


def test_a_cluster_member_carries_its_heads_pod_key() -> None:
    assert key_owner("rig-b", "big", "rig-a") == ("rig-a", "big")
    assert key_owner("rig-b", "left", None) == ("rig-b", "left")


def test_every_pod_is_keyed_by_default_with_its_own_key_in_its_0600_key_file_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    pods = [{"name": "left", "variant": DUAL, "gpus": [0, 1], "port": 8030},
            {"name": "right", "variant": DUAL, "gpus": [2, 3], "port": 8031}]
    plans = host_plans(data(pods=pods), "rig-01", require_lock=False, base_dir=tmp_path)
    keys = {}
    for plan in plans:
        key = pod_key(data(), "rig-01", plan.recipe.pod, tmp_path, make=False)  # the plan made it
        keys[plan.recipe.pod] = key
        assert plan.secret_names == ("VLLM_API_KEY",) and plan.secret_text("VLLM_API_KEY") == key + "\n"
        assert plan.secret_files == {"VLLM_API_KEY": f"/opt/rigup/variants/{plan.recipe.pod}/secrets/VLLM_API_KEY"}
        (service,) = yaml.safe_load(plan.compose.content)["services"].values()
        # the container reads it from its file (the entrypoint wrapper exports it): no value of its environment
        assert not any("VLLM_API_KEY" in str(item) for item in service["environment"])
        assert "< /run/rigup/secrets/VLLM_API_KEY" in service["entrypoint"][2]
        assert not [path for path, f in plan.rendered.items() if key in f.content]  # in no rendered file
    assert keys["left"] != keys["right"]  # two pods of one model on one rig: a key each
    # a preview says so without reading or making anything
    (preview,) = host_plans(data(), "rig-02", require_lock=False, read_secrets=False, base_dir=tmp_path / "none")
    assert preview.secret_names == ("VLLM_API_KEY",) and not (tmp_path / "none").exists()
