"""A small client for vLLM's OpenAI-compatible API: /v1/models, chat completions, SSE streaming.

verify and bench send their requests through this module. Failures come back as values (status 0
for no HTTP answer at all: refused, timed out, dropped), never as exceptions, because the checks grade
them. Streaming records when the first content or reasoning delta arrived (TTFT) and when the stream
ended, with perf_counter stamps taken as the bytes are read, so the parsing cost stays out of them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import requests
import urllib3

CONNECT_TIMEOUT_S = 5.0
READ_SIZE = 65536


@dataclass
class ToolCall:
    name: str
    arguments: str
    id: str | None = None

    def parsed_arguments(self) -> dict[str, Any] | None:
        """The arguments as a JSON object, or None when they are not one."""
        try:
            value = json.loads(self.arguments) if self.arguments else {}
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


@dataclass
class ChatResult:
    """One chat completion. status 0: no HTTP response (connection refused, timeout, dropped)."""

    status: int
    elapsed: float
    error: str | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def completion_tokens(self) -> int | None:
        return None if self.usage is None else self.usage.get("completion_tokens")

    def describe_failure(self) -> str:
        if self.status == 0:
            return f"no response ({self.error})"
        return f"HTTP {self.status}: {self.error}" if self.error else f"HTTP {self.status}"


@dataclass
class StreamResult(ChatResult):
    """A streamed chat completion with its timings (seconds, perf_counter clock)."""

    started: float = 0.0  # request about to be sent
    first_token_at: float | None = None  # first delta carrying content or reasoning text
    finished: float = 0.0  # stream ended ([DONE], EOF or error)
    content_chunks: int = 0
    reasoning_chunks: int = 0
    events: int = 0
    done: bool = False  # saw `data: [DONE]`
    # Text pieces as they arrive, joined into content/reasoning when the stream ends (appending to
    # one string would copy it for every token).
    content_parts: list[str] = field(default_factory=list, repr=False)
    reasoning_parts: list[str] = field(default_factory=list, repr=False)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started


@dataclass
class ModelsResult:
    status: int
    elapsed: float
    error: str | None = None
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> the entry vLLM returned

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def describe_failure(self) -> str:
        return f"no response ({self.error})" if self.status == 0 else f"HTTP {self.status}: {self.error}"

    def max_model_len(self, model: str) -> int | None:
        value = self.models.get(model, {}).get("max_model_len")
        return value if isinstance(value, int) else None


class SSEParser:
    """Incremental parser for text/event-stream: feed bytes, get each event's data string.

    Follows the WHATWG rules that matter for OpenAI streams: events end at a blank line, several
    `data:` lines join with newlines, one space after the colon is dropped, comments (`:`) and other
    fields are ignored, and lines may end in CRLF.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        events: list[str] = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data).decode("utf-8"))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return events

    def close(self) -> list[str]:
        """Events left when the stream ended without a final blank line."""
        events = self.feed(b"\n\n") if self._buffer or self._data else []
        return events


class ApiClient:
    """Requests to one OpenAI-compatible server. One instance per thread (requests.Session is not
    documented as thread-safe)."""

    def __init__(self, base_url: str, api_key: str | None = None, ca_file: str | None = None) -> None:
        """`ca_file`: the CA certificate an https server's certificate is verified against (the fleet CA's for
        the entrance); None: the system's trust store. The check is never skipped."""
        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()
        self.ca_file = ca_file
        # given with each request: a session's own `verify` loses to $REQUESTS_CA_BUNDLE (requests'
        # merge_environment_settings), a request's does not
        self.verify: str | bool = ca_file or True
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def close(self) -> None:
        self.session.close()

    def models(self, timeout: float = 5.0) -> ModelsResult:
        started = time.perf_counter()
        try:
            response = self.session.get(f"{self.base_url}/v1/models", timeout=(CONNECT_TIMEOUT_S, timeout), verify=self.verify)
        except requests.RequestException as exc:
            return ModelsResult(0, time.perf_counter() - started, _request_error(exc, self.ca_file))
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            return ModelsResult(response.status_code, elapsed, _error_text(response.text))
        try:
            entries = response.json()["data"]
            models = {entry["id"]: entry for entry in entries}
        except (ValueError, KeyError, TypeError):
            return ModelsResult(response.status_code, elapsed, "response is not an OpenAI model list")
        return ModelsResult(200, elapsed, None, models)

    def chat(self, payload: dict[str, Any], timeout: float) -> ChatResult:
        """A non-streaming chat completion."""
        started = time.perf_counter()
        body = {**payload, "stream": False}
        try:
            response = self.session.post(
                f"{self.base_url}/v1/chat/completions", json=body, timeout=(CONNECT_TIMEOUT_S, timeout),
                verify=self.verify,
            )
        except requests.RequestException as exc:
            return ChatResult(0, time.perf_counter() - started, _request_error(exc, self.ca_file))
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            return ChatResult(response.status_code, elapsed, _error_text(response.text))
        try:
            document = response.json()
            choice = document["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            return ChatResult(200, elapsed, "response is not an OpenAI chat completion")
        calls = [
            ToolCall(
                name=(call.get("function") or {}).get("name") or "",
                arguments=(call.get("function") or {}).get("arguments") or "",
                id=call.get("id"),
            )
            for call in message.get("tool_calls") or ()
        ]
        return ChatResult(
            status=200,
            elapsed=elapsed,
            content=message.get("content") or "",
            reasoning=message.get("reasoning") or message.get("reasoning_content") or "",
            tool_calls=calls,
            finish_reason=choice.get("finish_reason"),
            usage=document.get("usage"),
        )

    def stream_chat(self, payload: dict[str, Any], timeout: float) -> StreamResult:
        """A streamed chat completion with usage; `timeout` bounds the whole request."""
        body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
        result = StreamResult(status=0, elapsed=0.0)
        result.started = time.perf_counter()
        deadline = result.started + timeout
        calls: dict[int, ToolCall] = {}
        try:
            response = self.session.post(
                f"{self.base_url}/v1/chat/completions",
                json=body,
                stream=True,
                timeout=(CONNECT_TIMEOUT_S, timeout),
                verify=self.verify,
            )
        except requests.RequestException as exc:
            return _finish(result, _request_error(exc, self.ca_file))
        with response:
            result.status = response.status_code
            if response.status_code != 200:
                return _finish(result, _error_text(response.text))
            parser = SSEParser()
            try:
                for received, chunk in _timed_reads(response):
                    for data in parser.feed(chunk):
                        apply_stream_event(result, calls, data, received)
                    if result.done:
                        break
                    if received > deadline:
                        return _finish(result, f"timed out after {timeout:g} s", calls)
                else:
                    for data in parser.close():
                        apply_stream_event(result, calls, data, time.perf_counter())
            except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
                # Reading the raw stream bypasses requests' own exception wrapping.
                return _finish(result, f"stream broke: {_request_error(exc, self.ca_file)}", calls)
            except ValueError as exc:
                return _finish(result, f"bad event in stream: {exc}", calls)
        if not result.done:
            return _finish(result, "stream ended without [DONE]", calls)
        return _finish(result, None, calls)


def _timed_reads(response: requests.Response) -> Iterator[tuple[float, bytes]]:
    """Bytes as they arrive, each with the perf_counter time it was read.

    read1 returns whatever one socket read (or one HTTP chunk) delivered instead of waiting for a
    full buffer, so the time stamps are those of arrival.
    """
    raw = response.raw
    while True:
        chunk = raw.read1(READ_SIZE, decode_content=True)
        if not chunk:
            return
        yield time.perf_counter(), chunk


def apply_stream_event(result: StreamResult, calls: dict[int, ToolCall], data: str, received: float) -> None:
    """Fold one event into the result."""
    if data == "[DONE]":
        result.done = True
        return
    event = json.loads(data)
    result.events += 1
    if event.get("usage"):
        result.usage = event["usage"]
    if "error" in event and not event.get("choices"):
        # vLLM reports errors that happen after the headers inside the stream.
        error = event["error"]
        raise ValueError(error.get("message") if isinstance(error, dict) else str(error))
    texted = False
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content:
            result.content_parts.append(content)
            result.content_chunks += 1
            texted = True
        # Newer vLLM names the field `reasoning`, older `reasoning_content`; some send both.
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            result.reasoning_parts.append(reasoning)
            result.reasoning_chunks += 1
            texted = True
        for fragment in delta.get("tool_calls") or ():
            index = fragment.get("index", 0)
            call = calls.setdefault(index, ToolCall(name="", arguments=""))
            if fragment.get("id"):
                call.id = fragment["id"]
            function = fragment.get("function") or {}
            if function.get("name"):
                call.name += function["name"]
            if function.get("arguments"):
                call.arguments += function["arguments"]
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    if texted and result.first_token_at is None:
        result.first_token_at = received


def _finish(result: StreamResult, error: str | None, calls: dict[int, ToolCall] | None = None) -> StreamResult:
    result.finished = time.perf_counter()
    result.elapsed = result.finished - result.started
    result.error = error
    result.content = "".join(result.content_parts)
    result.reasoning = "".join(result.reasoning_parts)
    if calls:
        result.tool_calls = [calls[index] for index in sorted(calls)]
    return result


def _request_error(exc: Exception, ca_file: str | None = None) -> str:
    """A short reason without the request details (URLs are fine, headers could hold the key)."""
    if isinstance(exc, (requests.Timeout, urllib3.exceptions.ReadTimeoutError, TimeoutError)):
        return "timed out"
    if isinstance(exc, (urllib3.exceptions.ProtocolError, ConnectionError)):
        return "connection dropped by the server"
    if isinstance(exc, requests.exceptions.SSLError):
        return tls_failure(exc, ca_file)
    if isinstance(exc, requests.ConnectionError):
        reason = str(exc.args[0]) if exc.args else "connection failed"
        if "Connection refused" in reason:
            return "connection refused"
        if "Name or service not known" in reason or "nodename nor servname" in reason:
            return "host name not resolved"
        if "RemoteDisconnected" in reason or "Connection aborted" in reason or "Connection reset" in reason:
            return "connection dropped by the server"
        return "connection failed"
    return type(exc).__name__


def tls_failure(exc: Exception, ca_file: str | None = None) -> str:
    """One line for a TLS handshake that failed: the server's certificate is not one the client trusts
    (another CA's, expired, for other names) or the server does not speak TLS."""
    text = str(exc)
    trusted = f"the CA in {ca_file}" if ca_file else "a CA this machine trusts (no CA file given)"
    for marker, why in (
        ("unable to get local issuer certificate", f"its certificate is not signed by {trusted}"),
        ("self-signed certificate in certificate chain", f"its certificate is not signed by {trusted}"),
        ("self signed certificate in certificate chain", f"its certificate is not signed by {trusted}"),
        ("certificate has expired", "its certificate has expired"),
        ("Hostname mismatch", "its certificate does not name the address asked"),
        ("IP address mismatch", "its certificate does not name the address asked"),
        ("WRONG_VERSION_NUMBER", "it does not speak TLS there (plain HTTP?)"),
        ("Could not find a suitable TLS CA certificate bundle", f"the CA certificate file is not there ({ca_file or '?'})"),
    ):
        if marker in text:
            return f"TLS refused: {why}"
    verify = re.search(r"certificate verify failed: ([^(')]+)", text)
    return f"TLS refused: {verify.group(1).strip() if verify else type(exc).__name__}"


def _error_text(text: str) -> str:
    """The message of an OpenAI-style error body, or the start of the body."""
    try:
        document = json.loads(text)
    except ValueError:
        return text.strip()[:300] or "empty body"
    error = document.get("error") if isinstance(document, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:300]
    if isinstance(error, str):
        return error[:300]
    if isinstance(document, dict) and "detail" in document:
        return str(document["detail"])[:300]
    return text.strip()[:300]
