#!/usr/bin/env python3
"""rigup-servingctl: the rig-side half of rigup's serving task.

tasks/serving.py uploads this file to {install_root}/bin/rigup-servingctl and runs it as root over SSH.
It needs only Python 3.8+ and its standard library (Ubuntu 22.04/24.04 ship 3.10/3.12), because the
rig has nothing else we can count on. Commands:

  probe    one quick look at a variant: unit state, whether its files changed after the service
           started, whether /v1/models lists the served model, and the release the provenance file
           records. Prints one JSON object (the ServingStatus fact).
  gate     the health gate: wait until /v1/models lists the served model, then one short
           deterministic chat completion (plus the release's chat_request fields, which some servers
           need in every request), then the probes (PROBES: fixed questions with checkable answers,
           judged by club-3090's degenerate-output rules and their known answers; the release's
           gate_probes names them; docs/sentinel.md). On success: record the generation (a copy of the files
           that passed) and write the provenance file. On failure: print the unit's last log lines
           and, when the last good generation differs, roll back to it, restart it and gate it again.
           With --hold (a cluster member: every member passes or none is recorded) it neither
           records nor rolls back: the control machine decides once every member's gate ended.
  rollback restore the last good generation, restart it and gate it (a cluster member whose release
           passed or not, when another member's gate failed: the cluster rolls back as one unit).
  supersede  a converge found the pod asked for the release it serves, not the one whose failed gate
           the last rollback records: mark that failure superseded (the fleet no longer asks for it).
  revalidate a converge found the rig's fingerprint (GPUs, PCI topology, driver, module, kernel, BIOS)
           differs from the one the pod's last passed gate recorded: remove vLLM's P2P access cache,
           restart the pod and gate it with every probe of its release (no rollback); a pod whose record
           has none gets today's recorded. With --member (a cluster member, whose cluster gates as one):
           remove the cache and restart the member only; the cluster's gate that follows asks every probe
           through the head and records the new fingerprint when every member passed.
  sentinel one round of the continuous sentinel (a timer runs it): every serving pod asked the probes
           directly; failed and passed rounds in a row counted in its sentinel.json, which quarantines
           and releases it; the results as a textfile for node_exporter (docs/sentinel.md).
  textfile rigup's facts for node_exporter's textfile collector, written atomically (a timer runs it,
           and `gate` after every result): per pod the release it serves, its generation, the last
           gate's result and time, whether the fleet still asks for a release that failed its gate,
           its rollbacks, its pinned commits and whether its release file still is the one that
           passed; the NVIDIA driver branch loaded and wanted; the filesystem holding the models.

Files (all under {install_root}):
  variants/<pod>/release.json             what the control machine wants to run (written by pyinfra; a
                                          host without pods has one pod, named after its variant)
  variants/<pod>/generations/<n>/         files of a release that passed the gate (n grows by one)
  state/provenance.json                   what this rig runs and when it last passed the gate (a listed
                                          pod's: state/pods/<pod>/provenance.json)

Exit codes of `gate` and `rollback`: 0 passed (gate, recorded or held); 1 failed, nothing to roll back
to; 2 failed and rolled back to the last good generation (which passed the gate again); 3 failed and the
rollback failed too.
Secrets (the values of the release's secret files, and of the secret .env keys of a release written before them)
are never printed: log lines are redacted.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

# shutil, tempfile and urllib.request are imported where a write, a generation or a POST needs them:
# `probe`, which every converged re-run runs, needs none of them (urllib.request alone is 25 ms of its start).

SCHEMA = 1
PROVENANCE_NAME = "provenance.json"
RELEASE_NAME = "release.json"
GENERATIONS_DIR = "generations"
UNIT_COPY_NAME = "unit.service"  # the unit file's copy inside a generation
RESULT_MARKER = "RIGUP-GATE-RESULT:"  # last line of `gate`; rigup.cli.rollout reads it from the output

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_ROLLED_BACK = 2
EXIT_ROLLBACK_FAILED = 3

POLL_S = 2.0
HTTP_TIMEOUT_S = 5.0
COMPLETION_TIMEOUT_S = 120.0
CRASH_RESTARTS = 3  # the unit restarted this often during one gate: a crash loop, stop waiting
DEAD_POLLS = 3  # consecutive polls with the unit inactive/failed: it is not coming up
JOURNAL_LINES = 40
# How far back the gate looks for the log's last error: every line since the gate began, up to this many. A
# cluster's head restarts every minute or more while its rendezvous fails, and the next start's Ray output
# buries the last start's error under more than JOURNAL_LINES lines by the time the gate gives up.
ERROR_SCAN_LINES = 5000
# The completion the gate asks for: greedy decoding with a fixed seed, a few tokens, no thinking.
GATE_PROMPT = "Reply with the single word OK."
GATE_MAX_TOKENS = 8
# Request fields the gate sets itself; a release's chat_request (fields a variant's server needs in every
# chat request, from the catalog) may add others but never these (rigup.desired.catalog checks it).
GATE_REQUEST_KEYS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed",
                               "chat_template_kwargs", "stream", "n", "tools", "tool_choice"})


class GateFailure(Exception):
    """The service did not pass the health gate; the message says why, in one line."""


# ----------------------------------------------------------------------------------------------
# small helpers


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as handle:
            return sha256_bytes(handle.read())
    except FileNotFoundError:
        return None


def read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, "rb") as handle:
            value = json.loads(handle.read().decode())
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # a torn or hand-edited file: treat as absent rather than crash the gate
    return value if isinstance(value, dict) else None


def atomic_write(path: str, data: bytes, mode: int) -> None:
    """Write `data` to `path` through a temporary file in the same directory (never half-written)."""
    import tempfile  # here, not at the top: see the note below the imports

    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".rigup-", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def parse_env_file(path: str) -> Dict[str, str]:
    """KEY=VALUE lines of a compose .env file (comments and blank lines skipped, quotes removed)."""
    values: Dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return values
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key = key.strip()
        if key.startswith("export "):
            key = key[len("export ") :].strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in ("'", '"'):
            value = value[1:-1]
        values[key] = value
    return values


class Redactor:
    """Replaces secret values in text that is about to be printed."""

    def __init__(self, secrets: List[str]) -> None:
        # Longest first, so a secret that contains another is hidden whole. Short values are not
        # secrets worth hiding (and would mangle every line).
        self.secrets = sorted({s for s in secrets if len(s) >= 6}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


# ----------------------------------------------------------------------------------------------
# the release: what pyinfra wants this pod to run (variants/<pod>/release.json)


class Release:
    """A parsed release.json. Written by rigup.desired.release.build_release on the control machine."""

    def __init__(self, data: Dict[str, Any], path: str) -> None:
        self.data = data
        self.path = path
        self.sha256 = sha256_file(path) or ""
        try:
            self.variant = str(data["variant"])
            # A listed pod (rigup.desired.pods) names its directory and keeps its record in its own
            # state directory; a host without pods has neither key (the pod is the variant).
            self.pod: Optional[str] = str(data["pod"]) if data.get("pod") else None
            self.own_state_dir: Optional[str] = str(data["state_dir"]) if data.get("state_dir") else None
            self.unit = str(data["unit"])
            self.unit_file = str(data["unit_file"])
            self.variant_dir = str(data["variant_dir"])
            self.install_root = str(data["install_root"])
            self.health_url = str(data["health_url"])
            self.served_model_name = str(data["served_model_name"])
            self.env_file = str(data["env_file"])
            self.api_key_env = data.get("api_key_env")  # None: the API is open
            self.secret_env_keys = [str(k) for k in data.get("secret_env_keys", [])]
            self.files = dict(data["files"])  # relpath under variant_dir -> sha256
            # secret name -> relpath under variant_dir of its 0600 file (no hash in the release); a release
            # written before them carried its secrets as .env lines (secret_env_keys)
            self.secret_files = {str(k): str(v) for k, v in dict(data.get("secret_files") or {}).items()}
            # Fields every chat request to this server must carry (absent: none); the gate adds them.
            chat_request = data.get("chat_request") or {}
            if not isinstance(chat_request, dict):
                raise TypeError("chat_request is not a JSON object")
            self.chat_request: Dict[str, Any] = dict(chat_request)
            # The probes the gate asks (the catalog's gate_probes; absent: every one, as for a release
            # written before the probes existed).
            probes = data.get("gate_probes", list(PROBE_NAMES))
            if not isinstance(probes, list):
                raise TypeError("gate_probes is not a list")
            self.gate_probes: List[str] = [str(p) for p in probes]
        except (KeyError, TypeError, ValueError) as exc:
            raise SystemExit(f"rigup: {path} is not a rigup release file ({exc})") from None
        unknown = sorted(set(self.gate_probes) - set(PROBE_NAMES))
        if unknown:
            raise SystemExit(f"rigup: {path}: gate_probes names {unknown}, not probes of this servingctl "
                             f"({', '.join(PROBE_NAMES)})")
        clash = sorted(set(self.chat_request) & GATE_REQUEST_KEYS)
        if clash:
            raise SystemExit(f"rigup: {path}: chat_request sets {clash}, which the health gate sets itself")

    @classmethod
    def load(cls, path: str) -> "Release":
        data = read_json(path)
        if data is None:
            raise SystemExit(f"rigup: release file {path} is missing or not JSON")
        return cls(data, path)

    @property
    def models_url(self) -> str:
        return self.health_url

    @property
    def base_url(self) -> str:
        url = self.health_url
        suffix = "/v1/models"
        return url[: -len(suffix)] if url.endswith(suffix) else url.rstrip("/")

    def env(self) -> Dict[str, str]:
        return parse_env_file(self.env_file)

    @property
    def kept_files(self) -> List[str]:
        """Relpaths of every file of the release under variant_dir: the rendered files and the secret files."""
        return sorted(self.files) + sorted(self.secret_files.values())

    def secret(self, name: str) -> Optional[str]:
        """Secret `name` from its file (stripped); None when the release has none or the file is not there."""
        if name not in self.secret_files:
            return None
        try:
            with open(os.path.join(self.variant_dir, self.secret_files[name]), encoding="utf-8") as handle:
                return handle.read().strip() or None
        except FileNotFoundError:
            return None

    def api_key(self) -> Optional[str]:
        if not self.api_key_env:
            return None
        if str(self.api_key_env) in self.secret_files:
            return self.secret(str(self.api_key_env))
        key = self.env().get(str(self.api_key_env))  # a release written before the secret files
        return key or None

    def redactor(self) -> Redactor:
        env = self.env()
        return Redactor([env[k] for k in self.secret_env_keys if env.get(k)]
                        + [v for v in (self.secret(n) for n in self.secret_files) if v])

    @property
    def generations_dir(self) -> str:
        return os.path.join(self.variant_dir, GENERATIONS_DIR)

    @property
    def name(self) -> str:
        """The directory name under variants/: the pod's, else the variant's."""
        return self.pod or self.variant

    @property
    def state_dir(self) -> str:
        return self.own_state_dir or os.path.join(self.install_root, "state")

    @property
    def provenance_path(self) -> str:
        return os.path.join(self.state_dir, PROVENANCE_NAME)


# ----------------------------------------------------------------------------------------------
# systemd (a class so the unit tests can substitute a fake)


class Systemd:
    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["systemctl", *args], check=check, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def show(self, unit: str) -> Dict[str, str]:
        props = (
            "ActiveState", "SubState", "NRestarts", "Result", "UnitFileState", "LoadState",
            "NeedDaemonReload", "ExecMainStartTimestamp", "ExecMainStartTimestampMonotonic",
        )
        out = self._run("show", unit, *[f"--property={p}" for p in props], check=False).stdout
        values: Dict[str, str] = {}
        for line in out.splitlines():
            key, _, value = line.partition("=")
            values[key] = value
        return values

    def restart(self, unit: str) -> None:
        # A crash loop can leave the unit at its start limit (StartLimitBurst); restart would refuse.
        # (Fails harmlessly on a unit systemd has not loaded: nothing to reset then.)
        self._run("reset-failed", unit, check=False)
        self._run("restart", unit)

    def enable(self, unit: str) -> None:
        self._run("enable", unit)

    def disable_now(self, unit: str) -> None:
        self._run("disable", "--now", unit)
        # A unit that crashed stays "failed" after the stop; taken out of service it ends inactive, so
        # `systemctl --failed` and the fleet's alerts name only units that should run and do not.
        self._run("reset-failed", unit, check=False)

    def daemon_reload(self) -> None:
        self._run("daemon-reload")

    def journal_tail(self, unit: str, lines: int, since: Optional[float] = None) -> List[str]:
        """The unit's last `lines` journal lines; with `since` (seconds since the epoch), only those logged since."""
        window = ["--since", f"@{int(since)}"] if since is not None else []
        proc = subprocess.run(
            ["journalctl", "-u", unit, "-n", str(lines), *window, "--no-pager", "-o", "short-iso"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        return proc.stdout.splitlines()[-lines:]


# ----------------------------------------------------------------------------------------------
# HTTP checks against the OpenAI-compatible API


def _request(url: str, api_key: Optional[str], body: Optional[Dict[str, Any]], timeout: float) -> Tuple[int, Any]:
    """(HTTP status, JSON body or None). Raises OSError (urllib's URLError is one) when there is no answer."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if body is None and url.startswith("http://"):
        status, payload = _plain_get(url, headers, timeout)
    else:
        # here, not at the top: see the note below the imports
        import urllib.error
        import urllib.request

        request = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status = response.status
                payload = response.read()
        except urllib.error.HTTPError as exc:
            status = exc.code
            payload = exc.read()
    try:
        parsed = json.loads(payload.decode() or "null")
    except ValueError:
        parsed = None
    return status, parsed


def _plain_get(url: str, headers: Dict[str, str], timeout: float) -> Tuple[int, bytes]:
    """A GET of an http:// URL as HTTP/1.0 (the server answers and closes, no chunked body): what the
    probe asks of the local server, without urllib's start-up cost. Raises OSError without an answer."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise OSError(f"no host in {url}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    request = [f"GET {target} HTTP/1.0", f"Host: {parts.netloc}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    chunks = []
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout) as sock:
        sock.sendall("\r\n".join(request).encode("latin-1"))
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    head, sep, body = b"".join(chunks).partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status_line) < 2 or not status_line[0].startswith(b"HTTP/") or not status_line[1].isdigit():
        raise OSError(f"{parts.netloc} did not answer in HTTP")
    if b"transfer-encoding: chunked" in head.lower():
        raise OSError(f"{parts.netloc} sent a chunked body to an HTTP/1.0 request")
    return int(status_line[1]), body


def list_models(models_url: str, api_key: Optional[str], timeout: float = HTTP_TIMEOUT_S) -> List[str]:
    """Model ids /v1/models lists. Raises GateFailure with a one-line reason when it cannot answer."""
    try:
        status, payload = _request(models_url, api_key, None, timeout)
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        raise GateFailure(f"{models_url} unreachable ({reason})") from None
    if status in (401, 403):
        raise GateFailure(f"{models_url} refused the API key (HTTP {status})")
    if status != 200:
        raise GateFailure(f"{models_url} answered HTTP {status}")
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise GateFailure(f"{models_url} answered without a model list")
    return [str(item.get("id")) for item in data if isinstance(item, dict) and "id" in item]


def chat_completion(
    base_url: str, model: str, api_key: Optional[str], timeout: float, extra: Optional[Dict[str, Any]] = None,
    messages: Optional[List[Dict[str, Any]]] = None, max_tokens: int = GATE_MAX_TOKENS,
    fields: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """One greedy, seeded, short chat completion. Returns a summary; raises GateFailure.

    + extra: fields the variant's server needs in every chat request (the release's chat_request, e.g.
      vLLM-Omni's "modalities": ["text"]); the gate's own fields (GATE_REQUEST_KEYS) are not among them
    + messages, max_tokens, fields: a probe's conversation, budget and own request fields (its tools);
      without them the one-word readiness prompt
    """
    url = f"{base_url}/v1/chat/completions"
    body = {
        **(extra or {}),
        **(fields or {}),
        "model": model,
        "messages": messages or [{"role": "user", "content": GATE_PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        # Qwen3-style templates would otherwise spend the few tokens on a thinking block.
        "chat_template_kwargs": {"enable_thinking": False},
    }
    started = time.monotonic()
    try:
        status, payload = _request(url, api_key, body, timeout)
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        raise GateFailure(f"chat completion failed: {url} unreachable ({reason})") from None
    if status != 200:
        detail = ""
        if isinstance(payload, dict):
            err = payload.get("error") or payload.get("message") or payload.get("detail")
            if isinstance(err, dict):
                err = err.get("message")
            if err:
                detail = f": {str(err)[:200]}"
        raise GateFailure(f"chat completion answered HTTP {status}{detail}")
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise GateFailure("chat completion answered without choices")
    message = choices[0].get("message") or {}
    text = (message.get("content") or message.get("reasoning_content") or "") if isinstance(message, dict) else ""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
    tokens = usage.get("completion_tokens")
    if not text.strip() and not calls and not (isinstance(tokens, int) and tokens > 0):
        raise GateFailure("chat completion produced no tokens")
    return {
        "seconds": round(time.monotonic() - started, 3),
        "completion_tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens"),
        "finish_reason": choices[0].get("finish_reason"),
        "text": text.strip()[:80],
        "full_text": text,
        "tool_calls": calls if isinstance(calls, list) else [],
    }


# ----------------------------------------------------------------------------------------------
# probes: answers the gate can check (issue 43)
#
# A pod can start, list its model, answer fast and still be wrong: club-3090 issue #922 (a patched P2P
# module under vLLM's custom all-reduce) answered "!!!!" for 60 of 60 tokens with finish_reason=length
# while every other indicator was green (club-3090 docs/PCIE_P2P.md@4a29ab57d42a1d587de1042fa5dfd9535f94a063,
# "A green verdict line is not a correctness check - and neither is TPS": "Only reading the generated
# text caught it"). So the gate asks a few questions whose answers it can check: greedy, seeded, no
# thinking, short. Each answer is judged by club-3090's degenerate-output rules first, then by its own
# known answer, the tier PCIE_P2P.md's correctness ladder puts above verify-full ("needle with known answer").

PROBE_MAX_TOKENS = 48  # room for a sentence around the answer; #922's garbage filled 60 of 60

# club-3090 scripts/verify-full.sh@4a29ab57d42a1d587de1042fa5dfd9535f94a063 (check_output_quality, last
# changed in 4264065b5700d07a65c39751b699c713baa5d84d): an empty completion fails; the same non-empty line
# (stripped) >= 5 times in a row fails; lexical variety (distinct / all words, words being [A-Za-z']+ of the
# lower-cased text) below 0.30 over the first 200 words fails, and no word at all is variety 0.000.
DEGENERATE_LINE_REPEATS = 5
DEGENERATE_MIN_VARIETY = 0.30
DEGENERATE_VARIETY_WORDS = 200

EXCERPT_CHARS = 40  # of an answer, in the gate's one-line reason (the probes are fixed: no user text)


def _line_repeats(text: str) -> int:
    """The longest run of one non-empty line (stripped), as verify-full counts it (0 without repeats)."""
    longest, current, count = 0, None, 0
    for line in (raw.strip() for raw in text.split("\n")):
        if not line:
            continue
        if line == current:
            count += 1
            longest = max(longest, count)
        else:
            current, count = line, 1
    return longest


def _lexical_variety(text: str) -> Optional[float]:
    """Distinct / all words over the first 200, verify-full's words ([A-Za-z']+, lower-cased); 0.0
    without any word, as verify-full scores "!!!!". None for an answer of digits without words ("391"):
    verify-full reads a 2,000-token essay, where that cannot happen; a probe's short answer can be a number."""
    import re

    words = re.findall(r"[A-Za-z']+", text.lower())[:DEGENERATE_VARIETY_WORDS]
    if not words:
        return None if re.search(r"[0-9]", text) else 0.0
    return len(set(words)) / len(words)


def degenerate(text: str) -> Optional[str]:
    """Why `text` is degenerate output by club-3090's verify-full rules (constants above), or None."""
    if not text.strip():
        return "empty completion"
    repeats = _line_repeats(text)
    if repeats >= DEGENERATE_LINE_REPEATS:
        return f"a line repeats {repeats} times in a row (verify-full fails >= {DEGENERATE_LINE_REPEATS})"
    variety = _lexical_variety(text)
    if variety is not None and variety < DEGENERATE_MIN_VARIETY:
        return (f"lexical variety {variety:.2f} over the first {DEGENERATE_VARIETY_WORDS} words "
                f"(verify-full fails < {DEGENERATE_MIN_VARIETY:.2f})")
    return None


def _judge_arithmetic(text: str, calls: List[Dict[str, Any]]) -> Optional[str]:
    import re

    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return None if "391" in numbers else "expected 391"


RECALL_CODE = "QX-4471-VELT"


def _judge_recall(text: str, calls: List[Dict[str, Any]]) -> Optional[str]:
    return None if RECALL_CODE in text else f"expected {RECALL_CODE}"


def _judge_tool_call(text: str, calls: List[Dict[str, Any]]) -> Optional[str]:
    functions = [c.get("function") for c in calls if isinstance(c, dict) and isinstance(c.get("function"), dict)]
    if not functions:
        return "expected a call of get_weather, got no tool call"
    function = functions[0]
    try:
        arguments = json.loads(function.get("arguments") or "")
    except (TypeError, ValueError):
        arguments = None
    if function.get("name") != "get_weather" or not isinstance(arguments, dict) or arguments.get("city") != "Paris":
        return f"expected get_weather({{\"city\": \"Paris\"}}), got {function.get('name')}({function.get('arguments')})"
    return None


def _judge_json_shape(text: str, calls: List[Dict[str, Any]]) -> Optional[str]:
    start, end = text.find("{"), text.rfind("}")
    try:
        value = json.loads(text[start : end + 1]) if 0 <= start < end else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        return 'expected a JSON object {"name": "rigup", "count": 3}, got none'
    if value.get("name") != "rigup" or value.get("count") != 3 or isinstance(value.get("count"), bool):
        return 'expected {"name": "rigup", "count": 3}'
    return None


class Probe:
    """One fixed question with a checkable answer: `judge(text, tool_calls)` says why the answer is wrong, or None."""

    def __init__(self, name: str, prompt: str, judge: Callable[[str, List[Dict[str, Any]]], Optional[str]],
                 fields: Optional[Dict[str, Any]] = None) -> None:
        self.name = name
        self.prompt = prompt
        self.judge = judge
        self.fields = fields or {}

    @property
    def messages(self) -> List[Dict[str, Any]]:
        return [{"role": "user", "content": self.prompt}]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# The probes, in the order the gate asks them. The catalog's `gate_probes` names a subset per variant.
# The tool call names its function (tool_choice): vLLM serves named function calling through structured
# outputs, without --enable-auto-tool-choice or a tool parser (docs.vllm.ai features/tool_calling: "vLLM
# currently supports named function calling, as well as the auto, required ... and none options").
PROBES: Dict[str, Probe] = {
    p.name: p
    for p in (
        Probe("arithmetic", "What is 17 * 23? Reply with the number only.", _judge_arithmetic),
        Probe("recall", f"The access code is {RECALL_CODE}. What is the access code? Reply with the code only.",
              _judge_recall),
        Probe("tool-call", "What is the weather in Paris? Use the tool.", _judge_tool_call,
              {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        Probe("json-shape", 'Reply with only a JSON object with the keys "name" (the string "rigup") and "count" '
              "(the number 3), nothing else.", _judge_json_shape),
    )
}
PROBE_NAMES = tuple(PROBES)


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """The start of an answer for a one-line reason: newlines shown as \\n, cut with an ellipsis."""
    flat = text.replace("\n", "\\n")
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")


def probe_fault(probe_: Probe, text: str, calls: List[Dict[str, Any]]) -> Optional[str]:
    """What is wrong with an answer: a degenerate text by club-3090's rules, else the probe's own judge; None if right."""
    why = None if calls else degenerate(text)
    return why if why is not None else probe_.judge(text, calls)


def judge_probe(probe_: Probe, completion: Dict[str, Any]) -> Optional[str]:
    """Why the completion fails `probe_` (its name, what is wrong and an excerpt of the answer), or None."""
    text = completion.get("full_text") or ""
    calls = completion.get("tool_calls") or []
    why = probe_fault(probe_, text, calls)
    if why is None:
        return None
    # a tool call's judge names the call it got; a text answer is shown by its start
    answered = "" if calls else f"; answered {excerpt(text)}"
    return (f"probe {probe_.name} failed: {why}{answered} "
            f"(finish_reason={completion.get('finish_reason')}, {completion.get('completion_tokens')} tokens)")


def run_probes(release: "Release", api_key: Optional[str], timeout: float) -> Dict[str, Any]:
    """Ask every probe the release names; raise GateFailure naming the first that fails."""
    results: Dict[str, Any] = {}
    for name in release.gate_probes:
        probe_ = PROBES[name]
        completion = chat_completion(release.base_url, release.served_model_name, api_key, timeout,
                                     release.chat_request, messages=probe_.messages, max_tokens=PROBE_MAX_TOKENS,
                                     fields=probe_.fields)
        failure = judge_probe(probe_, completion)
        if failure is not None:
            raise GateFailure(failure)
        answer = completion["full_text"] or json.dumps([c.get("function") for c in completion["tool_calls"]])
        results[name] = {"seconds": completion["seconds"], "answer_sha256": sha256_bytes(answer.encode())}
    return results


# ----------------------------------------------------------------------------------------------
# the sentinel: the gate's probes asked of every serving pod again and again (issue 43, docs/sentinel.md)
#
# A pod that passed its gate can go wrong later: #922's garbage came from a peer path, which a driver or
# module change can break under a running engine. rigup-sentinel.timer runs `sentinel` every
# sentinel_interval_s: each pod on this rig whose unit is active and whose /v1/models lists its model is
# asked its release's probes directly (its own port, never through the entrance), one request at a time
# (a batch of one beside whatever traffic the pod has). A round passes when every probe's answer passes
# its judge. fail_after failed rounds in a row quarantine the pod, pass_after passed rounds in a row
# release it, and a converge that changed its release starts its record afresh. A pod that does not
# answer at all is no evidence of a wrong answer (a restart, a load): that round is skipped, and
# RigupPodDown says the rest. The record is the pod's state file (sentinel.json beside its provenance);
# the results are a textfile for node_exporter, which the monitor scrapes.

SENTINEL_NAME = "sentinel.json"
SENTINEL_TIMEOUT_S = 60.0  # one probe's answer; longer is a pod too busy to judge this round


def release_identity(data: Dict[str, Any]) -> str:
    """What makes two pods replicas whose greedy answers must agree: the variant, the image (digest, else
    reference), the pinned sources' commits, the model files (repository, revision, files' SHA-256) and
    the engine settings (tensor parallel size, lengths, KV dtype, speculative method, Genesis patches).
    Pod-specific fields (name, port, paths, GPU ids) are left out. The first 16 hex digits of its SHA-256."""
    image = data.get("image") if isinstance(data.get("image"), dict) else {}
    identity = {
        "variant": data.get("variant"),
        "image": image.get("digest") or image.get("ref"),
        "sources": sorted([str(s.get("name")), str(s.get("commit"))] for s in data.get("sources") or []
                          if isinstance(s, dict)),
        "models": sorted([str(m.get("repo_id")), str(m.get("revision")), str(m.get("files_sha256"))]
                         for m in data.get("models") or [] if isinstance(m, dict)),
        "engine": data.get("engine"),
        "probes": data.get("gate_probes"),
    }
    return sha256_bytes(json.dumps(identity, sort_keys=True).encode())[:16]


def served_releases(install_root: str) -> List[Release]:
    """The current release of every pod on this rig (variants/<pod>/release.json; kept generations are not)."""
    releases = []
    for path in sorted(glob.glob(os.path.join(install_root, "variants", "*", RELEASE_NAME))):
        data = read_json(path)
        if data is not None:
            try:
                releases.append(Release(data, path))
            except SystemExit:
                continue  # a release this servingctl cannot read is the converge's to report, not the sentinel's
    return releases


def ask_probe(release: Release, probe_: Probe, api_key: Optional[str], timeout: float) -> Dict[str, Any]:
    """One probe asked of the pod: passed, why not (the judge's words), the answer's start and SHA-256,
    seconds and tokens. Raises GateFailure when the pod gives no answer at all (not a wrong one)."""
    completion = chat_completion(release.base_url, release.served_model_name, api_key, timeout, release.chat_request,
                                 messages=probe_.messages, max_tokens=PROBE_MAX_TOKENS, fields=probe_.fields)
    text = completion.get("full_text") or ""
    calls = completion.get("tool_calls") or []
    why = probe_fault(probe_, text, calls)
    answer = text or json.dumps([c.get("function") for c in calls])
    return {
        "passed": why is None,
        "why": why,
        "answer": excerpt(answer),
        "answer_sha256": sha256_bytes(answer.encode()),
        "seconds": completion["seconds"],
        "tokens": _int_field(completion.get("completion_tokens")) + _int_field(completion.get("prompt_tokens")),
        "finish_reason": completion.get("finish_reason"),
    }


def sentinel_state_path(release: Release) -> str:
    return os.path.join(release.state_dir, SENTINEL_NAME)


def serving_generation(release: Release) -> str:
    """What the pod serves, as its last passed gate recorded it: the release's SHA-256 and the generation.
    It changes only when a converge restarted the pod on other files and its gate passed; a release file
    edited by hand (RigupReleaseDrift) does not change it."""
    record = read_json(release.provenance_path) or {}
    return f"{record.get('release_sha256')}:{record.get('generation')}"


def sentinel_round(release: Release, record: Dict[str, Any], results: Optional[Dict[str, Dict[str, Any]]],
                   fail_after: int, pass_after: int, at: str) -> Dict[str, Any]:
    """The pod's sentinel record after one round. `results`: each probe's outcome (ask_probe), or None when
    the pod gave no answer (the round is skipped: nothing counts). A record of another generation starts
    afresh (serving_generation): a converge changed the pod, and a quarantine ends with it."""
    serves = serving_generation(release)
    if record.get("serves") != serves:
        record = {"serves": serves, "consecutive_failures": 0, "consecutive_passes": 0, "quarantined": None,
                  "rounds": 0, "tokens": 0}
    record = dict(record)
    record["identity"] = release_identity(release.data)
    if results is None:
        record["last_round"] = {"at": at, "skipped": True}
        return record
    failed = [name for name, result in results.items() if not result["passed"]]
    record["rounds"] = _int_field(record.get("rounds")) + 1
    record["tokens"] = _int_field(record.get("tokens")) + sum(r["tokens"] for r in results.values())
    record["last_round"] = {"at": at, "skipped": False, "probes": results}
    if failed:
        record["consecutive_failures"] = _int_field(record.get("consecutive_failures")) + 1
        record["consecutive_passes"] = 0
        first = results[failed[0]]
        record["last_failure"] = {"at": at, "probe": failed[0], "answer": first["answer"], "expected": first["why"],
                                  "finish_reason": first["finish_reason"]}
    else:
        record["consecutive_passes"] = _int_field(record.get("consecutive_passes")) + 1
        record["consecutive_failures"] = 0
    if record.get("quarantined") is None and record["consecutive_failures"] >= fail_after:
        record["quarantined"] = {**record["last_failure"], "since": at,
                                 "why": f"{record['consecutive_failures']} failed probe rounds in a row"}
    elif record.get("quarantined") is not None and record["consecutive_passes"] >= pass_after:
        record["released"] = {"at": at, "after_passes": record["consecutive_passes"]}
        record["quarantined"] = None
    return record


def sentinel(install_root: str, out_path: str, fail_after: int, pass_after: int, systemd: Systemd,
             out: Callable[[str], None] = print, timeout: float = SENTINEL_TIMEOUT_S) -> int:
    """One sentinel round over every serving pod of this rig; writes each pod's record and the textfile."""
    records = []
    for release in served_releases(install_root):
        if systemd.show(release.unit).get("ActiveState") != "active":
            continue  # a pod taken out of service or switched away: nothing to judge, no series
        path = sentinel_state_path(release)
        record = read_json(path) or {}
        api_key = release.api_key()
        results: Optional[Dict[str, Dict[str, Any]]] = {}
        try:
            if release.served_model_name not in list_models(release.models_url, api_key, timeout=HTTP_TIMEOUT_S):
                results = None
            else:
                for name in release.gate_probes:
                    results[name] = ask_probe(release, PROBES[name], api_key, timeout)
        except GateFailure as exc:
            out(f"rigup-sentinel: {release.name}: no answer this round ({exc})")
            results = None
        before = record.get("quarantined")
        record = sentinel_round(release, record, results, fail_after, pass_after, now_iso())
        if record.get("quarantined") and not before:
            q = record["quarantined"]
            out(f"rigup-sentinel: {release.name} QUARANTINED: probe {q['probe']}: {q['expected']}; answered {q['answer']}")
        elif before and not record.get("quarantined") and record.get("released"):
            out(f"rigup-sentinel: {release.name} released from quarantine after {record['released']['after_passes']} "
                f"passed rounds")
        os.makedirs(release.state_dir, mode=0o755, exist_ok=True)
        atomic_write(path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode(), 0o644)
        records.append((release, record))
    os.makedirs(os.path.dirname(out_path), mode=0o755, exist_ok=True)
    atomic_write(out_path, sentinel_metrics(records).encode(), 0o644)
    return 0


def sentinel_metrics(records: List[Tuple[Release, Dict[str, Any]]], now: Callable[[], float] = time.time) -> str:
    """The sentinel's textfile: per pod and probe the last round's verdict, seconds and answer hash (labelled
    with the pod's release identity, for the monitor's replica consensus), and per pod its failed rounds in a
    row, its quarantine (labelled with the evidence) and the probes' tokens so far."""
    families: Dict[str, Tuple[str, str, List[str]]] = {}

    def add(name: str, kind: str, help_text: str, labels: str, value: float) -> None:
        text = str(int(value)) if float(value).is_integer() else repr(float(value))
        families.setdefault(name, (kind, help_text, []))[2].append(f"{name}{labels} {text}")

    for release, record in records:
        pod, variant, identity = release.name, release.variant, str(record.get("identity") or "")
        last = record.get("last_round") if isinstance(record.get("last_round"), dict) else {}
        for probe_name, result in sorted((last.get("probes") or {}).items()):
            add("rigup_sentinel_probe_passed", "gauge", "1 when the pod's last answer to the probe passed its judge.",
                _labels(pod=pod, variant=variant, probe=probe_name), 1 if result.get("passed") else 0)
            add("rigup_sentinel_probe_seconds", "gauge", "Seconds the pod took to answer the probe, last round.",
                _labels(pod=pod, probe=probe_name), float(result.get("seconds") or 0))
            add("rigup_sentinel_answer_info", "gauge",
                "The first 16 hex digits of the SHA-256 of the pod's last greedy answer to the probe; replicas "
                "(same identity) must agree.",
                _labels(pod=pod, variant=variant, identity=identity, probe=probe_name,
                        answer=str(result.get("answer_sha256") or "")[:16]), 1)
        add("rigup_sentinel_consecutive_failures", "gauge", "Sentinel rounds in a row in which a probe failed.",
            _labels(pod=pod, variant=variant), _int_field(record.get("consecutive_failures")))
        quarantine = record.get("quarantined") if isinstance(record.get("quarantined"), dict) else None
        add("rigup_sentinel_quarantined", "gauge",
            "1 while the sentinel holds the pod in quarantine; the labels carry the evidence (a fixed probe: no user text).",
            _labels(pod=pod, variant=variant, model=release.served_model_name, probe=(quarantine or {}).get("probe", ""),
                    answer=(quarantine or {}).get("answer", ""), expected=(quarantine or {}).get("expected", "")),
            1 if quarantine else 0)
        add("rigup_sentinel_probe_tokens_total", "counter",
            "Prompt and completion tokens the sentinel's probes cost the pod since its release started.",
            _labels(pod=pod), _int_field(record.get("tokens")))
        at = epoch_seconds(last.get("at"))
        if at is not None:
            add("rigup_sentinel_last_round_timestamp_seconds", "gauge", "When the sentinel last asked the pod.",
                _labels(pod=pod), at)
    add("rigup_sentinel_timestamp_seconds", "gauge", "When rigup-servingctl sentinel last wrote this file.", "",
        round(now(), 3))
    lines = []
    for name, (kind, help_text, samples) in families.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# the gate itself


def wait_until_serving(
    release: Release,
    timeout_s: float,
    systemd: Systemd,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, Any]:
    """Wait for /v1/models to list the served model, then run the chat completion.

    Fails early when the unit is dead for several polls in a row or crash-loops, instead of
    waiting out a cold-start budget of many minutes.
    """
    started = clock()
    deadline = started + timeout_s
    api_key = release.api_key()
    first = systemd.show(release.unit)
    restarts_at_start = _int(first.get("NRestarts"))
    dead_polls = 0
    last_reason = "no answer yet"
    last_progress = started
    models: List[str] = []
    while True:
        unit = systemd.show(release.unit)
        active = unit.get("ActiveState", "")
        if active in ("inactive", "failed"):
            dead_polls += 1
            if dead_polls >= DEAD_POLLS:
                result = unit.get("Result") or "unknown"
                raise GateFailure(f"{release.unit} is {active} (result: {result}); it is not starting")
        else:
            dead_polls = 0
        restarts = _int(unit.get("NRestarts")) - restarts_at_start
        if restarts >= CRASH_RESTARTS:
            raise GateFailure(f"{release.unit} restarted {restarts} times while starting (crash loop)")
        if active in ("active", "activating", "reloading"):
            try:
                models = list_models(release.models_url, api_key)
            except GateFailure as exc:
                last_reason = str(exc)
            else:
                if release.served_model_name in models:
                    break
                last_reason = f"/v1/models lists {models or 'no models'}, not {release.served_model_name!r}"
        now = clock()
        if now >= deadline:
            raise GateFailure(
                f"{release.served_model_name!r} not served after {round(timeout_s)} s: {last_reason}"
            )
        if progress is not None and now - last_progress >= 30:
            progress(f"still waiting ({round(now - started)} s): {last_reason}")
            last_progress = now
        sleep(min(poll_s, max(0.0, deadline - now)))

    ready_s = clock() - started
    remaining = max(10.0, deadline - clock())
    completion: Dict[str, Any] = {}
    attempts = 0
    while True:
        attempts += 1
        try:
            completion = chat_completion(
                release.base_url, release.served_model_name, api_key, min(COMPLETION_TIMEOUT_S, remaining),
                release.chat_request,
            )
            break
        except GateFailure as exc:
            # A 5xx or a dropped connection right after readiness can be transient; a 4xx is not.
            transient = "unreachable" in str(exc) or "HTTP 5" in str(exc)
            if attempts >= 3 or not transient or clock() >= deadline:
                raise
            sleep(poll_s)
    completion.pop("full_text", None)
    completion.pop("tool_calls", None)
    # The answers judged (issue 43): a pod that serves garbage fast does not pass.
    probes = run_probes(release, api_key, min(COMPLETION_TIMEOUT_S, max(10.0, deadline - clock())))
    return {
        "result": "passed",
        "ready_seconds": round(ready_s, 3),
        "seconds": round(clock() - started, 3),
        "models": models,
        "completion": completion,
        "probes": probes,
    }


def _int(value: Optional[str]) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


# ----------------------------------------------------------------------------------------------
# generations: copies of the files of every release that passed the gate


def generation_numbers(generations_dir: str) -> List[int]:
    try:
        names = os.listdir(generations_dir)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(generations_dir, n)))


def generation_matches(generations_dir: str, number: int, release: Release) -> bool:
    """True when generation `number` holds exactly the files the release runs now.

    Compares the files, not only release.json: the release carries no secrets, so a rotated API
    key or HF token changes its secret file alone.
    """
    gen_dir = os.path.join(generations_dir, str(number))
    if sha256_file(os.path.join(gen_dir, RELEASE_NAME)) != release.sha256:
        return False
    for relpath in release.kept_files:
        if sha256_file(os.path.join(gen_dir, relpath)) != sha256_file(os.path.join(release.variant_dir, relpath)):
            return False
    return sha256_file(os.path.join(gen_dir, UNIT_COPY_NAME)) == sha256_file(release.unit_file)


def record_generation(release: Release, keep: int, dropped_images: Optional[set] = None) -> int:
    """Copy the release's files into a new generation; prune to the newest `keep`. Returns its number.
    The image references of the generations pruned are added to `dropped_images`.

    When the newest generation already holds this exact release, it is reused (a re-gate of a
    release that passed before is not a new generation).
    """
    # here, not at the top: see the note below the imports
    import shutil
    import tempfile

    gens_dir = release.generations_dir
    os.makedirs(gens_dir, mode=0o700, exist_ok=True)
    numbers = generation_numbers(gens_dir)
    if numbers and generation_matches(gens_dir, numbers[-1], release):
        number = numbers[-1]
    else:
        number = (numbers[-1] + 1) if numbers else 1
        final = os.path.join(gens_dir, str(number))
        staging = tempfile.mkdtemp(prefix=f".{number}-", dir=gens_dir)
        try:
            os.chmod(staging, 0o700)
            for relpath in release.kept_files:
                src = os.path.join(release.variant_dir, relpath)
                dst = os.path.join(staging, relpath)
                os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
                shutil.copy2(src, dst)
            shutil.copy2(release.path, os.path.join(staging, RELEASE_NAME))
            if os.path.exists(release.unit_file):
                shutil.copy2(release.unit_file, os.path.join(staging, UNIT_COPY_NAME))
            os.rename(staging, final)  # a generation appears whole or not at all
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        numbers.append(number)
    keep = max(1, keep)
    for old in numbers[:-keep]:
        if dropped_images is not None:
            ref = image_ref_of(os.path.join(gens_dir, str(old), RELEASE_NAME))
            if ref:
                dropped_images.add(ref)
        shutil.rmtree(os.path.join(gens_dir, str(old)), ignore_errors=True)
    for leftover in os.listdir(gens_dir):  # staging dirs of an interrupted earlier run
        if leftover.startswith("."):
            shutil.rmtree(os.path.join(gens_dir, leftover), ignore_errors=True)
    return number


def image_ref_of(release_path: str) -> Optional[str]:
    data = read_json(release_path)
    image = data.get("image") if isinstance(data, dict) else None
    ref = image.get("ref") if isinstance(image, dict) else None
    return str(ref) if ref else None


def images_in_use(install_root: str) -> set:
    """The image of every release on this host that may run again: each variant's or pod's current
    release and every generation kept for rollback."""
    base = os.path.join(install_root, "variants")
    paths = glob.glob(os.path.join(base, "*", RELEASE_NAME)) + glob.glob(os.path.join(base, "*", GENERATIONS_DIR, "*", RELEASE_NAME))
    return {ref for ref in (image_ref_of(p) for p in paths) if ref}


class Docker:
    """The engine, for removing images (a class so the unit tests can substitute a fake)."""

    def remove_image(self, ref: str) -> Tuple[bool, str]:
        proc = subprocess.run(["docker", "image", "rm", ref], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              check=False)
        return proc.returncode == 0, proc.stdout.strip()


def prune_images(install_root: str, dropped: set, docker: "Docker", out: Callable[[str], None]) -> None:
    """Remove the images of pruned generations that no kept release uses (each is gigabytes on a rig).
    Not forced: an image a container still uses stays, and says why."""
    for ref in sorted(dropped - images_in_use(install_root)):
        ok, detail = docker.remove_image(ref)
        out(f"rigup: removed image {ref}: no kept generation uses it" if ok else f"rigup: kept image {ref}: {detail}")


def restore_generation(install_root: str, variant: str, number: int, systemd: Systemd) -> Release:
    """Put the files of generation `number` of `variant` back in place. Returns its release.

    Reloads systemd only when the unit file really changes (a reload can detach GPUs from running
    containers: NVIDIA/nvidia-container-toolkit#48).
    """
    variant_dir = os.path.join(install_root, "variants", variant)
    gen_dir = os.path.join(variant_dir, GENERATIONS_DIR, str(number))
    old = Release.load(os.path.join(gen_dir, RELEASE_NAME))
    for relpath in old.kept_files:
        src = os.path.join(gen_dir, relpath)
        with open(src, "rb") as handle:
            data = handle.read()
        dst = os.path.join(variant_dir, relpath)
        os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
        atomic_write(dst, data, os.stat(src).st_mode & 0o7777)
    with open(os.path.join(gen_dir, RELEASE_NAME), "rb") as handle:
        atomic_write(os.path.join(variant_dir, RELEASE_NAME), handle.read(), 0o644)
    unit_copy = os.path.join(gen_dir, UNIT_COPY_NAME)
    if os.path.exists(unit_copy):
        with open(unit_copy, "rb") as handle:
            unit_data = handle.read()
        if sha256_file(old.unit_file) != sha256_bytes(unit_data):
            atomic_write(old.unit_file, unit_data, 0o644)
            systemd.daemon_reload()
    return Release.load(os.path.join(variant_dir, RELEASE_NAME))


# ----------------------------------------------------------------------------------------------
# the rig's fingerprint: what a passed gate was true of (issue 43, docs/sentinel.md)
#
# vLLM keeps its P2P verdict in gpu_p2p_access_cache_for_<CUDA_VISIBLE_DEVICES>.json under VLLM_CACHE_ROOT and
# reads it on later starts without checking again (gpu_p2p_access_check, vllm/distributed/device_communicators/
# all_reduce_utils.py at vllm-project/vllm b250ac3dd5ef41c880d647ac1556ead89a7bff54); club-3090's
# docs/PCIE_P2P.md@4a29ab57d42a1d587de1042fa5dfd9535f94a063 says to delete it "after any hardware, BIOS, or
# driver change", because its name is keyed only on the device ids. So the gate records the rig's
# fingerprint with the release that passed, a converge compares it with the rig's fingerprint now (the
# RigFingerprint fact runs the same script and parser), and when it changed `revalidate` removes the P2P
# cache, restarts the pod and gates it again with every probe of its release.

FINGERPRINT_MARK = "--rigup-fingerprint--"
# One shell script, read by the gate (recorded) and by the converge's fact (compared): the GPUs' UUIDs, PCI
# bus ids and VBIOS versions and the driver's version (nvidia-smi), the GPU-to-GPU link matrix (PCI topology)
# and P2P read matrix as nvidia-smi reports them, the loaded NVIDIA module's own line (a rebuilt or patched
# P2P module has its own build line), the running kernel and the BIOS version where DMI is readable.
FINGERPRINT_SCRIPT = (
    "nvidia-smi --query-gpu=index,uuid,pci.bus_id,driver_version,vbios_version --format=csv,noheader 2>/dev/null; "
    f"echo {FINGERPRINT_MARK}; nvidia-smi topo -m 2>/dev/null; "
    f"echo {FINGERPRINT_MARK}; nvidia-smi topo -p2p r 2>/dev/null; "
    f"echo {FINGERPRINT_MARK}; head -n 1 /proc/driver/nvidia/version 2>/dev/null; "
    f"echo {FINGERPRINT_MARK}; uname -r; "
    f"echo {FINGERPRINT_MARK}; cat /sys/class/dmi/id/bios_version 2>/dev/null; true"
)
FINGERPRINT_NAMES = {"driver": "driver", "topology": "PCI topology", "p2p": "P2P matrix", "module": "NVIDIA module",
                     "kernel": "kernel", "bios": "BIOS", "uuid": "UUID", "pci": "PCI bus id", "vbios": "VBIOS"}
P2P_CACHE_GLOB = "gpu_p2p_access_cache_for_*.json"


def _gpu_matrix(lines: List[str]) -> Optional[str]:
    """The GPU-to-GPU cells of `nvidia-smi topo -m` or `topo -p2p r` ("GPU0 X PIX; GPU1 PIX X"): the rows
    named GPU<n>, each cut to its GPU columns (CPU and NUMA affinity, NICs and the legend left out)."""
    import re

    rows = [line.replace("\x1b[4m", " ").replace("\x1b[0m", " ").split() for line in lines]
    rows = [row for row in rows if row and re.fullmatch(r"GPU\d+", row[0]) and "X" in row]  # not the header
    if not rows:
        return None
    return "; ".join(" ".join(row[: len(rows) + 1]) for row in rows)


def parse_fingerprint(lines: List[str]) -> Dict[str, Optional[str]]:
    """FINGERPRINT_SCRIPT's output as {"driver", "gpu0.uuid", "gpu0.pci", "gpu0.vbios", .., "topology", "p2p",
    "module", "kernel", "bios"}: strings, None where the rig gave nothing (no driver, no DMI)."""
    sections: List[List[str]] = [[]]
    for line in lines:
        if line.strip() == FINGERPRINT_MARK:
            sections.append([])
        else:
            sections[-1].append(line)
    sections += [[] for _ in range(6 - len(sections))]
    gpus, topo, p2p, module, kernel, bios = sections[:6]
    found: Dict[str, Optional[str]] = {"driver": None}
    for line in gpus:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 5 or not cells[0].isdigit():
            continue  # nvidia-smi's failure text (no driver, a version mismatch): no GPU read
        index, uuid, bus_id, driver, vbios = cells
        found["driver"] = found["driver"] or driver
        found.update({f"gpu{index}.uuid": uuid, f"gpu{index}.pci": bus_id, f"gpu{index}.vbios": vbios})

    def first(part: List[str]) -> Optional[str]:
        text = " ".join(" ".join(part).split())
        return text or None

    found.update(topology=_gpu_matrix(topo), p2p=_gpu_matrix(p2p), module=first(module), kernel=first(kernel),
                 bios=first(bios))
    return found


def rig_fingerprint() -> Dict[str, Optional[str]]:
    """This rig's fingerprint now (FINGERPRINT_SCRIPT); a part that cannot be read is None."""
    try:
        proc = subprocess.run(["sh", "-c", FINGERPRINT_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return parse_fingerprint([])
    return parse_fingerprint(proc.stdout.splitlines())


def fingerprint_changes(recorded: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """What differs, one phrase per part: "driver 580.95.05 to 580.105.08", "GPU1 UUID GPU-9f.. to none"."""
    changes = []
    for key in sorted(set(recorded) | set(current), key=lambda k: (k.startswith("gpu"), k)):
        before, after = recorded.get(key), current.get(key)
        if before != after:
            gpu, _, part = key.partition(".")
            name = f"{gpu.upper()} {FINGERPRINT_NAMES.get(part, part)}" if part else FINGERPRINT_NAMES.get(key, key)
            changes.append(f"{name} {before or 'none'} to {after or 'none'}")
    return changes


def p2p_cache_files(release: Release) -> List[str]:
    """vLLM's P2P access cache files the pod keeps on this rig: in the host directories its release names
    (p2p_cache_dirs: where the compose file mounts the container's VLLM_CACHE_ROOT; rigup.desired.release).
    A pod without such a mount keeps the file in its container, which every start of rigup's unit removes
    (`docker compose down` in ExecStartPre and ExecStop)."""
    found: List[str] = []
    for directory in release.data.get("p2p_cache_dirs") or []:
        found += sorted(glob.glob(os.path.join(str(directory), P2P_CACHE_GLOB)))
    return found


# ----------------------------------------------------------------------------------------------
# provenance


def host_versions() -> Dict[str, Optional[str]]:
    """Versions of the host layer the release runs on (best effort: None when a tool is missing)."""

    def first_line(*cmd: str) -> Optional[str]:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        return lines[0] if proc.returncode == 0 and lines else None

    return {
        "kernel": first_line("uname", "-r"),
        "nvidia_driver": first_line("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "docker": first_line("docker", "version", "--format", "{{.Server.Version}}"),
        "docker_compose": first_line("docker", "compose", "version", "--short"),
        "nvidia_ctk": first_line("nvidia-ctk", "--version"),
    }


def write_provenance(
    release: Release,
    generation: int,
    gate: Dict[str, Any],
    previous: Optional[Dict[str, Any]] = None,
    versions: Optional[Dict[str, Optional[str]]] = None,
    fingerprint: Optional[Dict[str, Optional[str]]] = None,
) -> Dict[str, Any]:
    record: Dict[str, Any] = {
        "schema": SCHEMA,
        "variant": release.variant,
        "unit": release.unit,
        "generation": generation,
        "release_sha256": release.sha256,
        "release": release.data,
        "host": versions if versions is not None else host_versions(),
        # what the gate passed on: a converge that finds another re-validates the pod (revalidate)
        "fingerprint": fingerprint if fingerprint is not None else rig_fingerprint(),
        "gate": gate,
        "written_at": now_iso(),
    }
    if release.pod is not None:
        record["pod"] = release.pod
    if previous and previous.get("last_rollback"):
        record["last_rollback"] = previous["last_rollback"]
    if previous and previous.get("rollbacks"):
        record["rollbacks"] = previous["rollbacks"]
    os.makedirs(release.state_dir, mode=0o755, exist_ok=True)
    atomic_write(release.provenance_path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode(), 0o644)
    return record


def note_rollback(provenance_path: str, record: Dict[str, Any], failed: Release, reason: str, outcome: str) -> None:
    record = dict(record)
    record["last_rollback"] = {
        "at": now_iso(),
        "failed_variant": failed.variant,
        "failed_release_sha256": failed.sha256,
        "failed_image": (failed.data.get("image") or {}).get("ref"),
        "reason": reason,
        "outcome": outcome,
    }
    record["rollbacks"] = _int_field(record.get("rollbacks")) + 1
    record["written_at"] = now_iso()
    atomic_write(provenance_path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode(), 0o644)


def standing_gate_failure(record: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The record's last rollback while its failure stands: no gate passed after it, and no converge has
    since found the pod asked for a release other than the one that failed (`supersede`). None otherwise."""
    rollback = record.get("last_rollback")
    if not isinstance(rollback, dict) or rollback.get("superseded_at"):
        return None
    gate = record.get("gate") if isinstance(record.get("gate"), dict) else {}
    passed_at = epoch_seconds(gate.get("at")) if gate.get("result") == "passed" else None
    failed_at = epoch_seconds(rollback.get("at"))
    if passed_at is not None and (failed_at is None or passed_at >= failed_at):
        return None
    return rollback


def supersede(release_path: str, out: Callable[[str], None] = print) -> int:
    """The converge asks the pod for the release at `release_path` (the one it serves, as recorded), not
    the one whose failed gate the last rollback records: mark that rollback superseded, atomically as
    note_rollback writes it, so the textfile stops reporting a failed release the fleet asks for.
    Returns 1, changing nothing, when the release asked for is the failed one or not the one that serves."""
    release = Release.load(release_path)
    record = read_json(release.provenance_path)
    failure = standing_gate_failure(record) if record else None
    if record is None or failure is None:
        out(f"rigup: {release.unit}: no failed gate stands in {release.provenance_path}; nothing to supersede")
        return 0
    failed_sha = str(failure.get("failed_release_sha256") or "")
    if failed_sha == release.sha256:
        out(f"rigup: {release.unit}: {release.path} is the release that failed its gate at {failure.get('at')}; "
            f"its failure stands")
        return 1
    if record.get("release_sha256") != release.sha256:
        out(f"rigup: {release.unit}: {release.path} is not the release that serves (generation "
            f"{record.get('generation')}); gate it first")
        return 1
    record = dict(record)
    record["last_rollback"] = {**failure, "superseded_at": now_iso(), "superseded_by_release_sha256": release.sha256}
    record["written_at"] = now_iso()
    atomic_write(release.provenance_path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode(), 0o644)
    out(f"rigup: {release.unit}: the fleet asks for release {release.sha256[:12]} (generation {record.get('generation')}, "
        f"serving), no longer for {failed_sha[:12]}, whose gate failed at {failure.get('at')}")
    return 0


# ----------------------------------------------------------------------------------------------
# metrics: rigup's facts as a node_exporter textfile (the fleet's Prometheus scrapes them with the node)


def _int_field(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _label(value: Any) -> str:
    """A label value in Prometheus' text format: backslash, quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: Any) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}"


def epoch_seconds(iso: Any) -> Optional[float]:
    """Seconds since the epoch of a time now_iso() wrote (2026-12-03T16:50:00+00:00); None if it is not one."""
    try:
        moment = datetime.datetime.fromisoformat(str(iso).replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def loaded_driver_branch(version_file: str = "/proc/driver/nvidia/version") -> int:
    """The branch (580 of 580.95.05) of the NVIDIA kernel module loaded now; 0 when none is."""
    try:
        with open(version_file) as f:
            text = f.read()
    except OSError:
        return 0
    for word in text.split():
        head = word.split(".")[0]
        if "." in word and head.isdigit() and len(head) == 3:
            return int(head)
    return 0


def mountpoint_of(path: str) -> str:
    """The mount point holding `path` (its nearest existing ancestor's)."""
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def provenance_records(install_root: str) -> List[Dict[str, Any]]:
    """Every provenance record under install_root: the one-variant host's and each listed pod's."""
    state = os.path.join(install_root, "state")
    paths = [os.path.join(state, PROVENANCE_NAME)] + sorted(glob.glob(os.path.join(state, "pods", "*", PROVENANCE_NAME)))
    return [r for r in (read_json(p) for p in paths) if isinstance(r, dict)]


def textfile_metrics(install_root: str, wanted_driver_branch: int, model_dir: str,
                     driver_version_file: str = "/proc/driver/nvidia/version",
                     now: Callable[[], float] = time.time) -> str:
    """The textfile's content: see `textfile` in the module docstring. Only gauges and counters whose
    values the rig's own files and /proc say now; a pod with no record has no series."""
    families: Dict[str, Tuple[str, str, List[str]]] = {}

    def add(name: str, kind: str, help_text: str, labels: str, value: float) -> None:
        text = str(int(value)) if float(value).is_integer() else repr(float(value))
        families.setdefault(name, (kind, help_text, []))[2].append(f"{name}{labels} {text}")

    for record in provenance_records(install_root):
        release = record.get("release") if isinstance(record.get("release"), dict) else {}
        variant = str(record.get("variant") or "")
        pod = str(record.get("pod") or variant)
        gate = record.get("gate") if isinstance(record.get("gate"), dict) else {}
        image = release.get("image") if isinstance(release.get("image"), dict) else {}
        add("rigup_release_info", "gauge", "The release a pod serves: the last that passed rigup's health gate.",
            _labels(pod=pod, variant=variant, unit=record.get("unit", ""), model=release.get("served_model_name", ""),
                    release=str(record.get("release_sha256", ""))[:12], image=image.get("ref", "")), 1)
        add("rigup_generation", "gauge", "The generation number of the release a pod serves.", _labels(pod=pod),
            _int_field(record.get("generation")))
        passed_at = epoch_seconds(gate.get("at")) if gate.get("result") == "passed" else None
        rollback = record.get("last_rollback") if isinstance(record.get("last_rollback"), dict) else {}
        failed_at = epoch_seconds(rollback.get("at"))
        last_passed = passed_at is not None and (failed_at is None or passed_at >= failed_at)
        add("rigup_gate_last_passed", "gauge", "1 when the pod's last health gate passed, 0 when it failed (and was rolled back).",
            _labels(pod=pod, variant=variant), 1 if last_passed else 0)
        add("rigup_release_failed_gate", "gauge",
            "1 while the fleet asks the pod for a release that failed its health gate (rolled back): until a gate "
            "passes or a converge asks it for another release.",
            _labels(pod=pod, variant=variant), 0 if standing_gate_failure(record) is None else 1)
        last = max([t for t in (passed_at, failed_at) if t is not None], default=None)
        if last is not None:
            add("rigup_gate_last_timestamp_seconds", "gauge", "When the pod's last health gate ended.", _labels(pod=pod), last)
        add("rigup_rollbacks_total", "counter", "Releases of the pod that failed the gate and were rolled back.",
            _labels(pod=pod), _int_field(record.get("rollbacks")))
        for source in release.get("sources") or []:
            if isinstance(source, dict) and source.get("commit"):
                add("rigup_source_info", "gauge", "A source checkout the pod's release pins.",
                    _labels(pod=pod, source=source.get("name", ""), commit=source["commit"]), 1)
        release_file = os.path.join(str(release.get("variant_dir") or ""), RELEASE_NAME)
        on_disk = sha256_file(release_file) if release.get("variant_dir") else None
        drift = on_disk is not None and on_disk != record.get("release_sha256")
        add("rigup_release_drift", "gauge",
            "1 when the pod's release file (what the last converge pinned) is not the release that passed the gate.",
            _labels(pod=pod), 1 if drift else 0)
    add("rigup_driver_loaded_branch", "gauge", "The NVIDIA driver branch loaded now (0: none).", "",
        loaded_driver_branch(driver_version_file))
    add("rigup_driver_wanted_branch", "gauge", "The NVIDIA driver branch the fleet file wants (nvidia_driver_branch).", "",
        wanted_driver_branch)
    add("rigup_model_filesystem", "gauge", "The filesystem holding the models (model_dir).",
        _labels(mountpoint=mountpoint_of(model_dir), path=model_dir), 1)
    add("rigup_textfile_timestamp_seconds", "gauge", "When rigup-servingctl last wrote this file.", "", round(now(), 3))
    lines = []
    for name, (kind, help_text, samples) in families.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"


def write_textfile(out_path: str, install_root: str, wanted_driver_branch: int, model_dir: str) -> None:
    """Write the textfile atomically (node_exporter never reads half of it), 0644."""
    os.makedirs(os.path.dirname(out_path), mode=0o755, exist_ok=True)
    atomic_write(out_path, textfile_metrics(install_root, wanted_driver_branch, model_dir).encode(), 0o644)


# ----------------------------------------------------------------------------------------------
# commands


def release_files(release: Release) -> List[str]:
    """Every file the running service depends on: the rendered files, the secret files, release.json, the unit."""
    return [os.path.join(release.variant_dir, rel) for rel in release.kept_files] + [release.path, release.unit_file]


def newest_mtime(paths: List[str]) -> Optional[float]:
    times = []
    for path in paths:
        try:
            times.append(os.stat(path).st_mtime)
        except FileNotFoundError:
            continue
    return max(times) if times else None


def main_started_at(unit: Dict[str, str]) -> Optional[float]:
    """Wall-clock time the unit's main process started, from its monotonic timestamp.

    systemd records CLOCK_MONOTONIC microseconds, as Python's time.monotonic() reads them; mapping
    through "now" keeps sub-second order against file mtimes (the text timestamps have seconds only).
    """
    start_us = _int(unit.get("ExecMainStartTimestampMonotonic"))
    if start_us <= 0:
        return None
    return time.time() - (time.monotonic() - start_us / 1e6)


def probe(release_path: str, systemd: Systemd) -> Dict[str, Any]:
    """Quick state of one variant (no waiting): what the ServingStatus fact returns.

    `stale`: the service runs, but one of its files changed after its main process started (a
    deploy wrote them and never restarted, e.g. it was interrupted): it must be restarted.
    `need_daemon_reload`: systemd has not loaded the unit file on disk yet.
    """
    result: Dict[str, Any] = {"release_present": False, "serving": False}
    data = read_json(release_path)
    if data is None:
        return result
    release = Release(data, release_path)
    unit = systemd.show(release.unit)
    active = unit.get("ActiveState") or "unknown"
    started_at = main_started_at(unit) if active in ("active", "activating", "reloading") else None
    newest = newest_mtime(release_files(release))
    result.update(
        {
            "release_present": True,
            "release_sha256": release.sha256,
            "unit": release.unit,
            "active": active,
            "enabled": unit.get("UnitFileState") or "unknown",
            "need_daemon_reload": unit.get("NeedDaemonReload") == "yes"
            or (unit.get("LoadState") == "not-found" and os.path.exists(release.unit_file)),
            "started_at": started_at,
            "stale": started_at is not None and newest is not None and newest > started_at,
            "models": None,
            "error": None,
        }
    )
    if active == "active":
        try:
            result["models"] = list_models(release.models_url, release.api_key(), timeout=3.0)
        except GateFailure as exc:
            result["error"] = str(exc)
        else:
            result["serving"] = release.served_model_name in result["models"]
            if not result["serving"]:
                result["error"] = f"{release.served_model_name!r} not listed"
    prov = read_json(release.provenance_path) or {}
    gate = prov.get("gate") if isinstance(prov.get("gate"), dict) else {}
    failure = standing_gate_failure(prov)
    result["provenance"] = {
        "variant": prov.get("variant"),
        "generation": prov.get("generation"),
        "release_sha256": prov.get("release_sha256"),
        "gate_result": gate.get("result"),
        # the release whose failed gate still stands (the converge supersedes it when it asks for another)
        "failed_release_sha256": failure.get("failed_release_sha256") if failure else None,
        # the rig's fingerprint the last passed gate recorded (None before issue 43's re-validation)
        "fingerprint": prov.get("fingerprint"),
    }
    return result


# What marks a log line as the error that stopped the engine (vLLM's and torch's own words).
ERROR_WORDS = ("Error", "ERROR", "Exception", "FAILED")
# vLLM's own wrapper, printed last, points up at the cause: the line before it is the one worth reading
# ("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): ...").
WRAPPER_WORDS = ("See root cause above",)


def last_error(lines: List[str]) -> Optional[str]:
    """The last log line naming an error (a container's own text: journald's and compose's prefixes cut),
    so the gate's one-line reason carries it: "crash loop" alone does not say that Gloo could not connect."""
    for line in reversed(lines):
        text = line.split(" | ", 1)[1] if " | " in line else line
        text = text.strip()
        if (any(word in text for word in ERROR_WORDS) and not text.startswith("Traceback")
                and not any(word in text for word in WRAPPER_WORDS)):
            return text[:300]
    return None


def _print_failure(release: Release, reason: str, systemd: Systemd, out: Callable[[str], None], since: float) -> str:
    """Print the failure and the unit's last log lines; returns the reason with the log's last error since
    `since` (the gate's start, seconds since the epoch)."""
    redact = release.redactor()
    journal = [redact(line) for line in systemd.journal_tail(release.unit, JOURNAL_LINES)]
    error = last_error([redact(line) for line in systemd.journal_tail(release.unit, ERROR_SCAN_LINES, since=since)])
    if error is not None:
        reason = f"{reason}; the log's last error: {error}"
    out(f"rigup: health gate FAILED for {release.unit} (variant {release.variant}): {redact(reason)}")
    out(f"rigup: last {JOURNAL_LINES} lines of journalctl -u {release.unit}:")
    for line in journal:
        out("  " + line)
    return reason


def gate(
    release_path: str,
    timeout_s: float,
    keep: int,
    rollback: bool,
    systemd: Systemd,
    out: Callable[[str], None] = print,
    versions: Optional[Dict[str, Optional[str]]] = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
    docker: Optional[Docker] = None,
    hold: bool = False,
    fingerprint: Optional[Dict[str, Optional[str]]] = None,
) -> int:
    """The health gate (module docstring). `hold`: a cluster member's first gate, which records nothing
    and rolls nothing back (RESULT "held" or "failed"): `rollback` or a second gate follows once the
    control machine has every member's result."""
    release = Release.load(release_path)
    previous = read_json(release.provenance_path)
    began = time.time()
    try:
        result = wait_until_serving(release, timeout_s, systemd, clock=clock, sleep=sleep, poll_s=poll_s, progress=out)
    except GateFailure as exc:
        reason = _print_failure(release, str(exc), systemd, out, since=began)
        if hold:
            out(f"{RESULT_MARKER} failed")
            return EXIT_FAILED
        return _roll_back(release, reason, previous, timeout_s, rollback, systemd, out, clock, sleep, poll_s)
    if hold:
        out(f"rigup: {release.unit} serves {release.served_model_name!r} (ready in {result['ready_seconds']} s); "
            f"recorded once every member of its cluster passed")
        out(f"{RESULT_MARKER} held")
        return EXIT_PASSED
    result["at"] = now_iso()
    dropped: set = set()
    number = record_generation(release, keep, dropped)
    write_provenance(release, number, result, previous, versions, fingerprint)
    prune_images(release.install_root, dropped, docker or Docker(), out)
    out(
        f"rigup: {release.unit} serves {release.served_model_name!r} (ready in {result['ready_seconds']} s, "
        f"completion in {result['completion']['seconds']} s); recorded as generation {number}"
    )
    out(f"{RESULT_MARKER} passed")
    return EXIT_PASSED


def roll_back(
    release_path: str,
    reason: str,
    timeout_s: float,
    systemd: Systemd,
    out: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
) -> int:
    """Take the release at `release_path` out of service for `reason` (another cluster member's failed
    gate), restoring, restarting and gating the last good generation: what `gate` does after a failure."""
    release = Release.load(release_path)
    out(f"rigup: {release.unit}: {release.redactor()(reason)}")
    return _roll_back(release, reason, read_json(release.provenance_path), timeout_s, True, systemd, out, clock, sleep,
                      poll_s)


def _roll_back(
    failed: Release,
    reason: str,
    previous: Optional[Dict[str, Any]],
    timeout_s: float,
    rollback: bool,
    systemd: Systemd,
    out: Callable[[str], None],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    poll_s: float,
) -> int:
    def give_up(why: str) -> int:
        out(f"rigup: not rolling back: {why}")
        out(f"{RESULT_MARKER} failed")
        return EXIT_FAILED

    if not rollback:
        return give_up("rollback disabled")
    if not previous or previous.get("gate", {}).get("result") not in ("passed", None):
        return give_up("no previous good generation is recorded in provenance.json")
    # The directory the good generation is in: the pod's (a listed pod's record names it), else the variant's.
    variant = previous.get("pod") or previous.get("variant")
    number = previous.get("generation")
    if not isinstance(variant, str) or not isinstance(number, int):
        return give_up("provenance.json names no generation")
    what = f"{'pod' if previous.get('pod') else 'variant'} {variant}"  # in messages
    gen_release = os.path.join(failed.install_root, "variants", variant, GENERATIONS_DIR, str(number), RELEASE_NAME)
    if not os.path.exists(gen_release):
        return give_up(f"generation {number} of {what} is gone")
    if variant == failed.name and generation_matches(failed.generations_dir, number, failed):
        return give_up(f"the failing release is the last good one (generation {number}): nothing older to restore")

    out(f"rigup: rolling back to {what} generation {number}")
    try:
        if variant != failed.name:
            systemd.disable_now(failed.unit)  # the GPUs belong to one variant at a time
        restored = restore_generation(failed.install_root, variant, number, systemd)
        systemd.enable(restored.unit)
        systemd.restart(restored.unit)
    except (OSError, subprocess.CalledProcessError, SystemExit) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) and exc.stderr else str(exc)
        note_rollback(failed.provenance_path, previous, failed, reason, f"rollback failed: {detail}")
        out(f"rigup: FAILED and the rollback to {what} generation {number} could not be done: {detail}")
        out(f"{RESULT_MARKER} rollback-failed")
        return EXIT_ROLLBACK_FAILED
    began = time.time()
    try:
        result = wait_until_serving(restored, timeout_s, systemd, clock=clock, sleep=sleep, poll_s=poll_s, progress=out)
    except GateFailure as exc:
        _print_failure(restored, f"after rollback: {exc}", systemd, out, since=began)
        note_rollback(failed.provenance_path, previous, failed, reason, f"rollback failed: {exc}")
        out(
            f"rigup: FAILED and the rollback to {what} generation {number} failed too; "
            f"{failed.unit} failed with: {failed.redactor()(reason)}"
        )
        out(f"{RESULT_MARKER} rollback-failed")
        return EXIT_ROLLBACK_FAILED
    note_rollback(failed.provenance_path, previous, failed, reason, "rolled back")
    out(
        f"rigup: FAILED and ROLLED BACK: the new release of variant {failed.variant} failed the health gate "
        f"({failed.redactor()(reason)}); {what} generation {number} serves again "
        f"(ready in {result['ready_seconds']} s)"
    )
    out(f"{RESULT_MARKER} failed-and-rolled-back")
    return EXIT_ROLLED_BACK


REVALIDATED_MARKER = "RIGUP-REVALIDATED:"  # last line of `revalidate`: what the converge's account says


def revalidate(
    release_path: str,
    timeout_s: float,
    keep: int,
    systemd: Systemd,
    out: Callable[[str], None] = print,
    fingerprint: Optional[Dict[str, Optional[str]]] = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
    docker: Optional[Docker] = None,
    member: bool = False,
) -> int:
    """The rig's fingerprint now against the one the pod's last passed gate recorded. Unchanged: nothing.
    None recorded (a gate before issue 43's re-validation): the fingerprint now is recorded, nothing restarts.
    Changed: vLLM's P2P access cache is removed (the host's files, p2p_cache_files; the container's goes with
    the restart's `compose down`), the pod restarted and gated with every probe its release names, without
    rollback (the release did not change: the rig did). A passed gate records the new fingerprint; a failed
    one keeps the old, so the next converge re-validates again. The last line says what was done
    (REVALIDATED_MARKER). Exit codes as `gate`'s.

    `member`: a cluster member (revalidate_member)."""
    release = Release.load(release_path)
    record = read_json(release.provenance_path) or {}
    gate_record = record.get("gate") if isinstance(record.get("gate"), dict) else {}
    if member:
        current = fingerprint if fingerprint is not None else rig_fingerprint()
        return revalidate_member(release, record, gate_record.get("result") == "passed", current, systemd, out)
    if record.get("release_sha256") != release.sha256 or gate_record.get("result") != "passed":
        out(f"rigup: {release.unit}: {release.path} is not the release whose gate passed; gate it first")
        out(f"{REVALIDATED_MARKER} not re-validated: the release did not pass its gate here")
        return EXIT_FAILED
    current = fingerprint if fingerprint is not None else rig_fingerprint()
    recorded = record.get("fingerprint")
    if not isinstance(recorded, dict):
        _record_fingerprint(release, record, current, out)
        return EXIT_PASSED
    changes = fingerprint_changes(recorded, current)
    if not changes:
        out(f"{REVALIDATED_MARKER} fingerprint unchanged")
        return EXIT_PASSED
    what = "; ".join(changes)
    out(f"rigup: {release.unit}: fingerprint changed: {what}")
    where = _remove_p2p_caches(release, out)
    if not _restarted(release, systemd, out, f"fingerprint changed: {what} -> P2P cache removed ({where})"):
        return EXIT_FAILED
    code = gate(release_path, timeout_s, keep, False, systemd, out=out, clock=clock, sleep=sleep, poll_s=poll_s,
                docker=docker, fingerprint=current)
    probes = f"{len(release.gate_probes)} probes: {', '.join(release.gate_probes)}"
    verdict = "passed" if code == EXIT_PASSED else "FAILED"
    out(f"{REVALIDATED_MARKER} fingerprint changed: {what} -> P2P cache removed ({where}), full probe set {verdict} "
        f"({probes})")
    return code


def _record_fingerprint(release: Release, record: Dict[str, Any], current: Dict[str, Optional[str]],
                        out: Callable[[str], None]) -> None:
    """The provenance record of a gate that predates fingerprints gets the rig's fingerprint now."""
    record = dict(record)
    record["fingerprint"] = current
    record["written_at"] = now_iso()
    atomic_write(release.provenance_path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode(), 0o644)
    out(f"{REVALIDATED_MARKER} fingerprint recorded (the last gate predates the record)")


def _remove_p2p_caches(release: Release, out: Callable[[str], None]) -> str:
    """vLLM's P2P access cache files on the host removed (p2p_cache_files); says where the cache went."""
    removed = []
    for path in p2p_cache_files(release):
        os.unlink(path)
        removed.append(path)
        out(f"rigup: removed vLLM's P2P access cache {path}")
    return (f"{len(removed)} file(s) on the host, and the container's with compose down" if removed
            else "the container's, with compose down: none is kept on the host")


def _restarted(release: Release, systemd: Systemd, out: Callable[[str], None], done: str) -> bool:
    """The pod restarted (ExecStop and ExecStartPre run `docker compose down`: a new container); False, with the
    reason and the marker line saying `done` and the failed restart, when systemd refused."""
    try:
        systemd.restart(release.unit)
    except subprocess.CalledProcessError as exc:
        detail = exc.stderr.strip() if exc.stderr else str(exc)
        out(f"rigup: {release.unit} could not be restarted: {detail}")
        out(f"{REVALIDATED_MARKER} {done}, restart FAILED")
        return False
    return True


def revalidate_member(
    release: Release,
    record: Dict[str, Any],
    passed: bool,
    current: Dict[str, Optional[str]],
    systemd: Systemd,
    out: Callable[[str], None],
) -> int:
    """`revalidate --member`: a cluster member's half of its re-validation. Its members pass or roll back as one
    (rigup.operations.cluster_gate), so a member is never gated alone: when the rig's fingerprint differs from
    the one its last passed gate recorded, vLLM's P2P access cache is removed (p2p_cache_files; the container's
    goes with the restart's `compose down`) and the member restarted; the converge then runs the cluster's gate
    (the head asks every probe of the release, for the whole cluster) and, when every member passed, the gate on
    each member records its generation with the fingerprint now. A failed cluster gate records nothing: the old
    fingerprint stays and the next converge re-validates again; with nothing older than the release that serves,
    the cluster's rollback restores nothing. When the release on disk is not the one that passed (a converge
    rolling out another), the cache is removed and the new release's restart and gate follow. A record without a
    fingerprint gets today's, without a restart. The last line says what was done (REVALIDATED_MARKER)."""
    recorded = record.get("fingerprint")
    serves_recorded = passed and record.get("release_sha256") == release.sha256
    if not isinstance(recorded, dict):
        if serves_recorded:
            _record_fingerprint(release, record, current, out)
        else:
            out(f"{REVALIDATED_MARKER} no fingerprint recorded: the cluster's next passed gate records it")
        return EXIT_PASSED
    changes = fingerprint_changes(recorded, current)
    if not changes:
        out(f"{REVALIDATED_MARKER} fingerprint unchanged")
        return EXIT_PASSED
    what = "; ".join(changes)
    out(f"rigup: {release.unit}: fingerprint changed: {what}")
    where = _remove_p2p_caches(release, out)
    probes = f"{len(release.gate_probes)} probes: {', '.join(release.gate_probes)}"
    if not serves_recorded:
        out(f"{REVALIDATED_MARKER} fingerprint changed: {what} -> P2P cache removed ({where}); the new release's "
            f"restart and the cluster's gate follow ({probes})")
        return EXIT_PASSED
    if not _restarted(release, systemd, out, f"fingerprint changed: {what} -> P2P cache removed ({where})"):
        return EXIT_FAILED
    out(f"{REVALIDATED_MARKER} fingerprint changed: {what} -> P2P cache removed ({where}), member restarted: the "
        f"cluster's gate asks the full probe set ({probes})")
    return EXIT_PASSED


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="rigup-servingctl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_probe = sub.add_parser("probe", help="print the state of one variant as JSON")
    p_probe.add_argument("--release", required=True, help="the variant's release.json")
    p_gate = sub.add_parser("gate", help="health-gate the running release; record or roll back")
    p_gate.add_argument("--release", required=True, help="the variant's release.json")
    p_gate.add_argument("--timeout", type=float, required=True, help="seconds to wait for the model")
    p_gate.add_argument("--keep", type=int, default=2, help="generations to keep")
    p_gate.add_argument("--no-rollback", action="store_true", help="fail without restoring the last good one")
    p_gate.add_argument("--hold", action="store_true",
                        help="a cluster member's gate: record nothing, roll nothing back (the control machine decides)")
    p_back = sub.add_parser("rollback", help="restore, restart and gate the last good generation")
    p_back.add_argument("--release", required=True, help="the variant's release.json (the one to take out)")
    p_back.add_argument("--timeout", type=float, required=True, help="seconds to wait for the restored model")
    p_back.add_argument("--reason", required=True, help="why, for the record (another member's failed gate)")
    p_reval = sub.add_parser("revalidate", help="the rig's fingerprint changed since the last passed gate: remove "
                             "vLLM's P2P cache, restart and gate with every probe")
    p_reval.add_argument("--release", required=True, help="the pod's release.json")
    p_reval.add_argument("--timeout", type=float, required=True, help="seconds to wait for the model")
    p_reval.add_argument("--keep", type=int, default=2, help="generations to keep")
    p_reval.add_argument("--member", action="store_true",
                         help="a cluster member: remove the cache and restart it; the cluster's gate follows")
    p_super = sub.add_parser("supersede", help="the fleet asks for the release that serves: a failed gate of another no longer stands")
    p_super.add_argument("--release", required=True, help="the pod's release.json (as the converge rendered it)")
    p_text = sub.add_parser("textfile", help="write rigup's facts for node_exporter's textfile collector")
    p_text.add_argument("--install-root", required=True)
    p_text.add_argument("--out", required=True, help="the .prom file, in node_exporter's textfile directory")
    p_text.add_argument("--wanted-driver-branch", type=int, required=True)
    p_text.add_argument("--model-dir", required=True)
    p_sent = sub.add_parser("sentinel", help="ask every serving pod the probes once; quarantine or release; write the textfile")
    p_sent.add_argument("--install-root", required=True)
    p_sent.add_argument("--out", required=True, help="the .prom file, in node_exporter's textfile directory")
    p_sent.add_argument("--fail-after", type=int, required=True, help="failed rounds in a row that quarantine a pod")
    p_sent.add_argument("--pass-after", type=int, required=True, help="passed rounds in a row that release it")
    args = parser.parse_args(argv)
    if args.command == "sentinel":
        return sentinel(args.install_root, args.out, args.fail_after, args.pass_after, Systemd())
    if args.command == "textfile":
        write_textfile(args.out, args.install_root, args.wanted_driver_branch, args.model_dir)
        return 0
    systemd = Systemd()
    if args.command == "probe":
        print(json.dumps(probe(args.release, systemd), sort_keys=True))
        return 0

    def out(line: str) -> None:
        print(line, flush=True)

    if args.command == "supersede":
        return supersede(args.release, out=out)
    if args.command == "revalidate":
        return revalidate(args.release, args.timeout, args.keep, systemd, out=out, member=args.member)
    if args.command == "rollback":
        return roll_back(args.release, args.reason, args.timeout, systemd, out=out)
    return gate(args.release, args.timeout, args.keep, not args.no_rollback, systemd, out=out, hold=args.hold)


if __name__ == "__main__":
    sys.exit(main())
