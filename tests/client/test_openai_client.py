"""The OpenAI client: SSE parsing rules, and real requests against the test responder."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigup.client.openai_client import ApiClient, SSEParser, ToolCall
from tests.support.responder import MODEL, responder

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_sse_events_survive_any_chunking() -> None:
    stream = b'data: {"a": 1}\n\n: keep-alive comment\n\ndata: {"b":\ndata: 2}\r\n\r\nevent: x\ndata:[DONE]\n\n'
    whole = SSEParser().feed(stream)
    assert whole == ['{"a": 1}', '{"b":\n2}', "[DONE]"]
    for size in (1, 2, 3, 7):
        parser = SSEParser()
        events: list[str] = []
        for i in range(0, len(stream), size):
            events += parser.feed(stream[i : i + size])
        assert events == whole, size


def test_sse_event_without_final_blank_line_is_flushed_on_close() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: tail") == []
    assert parser.close() == ["tail"]


def test_tool_call_arguments_must_be_a_json_object() -> None:
    assert ToolCall("f", '{"city": "Paris"}').parsed_arguments() == {"city": "Paris"}
    assert ToolCall("f", "").parsed_arguments() == {}
    assert ToolCall("f", '["Paris"]').parsed_arguments() is None
    assert ToolCall("f", "{city: Paris").parsed_arguments() is None


def test_models_chat_and_stream_against_the_responder(tmp_path: Path) -> None:
    with responder(tmp_path, "--max-model-len", "4096") as server:
        client = ApiClient(server.url)
        models = client.models()
        assert models.ok and list(models.models) == [MODEL]
        assert models.max_model_len(MODEL) == 4096

        plain = client.chat({"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}],
                             "max_tokens": 400}, timeout=10)
        assert plain.ok and plain.content == "2 + 2 = 4." and plain.finish_reason == "stop"
        assert len(plain.reasoning) > 50  # thinking is on by default, as for Qwen3

        streamed = client.stream_chat({"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}],
                                       "max_tokens": 400}, timeout=10)
        assert streamed.ok and streamed.done
        assert streamed.content == plain.content and streamed.reasoning == plain.reasoning
        assert streamed.usage == plain.usage  # the final usage chunk
        assert streamed.usage["completion_tokens"] == streamed.content_chunks + streamed.reasoning_chunks
        assert streamed.ttft is not None and 0 < streamed.ttft <= streamed.elapsed


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_assembled(tmp_path: Path, stream: bool) -> None:
    with responder(tmp_path) as server:
        client = ApiClient(server.url)
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                   "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}}
        result = client.stream_chat(payload, 10) if stream else client.chat(payload, 10)
        assert result.ok and result.finish_reason == "tool_calls"
        assert [(c.name, c.parsed_arguments()) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
        assert result.tool_calls[0].id


def test_reasoning_content_field_of_older_vllm_is_read(tmp_path: Path) -> None:
    with responder(tmp_path, "--reasoning-field", "reasoning_content") as server:
        client = ApiClient(server.url)
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 400}
        assert len(client.chat(payload, 10).reasoning) > 50
        assert len(client.stream_chat(payload, 10).reasoning) > 50


def test_errors_come_back_as_values(tmp_path: Path) -> None:
    with responder(tmp_path, "--max-model-len", "1000", "--api-key", "sk-test-key") as server:
        anonymous = ApiClient(server.url)
        assert anonymous.models().status == 401
        client = ApiClient(server.url, api_key="sk-test-key")
        too_long = client.chat({"model": MODEL, "messages": [{"role": "user", "content": "x" * 8000}]}, 10)
        assert too_long.status == 400 and "maximum context length is 1000" in (too_long.error or "")
        wrong = client.stream_chat({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 10)
        assert wrong.status == 404 and "does not exist" in (wrong.error or "")
        port = server.url.rsplit(":", 1)[1]
    refused = ApiClient(f"http://127.0.0.1:{port}").chat({"model": MODEL, "messages": []}, 5)
    assert refused.status == 0 and refused.error == "connection refused"
    assert refused.describe_failure() == "no response (connection refused)"


def test_stream_timeout_bounds_the_whole_request(tmp_path: Path) -> None:
    with responder(tmp_path, "--tokens-per-s", "20") as server:
        client = ApiClient(server.url)
        result = client.stream_chat(
            {"model": MODEL, "messages": [{"role": "user", "content": "Write an essay."}], "max_tokens": 200,
             "chat_template_kwargs": {"enable_thinking": False}},
            timeout=0.5,
        )
        assert result.error is not None and "timed out" in result.error
        assert result.elapsed < 2.0


def test_a_crashing_server_is_a_status_0_or_a_broken_stream(tmp_path: Path) -> None:
    with responder(tmp_path, "--crash-above-tokens", "100") as server:
        client = ApiClient(server.url)
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 30}
        plain = client.chat(payload, 10)
        assert plain.status == 0 and plain.error == "connection dropped by the server"
        streamed = ApiClient(server.url).stream_chat(payload, 10)
        assert streamed.status == 200 and not streamed.ok and not streamed.done
        assert streamed.error is not None and streamed.error.startswith("stream broke")
        assert streamed.content == "The"  # what arrived before the drop is kept
        assert client.models().ok  # the responder itself lives on (a restarted engine)
