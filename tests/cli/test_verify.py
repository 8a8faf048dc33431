"""rigup verify: every check passes against a healthy responder and fails (or skips) exactly when the
responder is put in the matching failing mode."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rigup.checks.verify import CheckResult
from rigup.cli import verify as V
from rigup.client.openai_client import ApiClient
from rigup.client.ssh import FileLog, RemoteError
from tests.support.responder import MODEL, responder


def context(url: str, log_file: Path | None = None, **changes: object) -> V.Context:
    options = V.VerifyOptions(mtp_wait_s=3.0, seed=7)
    ctx = V.Context(
        client=ApiClient(url),
        model=MODEL,
        max_model_len=None,
        log=FileLog(str(log_file)) if log_file is not None else None,
        gpus=None,
        options=options,
        rng=random.Random(7),
        expects_patches=True,
        speculative="mtp",
    )
    for key, value in changes.items():
        setattr(ctx, key, value)
    return ctx


def outcomes(results: list[CheckResult]) -> dict[str, str]:
    return {r.check: r.outcome for r in results}


# --------------------------------------------------------------------------------------------
# pure helpers (the verdicts' own are in tests/checks/test_verify.py)


def test_needle_prompt_places_the_secret_at_half_depth() -> None:
    prompt = V.needle_prompt(150, "blue otter 42")
    at = prompt.index("blue otter 42")
    assert 0.45 < at / len(prompt) < 0.55
    assert 9_000 < len(prompt) / 4 < 11_000  # the seeds' scale 150 is ~10K tokens


def test_ceiling_rungs_follow_the_seed_ladder() -> None:
    assert V.ceiling_rungs(262144, 95000, 30000, 0.92) == [95000, 125000, 155000, 185000, 215000]
    assert V.ceiling_rungs(65536, 95000, 30000, 0.92) == []


def test_skip_names_families_and_seed_aliases() -> None:
    skip = frozenset({"needle", "tools"})
    assert V.skipped("needle-90k", skip) and V.skipped("tool-call", skip) and V.skipped("streaming-tool-call", skip)
    assert not V.skipped("tool-prefill", skip) and not V.skipped("models", skip)
    assert V.skipped("tool-prefill", frozenset({"tool_prefill"}))


# --------------------------------------------------------------------------------------------
# against the responder


def test_every_full_check_passes_on_a_healthy_server(tmp_path: Path) -> None:
    with responder(tmp_path, "--max-model-len", "262144", "--startup-log", "[Genesis] applied: 14 patches") as server:
        ctx = context(server.url, server.log_file, options=V.VerifyOptions(suite="full", mtp_wait_s=3.0))
        results = V.run_checks(ctx)
    assert outcomes(results) == {
        "models": "pass", "patches": "pass", "completion": "pass", "tool-call": "pass", "streaming": "pass",
        "streaming-tool-call": "pass", "thinking": "pass", "needle-10k": "pass", "needle-30k": "pass",
        "needle-60k": "pass", "needle-90k": "pass", "tool-prefill": "pass", "output-quality": "pass", "mtp": "pass",
    }
    assert ctx.max_model_len == 262144  # learnt from /v1/models
    mtp = next(r for r in results if r.check == "mtp")
    assert mtp.data["acceptance_length"] == 3.40


def test_every_stress_probe_passes_and_the_ceiling_climbs(tmp_path: Path) -> None:
    with responder(tmp_path, "--max-model-len", "200000") as server:
        ctx = context(server.url, options=V.VerifyOptions(suite="stress"))
        ctx.gpus = lambda: [(20000, 24576), (19000, 24576)]
        results = V.run_checks(ctx)
    assert outcomes(results) == {
        "models": "pass", "needle-10k": "pass", "needle-30k": "pass", "tool-prefill": "pass", "ide-agent": "pass",
        "multi-turn-agent": "pass", "lcb-coding": "pass", "reasoning-heavy": "pass", "needle-60k": "pass",
        "needle-90k": "pass", "ceiling-95k": "pass", "ceiling-125k": "pass", "ceiling-155k": "pass",
    }
    rung = next(r for r in results if r.check == "ceiling-95k")
    assert rung.data["min_free_mib"] == 4576 and rung.data["prompt_tokens"] > 90000


def test_over_length_needles_are_skipped_not_failed(tmp_path: Path) -> None:
    with responder(tmp_path, "--max-model-len", "40000") as server:
        ctx = context(server.url)
        V.check_models(ctx)
        results = [V.check_needle(ctx, rung) for rung in ("10k", "30k", "60k", "90k")]
    assert [r.outcome for r in results] == ["pass", "pass", "skip", "skip"]
    assert "over max_model_len (40000)" in results[2].detail


def test_out_of_memory_on_long_prompts_fails_prefill_needles_and_ceiling(tmp_path: Path) -> None:
    with responder(tmp_path, "--max-model-len", "200000", "--oom-above-tokens", "20000") as server:
        ctx = context(server.url)
        V.check_models(ctx)
        assert V.check_needle(ctx, "10k").outcome == "pass"
        needle = V.check_needle(ctx, "30k")
        prefill = V.check_tool_prefill(ctx)
        ceiling = V.check_ceiling(ctx)
    assert needle.outcome == "fail" and "HTTP 500" in needle.detail and "out of memory" in needle.detail
    assert prefill.outcome == "fail" and "HTTP 500" in prefill.detail
    assert [(r.check, r.outcome) for r in ceiling] == [("ceiling-95k", "fail")]  # stops at the first failure


def test_ceiling_warns_when_vram_margin_is_thin(tmp_path: Path) -> None:
    with responder(tmp_path, "--max-model-len", "110000") as server:
        ctx = context(server.url, max_model_len=110000)
        ctx.gpus = lambda: [(24000, 24576)]
        results = V.check_ceiling(ctx)
    assert [(r.check, r.outcome) for r in results] == [("ceiling-95k", "warn")]
    assert "576 MiB free" in results[0].detail


def test_inlined_tool_calls_fail_both_tool_checks(tmp_path: Path) -> None:
    with responder(tmp_path, "--inline-tool-calls") as server:
        ctx = context(server.url)
        plain, streamed = V.check_tool_call(ctx), V.check_streaming_tool_call(ctx)
    for result in (plain, streamed):
        assert result.outcome == "fail" and "inlined in content" in result.detail


def test_missing_reasoning_fails_thinking(tmp_path: Path) -> None:
    with responder(tmp_path, "--no-reasoning") as server:
        result = V.check_thinking(context(server.url))
    assert result.outcome == "fail" and "reasoning missing" in result.detail


def test_thinking_that_uses_the_whole_budget_still_passes(tmp_path: Path) -> None:
    with responder(tmp_path, "--reasoning-tokens", "5000") as server:
        result = V.check_thinking(context(server.url))
    assert result.outcome == "pass"


def test_cascade_fails_output_quality_but_not_short_answers(tmp_path: Path) -> None:
    with responder(tmp_path, "--cascade") as server:
        ctx = context(server.url)
        quality, completion = V.check_output_quality(ctx), V.check_completion(ctx)
    assert quality.outcome == "fail" and "repeats" in quality.detail and "lexical variety" in quality.detail
    assert completion.outcome == "pass"


def test_streaming_needs_several_chunks(tmp_path: Path) -> None:
    with responder(tmp_path, "--tokens-per-chunk", "64") as server:
        result = V.check_streaming(context(server.url))
    assert result.outcome == "fail" and "1 content chunks" in result.detail


def test_reasoning_heavy_fails_on_short_generations(tmp_path: Path) -> None:
    with responder(tmp_path, "--eos-after", "100", "--reasoning-tokens", "50") as server:
        result = V.check_reasoning_heavy(context(server.url))
    assert result.outcome == "fail" and "< 500" in result.detail


@pytest.mark.parametrize(
    ("flags", "outcome", "detail"),
    [
        (("--acceptance-length", "1.5"), "fail", "1.50 < 2.0"),
        (("--acceptance-length", "0"), "skip", "no SpecDecoding metrics"),
    ],
)
def test_mtp_acceptance_length_gate(tmp_path: Path, flags: tuple[str, ...], outcome: str, detail: str) -> None:
    with responder(tmp_path, *flags) as server:
        result = V.check_mtp(context(server.url, server.log_file, options=V.VerifyOptions(mtp_wait_s=1.0)))
    assert result.outcome == outcome and detail in result.detail


def test_mtp_skips_without_speculative_decoding_or_log(tmp_path: Path) -> None:
    with responder(tmp_path) as server:
        assert V.check_mtp(context(server.url, server.log_file, speculative=None)).outcome == "skip"

        class Unreachable:
            def grep(self, pattern: str, lines: int) -> list[str]:
                raise RemoteError("ssh rig-01: timed out")

            def tail(self, lines: int) -> list[str]:
                raise RemoteError("ssh rig-01: timed out")

        result = V.check_mtp(context(server.url, log=Unreachable()))
    assert result.outcome == "skip" and "timed out" in result.detail


@pytest.mark.parametrize(
    ("startup", "expects", "outcome"),
    [
        (("[Genesis] FAILED: P64 could not apply",), True, "fail"),
        (("[Genesis] applied: 14 patches", "[Genesis] apply_all elapsed 2.1s"), True, "pass"),
        ((), True, "warn"),
        ((), False, "skip"),
    ],
)
def test_patch_markers(tmp_path: Path, startup: tuple[str, ...], expects: bool, outcome: str) -> None:
    flags = [arg for line in startup for arg in ("--startup-log", line)]
    with responder(tmp_path, *flags) as server:
        result = V.check_patches(context(server.url, server.log_file, expects_patches=expects))
    assert result.outcome == outcome


def test_wrong_model_or_server_errors_fail(tmp_path: Path) -> None:
    with responder(tmp_path, model="another-model") as server:
        assert "not served" in V.check_models(context(server.url)).detail
    with responder(tmp_path, "--fail-status", "500") as server:
        ctx = context(server.url)
        assert V.check_models(ctx).outcome == "pass"
        completion = V.check_completion(ctx)
    assert completion.outcome == "fail" and completion.detail.startswith("HTTP 500")


def test_nothing_runs_past_a_dead_api(tmp_path: Path) -> None:
    with responder(tmp_path) as server:
        url = server.url
    results = V.run_checks(context(url))
    assert results[0].outcome == "fail" and "connection refused" in results[0].detail
    assert {r.outcome for r in results[1:]} == {"skip"}


def test_cli_exit_code_counts_failures_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rigup.cli import main

    with responder(tmp_path, "--cascade", "--inline-tool-calls", "--max-model-len", "50000") as server:
        code = main(["verify", "--full", "--url", server.url, "--log-file", str(server.log_file), "--json"])
    report = json.loads(capsys.readouterr().out)
    host = report["hosts"][0]
    failed = sorted(r["check"] for r in host["results"] if r["outcome"] == "fail")
    assert failed == ["output-quality", "streaming-tool-call", "tool-call"]
    assert code == 3 == report["failed"] == host["failed"]
    assert {r["check"]: r["outcome"] for r in host["results"]}["needle-90k"] == "skip"


def test_cli_table_and_api_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rigup.cli import main

    key_file = tmp_path / "key"
    key_file.write_text("sk-verify-key\n")
    key_file.chmod(0o600)
    with responder(tmp_path, "--api-key", "sk-verify-key") as server:
        assert main(["verify", "--url", server.url, "--quiet"]) == 1  # models: 401
        capsys.readouterr()
        code = main(["verify", "--url", server.url, "--api-key-file", str(key_file), "--quiet"])
    table = capsys.readouterr().out
    assert code == 0
    assert "tool-call" in table and "PASS" in table and "0 check(s) failed" in table
    assert "sk-verify-key" not in table


def test_fleet_hosts_are_checked_with_their_recipe_and_ssh_skips_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet host's API is http://<ssh_hostname>:<recipe port>, with the key from serving_api_key_file;
    the service log comes over SSH, and a rig whose SSH is closed skips the log checks, not fails them."""
    import socket

    from rigup.cli import main
    from rigup.desired.knobs import load_defaults
    from rigup.desired.recipe import resolve

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    ssh_port = closed.getsockname()[1]  # bound, never listening: connection refused
    key_file = tmp_path / "api.key"
    key_file.write_text("sk-fleet-key\n")
    key_file.chmod(0o600)
    served = resolve({**load_defaults(), "variant": "dual"}).served_model_name
    with responder(tmp_path, "--api-key", "sk-fleet-key", "--max-model-len", "50000", model=served) as server:
        port = int(server.url.rsplit(":", 1)[1])
        fleet = tmp_path / "rigs.yaml"
        fleet.write_text(
            "groups:\n  canary:\n    hosts:\n"
            f"      rig-01: {{ssh_hostname: 127.0.0.1, ssh_port: {ssh_port}, variant: dual,"
            f" serving_api_key_file: {key_file}, variant_overrides: {{port: {port}}}}}\n"
            "      rig-02: {ssh_hostname: 127.0.0.1, variant: dual}\n"
        )
        monkeypatch.setenv("RIGUP_RIGS", str(fleet))
        code = main(["verify", "--full", "--limit", "rig-01", "--json", "--skip", "longctx", "--skip", "tool-prefill"])
    closed.close()
    report = json.loads(capsys.readouterr().out)
    assert [h["host"] for h in report["hosts"]] == ["rig-01"]
    host = report["hosts"][0]
    assert host["url"] == f"http://127.0.0.1:{port}" and host["variant"] == "dual" and host["model"] == served
    results = {r["check"]: r for r in host["results"]}
    assert results["models"]["outcome"] == "pass"
    assert results["mtp"]["outcome"] == "skip" and "connection refused" in results["mtp"]["detail"]
    assert results["needle-10k"]["outcome"] == "skip" and results["tool-prefill"]["detail"] == "skipped (--skip)"
    assert code == 0 == report["failed"]
    monkeypatch.setenv("RIGUP_RIGS", str(fleet))
    assert main(["verify", "--limit", "rig-09"]) == 2  # an unknown host is a usage error


def test_a_crash_on_long_prompts_fails_the_needle_as_no_response(tmp_path: Path) -> None:
    with responder(tmp_path, "--max-model-len", "200000", "--crash-above-tokens", "50000") as server:
        ctx = context(server.url)
        assert V.check_needle(ctx, "30k").outcome == "pass"
        result = V.check_needle(ctx, "60k")
    assert result.outcome == "fail" and result.detail.startswith("no response: timeout or server crash")


def test_requests_carry_the_recipes_chat_request_fields(tmp_path: Path) -> None:
    """Every request to a vLLM-Omni rig carries "modalities": ["text"] (the catalog's chat_request, as the
    health gate's does); a variant without chat_request sends none, and a bare URL knows of none."""
    import http.server
    import threading

    from rigup.client.targets import Target
    from rigup.desired.knobs import load_defaults
    from rigup.desired.recipe import resolve

    bodies: list[dict[str, object]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def reply(self, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self.reply({"object": "list", "data": [{"id": served, "object": "model", "max_model_len": 65536}]})

        def do_POST(self) -> None:  # noqa: N802
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.reply({"choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris is sunny today."},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for variant, expected in (("qwen-omni-dual-autoround-int4-omni", ["text"]), ("dual", None)):
            recipe = resolve({**load_defaults(), "variant": variant})
            served = recipe.served_model_name
            bodies.clear()
            V.verify_target(Target("rig-01", url, recipe=recipe), V.VerifyOptions(), quiet=True)
            assert len(bodies) >= 2  # completion and tool call
            assert all(b.get("modalities") == expected and b["model"] == served for b in bodies), bodies
        bodies.clear()
        V.verify_target(Target(url, url), V.VerifyOptions(), quiet=True)
        assert bodies and all("modalities" not in b for b in bodies)
    finally:
        server.shutdown()
        server.server_close()


def test_models_through_a_gateway_that_states_no_max_model_len_says_so_not_none() -> None:
    """LiteLLM's /v1/models lists a route's model without vLLM's max_model_len: verify through the
    gateway printed "qwen (max_model_len None)"; it says where the long checks' length comes from."""
    import http.server
    import threading

    class Gateway(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            data = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "openai"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        bare = V.check_models(context(url))
        from_recipe = V.check_models(context(url, max_model_len=65536))
    finally:
        server.shutdown()
        server.server_close()
    assert bare.outcome == from_recipe.outcome == "pass"
    assert "None" not in bare.detail and "None" not in from_recipe.detail
    assert bare.detail == f"{MODEL} (/v1/models states no max_model_len; the context-ceiling ladder is skipped)"
    assert from_recipe.detail == f"{MODEL} (/v1/models states no max_model_len; the recipe's 65536 is used)"
