"""The gateway venv's pip command (rigup/operations/gateway.py): by default pip's own configured index
(pip.conf, PIP_INDEX_URL on the gateway host), an explicit gateway_pip_index_url when one is set. Run
through pyinfra's API on a @fake host whose venv is not built yet."""

from __future__ import annotations

import shlex
from typing import Any

from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

from rigup.desired.gateway import gateway_plan
from rigup.desired.knobs import load_defaults
from rigup.operations.gateway import gateway_venv

VENV = "/opt/rigup/gateway/venv-abc"
REQUIREMENTS = "/opt/rigup/gateway/requirements.txt"
MARKER = ".rigup-installed"  # VenvComplete's fact reads it: no answer, so the venv is (re)built


def pip_words(index_url: str | None) -> list[str]:
    """The words of the pip install the operation runs for `index_url` (the operation's one change)."""
    inventory = Inventory((["@fake/gw"], {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": {}}))
    state = State(inventory=inventory, config=Config())
    connect_all(state)
    host = inventory.get_host("@fake/gw")
    add_op(state, gateway_venv, name="gateway venv", venv=VENV, requirements=REQUIREMENTS,
           requirements_sha256="abc", index_url=index_url)
    before = len(host.connector.executed_commands)
    run_ops(state)
    disconnect_all(state)
    builds = [c for c in host.connector.executed_commands[before:] if "bin/pip" in c and "install" in c]
    assert len(builds) == 1, host.connector.executed_commands[before:]
    # the command runs as `sh -c '...'` (through sudo): split it twice to get pip's own words
    outer = shlex.split(builds[0])
    inner = shlex.split(outer[-1]) if outer[-2:-1] == ["-c"] else outer
    start = inner.index(f"{VENV}/bin/pip")
    return inner[start:inner.index("&&", start)]


def test_by_default_pip_uses_its_own_configured_index() -> None:
    words = pip_words(None)
    assert words[:2] == [f"{VENV}/bin/pip", "install"]
    assert "--require-hashes" in words and "--no-deps" in words and words[-2:] == ["-r", REQUIREMENTS]
    assert not any(w.startswith(("--index-url", "-i", "--trusted-host", "--extra-index-url")) for w in words)


def test_an_explicit_index_is_passed_as_pip_takes_it() -> None:
    words = pip_words("https://mirror.lan/pypi/simple")
    assert words[words.index("--index-url") + 1] == "https://mirror.lan/pypi/simple"
    assert "--trusted-host" not in words  # https needs no trust


def test_a_plain_http_index_is_trusted_by_host() -> None:
    words = pip_words("http://10.213.0.1:8083/simple")  # what the test bed's hub serves
    assert words[words.index("--index-url") + 1] == "http://10.213.0.1:8083/simple"
    assert words[words.index("--trusted-host") + 1] == "10.213.0.1"


def test_the_plan_carries_no_index_unless_the_knob_sets_one(tmp_path: Any) -> None:
    key = tmp_path / "gateway.key"
    key.write_text("sk-gateway\n")
    key.chmod(0o600)
    data = {**load_defaults(), "serves_variant": False, "gateway_api_key_file": str(key)}
    assert load_defaults()["gateway_pip_index_url"] is None
    plan = gateway_plan("gw", data, ["gateway"], [("gw", data)])
    assert plan is not None and plan.pip_index_url is None
    data["gateway_pip_index_url"] = "https://mirror.lan/simple"
    plan = gateway_plan("gw", data, ["gateway"], [("gw", data)])
    assert plan is not None and plan.pip_index_url == "https://mirror.lan/simple"
