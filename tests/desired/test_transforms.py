"""Each transform of rigup/desired/transforms.py on small compose documents written here.

The documents are UpstreamFile objects with inline text; the repository they come from is a
WorkingTrees reader over tmp_path (what `exists` asks for the host-paths transform).
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.desired.compose_doc import ComposeEdit, ComposeError, UpstreamFile, audit, dump, explain
from rigup.desired.interconnect import Interconnect, nccl_settings
from rigup.desired.transforms import (
    KEY_WRAPPER,
    KEY_WRAPPER_WORDS,
    SECRET_VARIABLES,
    SECRETS_TARGET,
    Context,
    SourceCheckout,
    apply_all,
    defaults,
    gpus,
    image_pin,
    interconnect,
    mounts,
    offline,
    overrides,
    publish,
    upstream_entrypoint,
)
from rigup.desired.upstream import WorkingTrees

COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMPOSE_PATH = "models/m/compose/dual.yml"
SOURCES = "/opt/rigup/sources"

BASE = """\
services:
  vllm-test:
    image: vllm/vllm-openai:${VLLM_NIGHTLY_SHA}
    container_name: vllm-test
    restart: unless-stopped
    ports:
      - "${PORT:-8010}:8000"
    volumes:
      - ${MODEL_DIR:-../../../models-cache}:/root/.cache/huggingface
      - ../cache/torch_compile:/root/.cache/vllm/torch_compile_cache
      - ../patches/fix.py:/patches/fix.py:ro
      - /opt/ai/vllm-src/vllm/marlin.py:/usr/lib/vllm/marlin.py:ro
    environment:
      - HUGGING_FACE_HUB_TOKEN=${HF_TOKEN:-}
      - NVIDIA_VISIBLE_DEVICES=all
      - NCCL_P2P_DISABLE=1
      - PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:512
      - NESTED=${OUTER:-${INNER:-deep}}
      - ALT=x${UNSET_FLAG:+--flag}y
    shm_size: 16gb
    ipc: host
    deploy:
      resources:
        reservations:
          devices:
            - driver: nvidia
              count: all
              capabilities: [gpu]
    entrypoint:
      - /bin/bash
      - -c
      - |
        for f in /patches/*.py; do python3 "$$f"; done
        exec vllm serve "$@"
      - --
    command:
      - --model
      - /root/.cache/huggingface/test-model
      - --served-model-name
      - test
      - --tensor-parallel-size
      - "${TP:-2}"
      - --disable-custom-all-reduce
      - --max-model-len
      - "${MAX_MODEL_LEN:-32768}"
      - --host
      - 0.0.0.0
      - --port
      - "8000"
"""


def upstream(text: str = BASE, path: str = COMPOSE_PATH) -> UpstreamFile:
    return UpstreamFile("club3090", "https://example.invalid/club.git", COMMIT, path, textwrap.dedent(text))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "club3090"
    (root / "models/m/patches").mkdir(parents=True)
    (root / "models/m/patches/fix.py").write_text("print('fix')\n")
    (root / "models/m/compose").mkdir(parents=True)
    return root


def context(repo: Path, **changes: Any) -> Context:
    reader = WorkingTrees({"club3090": repo})
    checkouts = {name: SourceCheckout(name, f"{SOURCES}/{name}") for name in ("club3090", "vllm-fork", "genesis")}
    values: dict[str, Any] = dict(
        variant="test",
        name="test",
        gpu_ids=None,
        image_ref="docker.io/vllm/vllm-openai:nightly-abc",
        image_why="catalog image",
        bind_address="0.0.0.0",
        host_port=None,
        container_port_default=8000,
        model_mounts=[("/opt/rigup/models/test-model", "/root/.cache/huggingface/test-model")],
        cache_dir="/opt/rigup/cache/test",
        secrets_dir="/opt/rigup/variants/test/secrets",
        image_repository="vllm/vllm-openai",
        upstream_source=checkouts["club3090"],
        path_sources={"/opt/ai/vllm-src": checkouts["vllm-fork"]},
        mount_fixes={},
        exists=lambda path: reader.kind("club3090", "", COMMIT, path),
        overrides={},
        gpu_count=lambda edit: int((edit.flag_values("--tensor-parallel-size") or ["1"])[0]),
        nccl=lambda tp: None,
        labels={"rigup.variant": "test", "rigup.image": "docker.io/vllm/vllm-openai:nightly-abc"},
    )
    values.update(changes)
    return Context(**values)


def edit_of(text: str = BASE) -> ComposeEdit:
    return ComposeEdit(upstream(text))


def env(edit: ComposeEdit) -> dict[str, str | None]:
    return edit.env()


def pinned(ctx: Context, text: str = BASE) -> ComposeEdit:
    edit = edit_of(text)
    image_pin(edit, ctx)
    defaults(edit)
    return edit


def transforms_of(edit: ComposeEdit, key: str) -> list[str]:
    return [c.transform for c in edit.changes if c.key == key]


# --- image-pin and defaults ---------------------------------------------------------------------


def test_image_pin_runs_before_defaults(repo: Path) -> None:
    with pytest.raises(ComposeError, match=r"\$\{VLLM_NIGHTLY_SHA\} has no default"):
        defaults(edit_of())  # upstream's image names a variable nothing sets
    edit = pinned(context(repo))
    assert edit.get("image") == "docker.io/vllm/vllm-openai:nightly-abc"
    assert transforms_of(edit, "image") == ["image-pin"]


def test_defaults_take_upstream_defaults(repo: Path) -> None:
    edit = pinned(context(repo))
    e = env(edit)
    assert edit.get("ports") == ["8010:8000"]
    assert e["NESTED"] == "deep"  # ${OUTER:-${INNER:-deep}}
    assert e["ALT"] == "xy"  # ${UNSET_FLAG:+--flag}: unset, so empty
    assert edit.flag_values("--tensor-parallel-size") == ["2"]
    assert edit.flag_values("--max-model-len") == ["32768"]
    script = edit.get("entrypoint")[2]
    assert 'python3 "$$f"' in script  # $$ stays: compose makes it a literal $
    assert 'exec vllm serve "$@"' in script  # $@ is not an interpolation
    (change,) = [c for c in edit.changes if c.key == "command --max-model-len"]
    assert change.transform == "defaults" and "${MAX_MODEL_LEN:-32768}" in change.why


def test_defaults_keep_secret_references_for_the_secrets_transform(repo: Path) -> None:
    edit = pinned(context(repo))
    assert env(edit)["HUGGING_FACE_HUB_TOKEN"] == "${HF_TOKEN:-}"  # never resolved: the secrets transform drops it


def test_secrets_are_files_never_values_of_the_environment(repo: Path) -> None:
    ctx = context(repo)
    edit = edit_of()
    apply_all(edit, ctx)
    environment = env(edit)
    # upstream's HUGGING_FACE_HUB_TOKEN=${HF_TOKEN:-} is gone, and nothing else names a secret
    assert "HUGGING_FACE_HUB_TOKEN" not in environment and "VLLM_API_KEY" not in environment
    text = dump(edit.doc, "h")
    for name in SECRET_VARIABLES:
        assert f"${{{name}" not in text and f"${name}" not in text, name
    assert environment["HF_TOKEN_PATH"] == f"{SECRETS_TARGET}/HF_TOKEN"
    assert "RAY_AUTH_TOKEN_PATH" not in environment  # a cluster member's only
    (bound,) = [v for v in edit.volumes() if v["target"] == SECRETS_TARGET]
    assert bound == {"type": "bind", "source": "/opt/rigup/variants/test/secrets", "target": SECRETS_TARGET,
                     "read_only": True, "create_host_path": False}
    # upstream's entrypoint, whole, after rigup's wrapper
    script = "for f in /patches/*.py; do python3 \"$$f\"; done\nexec vllm serve \"$@\"\n"
    assert edit.get("entrypoint") == [*KEY_WRAPPER_WORDS, "/bin/bash", "-c", script, "--"]
    assert upstream_entrypoint(edit.get("entrypoint")) == ["/bin/bash", "-c", script, "--"]
    lines, unexplained = explain(edit.origin, text, edit.changes)
    assert unexplained == 0
    assert "secrets" in transforms_of(edit, "entrypoint") and "secrets" in transforms_of(edit, "environment HF_TOKEN_PATH")


def test_without_an_entrypoint_the_wrapper_execs_the_images(repo: Path) -> None:
    text = BASE[:BASE.index("    entrypoint:")] + BASE[BASE.index("    command:"):]
    for repository, words in (("vllm/vllm-openai", ["vllm", "serve"]), ("vllm/vllm-omni", [])):
        edit = edit_of(text)
        apply_all(edit, context(repo, image_repository=repository))
        assert edit.get("entrypoint") == [*KEY_WRAPPER_WORDS, *words]
    edit = edit_of(text)
    with pytest.raises(ComposeError, match="does not know image example/server's"):
        apply_all(edit, context(repo, image_repository="example/server"))


@pytest.mark.parametrize("present", [True, False])
def test_the_wrapper_exports_the_key_from_its_file_and_execs_the_rest(tmp_path: Path, present: bool) -> None:
    """The wrapper as bash runs it (compose's `$$` unescaped, its directory a temporary one): the key reaches the
    command's environment, never its argv; without its file the container stops instead of serving open."""
    key = "k" * 64
    if present:
        (tmp_path / "VLLM_API_KEY").write_text(key + "\n")
    script = KEY_WRAPPER.replace(SECRETS_TARGET, str(tmp_path)).replace("$$", "$")
    argv = ["bash", "-c", script, "rigup-pod-key", "python3", "-c",
            "import os, sys; print(os.environ.get('VLLM_API_KEY')); print(sys.argv[1:])", "--flag"]
    proc = subprocess.run(argv, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert key not in " ".join(argv)
    if present:
        assert proc.returncode == 0 and proc.stdout.splitlines() == [key, "['--flag']"], proc
    else:
        assert proc.returncode == 1 and f"no API key at {tmp_path}/VLLM_API_KEY: the pod does not start open" in proc.stderr, proc


def test_a_variable_without_default_fails_naming_file_key_and_commit(repo: Path) -> None:
    text = BASE.replace('"${MAX_MODEL_LEN:-32768}"', '"${MAX_MODEL_LEN}"')
    with pytest.raises(ComposeError) as info:
        pinned(context(repo), text)
    message = str(info.value)
    assert COMPOSE_PATH in message and COMMIT[:12] in message and "command" in message
    assert "${MAX_MODEL_LEN} has no default" in message


def test_a_required_variable_fails(repo: Path) -> None:
    text = BASE.replace("NESTED=${OUTER:-${INNER:-deep}}", "NESTED=${OUTER:?set OUTER}")
    with pytest.raises(ComposeError, match=r"\$\{OUTER:\?set OUTER\} requires OUTER"):
        pinned(context(repo), text)


def test_set_alternative_and_plain_dollar_forms() -> None:
    from rigup.desired.compose_doc import interpolate

    def run(text: str, values: dict[str, str]) -> str:
        return interpolate(text, values.get, lambda name: False, "test")[0]

    assert run("${X:+--flag}", {"X": "1"}) == "--flag"
    assert run("${X:+--flag}", {"X": ""}) == ""  # ":+" treats empty as unset
    assert run("${X+--flag}", {"X": ""}) == "--flag"  # "+" only unset
    assert run("${X:-d}", {"X": ""}) == "d" and run("${X-d}", {"X": ""}) == ""
    assert run("$$HOME $X", {"X": "v"}) == "$$HOME v"
    with pytest.raises(ComposeError, match="unterminated"):
        run("${X:-d", {})


# --- publish, mounts ----------------------------------------------------------------------------


def test_publish_binds_the_address_and_port(repo: Path) -> None:
    edit = pinned(context(repo))
    publish(edit, context(repo, bind_address="127.0.0.1"))
    assert edit.get("ports") == ["127.0.0.1:8010:8000"]
    publish(edit, context(repo, host_port=9100, bind_address="::1"))
    assert edit.get("ports") == ["[::1]:9100:8000"]
    assert transforms_of(edit, "ports[0]") == ["defaults", "publish", "publish"]
    bad = pinned(context(repo), BASE.replace('"${PORT:-8010}:8000"', '"8010:9000"'))
    with pytest.raises(ComposeError, match="container port 9000"):
        publish(bad, context(repo))


def test_mounts(repo: Path) -> None:
    ctx = context(repo)
    edit = pinned(ctx)
    mounts(edit, ctx)
    vols = {v["target"]: v for v in edit.volumes()}
    # models-read-only: the whole cache is replaced by the verified model directory, read-only
    assert "/root/.cache/huggingface" not in vols
    model = vols["/root/.cache/huggingface/test-model"]
    assert (model["source"], model["read_only"]) == ("/opt/rigup/models/test-model", True)
    # caches: under the install root, per variant
    assert vols["/root/.cache/vllm/torch_compile_cache"]["source"] == "/opt/rigup/cache/test/torch_compile"
    assert ctx.host_dirs == ["/opt/rigup/cache/test/torch_compile"]
    # host-paths: relative to the compose file's directory, in the upstream checkout
    assert vols["/patches/fix.py"]["source"] == f"{SOURCES}/club3090/models/m/patches/fix.py"
    # host-paths: an absolute host path through the catalog's source_paths
    assert vols["/usr/lib/vllm/marlin.py"]["source"] == f"{SOURCES}/vllm-fork/vllm/marlin.py"
    assert ctx.used_sources == {"club3090": {"models/m/patches/fix.py"}, "vllm-fork": {"vllm/marlin.py"}}
    # strict-binds: every bind fails on a missing source
    assert all(not v["create_host_path"] for v in vols.values())
    assert transforms_of(edit, "volumes /patches/fix.py") == ["host-paths", "strict-binds"]
    assert transforms_of(edit, "volumes /root/.cache/huggingface") == ["defaults", "models-read-only"]
    # read-only flags are upstream's except the models'
    assert vols["/patches/fix.py"]["read_only"] and not vols["/root/.cache/vllm/torch_compile_cache"]["read_only"]


def test_a_missing_upstream_path_fails_with_path_and_commit(repo: Path) -> None:
    (repo / "models/m/patches/fix.py").unlink()
    ctx = context(repo)
    edit = pinned(ctx)
    with pytest.raises(ComposeError) as info:
        mounts(edit, ctx)
    message = str(info.value)
    assert "models/m/patches/fix.py" in message and COMMIT[:12] in message and "does not exist" in message


def test_an_unknown_host_path_fails(repo: Path) -> None:
    ctx = context(repo, path_sources={})
    edit = pinned(ctx)
    with pytest.raises(ComposeError, match="host path '/opt/ai/vllm-src/vllm/marlin.py' is not one rigup provides"):
        mounts(edit, ctx)


def test_catalog_fix_redirects_a_mount(repo: Path) -> None:
    genesis = SourceCheckout("genesis", f"{SOURCES}/genesis")
    ctx = context(repo, mount_fixes={"/patches/fix.py": {"source": "genesis", "path": "probe/fix.py",
                                                          "why": "upstream's path has no such file", "checkout": genesis}})
    (repo / "models/m/patches/fix.py").unlink()  # a fixed mount is not looked up upstream
    edit = pinned(ctx)
    mounts(edit, ctx)
    vols = {v["target"]: v for v in edit.volumes()}
    assert vols["/patches/fix.py"]["source"] == f"{SOURCES}/genesis/probe/fix.py"
    (change,) = [c for c in edit.changes if c.key == "volumes /patches/fix.py" and c.transform == "catalog-fix"]
    assert change.why == "upstream's path has no such file"
    assert ctx.used_sources["genesis"] == {"probe/fix.py"}


# --- environment and command --------------------------------------------------------------------


def test_offline(repo: Path) -> None:
    edit = pinned(context(repo))
    offline(edit)
    assert env(edit)["HF_HUB_OFFLINE"] == env(edit)["TRANSFORMERS_OFFLINE"] == "1"
    assert transforms_of(edit, "environment HF_HUB_OFFLINE") == ["offline"]


def test_overrides(repo: Path) -> None:
    ctx = context(repo, overrides={"max_model_len": 65536, "gpu_memory_utilization": 0.9, "max_num_seqs": 3})
    edit = pinned(ctx)
    overrides(edit, ctx)
    assert edit.flag_values("--max-model-len") == ["65536"]
    assert edit.flag_values("--gpu-memory-utilization") == ["0.9"]
    cmd = edit.command()
    assert cmd.index("--max-num-seqs") < cmd.index("--host")  # a new flag goes before --host
    assert cmd[-4:] == ["--host", "0.0.0.0", "--port", "8000"]
    (change,) = [c for c in edit.changes if c.transform == "overrides" and c.key == "command --max-model-len"]
    assert change.why == "variant_overrides['max_model_len']" and change.before == ["32768"]


def test_gpus_reserve_the_count_and_drop_visible_devices(repo: Path) -> None:
    ctx = context(repo)
    edit = pinned(ctx)
    gpus(edit, ctx)
    assert edit.get("deploy")["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 2, "capabilities": ["gpu"]}]
    assert "NVIDIA_VISIBLE_DEVICES" not in env(edit)
    assert transforms_of(edit, "environment NVIDIA_VISIBLE_DEVICES") == ["gpus"]
    with pytest.raises(ComposeError, match="device_ids"):
        gpus(pinned(ctx, BASE.replace("count: all", "device_ids: ['0']")), ctx)


NVLINK = Interconnect(nvlink=True, p2p_ok=True, source="forced", detail="test")


def test_interconnect_nvlink(repo: Path) -> None:
    ctx = context(repo, nccl=lambda tp: nccl_settings(NVLINK, tp), nvlink=True)
    edit = pinned(ctx)
    interconnect(edit, ctx)
    e = env(edit)
    assert "NCCL_P2P_DISABLE" not in e and e["NCCL_P2P_LEVEL"] == "NVL"
    assert e["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # custom all-reduce: no expandable segments
    assert "--disable-custom-all-reduce" not in edit.command()
    assert "NVLINK_MODE" not in e  # upstream has none: none is added
    assert ctx.interconnect_note is not None and "NVLink" in ctx.interconnect_note
    with_mode = BASE.replace("      - NCCL_P2P_DISABLE=1\n", "      - NVLINK_MODE=${NVLINK_MODE:-auto}\n      - NCCL_P2P_DISABLE=1\n")
    edit = pinned(ctx, with_mode)
    assert env(edit)["NVLINK_MODE"] == "auto"
    interconnect(edit, ctx)
    assert env(edit)["NVLINK_MODE"] == "force_on"
    assert transforms_of(edit, "environment NVLINK_MODE") == ["defaults", "interconnect"]
    # with NVLINK_MODE upstream's script owns the NCCL variables: rigup leaves them as upstream wrote them
    assert env(edit)["NCCL_P2P_DISABLE"] == "1" and "NCCL_P2P_LEVEL" not in env(edit)


def test_interconnect_pcie_keeps_upstream(repo: Path) -> None:
    ctx = context(repo, nccl=lambda tp: nccl_settings(Interconnect(False, False, "detected", "PCIe"), tp))
    edit = pinned(ctx)
    before = list(edit.changes)
    interconnect(edit, ctx)
    assert edit.changes == before and "--disable-custom-all-reduce" in edit.command()


# --- the whole chain ----------------------------------------------------------------------------


def test_apply_all_labels_logging_and_audit(repo: Path) -> None:
    ctx = context(repo)
    edit = edit_of()
    apply_all(edit, ctx)
    assert edit.doc["name"] == "rigup-test"
    assert edit.get("container_name") == "rigup-test" and edit.get("restart") == "no"
    assert edit.get("labels") == {"rigup.variant": "test", "rigup.image": "docker.io/vllm/vllm-openai:nightly-abc"}
    assert edit.get("logging") == {"driver": "json-file", "options": {"max-size": "50m", "max-file": "3"}}
    text = dump(edit.doc, "header")
    assert text.startswith("# header\n") and yaml.safe_load(text) == edit.doc
    lines, unexplained = explain(edit.origin, text, edit.changes)
    assert unexplained == 0 and lines[-1].endswith("unexplained: 0")
    keys = {line.key for line in audit(edit.origin, text, edit.changes)}
    assert {"image", "container_name", "restart", "labels.rigup.variant", "logging.driver",
            "environment NVIDIA_VISIBLE_DEVICES"} <= keys
    # An edit nobody recorded is reported.
    edit.doc["services"]["vllm-test"]["shm_size"] = "32gb"
    text = dump(edit.doc, "header")
    lines, unexplained = explain(edit.origin, text, edit.changes)
    assert unexplained == 1
    assert any(line.startswith("  shm_size: 16gb -> 32gb") and line.endswith("[UNEXPLAINED]") for line in lines)
    # A recorded change the shipped file contradicts is unexplained too.
    edit.doc["services"]["vllm-test"]["shm_size"] = "16gb"
    edit.doc["services"]["vllm-test"]["container_name"] = "other"
    (line,) = [a for a in audit(edit.origin, dump(edit.doc, "h"), edit.changes) if a.key == "container_name"]
    assert line.change is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BASE.replace("    ipc: host\n", "    ipc: host\n    env_file: .env\n"),
         "services.vllm-test.env_file is not understood"),
        (BASE + "volumes:\n  data: {}\n", "top-level key 'volumes' is not understood"),
        (BASE + "  other:\n    image: x\n", "the catalog must name the one to render"),
        ("services: {}\n", "no services"),
        # keys that would bypass the published port or the GPU count
        (BASE.replace("    ipc: host\n", "    ipc: host\n    network_mode: host\n"),
         "services.vllm-test.network_mode is not understood"),
        (BASE.replace("    ipc: host\n", "    ipc: host\n    runtime: nvidia\n"),
         "services.vllm-test.runtime is not understood"),
        # a flag rigup reads, written so it would read the wrong one
        (BASE.replace("      - --max-model-len\n", "      - --max-model-len=1024\n      - --max-model-len\n"),
         "--flag=value form"),
        (BASE.replace("      - --host\n", "      - --served-model-name\n      - other\n      - --host\n"),
         "given twice"),
        (BASE.replace("      - NCCL_P2P_DISABLE=1\n", "      - NCCL_P2P_DISABLE=1\n      - NCCL_P2P_DISABLE=0\n"),
         "NCCL_P2P_DISABLE set twice"),
        (BASE.replace("      - --host\n", "      - --enforce-eager\n      - yes\n      - --host\n"),
         "unquoted True is read differently by YAML 1.1 and Compose"),
    ],
)
def test_unknown_constructs_fail(text: str, message: str) -> None:
    with pytest.raises(ComposeError, match=message) as info:
        edit_of(text)
    assert COMMIT[:12] in str(info.value) and COMPOSE_PATH in str(info.value)


def test_several_services_fail_even_when_one_is_named() -> None:
    with pytest.raises(ComposeError, match="several services"):
        ComposeEdit(upstream(BASE + "  other:\n    image: x\n"), "vllm-test")
    with pytest.raises(ComposeError, match="no service 'nope'"):
        ComposeEdit(upstream(), "nope")


def test_an_unknown_volume_form_fails(repo: Path) -> None:
    ctx = context(repo)
    text = BASE.replace("      - ../patches/fix.py:/patches/fix.py:ro\n",
                        "      - type: volume\n        source: data\n        target: /data\n")
    with pytest.raises(ComposeError, match="volume type 'volume'"):
        pinned(ctx, text)


def test_a_secret_outside_the_environment_fails(repo: Path) -> None:
    ctx = context(repo)
    text = BASE.replace("      - --host\n", "      - --api-key\n      - ${VLLM_API_KEY}\n      - --host\n")
    edit = edit_of(text)
    image_pin(edit, ctx)
    with pytest.raises(ComposeError, match=r"\$\{VLLM_API_KEY\} outside environment would put a secret on a command line"):
        defaults(edit)


# --- constructs of the vLLM-Omni, LMCache and Nemotron composes ----------------------------------

OMNI = """\
services:
  omni:
    image: ${OMNI_IMAGE:-vllm/vllm-omni:v0.20.0}
    container_name: omni
    restart: unless-stopped
    ports:
      - "${PORT:-8042}:8091"
    ipc: host
    environment:
      NCCL_P2P_DISABLE: "1"
    volumes:
      - "${MODEL_DIR:-../../models-cache}:/models:ro"
      - "./stages.yaml:/cfg/stages.yaml:ro"
    command: >-
      vllm serve /models/${SUBDIR:-omni-model}
      --omni
      --deploy-config /cfg/stages.yaml
      --port 8091
      --kv-cache-dtype ${KV:-fp8}
    deploy:
      resources:
        reservations:
          devices:
            - driver: nvidia
              count: all
              capabilities: [gpu]
"""

STAGES = """\
stages:
  - stage_id: 0
    max_model_len: 65536
    max_num_seqs: 8
    gpu_memory_utilization: 0.92
    devices: "0"
  - stage_id: 1
    devices: "1"
"""


def omni_repo(repo: Path, stages: str = STAGES) -> Path:
    (repo / "models/m/compose/stages.yaml").write_text(stages)
    return repo


def omni_context(repo: Path, **changes: Any) -> Context:
    reader = WorkingTrees({"club3090": repo})
    values: dict[str, Any] = dict(
        model_root="/models",
        model_mounts=[("/opt/rigup/models/omni-model", "/models/omni-model")],
        read=lambda path: reader.read("club3090", "", COMMIT, path),
    )
    values.update(changes)
    return context(repo, **values)


def test_a_one_string_command_is_split_like_compose_and_written_as_a_list(repo: Path) -> None:
    from rigup.desired.compose_doc import command_tokens

    assert command_tokens("vllm serve /m/${X:-a}\n  --omni   --port 8091", "w") == [
        "vllm", "serve", "/m/${X:-a}", "--omni", "--port", "8091"]
    assert command_tokens(["--a", 1], "w") == ["--a", "1"]
    for text, bad in [("vllm serve 'a b'", "'"), ('x "y"', '"'), ("a \\\\ b", "\\\\"), ("a; b", ";"), ("a && b", "&"),
                      ("a | b", "|"), ("a > f", ">"), ("a # c", "#"), ("a $(b)", "(")]:
        with pytest.raises(ComposeError, match="shell-word rules"):
            command_tokens(text, "w")
    with pytest.raises(ComposeError, match="holds whitespace"):
        command_tokens("--flag ${X:-a b}", "w")
    ctx = omni_context(omni_repo(repo))
    edit = edit_of(OMNI)
    assert edit.command()[:3] == ["vllm", "serve", "/models/${SUBDIR:-omni-model}"]
    apply_all(edit, ctx)
    assert isinstance(edit.get("command"), list) and edit.command()[:3] == ["vllm", "serve", "/models/omni-model"]
    assert transforms_of(edit, "command (one string)") == ["command-list"]
    text = dump(edit.doc, "header")
    lines, unexplained = explain(edit.origin, text, edit.changes)
    assert unexplained == 0, "\n".join(lines)
    assert any(line.startswith("  command (one string): true -> (absent)  [command-list]") for line in lines)


def test_container_port_moves_to_rigups_with_the_command_port(repo: Path) -> None:
    ctx = omni_context(omni_repo(repo))
    edit = pinned(ctx, OMNI)
    edit.command_as_list("command-list", "test")
    publish(edit, ctx)
    assert edit.get("ports") == ["0.0.0.0:8042:8000"]
    assert edit.flag_values("--port") == ["8000"]
    assert transforms_of(edit, "command --port") == ["container-port"]
    (change,) = [c for c in edit.changes if c.key == "ports[0]" and c.transform == "publish"]
    assert "container port 8091 -> 8000" in change.why
    # The number anywhere else in the service could not move with it.
    checked = OMNI.replace("    ipc: host\n", "    ipc: host\n    healthcheck:\n      test: [CMD, curl, localhost:8091/health]\n")
    edit = pinned(ctx, checked)
    with pytest.raises(ComposeError, match=r"healthcheck.test\[2\]: names the container port 8091"):
        publish(edit, ctx)
    # A published container port the command does not listen on is upstream's mistake: it fails.
    edit = pinned(ctx, OMNI.replace(":8091\"", ":8092\""))
    with pytest.raises(ComposeError, match="container port 8092; the command listens on 8091"):
        publish(edit, ctx)


def test_model_root_and_a_missing_model_cache(repo: Path) -> None:
    ctx = omni_context(omni_repo(repo))
    edit = pinned(ctx, OMNI)
    mounts(edit, ctx)
    vols = {v["target"]: v for v in edit.volumes()}
    assert "/models" not in vols
    assert (vols["/models/omni-model"]["source"], vols["/models/omni-model"]["read_only"]) == (
        "/opt/rigup/models/omni-model", True)
    assert ctx.repo_mounts == {"/cfg/stages.yaml": ("club3090", "models/m/compose/stages.yaml")}
    with pytest.raises(ComposeError, match="upstream mounts no model cache at /root/.cache/huggingface"):
        mounts(pinned(ctx, OMNI), context(repo))


def test_data_dirs_become_empty_directories_under_the_install_root(repo: Path) -> None:
    text = BASE.replace("      - ../patches/fix.py:/patches/fix.py:ro\n",
                        "      - ../patches/fix.py:/patches/fix.py:ro\n      - ${KV_DIR:-../../../kv}:/lmcache-kv\n")
    ctx = context(repo, data_dirs={"/lmcache-kv": "an optional disk tier"})
    edit = pinned(ctx, text)
    mounts(edit, ctx)
    vols = {v["target"]: v for v in edit.volumes()}
    assert vols["/lmcache-kv"]["source"] == "/opt/rigup/cache/test/data/lmcache-kv"
    assert not vols["/lmcache-kv"]["read_only"] and not vols["/lmcache-kv"]["create_host_path"]
    assert "/opt/rigup/cache/test/data/lmcache-kv" in ctx.host_dirs
    (change,) = [c for c in edit.changes if c.key == "volumes /lmcache-kv" and c.transform == "data-dirs"]
    assert change.why.startswith("an optional disk tier: /opt/rigup/cache/test/data/lmcache-kv")
    assert "lmcache-kv" not in str(ctx.used_sources)  # nothing is mounted from a checkout
    with pytest.raises(ComposeError, match="data_dirs names /elsewhere, which upstream does not mount"):
        mounts(pinned(ctx, text), context(repo, data_dirs={"/elsewhere": "x"}))


def test_the_deploy_config_gives_the_gpus_and_refuses_envelope_overrides(repo: Path) -> None:
    from rigup.desired.transforms import entry_stage, read_deploy_config, stage_gpu_count

    ctx = omni_context(omni_repo(repo))
    edit = edit_of(OMNI)
    apply_all(edit, ctx)
    assert ctx.stages is not None and entry_stage(ctx.stages)["max_model_len"] == 65536
    assert stage_gpu_count(ctx.stages) == 2
    assert edit.get("deploy")["resources"]["reservations"]["devices"][0]["count"] == 2
    (change,) = [c for c in edit.changes if c.transform == "gpus" and c.key.startswith("deploy")]
    assert change.why == "2 GPU(s): the deploy config's stage devices"
    assert stage_gpu_count([{"stage_id": 0, "devices": "2"}]) == 3  # device 2 needs GPUs 0 and 1 visible too
    with pytest.raises(ComposeError, match=r"variant_overrides\['max_model_len'\]: upstream sets it per stage"):
        apply_all(edit_of(OMNI), omni_context(repo, overrides={"max_model_len": 32768}))
    # The file must come from upstream's repository, where rigup can read it.
    baked = OMNI.replace('      - "./stages.yaml:/cfg/stages.yaml:ro"\n', "")
    with pytest.raises(ComposeError, match="/cfg/stages.yaml is not a file rigup mounts from upstream's repository"):
        apply_all(edit_of(baked), omni_context(repo))
    edit = pinned(ctx, OMNI)
    edit.command_as_list("command-list", "test")
    mounts(edit, ctx)
    for stages, message in [
        ("stage_args: []\n", "a `stages` list of mappings"),
        ("stages:\n  - stage_id: 1\n    devices: '0'\n", "one of them 0"),
        ("stages:\n  - stage_id: 0\n  - stage_id: 0\n", "distinct integer stage_id"),
        ("stages:\n  - stage_id: 0\n    devices: gpu0\n", "devices 'gpu0' is not a list of GPU indices"),
        ("stages:\n  - stage_id: 0\n    devices: '0'\n    max_model_len: 64k\n", "max_model_len '64k' is not an integer"),
        ("stages: [", "not valid YAML"),
    ]:
        omni_repo(repo, stages)
        with pytest.raises(ComposeError, match=message) as info:
            read_deploy_config(edit, ctx)
        assert "models/m/compose/stages.yaml" in str(info.value)


def test_memory_caps_are_kept_as_upstream_wrote_them(repo: Path) -> None:
    text = BASE.replace("    shm_size: 16gb\n", "    mem_limit: ${MEM:-70g}\n    memswap_limit: ${MEM:-70g}\n    shm_size: 16gb\n")
    ctx = context(repo)
    edit = edit_of(text)
    apply_all(edit, ctx)
    assert (edit.get("mem_limit"), edit.get("memswap_limit")) == ("70g", "70g")
    assert transforms_of(edit, "mem_limit") == ["defaults"]
    assert explain(edit.origin, dump(edit.doc, "h"), edit.changes)[1] == 0
