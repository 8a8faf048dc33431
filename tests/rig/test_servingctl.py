"""The rig-side health gate (rigup/rig/servingctl.py) against a real OpenAI-compatible responder on
loopback, with systemd replaced by a fake that "restarts" the responder from the files on disk.

Covers the gate's waiting and checks, generation bookkeeping, provenance content and rollback.
"""

from __future__ import annotations

import datetime
import hashlib
import http.server
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rigup.rig import servingctl as ctl
from tests.support.json_http import JsonHandler

MODEL = "qwen3.6-27b-autoround"
API_KEY = "sk-test-0123456789abcdef"
VERSIONS = {"kernel": "6.8.0", "nvidia_driver": "580.95.05", "docker": "28.0.1", "docker_compose": "2.40.3", "nvidia_ctk": None}
# the rig's fingerprint the gate records (servingctl.rig_fingerprint's shape; tests/rig/test_fingerprint.py)
FINGERPRINT = {"driver": "580.95.05", "gpu0.uuid": "GPU-0a", "gpu0.pci": "00000000:01:00.0", "gpu0.vbios": "94.02.42.00.A9",
               "topology": "GPU0 X", "p2p": "GPU0 X", "module": "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64 580.95.05",
               "kernel": "6.8.0-45-generic", "bios": "F20"}


# --------------------------------------------------------------------------------------------
# a tiny OpenAI-compatible server


class Behaviour:
    """What the responder does; tests and the fake systemd change it while it runs."""

    def __init__(self) -> None:
        self.model: str | None = MODEL  # None: /v1/models lists nothing
        self.unlisted_polls = 0  # /v1/models lists nothing for this many requests (cold start)
        self.completion_status = 200
        self.completion_text = "OK"
        self.api_key: str | None = None
        self.models_requests = 0
        self.completions: list[dict[str, Any]] = []
        self.down = False  # refuse with 503 as a proxy would while vLLM is not up
        # Fields a completion must carry, else 500 (vLLM-Omni without "modalities": ["text"] kills its engine)
        self.required: dict[str, Any] = {}
        # The gate's probes, answered as a working model answers them (prompt substring -> content);
        # a test replaces one to make the pod answer it wrong.
        self.answers: dict[str, str] = {
            "17 * 23": "17 * 23 = 391.",
            "access code": "The access code is QX-4471-VELT.",
            "JSON object": '{"name": "rigup", "count": 3}',
        }
        self.tool_city = "Paris"  # the get_weather call's city; None: no tool call, content instead
        self.finish_reason = "stop"
        # club-3090 #922's broken all-reduce: every answer is "!" until max_tokens (finish_reason=length)
        self.garbage = False


def reply_for(b: Behaviour, body: dict[str, Any]) -> dict[str, Any]:
    """The assistant message the fake model answers `body` with."""
    prompt = body["messages"][-1]["content"]
    if b.garbage:
        return {"role": "assistant", "content": "!" * body["max_tokens"]}
    if body.get("tools") and b.tool_city is not None:
        arguments = json.dumps({"city": b.tool_city})
        call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    text = next((answer for key, answer in b.answers.items() if key in prompt), b.completion_text)
    return {"role": "assistant", "content": text}


class Handler(JsonHandler):
    server: "Server"

    def authorised(self) -> bool:
        key = self.server.behaviour.api_key
        return key is None or self.headers.get("Authorization") == f"Bearer {key}"

    def do_GET(self) -> None:  # noqa: N802
        b = self.server.behaviour
        if b.down:
            return self.reply(503, {"detail": "starting"})
        if not self.authorised():
            return self.reply(401, {"error": "Unauthorized"})
        if self.path != "/v1/models":
            return self.reply(404, {})
        b.models_requests += 1
        listed = b.model is not None and b.models_requests > b.unlisted_polls
        return self.reply(200, {"object": "list", "data": [{"id": b.model, "object": "model"}] if listed else []})

    def do_POST(self) -> None:  # noqa: N802
        b = self.server.behaviour
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self.authorised():
            return self.reply(401, {"error": "Unauthorized"})
        b.completions.append(body)
        if b.completion_status != 200:
            return self.reply(b.completion_status, {"error": {"message": "EngineCore encountered an issue."}})
        if any(body.get(k) != v for k, v in b.required.items()):
            return self.reply(500, {"error": {"message": "EngineCore encountered an issue (talker stage)."}})
        if body.get("model") != b.model:
            return self.reply(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
        message = reply_for(b, body)
        tokens = len((message["content"] or "").split()) or len(message.get("tool_calls", ()))
        if b.garbage:
            tokens = body["max_tokens"]
        return self.reply(
            200,
            {
                "choices": [{"index": 0, "message": message,
                             "finish_reason": "length" if b.garbage else b.finish_reason}],
                "usage": {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens},
            },
        )


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.behaviour = Behaviour()


@pytest.fixture
def server():
    srv = Server()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


# --------------------------------------------------------------------------------------------
# fake systemd: a restart reconfigures the responder from the variant's compose.yaml


class FakeSystemd(ctl.Systemd):
    def __init__(self, server: Server, root: Path) -> None:
        self.server = server
        self.root = root
        self.calls: list[tuple[str, ...]] = []
        self.state: dict[str, dict[str, str]] = {}
        self.journal = ["vllm  | INFO Started server process", "vllm  | ERROR something broke"]

    def unit(self, name: str) -> dict[str, str]:
        return self.state.setdefault(
            name,
            {"ActiveState": "active", "SubState": "running", "NRestarts": "0", "Result": "success",
             "UnitFileState": "enabled", "LoadState": "loaded", "NeedDaemonReload": "no",
             "ExecMainStartTimestampMonotonic": str(int(time.monotonic() * 1e6))},
        )

    def show(self, unit: str) -> dict[str, str]:
        return dict(self.unit(unit))

    def _apply(self, unit: str) -> None:
        variant = unit[len("rigup-") : -len(".service")]
        compose = (self.root / "opt/rigup/variants" / variant / "compose.yaml").read_text()
        # The "container" serves the model the compose file names, or nothing when it says broken.
        served = compose.split("model=", 1)[1].split()[0]
        self.server.behaviour.model = None if served == "broken" else served
        # an image tagged *-garbage serves, but answers like club-3090 #922's broken all-reduce
        self.server.behaviour.garbage = "-garbage" in compose
        self.unit(unit).update(ActiveState="active", ExecMainStartTimestampMonotonic=str(int(time.monotonic() * 1e6)))

    def restart(self, unit: str) -> None:
        self.calls.append(("restart", unit))
        self._apply(unit)

    def enable(self, unit: str) -> None:
        self.calls.append(("enable", unit))

    def disable_now(self, unit: str) -> None:
        self.calls.append(("disable --now", unit))
        self.unit(unit)["ActiveState"] = "inactive"

    def daemon_reload(self) -> None:
        self.calls.append(("daemon-reload",))

    def journal_tail(self, unit: str, lines: int, since: float | None = None) -> list[str]:
        self.calls.append(("journal", unit))
        return self.journal[-lines:]


# --------------------------------------------------------------------------------------------
# a rig layout in a temporary directory


class Rig:
    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.install_root = root / "opt/rigup"
        self.unit_dir = root / "etc/systemd/system"
        self.unit_dir.mkdir(parents=True)

    def variant_dir(self, variant: str) -> Path:
        return self.install_root / "variants" / variant

    def deploy(self, variant: str, model: str, *, api_key: str | None = None, unit_extra: str = "", tag: str = "v1",
               chat_request: dict[str, Any] | None = None, pod: str | None = None,
               gate_probes: list[str] | None = None, legacy_env_key: bool = False) -> Path:
        """Write the files pyinfra would upload (for a listed pod: in its directory); returns the release path.
        The key is the 0600 file secrets/VLLM_API_KEY the release's secret_files names; legacy_env_key: a release
        written before those, its key a line of the .env (secret_env_keys)."""
        name = pod or variant
        vdir = self.variant_dir(name)
        vdir.mkdir(parents=True, exist_ok=True)
        compose = f"# compose for {variant}\nimage: vllm/vllm-openai:{tag}\nmodel={model} \n"
        env = "# env\n" + (f"VLLM_API_KEY='{api_key}'\n" if api_key and legacy_env_key else "")
        if api_key and not legacy_env_key:
            (vdir / "secrets").mkdir(mode=0o700, exist_ok=True)
            (vdir / "secrets/VLLM_API_KEY").write_text(api_key + "\n")
            os.chmod(vdir / "secrets/VLLM_API_KEY", 0o600)
        unit = f"[Service]\nExecStart=/usr/bin/docker compose up\n{unit_extra}"
        (vdir / "compose.yaml").write_text(compose)
        (vdir / ".env").write_text(env)
        os.chmod(vdir / ".env", 0o600)
        unit_file = self.unit_dir / f"rigup-{name}.service"
        unit_file.write_text(unit)
        release = {
            "schema": 1,
            "variant": variant,
            "install_root": str(self.install_root),
            "variant_dir": str(vdir),
            "unit": f"rigup-{name}.service",
            "unit_file": str(unit_file),
            "unit_sha256": hashlib.sha256(unit.encode()).hexdigest(),
            "env_file": str(vdir / ".env"),
            "files": {
                "compose.yaml": hashlib.sha256(compose.encode()).hexdigest(),
                ".env": hashlib.sha256(b"# env\n").hexdigest(),
            },
            "health_url": f"http://127.0.0.1:{self.port}/v1/models",
            "served_model_name": MODEL,
            "api_key_env": "VLLM_API_KEY" if api_key else None,
            **({"secret_env_keys": ["VLLM_API_KEY"] if api_key else []} if legacy_env_key else
               {"secret_files": {"VLLM_API_KEY": "secrets/VLLM_API_KEY"} if api_key else {}}),
            "image": {"ref": f"docker.io/vllm/vllm-openai:{tag}", "digest": None},
            "sources": [{"name": "genesis", "commit": "2db18df4bc3abd4eb58a9b2e0342082fa7012c64"}],
            "models": [{"repo_id": "Lorbus/Qwen3.6-27B-int4-AutoRound", "revision": "a" * 40}],
        }
        if chat_request is not None:
            release["chat_request"] = chat_request
        if gate_probes is not None:
            release["gate_probes"] = gate_probes
        if pod is not None:
            release.update(pod=pod, state_dir=str(self.install_root / "state/pods" / pod), gpu_ids=[2, 3])
        path = vdir / "release.json"
        path.write_text(json.dumps(release, indent=2, sort_keys=True) + "\n")
        return path

    @property
    def provenance(self) -> dict[str, Any]:
        return json.loads((self.install_root / "state/provenance.json").read_text())

    def pod_provenance(self, pod: str) -> dict[str, Any]:
        return json.loads((self.install_root / "state/pods" / pod / "provenance.json").read_text())

    def generations(self, variant: str) -> list[int]:
        return ctl.generation_numbers(str(self.variant_dir(variant) / "generations"))


@pytest.fixture
def rig(tmp_path, server):
    return Rig(tmp_path, server.server_address[1])


@pytest.fixture
def systemd(server, tmp_path):
    return FakeSystemd(server, tmp_path)


class FakeDocker(ctl.Docker):
    """Records the images the gate removes; one still used by a container is refused as docker refuses it."""

    def __init__(self, in_use: tuple[str, ...] = ()) -> None:
        self.removed: list[str] = []
        self.in_use = in_use

    def remove_image(self, ref: str) -> tuple[bool, str]:
        if ref in self.in_use:
            return False, f"Error response from daemon: conflict: unable to remove repository reference \"{ref}\" - container is using it"
        self.removed.append(ref)
        return True, f"Untagged: {ref}"


def run_gate(release: Path, systemd: FakeSystemd, *, timeout: float = 5.0, keep: int = 2, rollback: bool = True,
             docker: FakeDocker | None = None) -> tuple[int, list[str]]:
    lines: list[str] = []
    code = ctl.gate(
        str(release), timeout, keep, rollback, systemd, out=lines.append, versions=VERSIONS, poll_s=0.01,
        docker=docker or FakeDocker(), fingerprint=FINGERPRINT,
    )
    return code, lines


# --------------------------------------------------------------------------------------------
# the gate


def test_gate_passes_records_generation_and_provenance(rig, systemd, server):
    release = rig.deploy("dual", MODEL)
    code, lines = run_gate(release, systemd)
    assert code == ctl.EXIT_PASSED, lines
    assert lines[-1] == f"{ctl.RESULT_MARKER} passed"
    assert rig.generations("dual") == [1]
    gen = rig.variant_dir("dual") / "generations/1"
    assert (gen / "compose.yaml").read_text() == (rig.variant_dir("dual") / "compose.yaml").read_text()
    assert (gen / ctl.UNIT_COPY_NAME).read_text().startswith("[Service]")
    assert oct((gen / ".env").stat().st_mode & 0o777) == "0o600"
    assert oct(gen.stat().st_mode & 0o777) == "0o700"
    prov = rig.provenance
    assert prov["variant"] == "dual" and prov["generation"] == 1
    assert prov["release_sha256"] == hashlib.sha256(release.read_bytes()).hexdigest()
    assert prov["release"]["sources"][0]["commit"] == "2db18df4bc3abd4eb58a9b2e0342082fa7012c64"
    assert prov["host"] == VERSIONS
    assert prov["gate"]["result"] == "passed"
    assert prov["gate"]["models"] == [MODEL]
    assert prov["gate"]["completion"]["completion_tokens"] == 1
    # The completion the gate sent is the short, greedy, seeded one; then one request per probe.
    first, *probes = server.behaviour.completions
    assert first["temperature"] == 0 and first["seed"] == 0 and first["max_tokens"] == ctl.GATE_MAX_TOKENS
    assert [p["messages"] for p in probes] == [ctl.PROBES[name].messages for name in ctl.PROBE_NAMES]
    assert all(p["temperature"] == 0 and p["seed"] == 0 and p["max_tokens"] == ctl.PROBE_MAX_TOKENS
               and p["chat_template_kwargs"] == {"enable_thinking": False} for p in probes)
    assert sorted(prov["gate"]["probes"]) == sorted(ctl.PROBE_NAMES)
    assert prov["gate"]["probes"]["recall"]["answer_sha256"] == hashlib.sha256(
        b"The access code is QX-4471-VELT.").hexdigest()
    assert ("journal", "rigup-dual.service") not in systemd.calls


def test_gate_sends_the_releases_chat_request_fields(rig, systemd, server):
    """vLLM-Omni needs "modalities": ["text"] in every text request (the release's chat_request)."""
    server.behaviour.required = {"modalities": ["text"]}
    code, lines = run_gate(rig.deploy("omni", MODEL), systemd)
    assert code == ctl.EXIT_FAILED and "chat completion answered HTTP 500" in lines[0]  # without them
    assert all("modalities" not in body for body in server.behaviour.completions)
    server.behaviour.completions.clear()
    code, lines = run_gate(rig.deploy("omni", MODEL, chat_request={"modalities": ["text"]}), systemd)
    assert code == ctl.EXIT_PASSED, lines
    sent = server.behaviour.completions[0]
    assert sent["modalities"] == ["text"] and sent["model"] == MODEL and sent["max_tokens"] == ctl.GATE_MAX_TOKENS
    assert all(probe["modalities"] == ["text"] for probe in server.behaviour.completions[1:])  # the probes too
    assert sent["temperature"] == 0 and sent["seed"] == 0  # everything else as before
    assert rig.provenance["release"]["chat_request"] == {"modalities": ["text"]}


@pytest.mark.parametrize(("chat_request", "message"), [
    ({"temperature": 1.0}, "chat_request sets ['temperature'], which the health gate sets itself"),
    (["modalities"], "chat_request is not a JSON object"),
])
def test_a_release_whose_chat_request_is_unusable_is_refused(rig, systemd, server, chat_request, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_gate(rig.deploy("omni", MODEL, chat_request=chat_request), systemd)
    assert server.behaviour.completions == []


def test_gate_waits_through_a_cold_start(rig, systemd, server):
    server.behaviour.unlisted_polls = 5
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd)
    assert code == ctl.EXIT_PASSED, lines
    assert server.behaviour.models_requests == 6
    assert rig.provenance["gate"]["ready_seconds"] >= 0


def test_gate_times_out_when_the_model_is_never_listed(rig, systemd, server):
    server.behaviour.model = "some-other-model"
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd, timeout=0.3)
    assert code == ctl.EXIT_FAILED
    text = "\n".join(lines)
    assert f"{MODEL!r} not served after 0 s" in text
    assert "lists ['some-other-model']" in text
    assert "journalctl -u rigup-dual.service" in text
    assert "  vllm  | ERROR something broke" in lines
    assert "no previous good generation" in text
    assert lines[-1] == f"{ctl.RESULT_MARKER} failed"
    assert not (rig.install_root / "state/provenance.json").exists()
    assert rig.generations("dual") == []


def test_gate_fails_when_the_server_is_unreachable(rig, systemd, server):
    release = rig.deploy("dual", MODEL)
    data = json.loads(release.read_text())
    data["health_url"] = "http://127.0.0.1:9/v1/models"  # discard port: nothing listens
    release.write_text(json.dumps(data))
    code, lines = run_gate(release, systemd, timeout=0.2)
    assert code == ctl.EXIT_FAILED
    assert "unreachable" in lines[0]


def test_gate_fails_when_the_completion_fails(rig, systemd, server):
    server.behaviour.completion_status = 500
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd)
    assert code == ctl.EXIT_FAILED
    assert "chat completion answered HTTP 500: EngineCore encountered an issue." in lines[0]
    assert len(server.behaviour.completions) == 3  # a 5xx right after readiness is retried twice


def test_gate_fails_on_an_empty_completion(rig, systemd, server):
    server.behaviour.completion_text = ""
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd)
    assert code == ctl.EXIT_FAILED
    assert "produced no tokens" in lines[0]


def test_a_wrong_answer_fails_the_gate_naming_its_probe_and_the_answer(rig, systemd, server):
    server.behaviour.answers["17 * 23"] = "17 * 23 = 381."
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd)
    assert code == ctl.EXIT_FAILED
    assert lines[0] == ("rigup: health gate FAILED for rigup-dual.service (variant dual): probe arithmetic failed: "
                        "expected 391; answered '17 * 23 = 381.' (finish_reason=stop, 5 tokens); "
                        "the log's last error: ERROR something broke")
    assert not (rig.install_root / "state/provenance.json").exists()


def test_a_wrong_tool_call_fails_the_tool_call_probe(rig, systemd, server):
    server.behaviour.tool_city = "Berlin"
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd)
    assert code == ctl.EXIT_FAILED
    assert ('probe tool-call failed: expected get_weather({"city": "Paris"}), got get_weather({"city": "Berlin"}) '
            '(finish_reason=stop, 1 tokens)') in lines[0]


def test_the_gate_asks_only_the_probes_the_release_names(rig, systemd, server):
    """A variant whose model cannot answer a probe leaves it out (the catalog's gate_probes)."""
    server.behaviour.tool_city = None  # this "model" calls no tool: the tool-call probe would fail it
    code, lines = run_gate(rig.deploy("dual", MODEL, gate_probes=["arithmetic", "recall"]), systemd)
    assert code == ctl.EXIT_PASSED, lines
    asked = [body["messages"][-1]["content"] for body in server.behaviour.completions[1:]]
    assert asked == [ctl.PROBES["arithmetic"].prompt, ctl.PROBES["recall"].prompt]
    assert sorted(rig.provenance["gate"]["probes"]) == ["arithmetic", "recall"]


def test_a_release_naming_an_unknown_probe_is_refused(rig, systemd, server):
    with pytest.raises(SystemExit, match=r"gate_probes names \['arithmatic'\], not probes of this servingctl "
                                         r"\(arithmetic, recall, tool-call, json-shape\)"):
        run_gate(rig.deploy("dual", MODEL, gate_probes=["arithmatic"]), systemd)
    assert server.behaviour.completions == []


def test_gate_fails_fast_on_a_dead_unit(rig, systemd, server):
    systemd.unit("rigup-dual.service").update(ActiveState="failed", Result="exit-code")
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd, timeout=60)
    assert code == ctl.EXIT_FAILED
    assert "rigup-dual.service is failed (result: exit-code)" in lines[0]


def test_gate_fails_fast_on_a_crash_loop(rig, systemd, server):
    server.behaviour.model = None
    shows = {"n": 0}
    original = systemd.show

    def show(unit: str) -> dict[str, str]:
        shows["n"] += 1
        state = original(unit)
        state["NRestarts"] = str(shows["n"] // 2)
        return state

    systemd.show = show  # type: ignore[method-assign]
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd, timeout=60)
    assert code == ctl.EXIT_FAILED
    assert "crash loop" in lines[0]


@pytest.mark.parametrize("legacy_env_key", [False, True])
def test_gate_uses_the_api_key_and_never_prints_it(rig, systemd, server, legacy_env_key):
    """The key from its file (secret_files), or from the .env of a release written before them (a rollback to
    one restores it so)."""
    server.behaviour.api_key = API_KEY
    systemd.journal.append(f"vllm  | api_key={API_KEY}")
    release = rig.deploy("dual", MODEL, api_key=API_KEY, legacy_env_key=legacy_env_key)
    code, lines = run_gate(release, systemd)
    assert code == ctl.EXIT_PASSED, lines
    # A wrong key is refused, and the failure output (with the journal) hides the real one.
    server.behaviour.api_key = "sk-the-server-wants-another-key"
    code, lines = run_gate(release, systemd, timeout=0.2, rollback=False)
    assert code == ctl.EXIT_FAILED
    text = "\n".join(lines)
    assert "refused the API key (HTTP 401)" in text
    assert API_KEY not in text
    assert "api_key=***" in text
    assert API_KEY not in (rig.install_root / "state/provenance.json").read_text()


def test_open_api_sends_no_authorization(rig, systemd, server):
    server.behaviour.api_key = API_KEY
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd, timeout=0.2)
    assert code == ctl.EXIT_FAILED
    assert "refused the API key (HTTP 401)" in lines[0]


# --------------------------------------------------------------------------------------------
# generations


def test_generations_grow_reuse_and_prune(rig, systemd, server):
    assert run_gate(rig.deploy("dual", MODEL, tag="v1"), systemd)[0] == 0
    assert run_gate(rig.deploy("dual", MODEL, tag="v2"), systemd)[0] == 0
    assert rig.generations("dual") == [1, 2]
    # Gating the same release again is not a new generation.
    assert run_gate(rig.deploy("dual", MODEL, tag="v2"), systemd)[0] == 0
    assert rig.generations("dual") == [1, 2]
    assert run_gate(rig.deploy("dual", MODEL, tag="v3"), systemd, keep=2)[0] == 0
    assert rig.generations("dual") == [2, 3]
    assert "v3" in (rig.variant_dir("dual") / "generations/3/compose.yaml").read_text()
    assert rig.provenance["generation"] == 3
    # keep=1 leaves only the current one.
    assert run_gate(rig.deploy("dual", MODEL, tag="v4"), systemd, keep=1)[0] == 0
    assert rig.generations("dual") == [4]


def test_images_of_pruned_generations_are_removed_unless_a_kept_release_uses_them(rig, systemd, server):
    docker = FakeDocker()
    for tag in ("v1", "v2"):
        assert run_gate(rig.deploy("dual", MODEL, tag=tag), systemd, keep=2, docker=docker)[0] == 0
    # another pod of the host still runs v1: its image stays when dual's generation 1 goes
    assert run_gate(rig.deploy("dual", MODEL, tag="v1", pod="left"), systemd, keep=2, docker=docker)[0] == 0
    code, lines = run_gate(rig.deploy("dual", MODEL, tag="v3"), systemd, keep=2, docker=docker)
    assert code == 0 and rig.generations("dual") == [2, 3] and docker.removed == []
    # v2's generation goes with v4; nothing else uses v2
    code, lines = run_gate(rig.deploy("dual", MODEL, tag="v4"), systemd, keep=2, docker=docker)
    assert code == 0 and docker.removed == ["docker.io/vllm/vllm-openai:v2"]
    assert "rigup: removed image docker.io/vllm/vllm-openai:v2: no kept generation uses it" in lines
    # an image a container still uses is kept, and the gate says why
    busy = FakeDocker(in_use=("docker.io/vllm/vllm-openai:v3",))
    code, lines = run_gate(rig.deploy("dual", MODEL, tag="v5"), systemd, keep=2, docker=busy)
    assert code == 0 and busy.removed == [] and any(line.startswith("rigup: kept image docker.io/vllm/vllm-openai:v3: ")
                                                   for line in lines)


def test_a_rotated_secret_is_a_new_generation(rig, systemd, server):
    server.behaviour.api_key = "sk-first-key-000000"
    assert run_gate(rig.deploy("dual", MODEL, api_key="sk-first-key-000000"), systemd)[0] == 0
    server.behaviour.api_key = "sk-second-key-11111"
    assert run_gate(rig.deploy("dual", MODEL, api_key="sk-second-key-11111"), systemd)[0] == 0
    # Same release.json (it has no secrets), another key file: generation 2 holds the new key, 0600 in a 0700 dir.
    assert rig.generations("dual") == [1, 2]
    kept = rig.variant_dir("dual") / "generations/2/secrets/VLLM_API_KEY"
    assert kept.read_text() == "sk-second-key-11111\n" and kept.stat().st_mode & 0o777 == 0o600
    assert (rig.variant_dir("dual") / "generations/2").stat().st_mode & 0o777 == 0o700
    # a rollback to generation 1 puts its key file back, 0600
    restored = ctl.restore_generation(str(rig.install_root), "dual", 1, systemd)
    key = rig.variant_dir("dual") / "secrets/VLLM_API_KEY"
    assert restored.api_key() == "sk-first-key-000000" and key.stat().st_mode & 0o777 == 0o600


def test_a_rotated_key_file_alone_makes_the_running_pod_stale(rig, systemd, server):
    """The restart decision (probe's stale) sees the secret files: a new key restarts the pod, once."""
    release = rig.deploy("dual", MODEL, api_key="sk-first-key-000000")
    systemd.restart("rigup-dual.service")
    assert ctl.probe(str(release), systemd)["stale"] is False
    time.sleep(0.01)
    key = rig.variant_dir("dual") / "secrets/VLLM_API_KEY"
    key.write_text("sk-second-key-11111\n")
    assert ctl.probe(str(release), systemd)["stale"] is True
    assert ctl.Release.load(str(release)).redactor()("key sk-second-key-11111") == "key ***"


def test_interrupted_staging_dirs_are_cleaned(rig, systemd, server):
    stale = rig.variant_dir("dual") / "generations/.2-abcdef"
    stale.mkdir(parents=True)
    assert run_gate(rig.deploy("dual", MODEL), systemd)[0] == 0
    assert not stale.exists()
    assert rig.generations("dual") == [1]


# --------------------------------------------------------------------------------------------
# rollback


def test_failed_upgrade_rolls_back_to_the_last_good_generation(rig, systemd, server):
    good = rig.deploy("dual", MODEL, tag="v1")
    assert run_gate(good, systemd)[0] == 0
    good_compose = (rig.variant_dir("dual") / "compose.yaml").read_text()
    good_release = good.read_text()
    # The upgrade: a new image whose container serves nothing.
    bad = rig.deploy("dual", "broken", tag="v2")
    systemd.restart("rigup-dual.service")  # what pyinfra's restart op does before the gate
    assert server.behaviour.model is None
    code, lines = run_gate(bad, systemd, timeout=0.3)
    text = "\n".join(lines)
    assert code == ctl.EXIT_ROLLED_BACK, text
    assert "FAILED and ROLLED BACK" in text and "generation 1 serves again" in text
    assert lines[-1] == f"{ctl.RESULT_MARKER} failed-and-rolled-back"
    # The old files are back, the unit was restarted, and the old release serves.
    assert (rig.variant_dir("dual") / "compose.yaml").read_text() == good_compose
    assert good.read_text() == good_release
    assert server.behaviour.model == MODEL
    assert systemd.calls.count(("restart", "rigup-dual.service")) == 2
    assert ("daemon-reload",) not in systemd.calls  # the unit file did not change
    prov = rig.provenance
    assert prov["generation"] == 1 and prov["gate"]["result"] == "passed"
    assert prov["last_rollback"]["outcome"] == "rolled back"
    assert prov["last_rollback"]["failed_image"] == "docker.io/vllm/vllm-openai:v2"
    assert "not served" in prov["last_rollback"]["reason"]
    assert rig.generations("dual") == [1]


def test_a_pod_answering_garbage_fails_its_gate_and_rolls_back(rig, systemd, server):
    """club-3090 #922: the pod starts, lists its model and answers fast, with "!" until max_tokens."""
    good = rig.deploy("dual", MODEL, tag="v1")
    assert run_gate(good, systemd)[0] == ctl.EXIT_PASSED
    bad = rig.deploy("dual", MODEL, tag="v2-garbage")
    systemd.restart("rigup-dual.service")
    assert server.behaviour.garbage
    code, lines = run_gate(bad, systemd)
    text = "\n".join(lines)
    assert code == ctl.EXIT_ROLLED_BACK, text
    reason = ("probe arithmetic failed: lexical variety 0.00 over the first 200 words (verify-full fails < 0.30); "
              "answered '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!...' (finish_reason=length, 48 tokens)")
    assert f"FAILED for rigup-dual.service (variant dual): {reason}" in lines[0]
    assert f"failed the health gate ({reason}" in text and "generation 1 serves again" in text
    assert not server.behaviour.garbage  # the restored release answers right again
    prov = rig.provenance
    assert prov["generation"] == 1 and prov["last_rollback"]["outcome"] == "rolled back"
    assert prov["last_rollback"]["reason"].startswith(reason)
    assert prov["last_rollback"]["failed_image"] == "docker.io/vllm/vllm-openai:v2-garbage"


def test_the_failure_reason_carries_the_logs_last_error(rig, systemd, server):
    systemd.journal = [
        "2026-12-04T05:00:01+0000 rig-a docker-compose[812]: rigup-big  | INFO Started",
        "2026-12-04T05:00:02+0000 rig-a docker-compose[812]: rigup-big  | RuntimeError: Gloo connectFullMesh failed with [pair.cc:144] no error",
        "2026-12-04T05:00:03+0000 rig-a docker-compose[812]: rigup-big  | RuntimeError: Engine core initialization "
        "failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}",
        "2026-12-04T05:00:03+0000 rig-a docker-compose[812]: rigup-big exited with code 1",
    ]
    server.behaviour.model = None
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd, timeout=0.2)
    assert code == ctl.EXIT_FAILED
    assert lines[0].endswith("; the log's last error: RuntimeError: Gloo connectFullMesh failed with [pair.cc:144] no error")
    assert ctl.last_error(["INFO all good", "Traceback (most recent call last):"]) is None


def test_the_reason_finds_the_last_error_since_the_gate_began_beyond_the_printed_lines(rig, systemd, server):
    # a cluster head between two failed starts: the last start's error lies further back than the lines printed
    error = "2026-12-04T05:00:02+0000 rig-a docker[812]: rigup-big  | RuntimeError: Gloo connectFullMesh failed with [pair.cc:144] no error"
    startup = [f"2026-12-04T05:01:{i % 60:02d}+0000 rig-a docker[901]: rigup-big  | INFO ray start: line {i}" for i in range(120)]
    systemd.journal = [error, *startup]
    server.behaviour.model = None
    code, lines = run_gate(rig.deploy("dual", MODEL), systemd, timeout=0.2)
    assert code == ctl.EXIT_FAILED
    assert lines[0].endswith("; the log's last error: RuntimeError: Gloo connectFullMesh failed with [pair.cc:144] no error")
    assert error not in "\n".join(lines)  # the printed tail is the last JOURNAL_LINES lines alone


def test_a_held_gate_records_nothing_and_rolls_nothing_back(rig, systemd, server):
    good = rig.deploy("dual", MODEL, tag="v1")
    assert run_gate(good, systemd)[0] == ctl.EXIT_PASSED
    new = rig.deploy("dual", MODEL, tag="v2")  # passes, but a cluster records it only once every member passed
    lines: list[str] = []
    code = ctl.gate(str(new), 5.0, 2, True, systemd, out=lines.append, versions=VERSIONS, poll_s=0.01,
                    docker=FakeDocker(), hold=True)
    assert code == ctl.EXIT_PASSED and lines[-1] == f"{ctl.RESULT_MARKER} held", lines
    assert rig.generations("dual") == [1]
    assert rig.provenance["release"]["image"]["ref"] == "docker.io/vllm/vllm-openai:v1"
    broken = rig.deploy("dual", "broken", tag="v3")
    systemd.restart("rigup-dual.service")
    lines = []
    code = ctl.gate(str(broken), 0.2, 2, True, systemd, out=lines.append, versions=VERSIONS, poll_s=0.01,
                    docker=FakeDocker(), hold=True)
    assert code == ctl.EXIT_FAILED and lines[-1] == f"{ctl.RESULT_MARKER} failed", lines
    assert "rolling back" not in "\n".join(lines)
    assert (rig.variant_dir("dual") / "compose.yaml").read_text().endswith("model=broken \n")  # left as it is


def test_rollback_takes_a_release_that_passed_out_for_another_members_failure(rig, systemd, server):
    good = rig.deploy("dual", MODEL, tag="v1")
    assert run_gate(good, systemd)[0] == ctl.EXIT_PASSED
    good_compose = (rig.variant_dir("dual") / "compose.yaml").read_text()
    new = rig.deploy("dual", MODEL, tag="v2")
    systemd.restart("rigup-dual.service")
    lines: list[str] = []
    code = ctl.roll_back(str(new), "cluster big: rig-a's gate failed: crash loop", 5.0, systemd, out=lines.append,
                         poll_s=0.01)
    text = "\n".join(lines)
    assert code == ctl.EXIT_ROLLED_BACK, text
    assert lines[0] == "rigup: rigup-dual.service: cluster big: rig-a's gate failed: crash loop"
    assert "generation 1 serves again" in text and lines[-1] == f"{ctl.RESULT_MARKER} failed-and-rolled-back"
    assert (rig.variant_dir("dual") / "compose.yaml").read_text() == good_compose
    prov = rig.provenance
    assert prov["generation"] == 1 and prov["rollbacks"] == 1
    assert prov["last_rollback"]["reason"] == "cluster big: rig-a's gate failed: crash loop"
    assert prov["last_rollback"]["failed_image"] == "docker.io/vllm/vllm-openai:v2"


@pytest.fixture
def seconds_pass(monkeypatch):
    """Each record the gate writes is a second later than the one before (a real failed gate takes several):
    the order of a pass and a rollback is read from their times, which have whole seconds."""
    moments = iter(range(10_000))
    monkeypatch.setattr(ctl, "now_iso", lambda: datetime.datetime.fromtimestamp(
        1796000000 + next(moments), datetime.timezone.utc).isoformat())


def failed_gate_gauge(rig: Rig) -> float:
    text = ctl.textfile_metrics(str(rig.install_root), 580, str(rig.root / "models"))
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("rigup_release_failed_gate{"))


def test_a_reverted_fleet_file_supersedes_the_failed_gate_and_a_repeated_failure_stands_again(rig, systemd, server,
                                                                                              seconds_pass):
    good = rig.deploy("dual", MODEL, tag="v1")
    assert run_gate(good, systemd)[0] == ctl.EXIT_PASSED
    good_sha = ctl.sha256_file(str(good))
    bad = rig.deploy("dual", "broken", tag="v2")
    bad_sha = ctl.sha256_file(str(bad))
    systemd.restart("rigup-dual.service")
    assert run_gate(bad, systemd, timeout=0.3)[0] == ctl.EXIT_ROLLED_BACK
    # rolled back: the good release is on disk and serves, yet the fleet still asks for the bad one
    assert ctl.sha256_file(str(good)) == good_sha
    assert ctl.probe(str(good), systemd)["provenance"]["failed_release_sha256"] == bad_sha
    assert failed_gate_gauge(rig) == 1
    # the converge renders the bad release again (before its restart): supersede refuses, nothing written
    rig.deploy("dual", "broken", tag="v2")
    lines: list[str] = []
    before = (rig.install_root / "state/provenance.json").read_bytes()
    assert ctl.supersede(str(good), out=lines.append) == 1
    assert "is the release that failed its gate" in lines[0] and "its failure stands" in lines[0]
    assert (rig.install_root / "state/provenance.json").read_bytes() == before
    # the operator reverts the fleet file: the converge renders the good release, which serves
    rig.deploy("dual", MODEL, tag="v1")
    assert ctl.sha256_file(str(good)) == good_sha
    lines.clear()
    assert ctl.supersede(str(good), out=lines.append) == 0
    assert f"no longer for {bad_sha[:12]}" in lines[0]
    record = rig.provenance
    assert record["last_rollback"]["superseded_by_release_sha256"] == good_sha
    assert record["last_rollback"]["failed_release_sha256"] == bad_sha  # rigup status still tells the story
    assert record["gate"]["result"] == "passed" and record["generation"] == 1 and record["rollbacks"] == 1
    assert ctl.probe(str(good), systemd)["provenance"]["failed_release_sha256"] is None
    assert failed_gate_gauge(rig) == 0
    assert 'rigup_gate_last_passed{pod="dual",variant="dual"} 0' in ctl.textfile_metrics(
        str(rig.install_root), 580, str(rig.root / "models"))  # the last gate did fail: that gauge says so
    lines.clear()
    assert ctl.supersede(str(good), out=lines.append) == 0 and "nothing to supersede" in lines[0]
    assert rig.provenance == record
    # the fleet asks for the bad release once more: it fails and rolls back again, and that failure stands
    bad = rig.deploy("dual", "broken", tag="v2")
    systemd.restart("rigup-dual.service")
    assert run_gate(bad, systemd, timeout=0.3)[0] == ctl.EXIT_ROLLED_BACK
    assert "superseded_at" not in rig.provenance["last_rollback"] and rig.provenance["rollbacks"] == 2
    assert ctl.probe(str(good), systemd)["provenance"]["failed_release_sha256"] == bad_sha
    assert failed_gate_gauge(rig) == 1


def test_supersede_refuses_a_release_that_does_not_serve(rig, systemd, server, seconds_pass):
    good = rig.deploy("dual", MODEL, tag="v1")
    assert run_gate(good, systemd)[0] == ctl.EXIT_PASSED
    bad = rig.deploy("dual", "broken", tag="v2")
    systemd.restart("rigup-dual.service")
    assert run_gate(bad, systemd, timeout=0.3)[0] == ctl.EXIT_ROLLED_BACK
    third = rig.deploy("dual", MODEL, tag="v3")  # neither the failed release nor the one that passed: gate it first
    lines: list[str] = []
    assert ctl.main(["supersede", "--release", str(third)]) == 1
    assert ctl.supersede(str(third), out=lines.append) == 1 and "gate it first" in lines[0]
    assert "superseded_at" not in rig.provenance["last_rollback"]


def test_rollback_without_a_good_generation_says_there_is_none(rig, systemd, server):
    first = rig.deploy("dual", MODEL, tag="v1")
    lines: list[str] = []
    assert ctl.roll_back(str(first), "rig-b's gate failed", 5.0, systemd, out=lines.append, poll_s=0.01) == ctl.EXIT_FAILED
    assert "no previous good generation" in "\n".join(lines) and lines[-1] == f"{ctl.RESULT_MARKER} failed"


def test_rollback_restores_a_changed_unit_and_reloads_once(rig, systemd, server):
    assert run_gate(rig.deploy("dual", MODEL, tag="v1"), systemd)[0] == 0
    bad = rig.deploy("dual", "broken", tag="v2", unit_extra="Environment=NEW=1\n")
    systemd.restart("rigup-dual.service")
    code, _ = run_gate(bad, systemd, timeout=0.3)
    assert code == ctl.EXIT_ROLLED_BACK
    assert "NEW=1" not in (rig.unit_dir / "rigup-dual.service").read_text()
    assert systemd.calls.count(("daemon-reload",)) == 1


def test_failed_variant_switch_rolls_back_to_the_previous_variant(rig, systemd, server):
    assert run_gate(rig.deploy("single", MODEL), systemd)[0] == 0
    bad = rig.deploy("dual", "broken")
    systemd.disable_now("rigup-single.service")  # pyinfra's sole_variant op
    systemd.restart("rigup-dual.service")
    code, lines = run_gate(bad, systemd, timeout=0.3)
    assert code == ctl.EXIT_ROLLED_BACK, lines
    assert ("disable --now", "rigup-dual.service") in systemd.calls
    # Stop the failed variant first (it holds the GPUs), then bring the old one back.
    tail = systemd.calls[systemd.calls.index(("disable --now", "rigup-dual.service")) :]
    assert tail == [
        ("disable --now", "rigup-dual.service"),
        ("enable", "rigup-single.service"),
        ("restart", "rigup-single.service"),
    ]
    assert rig.provenance["variant"] == "single"
    assert rig.provenance["last_rollback"]["failed_variant"] == "dual"


def test_a_pods_record_and_rollback_stay_in_the_pods_own_places(rig, systemd, server):
    good = rig.deploy("dual", MODEL, pod="right")
    assert run_gate(good, systemd)[0] == 0
    record = rig.pod_provenance("right")
    assert (record["pod"], record["variant"], record["unit"], record["generation"]) == ("right", "dual", "rigup-right.service", 1)
    assert not (rig.install_root / "state/provenance.json").exists()  # the host's own record is not the pod's
    assert rig.generations("right") == [1]
    # the pod switches variant and fails its gate: its previous generation comes back in its directory
    bad = rig.deploy("single", "broken", pod="right")
    systemd.restart("rigup-right.service")
    code, lines = run_gate(bad, systemd, timeout=0.3)
    assert code == ctl.EXIT_ROLLED_BACK, lines
    assert ("disable --now", "rigup-right.service") not in systemd.calls  # the pod's unit stays, on the old files
    assert systemd.calls[-1] == ("restart", "rigup-right.service")
    assert "rolling back to pod right generation 1" in "\n".join(lines)
    assert json.loads(good.read_text())["variant"] == "dual"
    record = rig.pod_provenance("right")
    assert record["variant"] == "dual" and record["last_rollback"]["failed_variant"] == "single"
    assert not (rig.install_root / "variants/single").exists()


def test_rollback_that_fails_too_says_so(rig, systemd, server):
    assert run_gate(rig.deploy("dual", MODEL, tag="v1"), systemd)[0] == 0
    bad = rig.deploy("dual", "broken", tag="v2")
    systemd.restart("rigup-dual.service")
    server.behaviour.completion_status = 500  # the old release cannot answer either now
    code, lines = run_gate(bad, systemd, timeout=0.3)
    text = "\n".join(lines)
    assert code == ctl.EXIT_ROLLBACK_FAILED
    assert "rollback to variant dual generation 1 failed too" in text
    assert lines[-1] == f"{ctl.RESULT_MARKER} rollback-failed"
    assert rig.provenance["last_rollback"]["outcome"].startswith("rollback failed")


def test_no_rollback_when_the_failing_release_is_the_last_good_one(rig, systemd, server):
    release = rig.deploy("dual", MODEL)
    assert run_gate(release, systemd)[0] == 0
    server.behaviour.model = None  # the service broke on its own; nothing older to go back to
    code, lines = run_gate(release, systemd, timeout=0.2)
    assert code == ctl.EXIT_FAILED
    assert "nothing older to restore" in "\n".join(lines)
    assert ("restart", "rigup-dual.service") not in systemd.calls


def test_rollback_can_be_disabled(rig, systemd, server):
    assert run_gate(rig.deploy("dual", MODEL, tag="v1"), systemd)[0] == 0
    bad = rig.deploy("dual", "broken", tag="v2")
    systemd.restart("rigup-dual.service")
    code, lines = run_gate(bad, systemd, timeout=0.2, rollback=False)
    assert code == ctl.EXIT_FAILED
    assert "rollback disabled" in "\n".join(lines)
    assert "v2" in (rig.variant_dir("dual") / "compose.yaml").read_text()


# --------------------------------------------------------------------------------------------
# probe (the ServingStatus fact)


def test_probe_reports_serving_and_the_recorded_release(rig, systemd, server):
    assert ctl.probe(str(rig.variant_dir("dual") / "release.json"), systemd) == {"release_present": False, "serving": False}
    release = rig.deploy("dual", MODEL)
    before = ctl.probe(str(release), systemd)
    assert before["serving"] is True and before["models"] == [MODEL]
    assert before["provenance"]["release_sha256"] is None
    run_gate(release, systemd)
    after = ctl.probe(str(release), systemd)
    assert after["provenance"] == {
        "variant": "dual",
        "generation": 1,
        "release_sha256": after["release_sha256"],
        "gate_result": "passed",
        "failed_release_sha256": None,
        "fingerprint": FINGERPRINT,
    }
    server.behaviour.model = "other"
    assert ctl.probe(str(release), systemd)["serving"] is False
    systemd.unit("rigup-dual.service")["ActiveState"] = "inactive"
    stopped = ctl.probe(str(release), systemd)
    assert stopped["active"] == "inactive" and stopped["models"] is None and stopped["serving"] is False


def test_env_file_parsing():
    assert ctl.parse_env_file("/nonexistent") == {}


def test_env_file_values(tmp_path):
    env = tmp_path / ".env"
    env.write_text("# c\n\nA=1\nexport B='two words'\nC=\"x=y\"\nnot a line\n")
    assert ctl.parse_env_file(str(env)) == {"A": "1", "B": "two words", "C": "x=y"}


def test_redactor_hides_long_secrets_only():
    redact = ctl.Redactor(["sk-abcdef123", "abc"])
    assert redact("key sk-abcdef123 and abc") == "key *** and abc"


def test_rollback_that_cannot_restart_says_so(rig, systemd, server):
    assert run_gate(rig.deploy("dual", MODEL, tag="v1"), systemd)[0] == 0
    bad = rig.deploy("dual", "broken", tag="v2")
    systemd.restart("rigup-dual.service")

    def restart(unit: str) -> None:
        raise ctl.subprocess.CalledProcessError(1, ["systemctl", "restart", unit], stderr="Job failed.\n")

    systemd.restart = restart  # type: ignore[method-assign]
    code, lines = run_gate(bad, systemd, timeout=0.2)
    assert code == ctl.EXIT_ROLLBACK_FAILED
    assert "could not be done: Job failed." in "\n".join(lines)
    assert rig.provenance["last_rollback"]["outcome"] == "rollback failed: Job failed."


def test_probe_sees_files_newer_than_the_running_service(rig, systemd, server):
    release = rig.deploy("dual", MODEL)
    systemd.restart("rigup-dual.service")  # started after the files were written
    status = ctl.probe(str(release), systemd)
    assert status["stale"] is False and status["need_daemon_reload"] is False
    assert abs(status["started_at"] - time.time()) < 5
    # A deploy writes new files but is interrupted before restarting: the next probe knows.
    time.sleep(0.01)
    rig.deploy("dual", MODEL, tag="v2")
    assert ctl.probe(str(release), systemd)["stale"] is True
    systemd.restart("rigup-dual.service")
    assert ctl.probe(str(release), systemd)["stale"] is False
    # Not running: never stale (it will be started, not restarted).
    systemd.unit("rigup-dual.service")["ActiveState"] = "inactive"
    rig.deploy("dual", MODEL, tag="v3")
    assert ctl.probe(str(release), systemd)["stale"] is False


def test_probe_reports_a_unit_file_systemd_has_not_loaded(rig, systemd, server):
    release = rig.deploy("dual", MODEL)
    systemd.unit("rigup-dual.service")["NeedDaemonReload"] = "yes"
    assert ctl.probe(str(release), systemd)["need_daemon_reload"] is True
    systemd.unit("rigup-dual.service").update(NeedDaemonReload="no", LoadState="not-found")
    assert ctl.probe(str(release), systemd)["need_daemon_reload"] is True  # the file exists now
    (rig.unit_dir / "rigup-dual.service").unlink()
    assert ctl.probe(str(release), systemd)["need_daemon_reload"] is False


# --------------------------------------------------------------------------------------------
# the probe's GET: plain HTTP/1.0 over a socket, without urllib


def test_list_models_over_plain_http_sends_the_key_and_reads_the_answer(server):
    server.behaviour.api_key = API_KEY
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/models"
    assert ctl.list_models(url, API_KEY) == [MODEL]
    with pytest.raises(ctl.GateFailure, match=r"refused the API key \(HTTP 401\)"):
        ctl.list_models(url, "sk-wrong-key-0123456789")
    server.behaviour.down = True
    with pytest.raises(ctl.GateFailure, match=r"answered HTTP 503"):
        ctl.list_models(url, API_KEY)


@pytest.mark.parametrize("answer, reason", [
    (b"SSH-2.0-OpenSSH_9.2\r\n", "did not answer in HTTP"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "chunked body"),
    (b"", "did not answer in HTTP"),
])
def test_list_models_names_a_server_that_does_not_answer_plain_http(answer: bytes, reason: str):
    import socket

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_once() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    try:
        with pytest.raises(ctl.GateFailure, match=f"unreachable .*{reason}"):
            ctl.list_models(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/models", None, timeout=5)
    finally:
        thread.join(5)
        listener.close()


def test_the_probes_get_imports_no_urllib_request(server):
    # The point of the plain GET: `probe` runs on every converged re-run, and urllib.request (with
    # http.client, email and ssl) is most of its start-up. A fresh interpreter shows what it loads.
    import subprocess
    import sys

    url = f"http://127.0.0.1:{server.server_address[1]}/v1/models"
    script = ("import runpy, sys; ctl = runpy.run_path(sys.argv[1]); print(ctl['list_models'](sys.argv[2], None)); "
              "print(sorted(m for m in ('urllib.request', 'http.client', 'email', 'ssl', 'shutil', 'tempfile') "
              "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script, ctl.__file__, url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"[{MODEL!r}]", "[]"]


def test_a_unit_taken_out_of_service_ends_inactive_not_failed(monkeypatch):
    """On real systemd a crash-looped unit stays "failed" after `disable --now` (the real engine's lineup
    run showed it after a rollback): servingctl resets it."""
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(ctl.subprocess, "run", lambda argv, **kwargs: calls.append(tuple(argv)) or
                        subprocess.CompletedProcess(argv, 0, "", ""))
    ctl.Systemd().disable_now("rigup-single.service")
    assert calls == [("systemctl", "disable", "--now", "rigup-single.service"),
                     ("systemctl", "reset-failed", "rigup-single.service")]
