"""The clients of the entrance verify its certificate (issue 44): `rigup verify` and `bench` with --url https://...
trust the fleet CA's certificate (or --ca-file), never skip the check, and a front whose certificate another CA
issued fails verify with one line naming the CA file it was checked against."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup.cli import main
from rigup.cli.bench import BenchSettings, bench_target
from rigup.client.openai_client import ApiClient
from rigup.client.ssh import RemoteError
from rigup.client.targets import url_ca_file, url_target
from tests.support.json_http import JsonHandler
from tests.support.tls import ServerCert, fleet_certificate, serve_tls

MODEL = "qwen3.6-27b"
KEY = "sk-entrance-tls-test-0123"


class FakeFront(JsonHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/v1/models" and self.headers.get("Authorization") == f"Bearer {KEY}":
            self.reply(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self.reply(401, {"error": {"message": "a valid bearer key is required", "code": 401}})


@pytest.fixture
def front(tmp_path: Path) -> Iterator[tuple[str, ServerCert]]:
    """A front over TLS with the certificate the fleet CA beside tmp_path/rigs.yaml issues (fleet_ca_dir's default)."""
    cert = fleet_certificate(tmp_path / "fleet-ca")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeFront)
    serve_tls(server, cert)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}", cert
    server.shutdown()


def key_file(tmp_path: Path) -> str:
    path = tmp_path / "client.key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return str(path)


def test_the_client_verifies_the_front_against_the_ca_it_is_given(front: tuple[str, ServerCert], tmp_path: Path) -> None:
    url, cert = front
    trusted = ApiClient(url, KEY, str(cert.ca_cert)).models()
    assert trusted.ok and list(trusted.models) == [MODEL]
    other = fleet_certificate(tmp_path / "other-ca").ca_cert
    refused = ApiClient(url, KEY, str(other)).models()
    assert refused.status == 0 and refused.error == f"TLS refused: its certificate is not signed by the CA in {other}"
    unchecked_never = ApiClient(url, KEY).models()  # no CA file: the system's roots, which do not hold the fleet CA
    assert unchecked_never.status == 0 and (unchecked_never.error or "").startswith("TLS refused: ")
    plain = ApiClient(url.replace("https://", "http://"), KEY).models()  # plain HTTP to a TLS port: no answer
    assert plain.status == 0


def test_verify_fails_with_one_line_on_another_cas_certificate(
    front: tuple[str, ServerCert], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = front
    other = fleet_certificate(tmp_path / "other-ca").ca_cert
    code = main(["verify", "--url", url, "--api-key-file", key_file(tmp_path), "--ca-file", str(other), "--json"])
    [host] = json.loads(capsys.readouterr().out)["hosts"]
    assert code == 1 and [(r["check"], r["outcome"]) for r in host["results"]] == [("tls", "fail")]
    assert host["results"][0]["detail"] == f"TLS refused: its certificate is not signed by the CA in {other} ({url})"
    assert main(["verify", "--url", url, "--ca-file", str(tmp_path / "nowhere.crt"), "--quiet"]) == 2
    assert f"--ca-file: {tmp_path / 'nowhere.crt'} does not exist" in capsys.readouterr().err


def test_an_https_url_of_the_fleets_entrance_trusts_its_ca_by_default(
    front: tuple[str, ServerCert], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, cert = front
    port = int(url.rsplit(":", 1)[1])
    fleet = tmp_path / "rigs.yaml"
    fleet.write_text("groups:\n"
                     "  gateway:\n"
                     f"    data: {{gateway_api_key_file: {key_file(tmp_path)}, gateway_port: {port}, serves_variant: false}}\n"
                     "    hosts: {gw-1: {ssh_hostname: 127.0.0.1}}\n")
    monkeypatch.setenv("RIGUP_RIGS", str(fleet))
    assert url_ca_file(url, None) == str(cert.ca_cert)  # the entrance at that address: the fleet CA's
    assert url_ca_file("https://10.9.9.9:4000", None) == str(cert.ca_cert)  # another address: the fleet CA's too
    assert url_ca_file("http://127.0.0.1:8000", None) is None  # plain HTTP (a pod): nothing to verify
    with pytest.raises(RemoteError, match="does not exist"):
        url_ca_file(url, str(tmp_path / "nowhere.crt"))
    target = url_target(url, key_file(tmp_path))
    assert target.ca_file == str(cert.ca_cert)
    # bench through it: the front's certificate checked, its models read
    document = bench_target(target, BenchSettings(prompts=(), warmups=0, runs=0), None, None, quiet=True)
    assert document["error"] is None and document["model"] == MODEL
    other = fleet_certificate(tmp_path / "other-ca").ca_cert
    refused = bench_target(url_target(url, key_file(tmp_path), str(other)), BenchSettings(prompts=(), warmups=0, runs=0),
                           None, None, quiet=True)
    assert refused["error"] == f"GET /v1/models: no response (TLS refused: its certificate is not signed by the CA in {other})"
