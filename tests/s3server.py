"""A real S3-protocol server on 127.0.0.1 for tests and benchmarks: moto's app, counted.

moto's WSGI app is served by werkzeug in a thread (as moto's ThreadedMotoServer does), wrapped
in a middleware that counts requests per method and the bytes uploaded, so tests can assert
"a re-push uploads nothing" from the server's side rather than trusting the client.
Every test uses its own bucket, so no state needs resetting between tests.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from werkzeug.serving import WSGIRequestHandler, make_server

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:  # one line per request is noise
        pass


class S3Server:
    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app

        self._app = DomainDispatcherApplication(create_backend_app)
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # "PUT", "GET", ...
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        self._server = make_server(
            "127.0.0.1", 0, self._count, threaded=True, request_handler=_QuietHandler
        )
        # shutdown() waits up to one poll interval (0.5 s by default) for the loop to notice
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def env(self) -> dict[str, str]:
        """What a client (this process or a subprocess) needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def start(self) -> S3Server:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_uploaded = 0
            self.bytes_downloaded = 0

    def uploads(self) -> int:
        """Requests that write object data (single PUTs, multipart parts and completions)."""
        return self.requests["PUT"] + self.requests["POST"]

    def _count(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        length = int(environ.get("CONTENT_LENGTH") or 0)
        with self._lock:
            self.requests[method] += 1
            if method in ("PUT", "POST"):
                self.bytes_uploaded += length
        body = self._app(environ, start_response)
        if method != "GET":
            return body
        return self._count_body(body)

    def _count_body(self, body: Iterable[bytes]) -> Iterable[bytes]:
        for chunk in body:
            with self._lock:
                self.bytes_downloaded += len(chunk)
            yield chunk
        close = getattr(body, "close", None)
        if close:
            close()


def new_bucket(server: S3Server) -> str:
    """A fresh bucket on the server, created through boto3 (not the code under test)."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    boto_client(server).create_bucket(Bucket=name)
    return name


def boto_client(server: S3Server) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
    )
