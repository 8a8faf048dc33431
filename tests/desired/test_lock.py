"""rigup/desired/lock.py: pins resolved against the fake hub and local git remotes, the lock file format, the
deploy's staleness checks and the `rigup lock` command."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup.cli.lock import run_lock
from rigup.desired.catalog import load_catalog
from rigup.desired.lock import (
    LOCK_COMMAND,
    FilePin,
    GitNeed,
    GitPin,
    ImageNeed,
    ImagePin,
    LockError,
    LockFile,
    ModelNeed,
    ModelPin,
    deploy_lock,
    lock_path,
)
from rigup.desired.needs import needs_for
from rigup.desired.pins import Resolver, registry_digest, update_lock
from rigup.desired.plan import host_plan
from rigup.desired.secrets import SecretError, read_hf_token
from rigup_testbed import hfhub
from rigup_testbed.gitremotes import GitServer, Remotes, add_commit, make_remotes
from tests.support.artifacts import DFLASH, GATED, QWEN, SHARD2, TOKEN, commit_files, hub_spec


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hfhub.HfHub]:
    with hfhub.HfHub(tmp_path_factory.mktemp("hub"), spec=hub_spec()) as hub:
        yield hub


@pytest.fixture(autouse=True)
def clean_hub(hub: hfhub.HfHub) -> Iterator[None]:
    admin = hub.admin()
    admin.configure(tokens=[])
    admin.set_ref(QWEN, -1)
    admin.set_repo(GATED, gated=True)
    yield
    admin.set_ref(QWEN, -1)


@pytest.fixture(scope="module")
def remotes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Remotes, str]]:
    root = tmp_path_factory.mktemp("git")
    rem = make_remotes(root)
    with GitServer(root) as server:
        yield rem, server.url or ""


def _need(rem_url: str, ref: str, name: str = "git:vllm-fork", full: bool = False) -> GitNeed:
    return GitNeed(name, rem_url, ref, full)


# ------------------------------------------------------------------------------------------
# git


def test_git_branch_resolves_to_its_head(remotes: tuple[Remotes, str]) -> None:
    rem, base = remotes
    pin = Resolver().git(_need(rem.vllm.url(base), "marlin-pad-sub-tile-n"))
    assert pin.commit == rem.vllm.head and pin.ref == "marlin-pad-sub-tile-n"


def test_git_annotated_tag_resolves_to_the_commit(remotes: tuple[Remotes, str]) -> None:
    rem, base = remotes
    pin = Resolver().git(_need(rem.genesis.url(base), rem.genesis.tag, "git:genesis"))
    assert pin.commit == rem.genesis.tags[rem.genesis.tag] == rem.genesis.dev_commits[2]  # the commit, not the tag object


def test_git_lightweight_tag_resolves_to_the_commit(remotes: tuple[Remotes, str]) -> None:
    rem, base = remotes
    pin = Resolver().git(_need(rem.genesis.url(base), rem.genesis.main_tag, "git:genesis"))
    assert pin.commit == rem.genesis.tags[rem.genesis.main_tag] == rem.genesis.main_commits[0]


def test_git_full_sha_on_a_branch_main_cannot_reach_is_verified(remotes: tuple[Remotes, str]) -> None:
    rem, base = remotes
    dev_pin = rem.genesis.pin  # like Genesis 2db18df: on dev, not an ancestor of main
    pin = Resolver().git(_need(rem.genesis.url(base), dev_pin, "git:genesis", full=True))
    assert pin.commit == dev_pin


def test_git_full_sha_that_does_not_exist_is_an_error(remotes: tuple[Remotes, str]) -> None:
    rem, base = remotes
    with pytest.raises(LockError, match="not reachable"):
        Resolver().git(_need(rem.genesis.url(base), "0123456789abcdef0123456789abcdef01234567", "git:genesis"))


def test_git_short_sha_is_expanded(remotes: tuple[Remotes, str]) -> None:
    rem, base = remotes
    full = rem.genesis.pin
    pin = Resolver().git(_need(rem.genesis.url(base), full[:9], "git:genesis"))
    assert pin.commit == full


def test_git_unknown_branch_is_an_error(remotes: tuple[Remotes, str]) -> None:
    rem, base = remotes
    with pytest.raises(LockError, match="no branch or tag named 'no-such-branch'"):
        Resolver().git(_need(rem.vllm.url(base), "no-such-branch"))


def test_club3090_follows_upstreams_default_branch(remotes: tuple[Remotes, str]) -> None:
    """The catalog's club3090 ref resolves against a remote shaped like upstream (master, no main);
    the `main` it once named is refused by name, as a real fleet's lock refused it."""
    rem, base = remotes
    ref = load_catalog()["sources"]["club3090"]["ref"]
    assert Resolver().git(_need(rem.club3090.url(base), ref, "git:club3090")).commit == rem.club3090.head
    with pytest.raises(LockError, match="no branch or tag named 'main'"):
        Resolver().git(_need(rem.club3090.url(base), "main", "git:club3090"))


def test_git_unreachable_remote_is_an_error() -> None:
    with pytest.raises(LockError, match="ls-remote"):
        Resolver().git(_need("http://127.0.0.1:9/nothing.git", "main"))


# ------------------------------------------------------------------------------------------
# Hugging Face


def _model_need(hub: hfhub.HfHub, repo: str = QWEN, revision: str = "main", gated: bool = False) -> ModelNeed:
    return ModelNeed(f"model:{repo}", repo, revision, hub.url or "", gated)


def test_model_pins_every_file_with_size_and_sha256(hub: hfhub.HfHub) -> None:
    pin = Resolver().model(_model_need(hub))
    sha, files = commit_files(hub, QWEN)
    assert pin.commit == sha and pin.revision == "main"
    assert {f.path: (f.size, f.sha256) for f in pin.files} == {p: (f["size"], f["sha256"]) for p, f in files.items()}
    # Small non-LFS files have no published sha256: the lock tool hashed them itself.
    config = next(f for f in pin.files if f.path == "config.json")
    assert not files["config.json"]["lfs"] and len(config.sha256) == 64


def test_model_revision_can_be_a_commit(hub: hfhub.HfHub) -> None:
    first, _ = commit_files(hub, QWEN, 0)
    pin = Resolver().model(_model_need(hub, revision=first))
    assert pin.commit == first


def test_gated_model_needs_a_token(hub: hfhub.HfHub) -> None:
    hub.admin().configure(tokens=[TOKEN])
    with pytest.raises(LockError, match="HF_TOKEN"):
        Resolver().model(_model_need(hub, GATED, gated=True))
    pin = Resolver(hf_token=TOKEN).model(_model_need(hub, GATED, gated=True))
    assert {f.path for f in pin.files} == {".gitattributes", "README.md", "config.json", "model.safetensors"}


def test_non_lfs_file_with_wrong_bytes_is_refused(hub: hfhub.HfHub, monkeypatch: pytest.MonkeyPatch) -> None:
    resolver = Resolver()
    monkeypatch.setattr(resolver, "_download", lambda need, commit, path: b"{}")
    with pytest.raises(LockError, match="git blob"):
        resolver.model(_model_need(hub))


# ------------------------------------------------------------------------------------------
# the lock file


def _sample_lock() -> LockFile:
    lock = LockFile()
    lock.git["git:genesis"] = GitPin("git:genesis", "https://g/x.git", "dev", "a" * 40)
    lock.models["model:o/m"] = ModelPin(
        "model:o/m", "o/m", "main", "b" * 40, (FilePin("config.json", 3, "c" * 64), FilePin("w.safetensors", 9, "d" * 64))
    )
    lock.images["image:vllm/vllm-openai:v1"] = ImagePin("image:vllm/vllm-openai:v1", "vllm/vllm-openai", "v1", None)
    return lock


def test_lock_file_round_trips_and_implements_the_recipe_protocol() -> None:
    from rigup.desired.recipe import Lock

    lock = _sample_lock()
    again = LockFile.parse(lock.dump())
    assert (again.git, again.models, again.images) == (lock.git, lock.models, lock.images)
    assert isinstance(again, Lock)
    assert again.git_commit("git:genesis") == "a" * 40
    assert again.model_revision("model:o/m") == "b" * 40
    assert again.image_digest("image:vllm/vllm-openai:v1") is None
    assert again.git_commit("git:other") is None
    assert lock.dump().startswith("# rigup lock file")


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("commit: " + "a" * 40, "commit: main", "full 40-hex"),
        ("sha256: " + "c" * 64, "sha256: xyz", "64 lowercase hex"),
        ("size: 3", "size: -3", "non-negative"),
        ("version: 1", "version: 7", "version: 1"),
        ("path: config.json", "path: ../config.json", "bad or duplicate"),
        ("digest: null", "digest: md5:00", "sha256:<64 hex>"),
    ],
)
def test_lock_file_rejects_bad_entries(old: str, new: str, message: str) -> None:
    text = _sample_lock().dump()
    assert old in text
    with pytest.raises(LockError, match=message):
        LockFile.parse(text.replace(old, new, 1), "rigs.lock.yaml")


def test_missing_lock_file_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(LockError, match=re.escape(LOCK_COMMAND)):
        deploy_lock({"lock_file": "rigs.lock.yaml"}, base_dir=tmp_path)


def test_lock_path_is_relative_to_the_fleet_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RIGUP_RIGS", str(tmp_path / "site" / "rigs.yaml"))
    assert lock_path("rigs.lock.yaml") == tmp_path / "site" / "rigs.lock.yaml"
    assert lock_path("/abs/x.yaml") == Path("/abs/x.yaml")


# ------------------------------------------------------------------------------------------
# staleness and the deploy's view


def _host_data(hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path, **extra: object) -> dict:
    from rigup.desired.knobs import load_defaults

    rem, base = remotes
    return {
        **load_defaults(),
        "variant": "dual-dflash",
        "hf_endpoint": hub.url,
        **rem.git_knobs(base),
        "source_refs": {k: v for k, v in rem.source_refs().items() if k != "genesis"},
        "lock_file": str(tmp_path / "rigs.lock.yaml"),
        **extra,
    }


def _lock_for(data: dict) -> LockFile:
    from rigup.desired.recipe import resolve

    needs = {n.name: n for n in needs_for(resolve(data, None), data)}
    new, _ = update_lock(LockFile(), needs, Resolver(), None)
    return new


def test_host_plan_uses_the_pins(hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    data = _host_data(hub, remotes, tmp_path)
    lock = _lock_for(data)
    lock.save(tmp_path / "rigs.lock.yaml")
    plan = host_plan(data, "rig-01", read_secrets=False)
    recipe, loaded = plan.recipe, plan.lock
    assert plan.release is not None and plan.release["variant"] == "dual-dflash"
    assert [s.commit for s in recipe.sources] == [remotes[0].vllm.head]
    assert {m.revision for m in recipe.models} == {commit_files(hub, QWEN)[0], commit_files(hub, DFLASH)[0]}
    assert loaded.path == tmp_path / "rigs.lock.yaml"


def test_deploy_refuses_a_stale_or_missing_entry(hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    data = _host_data(hub, remotes, tmp_path)
    lock = _lock_for(data)
    del lock.models[f"model:{DFLASH}"]
    lock.save(tmp_path / "rigs.lock.yaml")
    with pytest.raises(LockError, match=rf"rig-01 \(variant dual-dflash\): model:{DFLASH}: no entry.*rigup lock"):
        host_plan(data, "rig-01", read_secrets=False)

    moved = _host_data(hub, remotes, tmp_path, vllm_fork_git_url="https://elsewhere/vllm.git")
    lock = _lock_for(data)
    lock.save(tmp_path / "rigs.lock.yaml")
    with pytest.raises(LockError, match="git:vllm-fork: locked from .* the host uses https://elsewhere/vllm.git"):
        host_plan(moved, "rig-01", read_secrets=False)


def test_update_keeps_pins_until_upgraded_and_upgrade_moves_only_one(
    hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path
) -> None:
    admin = hub.admin()
    admin.set_ref(QWEN, 0)  # main at the first commit when the lock is taken
    data = _host_data(hub, remotes, tmp_path)
    from rigup.desired.recipe import resolve

    needs = {n.name: n for n in needs_for(resolve(data, None), data)}
    first, changes = update_lock(LockFile(), needs, Resolver(), None)
    assert {c.kind for c in changes} == {"added"}
    admin.set_ref(QWEN, 1)  # upstream moves main

    kept, changes = update_lock(first, needs, Resolver(), None)
    assert kept.dump() == first.dump() and changes == []

    upgraded, changes = update_lock(first, needs, Resolver(), [f"model:{QWEN}"])
    assert [(c.name, c.kind) for c in changes] == [(f"model:{QWEN}", "upgraded")]
    diff = "\n".join(changes[0].lines)
    assert f"~ {SHARD2}" in diff and "commit:" in diff
    assert sum(line.startswith(("~", "+", "-")) for line in changes[0].lines) == 1  # only that file changed
    for name in first.names():
        if name != f"model:{QWEN}":
            assert upgraded.entry(name) == first.entry(name)

    with pytest.raises(LockError, match="nothing named nope"):
        update_lock(first, needs, Resolver(), ["nope"])


def test_upgrade_of_a_git_pin_after_the_branch_moves(
    hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("git-moving")
    rem = make_remotes(root)
    with GitServer(root) as server:
        data = _host_data(hub, (rem, server.url or ""), tmp_path)
        from rigup.desired.recipe import resolve

        needs = {n.name: n for n in needs_for(resolve(data, None), data)}
        first, _ = update_lock(LockFile(), needs, Resolver(), None)
        new_head = add_commit(rem.vllm, "marlin-pad-sub-tile-n", {"NOTES.md": "moved\n"}, "move the branch")
        same, changes = update_lock(first, needs, Resolver(), None)
        assert same.git_commit("git:vllm-fork") == rem.vllm.head != new_head and changes == []
        moved, changes = update_lock(first, needs, Resolver(), ["vllm-fork"])
        assert moved.git_commit("git:vllm-fork") == new_head
        assert changes[0].lines == [f"commit: {rem.vllm.head} -> {new_head}"]


# ------------------------------------------------------------------------------------------
# the command


def _write_fleet(path: Path, hub: hfhub.HfHub, remotes: tuple[Remotes, str]) -> Path:
    rem, base = remotes
    path.write_text(
        f"""
data:
  hf_endpoint: {hub.url}
  vllm_fork_git_url: {rem.vllm.url(base)}
  genesis_git_url: {rem.genesis.url(base)}
  club3090_git_url: {rem.club3090.url(base)}
  source_refs: {json.dumps({k: v for k, v in rem.source_refs().items() if k != "genesis"})}
groups:
  canary:
    hosts:
      rig-01: {{ssh_hostname: 10.0.0.11, variant: dual}}
  rigs:
    hosts:
      rig-02: {{ssh_hostname: 10.0.0.12, variant: dual-dflash}}
"""
    )
    return path


def _run(fleet: Path, *argv: str) -> tuple[int, str]:
    from rigup.cli import build_parser

    args = build_parser().parse_args(["lock", "--fleet", str(fleet), *argv])
    out = io.StringIO()
    return run_lock(args, out), out.getvalue()


def test_lock_command_check_write_and_rerun(hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    fleet = _write_fleet(tmp_path / "rigs.yaml", hub, remotes)
    assert _run(fleet, "--check") == (1, f"{tmp_path / 'rigs.lock.yaml'}: missing\n")
    code, out = _run(fleet)
    # 2 images, 2 sources, 1 model for the variants, and the rigs' GPU exporter image (metrics_exporters)
    assert code == 0 and "written (6 pins)" in out
    text = (tmp_path / "rigs.lock.yaml").read_text()
    assert "nvidia/k8s/dcgm-exporter:" in text
    assert _run(fleet, "--check")[0] == 0
    code, out = _run(fleet)
    assert code == 0 and "unchanged (6 pins)" in out
    assert (tmp_path / "rigs.lock.yaml").read_text() == text
    code, out = _run(fleet, "--dry-run", "--upgrade")
    assert code == 0 and "unchanged (dry run)" in out


def test_lock_command_upgrade_shows_the_diff(hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    fleet = _write_fleet(tmp_path / "rigs.yaml", hub, remotes)
    hub.admin().set_ref(QWEN, 0)
    assert _run(fleet)[0] == 0
    before = LockFile.load(tmp_path / "rigs.lock.yaml")
    hub.admin().set_ref(QWEN, 1)
    code, out = _run(fleet, "--upgrade", QWEN)
    assert code == 0
    assert f"upgraded  model:{QWEN}" in out and f"~ {SHARD2}: sha256" in out
    after = LockFile.load(tmp_path / "rigs.lock.yaml")
    assert [n for n in after.names() if after.entry(n) != before.entry(n)] == [f"model:{QWEN}"]


def test_lock_command_reports_resolution_errors(hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = _write_fleet(tmp_path / "rigs.yaml", hub, remotes)
    fleet.write_text(fleet.read_text().replace(remotes[0].vllm.url(remotes[1]), "http://127.0.0.1:9/gone.git"))
    code, _ = _run(fleet)
    assert code == 2
    assert "git:vllm-fork" in capsys.readouterr().err
    assert not (tmp_path / "rigs.lock.yaml").exists()


# ------------------------------------------------------------------------------------------
# tokens and image digests


def test_hf_token_from_env_or_a_private_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    token_file = tmp_path / "hf"
    token_file.write_text("hf_file_token\n")
    token_file.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        read_hf_token(str(token_file))
    token_file.chmod(0o600)
    assert read_hf_token(str(token_file)) == "hf_file_token"
    monkeypatch.setenv("HF_TOKEN", "hf_env_token")
    assert read_hf_token(str(token_file)) == "hf_env_token"
    monkeypatch.delenv("HF_TOKEN")
    assert read_hf_token(None) is None


class _Registry(http.server.BaseHTTPRequestHandler):
    """Registry v2 manifests behind an anonymous bearer token, like Docker Hub."""

    digest = "sha256:" + hashlib.sha256(b"manifest").hexdigest()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        if self.path.startswith("/token?"):
            body = b'{"token": "anon"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(404)
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802
        if self.headers.get("Authorization") != "Bearer anon":
            self.send_response(401)
            port = self.server.server_address[1]
            self.send_header("WWW-Authenticate", f'Bearer realm="http://127.0.0.1:{port}/token",service="reg",scope="x"')
            self.end_headers()
            return
        if self.path == "/v2/vllm/vllm-openai/manifests/v0.21.0":
            self.send_response(200)
            self.send_header("Docker-Content-Digest", self.digest)
            self.end_headers()
            return
        self.send_response(404)
        self.end_headers()


def test_image_digest_from_the_registry() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        registry = f"127.0.0.1:{server.server_address[1]}"
        assert registry_digest(registry, "vllm/vllm-openai", "v0.21.0") == _Registry.digest
        with pytest.raises(LockError, match="purged"):
            registry_digest(registry, "vllm/vllm-openai", "nightly-01d4d1ad")
        need = ImageNeed("image:vllm/vllm-openai:v0.21.0", "vllm/vllm-openai", "v0.21.0", registry)
        assert Resolver(image_digests=True).image(need, None).digest == _Registry.digest
        # Without --image-digests a digest already in the lock is kept, never dropped.
        previous = ImagePin(need.name, need.repository, need.tag, _Registry.digest)
        assert Resolver().image(need, previous).digest == _Registry.digest
    finally:
        server.shutdown()
        server.server_close()


def test_cli_registers_the_lock_command() -> None:
    from rigup.cli import build_parser

    args = build_parser().parse_args(["lock", "--upgrade", "git:genesis", "--image-digests"])
    assert args.func is run_lock and args.upgrade == ["git:genesis"] and args.image_digests


# ------------------------------------------------------------------------------------------
# the deploy without a usable lock (tests/tasks/test_dry_without_lock.py runs the deploy itself)


def test_phases_without_a_lock_say_what_the_lock_pins_and_how_to_make_it() -> None:
    from rigup.desired.knobs import load_defaults
    from rigup.desired.lock import PINNED_PHASES, phase_without_lock
    from rigup.desired.recipe import resolve

    recipe = resolve({**load_defaults(), "variant": "dual-turbo"})
    problem = f"/x/rigs.lock.yaml: lock file not found (knob lock_file); run `{LOCK_COMMAND}` on the control machine"
    lines = {phase: phase_without_lock(phase, recipe, problem, dry=True) for phase in PINNED_PHASES}
    assert lines["sources"].startswith("SOURCES SKIPPED in this dry run (a real run stops here): it needs the lock")
    assert "git commits of vllm-fork (marlin-pad-sub-tile-n), genesis (" in lines["sources"]
    assert "SHA-256 of every file" in lines["model"] and recipe.models[0].repo_id in lines["model"]
    assert f"image digest of {recipe.image.repository}:{recipe.image.tag} and the release" in lines["serving"]
    for line in lines.values():
        assert "\n" not in line and line.endswith(problem) and line.count(LOCK_COMMAND) == 1
    real = phase_without_lock("model", recipe, problem, dry=False)
    assert real.startswith("model cannot run: it needs the lock, which pins the model revisions")
    # A problem that does not say how to make the lock gets the command appended.
    assert phase_without_lock("serving", recipe, "bad YAML.", dry=False).endswith(
        f"bad YAML; run `{LOCK_COMMAND}` on the control machine and commit the file"
    )
    with pytest.raises(ValueError, match="needs no pins"):
        phase_without_lock("docker", recipe, problem, dry=True)


def test_dry_run_is_read_from_the_pyinfra_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    import click

    from rigup import runstate as lockmod

    assert lockmod.pyinfra_dry_run() is False  # not under the pyinfra CLI (pytest never has --dry)

    @click.command()
    @click.argument("inventory")
    @click.argument("operations", nargs=-1)
    @click.option("--dry", is_flag=True)
    @click.option("--data", multiple=True)
    def cli(**kwargs: object) -> None:  # stands in for pyinfra_cli.cli.cli (importing that patches gevent)
        raise AssertionError("never invoked")

    monkeypatch.setitem(sys.modules, "pyinfra_cli.cli", types.SimpleNamespace(cli=cli))
    monkeypatch.setattr(lockmod, "_DRY", {})
    for argv, dry in (
        (["inventory.py", "deploy.py", "--dry"], True),
        (["--dry", "inventory.py", "deploy.py"], True),
        (["inventory.py", "deploy.py"], False),
        (["--data", "note=--dry", "inventory.py", "deploy.py"], False),
    ):
        monkeypatch.setattr(sys, "argv", ["pyinfra", *argv])
        assert lockmod.pyinfra_dry_run() is dry, argv


def test_lock_upgrade_of_the_recipe_repository_prints_each_rendered_diff(
    hub: hfhub.HfHub, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`rigup lock --upgrade club3090` after upstream changed a recipe: the pin moves, and the diff of the
    rendered compose file of every variant the fleet runs from it is printed (read from git, not the
    fixture trees)."""
    from rigup.desired.upstream import GitCache, use_reader
    from rigup_testbed.recipes import tree

    root = tmp_path_factory.mktemp("git-recipes")
    rem = make_remotes(root)
    previous = use_reader(GitCache(tmp_path / "cache"))
    try:
        with GitServer(root) as server:
            base = server.url or ""
            fleet = tmp_path / "rigs.yaml"
            fleet.write_text(
                f"""
data:
  hf_endpoint: {hub.url}
  club3090_git_url: {rem.club3090.url(base)}
groups:
  rigs:
    hosts:
      rig-01: {{ssh_hostname: 10.0.0.11, variant: qwen-dual-autoround-int4-fp8-mtp}}
      rig-02: {{ssh_hostname: 10.0.0.12, variant: qwen-dual-autoround-int4-fp8-mtp}}
      rig-03: {{ssh_hostname: 10.0.0.13, variant: qwen-single-autoround-int4-minimal}}
      rig-04:
        ssh_hostname: 10.0.0.14
        pods: [{{name: a, variant: qwen-dual-autoround-int4-fp8-mtp, gpus: [0, 1]}},
               {{name: b, variant: qwen-dual-autoround-int4-fp8-mtp, gpus: [2, 3], port: 8061}}]
"""
            )
            assert _run(fleet)[0] == 0
            before = LockFile.load(tmp_path / "rigs.lock.yaml")
            assert before.git_commit("git:club3090") == rem.club3090.head
            path = "models/qwen3.6-27b/vllm/compose/dual/autoround-int4/fp8-mtp.yml"
            text = (tree("club3090") / path).read_text()
            assert "${MAX_NUM_SEQS:-2}" in text
            moved = add_commit(rem.club3090, "master", {path: text.replace("${MAX_NUM_SEQS:-2}", "${MAX_NUM_SEQS:-3}")},
                               "dual: three streams")
            code, out = _run(fleet)  # without --upgrade the pin stays
            assert code == 0 and "rendered" not in out
            code, out = _run(fleet, "--upgrade", "club3090")
    finally:
        use_reader(previous)
    assert code == 0, out
    assert "upgraded  git:club3090" in out and moved in out
    # one diff, for the two rigs of the changed recipe; the single-card recipe renders the same but
    # for the base commit its header names
    assert out.count("compose.yaml changes for") == 1  # the pods of that variant too: one diff
    assert "compose.yaml changes for rig-01, rig-02, rig-04/a, rig-04/b:" in out
    assert "compose.yaml for rig-03: only the base commit in its header changes" in out
    assert "-    - '2'" in out and "+    - '3'" in out
    assert f"at club3090@{rem.club3090.head[:12]}" in out and f"at club3090@{moved[:12]}" in out
    assert LockFile.load(tmp_path / "rigs.lock.yaml").git_commit("git:club3090") == moved
