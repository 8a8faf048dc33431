"""A quiet HTTP handler base for the tests' small fake servers: JSON replies, no access log."""

from __future__ import annotations

import http.server
import json
from typing import Any


class JsonHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
