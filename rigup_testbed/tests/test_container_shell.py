"""Containers that run their own entrypoint script (stand-in dockerd's "shell" kind, container.py).

Run off-container like test_standins.py: the built packages unpacked in a scratch root, dockerd started
with RIGUP_STANDIN_ROOT. The container's root is assembled in a private mount namespace, so these
tests need root (and mount namespaces), which the test bed always has.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rigup_testbed import hardware as hw
from rigup_testbed.tests.test_standins import (  # noqa: F401 - fixtures
    CTK,
    Daemon,
    Root,
    boot_module,
    compose,
    docker_root,
    free_port,
    http,
    http_status,
    install_driver,
    repo,
    root,
    wait_for,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="assembles container roots in a mount namespace (root only)")

VLLM_SITE = "/usr/local/lib/python3.12/dist-packages/vllm"
IMAGE = "vllm/vllm-openai:v0.11.0"
LMCACHE_IMAGE = "lmcache/vllm-openai:v0.4.7-cu129"
OMNI_IMAGE = "vllm/vllm-omni:v0.20.0"
# club-3090's deploy config of its vllm-omni compose (4a29ab57), as the test bed's upstream fixture carries it
OMNI_DEPLOY = (Path(__file__).resolve().parents[1] / "upstream/club-3090/aug/models/qwen3-omni-30b-a3b/vllm-omni/"
               "compose/dual/autoround-int4/qwen3_omni_3090.yaml")


@pytest.fixture
def gpu_root(docker_root: tuple[Root, Daemon]) -> Iterator[tuple[Root, Daemon]]:
    """Docker with the nvidia runtime and a loaded driver: GPU containers start."""
    root, daemon = docker_root
    root.install(f"{CTK}/*1.18.0-1_amd64.deb")
    root.run("nvidia-ctk", "runtime", "configure", "--runtime=docker", check=True)
    install_driver(root)
    root.reboot()
    boot_module(root)
    daemon.restart()
    yield root, daemon


def network(root: Root, allowed: bool) -> None:
    root.write("etc/rigup-testbed/containers.json", json.dumps({"network": allowed}))


def run(root: Root, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """docker run --rm (attached: exit code and logs come back)."""
    return root.run("docker", "run", "--rm", *args, timeout=timeout)


def bash(root: Root, script: str, *volumes: str, image: str = IMAGE) -> subprocess.CompletedProcess[str]:
    vols = [a for v in volumes for a in ("-v", v)]
    return run(root, *vols, "--entrypoint", "/bin/bash", image, "-c", textwrap.dedent(script))


def model_dir(path: Path, config: bool = True, weights: bool = True) -> Path:
    path.mkdir(parents=True)
    if config:
        (path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    if weights:
        (path / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    return path


def genesis_tree(path: Path, apply_all: str = "def main():\n    return 0\n\nmain()\n") -> Path:
    (path / "patches").mkdir(parents=True)
    (path / "__init__.py").write_text("")
    (path / "patches/__init__.py").write_text("")
    (path / "patches/apply_all.py").write_text(apply_all)
    return path


UPSTREAM_SCRIPT = f"""\
set -e
pip install xxhash pandas scipy -q
if [ ! -f {VLLM_SITE}/_genesis/patches/apply_all.py ]; then
  echo "ERROR: Genesis patches missing" >&2; exit 1
fi
bash /etc/club3090/install-pr35936.sh
source /etc/club3090/detect_nvlink.sh
python3 -m vllm._genesis.patches.apply_all
python3 /patches/qwen3coder_tool_parser_deferred_commit.py
echo "leak" > /opt/written-in-container
SPEC_ARGS=(--speculative-config '{{"method":"mtp","num_speculative_tokens":3}}')
echo "NCCL_P2P_LEVEL=${{NCCL_P2P_LEVEL:-unset}} GPUS=$GPU_COUNT"
exec vllm serve --disable-custom-all-reduce "$@" "${{SPEC_ARGS[@]}}"
"""

DETECT_NVLINK = """\
if nvidia-smi topo -m | grep -q 'NV[0-9]'; then export NCCL_P2P_LEVEL=NVL; fi
GPU_COUNT=$(nvidia-smi -L | wc -l)
"""


def upstream_project(tmp_path: Path, ports: list[tuple[int, int]], port_arg: str = "8000") -> Path:
    project = tmp_path / "club3090"
    (project / "patches").mkdir(parents=True)
    (project / "scripts").mkdir()
    (project / "patches/qwen3coder_tool_parser_deferred_commit.py").write_text("import sys\nprint('patched', sys.argv)\n")
    (project / "scripts/install-pr35936.sh").write_text('echo "installing PR 35936 from $0"\n')
    (project / "scripts/detect_nvlink.sh").write_text(DETECT_NVLINK)
    model_dir(tmp_path / "hf/qwen3.6-27b-autoround-int4")
    genesis = genesis_tree(tmp_path / "genesis/vllm/_genesis")
    published = ", ".join(f'"127.0.0.1:{host}:{ctr}"' for host, ctr in ports)
    entry = "\n".join("        " + line for line in UPSTREAM_SCRIPT.replace("$", "$$").splitlines())
    (project / "compose.yaml").write_text(f"""\
services:
  qwen:
    image: {IMAGE}
    container_name: club3090-qwen
    ports: [{published}]
    entrypoint:
      - /bin/bash
      - -c
      - |
{entry}
      - --
    command: [--model, /root/.cache/huggingface/qwen3.6-27b-autoround-int4, --served-model-name, qwen3.6-27b,
              qwen-coder, --max-model-len, "8192", --tensor-parallel-size, "2", --port, "{port_arg}"]
    environment:
      VLLM_API_KEY: sekrit
    volumes:
      - {tmp_path}/hf:/root/.cache/huggingface:ro
      - ./patches/qwen3coder_tool_parser_deferred_commit.py:/patches/qwen3coder_tool_parser_deferred_commit.py:ro
      - ./scripts/install-pr35936.sh:/etc/club3090/install-pr35936.sh:ro
      - ./scripts/detect_nvlink.sh:/etc/club3090/detect_nvlink.sh:ro
      - type: bind
        source: {genesis}
        target: {VLLM_SITE}/_genesis
        read_only: true
        bind:
          create_host_path: false
    deploy:
      resources:
        reservations:
          devices: [{{driver: nvidia, count: all, capabilities: [gpu]}}]
""")
    return project


def logs(root: Root, name: str) -> str:
    out = root.run("docker", "logs", name)
    return out.stdout + out.stderr


def state(root: Root, name: str) -> tuple[str, int]:
    out = root.run("docker", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name, check=True).stdout.split()
    return out[0], int(out[1])


# --- upstream compose files ---------------------------------------------------------------------


def test_upstream_entrypoint_comes_up_through_bash(gpu_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = gpu_root
    network(root, True)
    port, other = free_port(), free_port()
    project = upstream_project(tmp_path, [(port, 8000), (other, 8001)])
    compose(root, project, "up", "-d", check=True)
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{base}/health") == 200 or state(root, "club3090-qwen")[0] != "running")
    text = logs(root, "club3090-qwen")
    assert state(root, "club3090-qwen") == ("running", 0), text
    status, body = http(f"{base}/v1/models", "sekrit")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["qwen3.6-27b", "qwen-coder"]
    assert json.loads(body)["data"][0]["max_model_len"] == 8192
    for served in ("qwen3.6-27b", "qwen-coder"):  # either served name reaches the model
        status, body = http(f"{base}/v1/chat/completions", "sekrit",
                            {"model": served, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert status == 200, body
    assert http(f"{base}/v1/chat/completions", "sekrit", {"model": "other", "messages": [{"role": "user", "content": "x"}]})[0] == 404
    wait_for(lambda: "SpecDecoding metrics: Mean acceptance length" in logs(root, "club3090-qwen"))
    text = logs(root, "club3090-qwen")
    # Every step of the script ran, in order, with the compose command as "$@" of the final exec.
    assert "rigup stand-in: pip would install: xxhash pandas scipy" in text
    assert "installing PR 35936 from /etc/club3090/install-pr35936.sh" in text
    assert f"python3 -m vllm._genesis.patches.apply_all: {VLLM_SITE}/_genesis/patches/apply_all.py compiled" in text
    assert "python3 /patches/qwen3coder_tool_parser_deferred_commit.py: compiled, ran" in text
    assert "NCCL_P2P_LEVEL=unset GPUS=2" in text  # nvidia-smi in the container: the PIX rig's two GPUs
    assert "'--disable-custom-all-reduce', '--model', '/root/.cache/huggingface/qwen3.6-27b-autoround-int4'" in text
    assert "'--speculative-config', '{\"method\":\"mtp\",\"num_speculative_tokens\":3}'" in text
    assert text.index("pip would install") < text.index("apply_all") < text.index("Application startup complete.")
    # Only the container port vLLM listens on (--port 8000) answers; 8001 is published to nothing.
    assert http_status(f"http://127.0.0.1:{other}/health") == 0
    # The container's writes stay in its own root.
    assert not Path("/opt/written-in-container").exists()
    cdir = next((root.path / "var/lib/docker-standin/containers").iterdir())
    assert not any((cdir / "rootfs").iterdir())
    inspect = json.loads(root.run("docker", "inspect", "club3090-qwen", check=True).stdout)[0]
    assert inspect["Path"] == "/bin/bash" and inspect["Args"][0] == "-c" and inspect["Args"][2] == "--"
    # vLLM holds its GPUs while it runs (the responder behind `exec vllm serve`).
    used = root.run("nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout.split()
    assert used == [str(1 + int(0.9 * 24576))] * 2
    compose(root, project, "down", check=True)
    assert http_status(f"{base}/health") == 0


def test_exec_vllm_serve_keeps_published_fds_and_honours_port(gpu_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = gpu_root
    network(root, True)
    port, other = free_port(), free_port()
    project = upstream_project(tmp_path, [(port, 8000), (other, 8001)], port_arg="8001")
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: http_status(f"http://127.0.0.1:{other}/health") == 200)
    assert http_status(f"http://127.0.0.1:{port}/health") == 0  # --port 8001: nothing listens on 8000
    pid = json.loads(root.run("docker", "inspect", "club3090-qwen", check=True).stdout)[0]["State"]["Pid"]
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[1].endswith(b"responder.py")  # bash exec'd the shim, the shim exec'd the responder: same pid
    compose(root, project, "down", check=True)


def test_upstream_entrypoint_without_network_fails_at_pip(gpu_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = gpu_root
    project = upstream_project(tmp_path, [(free_port(), 8000)])
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: state(root, "club3090-qwen")[0] == "exited")
    assert state(root, "club3090-qwen") == ("exited", 1)
    text = logs(root, "club3090-qwen")
    assert "Network is unreachable" in text and "No matching distribution found for xxhash" in text
    assert "pip install xxhash pandas scipy: network is unreachable" in text
    assert "installing PR 35936" not in text  # set -e stopped the script


def test_long_syntax_missing_source_fails_the_start(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = docker_root
    project = tmp_path / "p"
    project.mkdir()
    missing = tmp_path / "nowhere/patch.py"
    (project / "compose.yaml").write_text(f"""\
services:
  s:
    image: {IMAGE}
    entrypoint: [bash, -c, "python3 /patches/patch.py"]
    volumes:
      - type: bind
        source: {missing}
        target: /patches/patch.py
        bind:
          create_host_path: false
""")
    up = compose(root, project, "up", "-d")
    assert up.returncode == 1
    assert f'Error response from daemon: invalid mount config for type "bind": bind source path does not exist: {missing}' \
        in up.stderr
    assert not missing.exists()


# --- the shell and its shims ----------------------------------------------------------------------


def test_set_e_stops_at_a_missing_script_mounted_as_empty_dir(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = docker_root
    src = tmp_path / "patches/missing.py"
    out = bash(root, """\
        set -e
        echo "before"
        python3 /patches/missing.py
        echo "not reached"
        """, f"{src}:/patches/missing.py:ro")
    assert out.returncode == 1, out
    assert "before\n" in out.stdout and "not reached" not in out.stdout
    assert "can't find '__main__' module in '/patches/missing.py'" in out.stdout
    assert src.is_dir() and not any(src.iterdir())  # Docker made the missing source an empty directory
    absent = bash(root, "python3 /patches/other.py")
    assert absent.returncode == 2 and "can't open file '/patches/other.py': [Errno 2]" in absent.stdout


def test_python_scripts_must_come_from_a_mount_and_compile(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = docker_root
    (tmp_path / "p").mkdir()
    (tmp_path / "p/good.py").write_text("import sys\nprint(sys.argv)\n")
    (tmp_path / "p/bad.py").write_text("def broken(:\n    pass\n")
    ok = bash(root, "/usr/bin/python3 -u /patches/good.py --flag && python /patches/good.py", f"{tmp_path}/p:/patches:ro")
    assert ok.returncode == 0, ok
    assert "rigup stand-in: python3 /patches/good.py --flag: compiled, ran (simulated)" in ok.stdout
    bad = bash(root, "python3 /patches/bad.py; echo status=$?", f"{tmp_path}/p:/patches:ro")
    assert 'File "/patches/bad.py", line 1' in bad.stdout and "SyntaxError" in bad.stdout
    assert "status=1" in bad.stdout
    own = bash(root, "printf 'print(1)\\n' > /tmp/own.py && python3 /tmp/own.py")
    assert own.returncode == 1 and "is in the container's own filesystem" in own.stdout
    inline = bash(root, "python3 -c 'print(1)'")
    assert inline.returncode == 1 and "python3 -c in a container is not simulated" in inline.stdout
    stdin = bash(root, "python3 - <<'EOF'\nprint(1)\nEOF")
    assert stdin.returncode == 1 and "not simulated" in stdin.stdout


def test_genesis_must_be_mounted_under_dist_packages(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = docker_root
    tree = genesis_tree(tmp_path / "genesis")
    site = VLLM_SITE.replace("dist-packages", "site-packages")
    wrong = bash(root, "python3 -m vllm._genesis.patches.apply_all", f"{tree}:{site}/_genesis:ro")
    assert wrong.returncode == 1
    assert "No module named 'vllm._genesis'" in wrong.stdout
    assert f"looked for the Genesis tree at {VLLM_SITE}/_genesis" in wrong.stdout
    assert f"a tree is mounted at {site}/_genesis, which is not on the image's sys.path" in wrong.stdout
    (tmp_path / "empty").mkdir()
    empty = bash(root, "python3 -m vllm._genesis.patches.apply_all", f"{tmp_path}/empty:{VLLM_SITE}/_genesis:ro")
    assert empty.returncode == 1 and "No module named 'vllm._genesis.patches'" in empty.stdout
    assert "it is empty or incomplete" in empty.stdout
    right = bash(root, "python3 -m vllm._genesis.patches.apply_all", f"{tree}:{VLLM_SITE}/_genesis:ro")
    assert right.returncode == 0, right
    assert f"{VLLM_SITE}/_genesis/patches/apply_all.py compiled" in right.stdout
    (tree / "patches/apply_all.py").write_text("import (\n")
    broken = bash(root, "python3 -m vllm._genesis.patches.apply_all", f"{tree}:{VLLM_SITE}/_genesis:ro")
    assert broken.returncode == 1 and "SyntaxError" in broken.stdout


def test_pip_needs_the_test_beds_network(docker_root: tuple[Root, Daemon]) -> None:
    root, _ = docker_root
    offline = bash(root, "pip install -q xxhash 'pandas>=2' scipy")
    assert offline.returncode == 1
    assert "[Errno 101] Network is unreachable')': /simple/xxhash/" in offline.stdout
    assert "pip install xxhash pandas>=2 scipy: network is unreachable" in offline.stdout
    assert bash(root, "python3 -m pip install transformers==5.8.0").returncode == 1
    network(root, False)
    assert bash(root, "pip3 install xxhash").returncode == 1
    network(root, True)
    online = bash(root, "pip install --upgrade -q xxhash 'pandas>=2' && python3 -m pip install transformers==5.8.0")
    assert online.returncode == 0, online
    assert "rigup stand-in: pip would install: xxhash pandas>=2" in online.stdout
    assert "Successfully installed transformers" in online.stdout


def test_unknown_commands_exit_127_naming_themselves(docker_root: tuple[Root, Daemon]) -> None:
    root, _ = docker_root
    out = bash(root, "curl -fsS http://localhost:8000/health")
    assert out.returncode == 127
    assert "rigup stand-in: curl in a container is not simulated" in out.stdout
    nested = bash(root, "printf 'uv pip install x\\n' > /tmp/s.sh && bash /tmp/s.sh")
    assert nested.returncode == 127 and "rigup stand-in: uv in a container is not simulated" in nested.stdout
    # What is there: real builtins and the allowlisted utilities; no host tools beyond them.
    ok = bash(root, "set -e; a=(x y z); echo ${#a[@]} $(echo abc | tr a-c A-C | sed s/B/b/); test -d /tmp; "
                    "ls /usr/bin | grep -c . >/dev/null; command -v dpkg || echo no-dpkg")
    assert ok.returncode == 0 and "3 AbC\n" in ok.stdout and "no-dpkg" in ok.stdout, ok
    missing = run(root, "--entrypoint", "/opt/no-such-tool", IMAGE)
    assert missing.returncode == 127
    assert 'error during container init: exec: "/opt/no-such-tool": stat /opt/no-such-tool: no such file or directory' \
        in missing.stderr
    src = Path(tempfile.mkdtemp()) / "entry.sh"
    directory = run(root, "-v", f"{src}:/entry.sh", "--entrypoint", "/entry.sh", IMAGE)  # made an empty dir
    assert directory.returncode == 126 and "exec /entry.sh: is a directory" in directory.stderr
    shutil.rmtree(src.parent)


LMCACHE_START = """\
lm_args=(--chunk-size "${LMCACHE_CHUNK_SIZE:-1584}" --l1-size-gb "${LMCACHE_L1_GB:-30}" --eviction-policy LRU)
if [ "${LMCACHE_L2:-0}" = "1" ]; then lm_args+=(--l2-adapter '{"type":"fs","base_path":"/lmcache-kv"}'); fi
lmcache server "${lm_args[@]}" &
pid=$!
sleep 1
kill -0 "$pid" && echo "server up"
kill "$pid"; wait "$pid"; echo "server rc=$?"
"""


def test_lmcache_server_checks_its_arguments_and_stays_up(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    """club-3090's vllm-lmcache entrypoint starts `lmcache server` in the background, then vLLM (LMCache's image)."""
    root, _ = docker_root

    def bash(root: Root, script: str, *volumes: str) -> subprocess.CompletedProcess[str]:
        return globals()["bash"](root, script, *volumes, image=LMCACHE_IMAGE)

    up = bash(root, LMCACHE_START)
    assert up.returncode == 0, up
    assert ("rigup stand-in: lmcache server listening on localhost:5555 (simulated): L1 30 GB, chunk 1584 tokens, "
            "eviction LRU, L2 none") in up.stdout
    assert "server up" in up.stdout and "server rc=143" in up.stdout  # a server: up until SIGTERM ends it
    assert "--l1-size-gb 30 is above /dev/shm (0.07 GB)" in up.stdout  # docker's default 64 MiB shm
    kv = tmp_path / "lmcache-kv"
    kv.mkdir()
    l2 = bash(root, "LMCACHE_L2=1\n" + LMCACHE_START, f"{kv}:/lmcache-kv")
    assert "L2 fs /lmcache-kv" in l2.stdout and "server up" in l2.stdout, l2
    no_dir = bash(root, "LMCACHE_L2=1\n" + LMCACHE_START)
    assert "No such file or directory: '/lmcache-kv'" in no_dir.stdout and "server up" not in no_dir.stdout
    read_only = bash(root, "LMCACHE_L2=1\n" + LMCACHE_START, f"{kv}:/lmcache-kv:ro")
    assert "Permission denied: '/lmcache-kv'" in read_only.stdout and "server up" not in read_only.stdout
    for args, code, message in [
        ("server --l1-size-gb 30 --chunk-szie 1584", 2, "unrecognized arguments: --chunk-szie 1584"),
        ("server --l1-size-gb 30 --chunk-size", 2, "argument --chunk-size: expected one argument"),
        ("server --l1-size-gb x", 2, "argument --l1-size-gb: invalid positive float value: 'x'"),
        ("server --l1-size-gb 30 --l2-adapter '{\"type\":\"nixl_store\"}'", 1,
         "lmcache server --l2-adapter type 'nixl_store' in a container is not simulated"),
        ("server --l1-size-gb 30 --eviction-policy FIFO", 1, "--eviction-policy FIFO in a container is not simulated"),
        ("server --chunk-size 1584", 1, "without --l1-size-gb"),
        ("controller", 1, "lmcache controller in a container is not simulated"),
    ]:
        out = bash(root, f"lmcache {args}; echo rc=$?")
        assert f"rc={code}" in out.stdout and message in out.stdout, (args, out)


def test_only_lmcaches_image_has_lmcache_and_its_own_layout(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    """dockerd hands container.py the image's kind: `lmcache` is LMCache's image's, in its /opt/venv, next to its
    vllm (the image's entrypoint); vllm/vllm-openai and vLLM-Omni's image have vllm but no lmcache."""
    root, _ = docker_root
    for image in (IMAGE, OMNI_IMAGE):
        out = bash(root, "command -v vllm; lmcache server --l1-size-gb 1; echo rc=$?", image=image)
        assert "/usr/local/bin/vllm\n" in out.stdout and "rc=127" in out.stdout, (image, out)
        assert "rigup stand-in: lmcache in a container is not simulated" in out.stdout
    out = bash(root, "command -v vllm lmcache python3; pwd; ls /vllm-workspace 2>&1 | head -1; vllm --version",
               image=LMCACHE_IMAGE)
    assert out.stdout.splitlines()[:4] == ["/opt/venv/bin/vllm", "/opt/venv/bin/lmcache", "/opt/venv/bin/python3",
                                           "/workspace"], out
    assert "No such file or directory" in out.stdout and out.stdout.splitlines()[-1] == "0.11.0"
    # The image's own entrypoint (/opt/venv/bin/vllm serve) serves a model given as the command.
    model_dir(tmp_path / "models/m")
    name = "lmcache-default-entrypoint"
    started = root.run("docker", "run", "-d", "--name", name, "-v", f"{tmp_path}/models:/models:ro", LMCACHE_IMAGE,
                       "/models/m", "--gpu-memory-utilization", "0.5")
    assert started.returncode == 0, started
    wait_for(lambda: "Application startup complete." in logs(root, name) or state(root, name)[0] != "running")
    inspect = json.loads(root.run("docker", "inspect", name, check=True).stdout)[0]
    assert inspect["Config"]["Entrypoint"] == ["/opt/venv/bin/vllm", "serve"]
    assert inspect["Config"]["WorkingDir"] == "/workspace"
    text = logs(root, name)
    assert "RuntimeError: Failed to infer device type" in text or "Application startup complete." in text, text
    root.run("docker", "rm", "-f", name, check=True)


def omni_project(tmp_path: Path, port: int, deploy: str, *, image: str = OMNI_IMAGE, extra: str = "") -> Path:
    """A compose file like club-3090's vllm-omni one: no entrypoint, the command is the whole `vllm serve`
    (in an image whose entrypoint is `vllm serve`, just its arguments)."""
    serve = "vllm serve " if image == OMNI_IMAGE else ""
    if not (tmp_path / "models/qwen3-omni").exists():
        model_dir(tmp_path / "models/qwen3-omni")
    project = tmp_path / "omni"
    project.mkdir(exist_ok=True)
    (project / "deploy.yaml").write_text(deploy)
    (project / "compose.yaml").write_text(f"""\
services:
  omni:
    image: {image}
    container_name: omni
    ports: ["127.0.0.1:{port}:8000"]
    volumes:
      - {tmp_path}/models:/models:ro
      - ./deploy.yaml:/cfg/deploy.yaml:ro
    command: >-
      {serve}/models/qwen3-omni --omni --deploy-config /cfg/deploy.yaml --port 8000 --trust-remote-code{extra}
    deploy:
      resources:
        reservations:
          devices: [{{driver: nvidia, count: all, capabilities: [gpu]}}]
""")
    return project


def chat(base: str, **fields: Any) -> tuple[int, Any]:
    status, body = http(f"{base}/v1/chat/completions", None,
                        {"model": "/models/qwen3-omni", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                         **fields})
    return status, json.loads(body)


def test_vllm_omni_serves_its_deploy_configs_stages(gpu_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    """vLLM-Omni's image has no entrypoint: `vllm serve MODEL --omni --deploy-config FILE` runs as written (not
    `vllm serve vllm serve ...`), each stage an engine on its devices; text requests are stage 0's, and one that
    reaches the talker stage (no "modalities": ["text"]) kills the engine, as upstream reports."""
    root, _ = gpu_root
    port = free_port()
    project = omni_project(tmp_path, port, OMNI_DEPLOY.read_text())
    compose(root, project, "up", "-d", check=True)
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{base}/health") == 200 or state(root, "omni")[0] != "running")
    text = logs(root, "omni")
    assert state(root, "omni") == ("running", 0), text
    inspect = json.loads(root.run("docker", "inspect", "omni", check=True).stdout)[0]
    assert inspect["Config"]["Entrypoint"] is None and inspect["Path"] == "vllm"
    assert inspect["Args"][:2] == ["serve", "/models/qwen3-omni"] and inspect["Config"]["WorkingDir"] == "/app"
    assert "vLLM-Omni: 3 stage(s) from /cfg/deploy.yaml: stage 0 on device(s) 0, stage 1 on device(s) 1, " \
           "stage 2 on device(s) 1" in text
    status, body = http(f"{base}/v1/models")
    assert status == 200 and [(m["id"], m["max_model_len"]) for m in json.loads(body)["data"]] == [
        ("/models/qwen3-omni", 65536)]  # stage 0's
    # Each stage holds its share of its device: the thinker GPU 0, talker + vocoder GPU 1.
    used = root.run("nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout.split()
    assert used == [str(1 + int(0.92 * 24576)), str(1 + int(0.55 * 24576) + int(0.18 * 24576))]
    status, body = chat(base, modalities=["text"])
    assert status == 200 and body["usage"]["completion_tokens"] > 0, body
    assert chat(base, modalities="text")[0] == 400
    status, body = chat(base)  # no modalities: through the talker and the vocoder
    assert status == 500 and "goes through stage(s) 1, 2" in body["message"] and "not simulated" in body["message"]
    wait_for(lambda: state(root, "omni")[0] == "exited")
    assert state(root, "omni") == ("exited", 1)
    assert "EngineCore encountered a fatal error." in logs(root, "omni")
    compose(root, project, "down", check=True)
    # A deploy config of one stage (the thinker alone) answers any request: nothing else is reached.
    one = "stages:\n  - stage_id: 0\n    max_model_len: 32768\n    gpu_memory_utilization: 0.9\n    devices: \"0\"\n"
    project = omni_project(tmp_path, port, one)
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: http_status(f"{base}/health") == 200 or state(root, "omni")[0] != "running")
    assert chat(base)[0] == 200 and state(root, "omni")[0] == "running"
    compose(root, project, "down", check=True)


@pytest.mark.parametrize(
    ("deploy", "extra", "image", "code", "message"),
    [
        (None, "", IMAGE, 2, "vllm serve: error: unrecognized arguments: --omni --deploy-config /cfg/deploy.yaml"),
        ("stage_args:\n  - stage_id: 0\n", "", OMNI_IMAGE, 1, "uses the removed `stage_args` schema"),
        ("stages: &s\n  - stage_id: 0\n", "", OMNI_IMAGE, 1, "cannot read the deploy config /cfg/deploy.yaml as YAML: "
         "line 1: '&' (anchors, aliases, tags, block scalars) is not simulated"),
        ("- just\n- a list\n", "", OMNI_IMAGE, 1, "Deploy config /cfg/deploy.yaml must be a YAML mapping"),
        ("stages:\n  - devices: '0'\n", "", OMNI_IMAGE, 1, "KeyError: 'stage_id'"),
        ("stages:\n  - {stage_id: 1, devices: '0'}\n", "", OMNI_IMAGE, 1, "a deploy config without stage 0"),
        ("stages:\n  - {stage_id: 0}\n", "", OMNI_IMAGE, 1, "stage 0 without devices"),
        ("stages:\n  - {stage_id: 0, devices: '2'}\n", "", OMNI_IMAGE, 1, "invalid device ordinal (stage 0 devices '2'; "
         "the container has 2 GPU(s))"),
        ("stages:\n  - {stage_id: 0, devices: '1', gpu_memory_utilization: 0.6}\n"
         "  - {stage_id: 1, devices: '1', gpu_memory_utilization: 0.5}\n", "", OMNI_IMAGE, 1,
         "Free memory on device cuda:1 (9.60/24.00 GiB) on startup is less than desired GPU memory utilization (0.5"),
        (None, " --deploy-config /cfg/missing.yaml", OMNI_IMAGE, 1,
         "No such file or directory: '/cfg/missing.yaml' (--deploy-config; nothing mounted there)"),
    ],
)
def test_vllm_omni_refuses_what_it_cannot_load(gpu_root: tuple[Root, Daemon], tmp_path: Path, deploy: str | None,
                                               extra: str, image: str, code: int, message: str) -> None:
    root, _ = gpu_root
    project = omni_project(tmp_path, free_port(), deploy or OMNI_DEPLOY.read_text(), image=image, extra=extra)
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: state(root, "omni")[0] == "exited")
    text = logs(root, "omni")
    assert state(root, "omni") == ("exited", code) and message in text, text
    compose(root, project, "down", check=True)


def test_a_script_hands_vllm_omni_a_deploy_config_of_its_own_root(gpu_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    """Through a script (container.py's vllm shim) the deploy config is read in the container's root: a file the
    script wrote there counts, one that is nowhere fails like vLLM-Omni's loader."""
    root, _ = gpu_root
    model_dir(tmp_path / "models/m")
    vol = f"{tmp_path}/models:/models:ro"
    serve = "exec vllm serve /models/m --omni --deploy-config /tmp/d.yaml"
    out = run(root, "--gpus", "all", "-v", vol, "--entrypoint", "/bin/bash", OMNI_IMAGE, "-c",
              f"printf 'stage_args:\\n  - stage_id: 0\\n' > /tmp/d.yaml; {serve}")
    assert out.returncode == 1 and "Deploy config /tmp/d.yaml uses the removed `stage_args` schema" in out.stdout, out
    out = run(root, "--gpus", "all", "-v", vol, "--entrypoint", "/bin/bash", OMNI_IMAGE, "-c", serve)
    assert out.returncode == 1 and "No such file or directory: '/tmp/d.yaml' (--deploy-config)" in out.stdout, out


def test_read_only_mounts_refuse_writes_and_nothing_leaks(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = docker_root
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    (ro / "existing").write_text("keep\n")
    out = bash(root, "echo x > /data/new", f"{ro}:/data:ro")
    assert out.returncode == 1 and "/data/new: Read-only file system" in out.stdout
    out = bash(root, "rm /data/existing", f"{ro}:/data:ro")
    assert out.returncode == 1 and "Read-only file system" in out.stdout
    assert sorted(p.name for p in ro.iterdir()) == ["existing"]
    out = bash(root, "echo x > /out/new && mkdir -p /usr/local/leak /etc/leak && echo y > /root/leak", f"{rw}:/out")
    assert out.returncode == 0, out
    assert (rw / "new").read_text() == "x\n"  # a writable mount writes through to the host
    assert not Path("/usr/local/leak").exists() and not Path("/etc/leak").exists()
    assert not (root.path / "usr/local/leak").exists()


def test_model_dir_needs_config_and_weights(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = docker_root
    model_dir(tmp_path / "models/noconfig", config=False)
    model_dir(tmp_path / "models/noweights", weights=False)
    vol = f"{tmp_path}/models:/models:ro"
    out = bash(root, "exec vllm serve --served-model-name x", vol)
    assert out.returncode == 2 and "the following arguments are required: model_tag" in out.stdout
    out = bash(root, "exec vllm serve /models/noconfig --served-model-name x", vol)
    assert out.returncode == 1
    assert "OSError: /models/noconfig does not appear to have a file named config.json" in out.stdout
    out = bash(root, "exec python3 -m vllm.entrypoints.openai.api_server --model /models/noweights", vol)
    assert out.returncode == 1 and "Cannot find any model weights with `/models/noweights`" in out.stdout
    out = bash(root, "exec vllm serve /models/elsewhere")
    assert out.returncode == 1 and "Incorrect path_or_model_id: '/models/elsewhere'" in out.stdout
    out = bash(root, "exec vllm serve Qwen/Qwen3-8B")  # a Hub id: no network, nothing cached
    assert out.returncode == 1 and "We couldn't connect to 'https://huggingface.co'" in out.stdout
    model_dir(tmp_path / "models/good")
    out = bash(root, "exec vllm serve /models/good --chat-template /vllm-workspace/examples/tool_chat_template_nope.jinja",
               vol)
    assert out.returncode == 1 and "appears path-like, but doesn't exist!" in out.stdout


def test_image_layer_and_gpu_visibility(gpu_root: tuple[Root, Daemon]) -> None:
    root, _ = gpu_root
    out = run(root, "--gpus", '"device=1"', "--entrypoint", "bash", IMAGE, "-c",
              f"cat {VLLM_SITE}/__init__.py; ls /vllm-workspace/examples | grep -c jinja; pwd; "
              "nvidia-smi --query-gpu=index,uuid --format=csv,noheader; vllm --version")
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert lines[0] == '__version__ = "0.11.0"' and int(lines[1]) >= 3 and lines[2] == "/vllm-workspace"
    assert lines[3] == "0, GPU-00000001-1111-2222-3333-444444444444" and lines[4] == "0.11.0"
    assert "tool_chat_template_gemma4.jinja" in bash(root, "ls /vllm-workspace/examples").stdout
    plain = run(root, "--entrypoint", "bash", "nvidia/cuda:12.6.0-base-ubuntu22.04", "-c", "nvidia-smi -L")
    assert plain.returncode == 127 and "nvidia-smi in a container is not simulated" in plain.stdout  # no --gpus


def test_fast_paths_are_unchanged(docker_root: tuple[Root, Daemon]) -> None:
    root, _ = docker_root
    out = run(root, "nvidia/cuda:12.6.0-base-ubuntu22.04", "echo", "hello")
    assert out.returncode == 0 and out.stdout == "hello\n"
    out = run(root, "nvidia/cuda:12.6.0-base-ubuntu22.04", "curl", "x")
    assert out.returncode == 127 and "running curl x in a container is not simulated" in out.stdout
    sys_path = Path(__file__).resolve().parents[1] / "standins"
    import sys

    sys.path.insert(0, str(sys_path))
    try:
        import dockerd
    finally:
        sys.path.pop(0)

    def kind(entry: list[str] | None, cmd: list[str] | None, image: str = IMAGE) -> str:
        return dockerd.classify({"Config": {"Entrypoint": entry, "Cmd": cmd, "Image": image, "Env": []}})[0]

    assert kind(None, ["--model", "/m"]) == "vllm"
    assert kind(["vllm", "serve"], ["/m"]) == "vllm"
    assert kind(None, ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"], "x/y") == "vllm"
    assert kind(["/opt/nvidia/nvidia_entrypoint.sh"], ["nvidia-smi", "-L"], "nvidia/cuda:12") == "nvidia-smi"
    assert kind(None, ["sleep", "infinity"], "busybox") == "simple"
    assert kind(["/app/llama-server"], ["-m", "/m.gguf"], "ghcr.io/ggml-org/llama.cpp:server") == "llama"
    assert kind(["/bin/bash", "-c", "exec vllm serve \"$@\"", "--"], ["--model", "/m"]) == "shell"
    assert kind(None, ["python3", "/patches/x.py"], "x/y") == "shell"
    # Image configs per kind, as the real images are: vLLM-Omni's has no entrypoint, LMCache's runs its venv's vllm.
    assert dockerd.image_config("vllm/vllm-openai")["Entrypoint"] == ["vllm", "serve"]
    assert dockerd.image_config("vllm/vllm-omni")["Entrypoint"] is None
    assert dockerd.image_config("10.213.0.1:5000/lmcache/vllm-openai")["Entrypoint"] == ["/opt/venv/bin/vllm", "serve"]
    assert [dockerd.image_kind(i) for i in (IMAGE, OMNI_IMAGE, LMCACHE_IMAGE, "mirror.lan:5000/hub/vllm/vllm-omni:v1",
                                            f"lmcache/vllm-openai@sha256:{'6' * 64}")] == \
        ["vllm", "vllm-omni", "lmcache", "vllm-omni", "lmcache"]
    assert kind(None, ["--model", "/m"], LMCACHE_IMAGE) == "vllm"  # the image's entrypoint + flags
    assert kind(["/opt/venv/bin/vllm", "serve"], ["/m"], LMCACHE_IMAGE) == "shell"  # a program file: container.py
    assert kind(None, ["vllm", "serve", "/m", "--omni"], OMNI_IMAGE) == "vllm"  # no entrypoint to prepend


def test_4x3090_preset_is_four_pcie_cards(root: Root) -> None:
    h = hw.preset("4x3090", "quad-01")
    assert [g.name for g in h.gpus] == ["NVIDIA GeForce RTX 3090"] * 4
    assert [g.pci_bus_id for g in h.gpus] == [f"00000000:0{i}:00.0" for i in range(1, 5)]
    assert h.topology == "PIX" and len({g.uuid for g in h.gpus}) == 4
    assert hw.from_dict(json.loads(h.to_json())) == h
    root.hardware(h.to_dict())
    install_driver(root)
    root.reboot()
    boot_module(root)
    assert len(root.run("nvidia-smi", "-L", check=True).stdout.splitlines()) == 4
    topo = root.run("nvidia-smi", "topo", "-m", check=True).stdout
    assert "GPU3\tPIX\tPIX\tPIX\t X \t" in topo
    assert root.run("nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader").stdout == "24576 MiB\n" * 4


def test_logs_of_a_failed_start_and_restart(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    """A script's stdout and stderr are the container's log, kept across restarts like json-file."""
    root, _ = docker_root
    name = "shell-logs"
    created = root.run("docker", "run", "-d", "--name", name, "--entrypoint", "bash", IMAGE, "-c",
                       "echo out-line; echo err-line >&2; exit 3")
    assert created.returncode == 0, created
    wait_for(lambda: state(root, name)[0] == "exited")
    assert state(root, name) == ("exited", 3)
    text = logs(root, name)
    assert "out-line" in text and "err-line" in text
    root.run("docker", "start", name, check=True)
    wait_for(lambda: state(root, name)[0] == "exited" and logs(root, name).count("out-line") == 2)
    root.run("docker", "rm", name, check=True)


def test_docker_ce_ships_container_py(repo: Any) -> None:
    deb = sorted(repo.root.glob("docker/linux/ubuntu/dists/noble/pool/stable/amd64/docker-ce_28.5.2*.deb"))[0]
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    assert "./usr/lib/docker-standin/daemon/container.py" in listing
    assert "./usr/lib/docker-standin/daemon/dockerd.py" in listing
