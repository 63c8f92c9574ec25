"""A test-only HTTP proxy in front of an S3 server that refuses requests signed with a session token it
was told is expired, as S3 does (HTTP 400, ``<Code>ExpiredToken</Code>``), and forwards the others.

It records every request's session token (``tokens``), so a test can count the requests and see which
credentials signed each. Threaded (``http.server``), keep-alive, bodies of GETs only.
"""

from __future__ import annotations

import http.client
import http.server
import threading
from typing import Any

_EXPIRED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ExpiredToken</Code>'
    b"<Message>The provided token has expired.</Message></Error>"
)


class ExpiringProxy:
    """``with ExpiringProxy(target_port, expired={"tok-1"}) as proxy: proxy.endpoint_url``."""

    def __init__(self, target_host: str, target_port: int, *, expired: set[str] | None = None,
                 expire_all: bool = False) -> None:  # fmt: skip
        self.target = (target_host, target_port)
        self.expired = set(expired or ())
        self.expire_all = expire_all
        self.tokens: list[str | None] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                token = self.headers.get("x-amz-security-token")
                with proxy._lock:
                    proxy.tokens.append(token)
                if proxy.expire_all or token in proxy.expired:
                    self._answer(400, [("Content-Type", "application/xml")], _EXPIRED)
                    return
                conn = http.client.HTTPConnection(*proxy.target, timeout=30)
                try:
                    conn.request("GET", self.path, headers=dict(self.headers.items()))
                    resp = conn.getresponse()
                    body = resp.read()
                    keep = [(k, v) for k, v in resp.getheaders()
                            if k.lower() not in ("content-length", "transfer-encoding", "connection")]
                    self._answer(resp.status, keep, body)
                finally:
                    conn.close()

            def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> ExpiringProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
