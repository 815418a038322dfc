"""Prefill/decode proxy for two `vllm serve` instances running the LMCompact connector.

Each completion goes first to the prefill instance (``kv_role`` ``"kv_producer"``) with
``max_tokens`` 1: it computes the prompt and stores its compacted chunks in the shared Redis
store; its response carries ``kv_transfer_params`` saying what it stored. The proxy copies them
into the request it then sends to the decode instance (``"kv_consumer"``), which loads the
stored prefix from Redis instead of computing it, and decodes. The client gets the decode
instance's answer (streamed when it asked for a stream). If the prefill instance fails, the
request still goes to the decode instance, which then computes the prompt itself.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8001 \\
        --decode http://127.0.0.1:8002 --port 8000

Standard library only; one thread per connection. A sketch of what a router does, not a
production load balancer (no retries, one prefill and one decode instance).
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("pd_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600.0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill instance gets: the same prompt, one token, no stream."""
    one = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    one["max_tokens"] = 1
    if "max_completion_tokens" in one:
        one["max_completion_tokens"] = 1
    return one


def decode_body(body: dict[str, Any], transfer: dict[str, Any] | None) -> dict[str, Any]:
    """The request the decode instance gets: the client's, with the producer's params."""
    if not transfer:
        return body
    return {**body, "kv_transfer_params": {**(body.get("kv_transfer_params") or {}), **transfer}}


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return dict(json.loads(response.read()))


class Proxy(BaseHTTPRequestHandler):
    prefill = ""
    decode = ""
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        if self.path not in ROUTES:
            self.send_error(404, f"only {', '.join(ROUTES)}")
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        transfer = None
        try:
            transfer = post_json(self.prefill + self.path, prefill_body(body)).get(
                "kv_transfer_params"
            )
        except (OSError, ValueError) as error:  # the decode side computes the prompt then
            logger.warning("prefill instance failed (%s); decoding without its prefix", error)
        self._relay(self.decode + self.path, decode_body(body, transfer))

    def do_GET(self) -> None:
        self._relay(self.decode + self.path, None)  # /v1/models, /metrics, /health

    def _relay(self, url: str, body: dict[str, Any] | None) -> None:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
        try:
            response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as error:
            self._send(error.code, error.headers.get("Content-Type"), iter([error.read()]))
            return
        with response:  # chunks as they come: a stream reaches the client token by token
            chunks = iter(lambda: response.read1(65536), b"")
            self._send(response.status, response.headers.get("Content-Type"), chunks)

    def _send(self, status: int, content_type: str | None, chunks: Iterator[bytes]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type or "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s " + format, self.address_string(), *args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="base URL of the kv_producer instance")
    parser.add_argument("--decode", required=True, help="base URL of the kv_consumer instance")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (logged)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Proxy.prefill, Proxy.decode = args.prefill.rstrip("/"), args.decode.rstrip("/")
    server = ThreadingHTTPServer((args.host, args.port), Proxy)
    host, port = server.server_address[:2]
    logger.info("proxy on %s:%d: prefill %s, decode %s", host, port, args.prefill, args.decode)
    server.serve_forever()


if __name__ == "__main__":
    main()
