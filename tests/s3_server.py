"""A real S3-compatible HTTP server on loopback for the ``s3://`` tests: moto's server mode.

One server per test session (``s3_server`` fixture in ``conftest.py``), one bucket, and a
fresh prefix per store (:meth:`S3Server.url`), so tests never see each other's objects.
Clients reach it either through ``storage_options`` (:attr:`S3Server.options`) or through
the usual AWS environment variables (:meth:`S3Server.env`, for subprocesses and the CLI).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid

BUCKET = "rlhf-pipeline-tests"
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret",
                "AWS_DEFAULT_REGION": "us-east-1"}


class RequestLog:
    """WSGI middleware that records ``(method, path?query)`` of each request while recording:
    what a test counts requests with, on the server's side."""

    def __init__(self, app):
        self.app = app
        self.entries: list[tuple] | None = None
        self._by_key = False
        self._lock = threading.Lock()

    def __call__(self, environ, start_response):
        if self.entries is not None:
            query = environ.get("QUERY_STRING")
            entry = (environ["REQUEST_METHOD"], environ.get("PATH_INFO", "") + (f"?{query}" if query else ""))
            if self._by_key:  # the access key id the request was signed with: which client sent it
                authorization = environ.get("HTTP_AUTHORIZATION", "")
                entry = (authorization.partition("Credential=")[2].partition("/")[0], *entry)
            with self._lock:
                self.entries.append(entry)
        return self.app(environ, start_response)

    @contextlib.contextmanager
    def recording(self, *, by_key: bool = False):
        """``with server.requests.recording() as entries:`` the requests sent inside the block;
        ``by_key``: ``(access key id, method, path)``, to tell clients signing with different keys apart."""
        entries: list[tuple] = []
        self.entries, self._by_key = entries, by_key
        try:
            yield entries
        finally:
            self.entries = None


class S3Server:
    def __init__(self):
        from moto.server import ThreadedMotoServer

        from rlhf_pipeline.bench.moto_etags import lock_moto_etags

        lock_moto_etags()

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
        requests = self.requests = RequestLog(None)

        class LoggedMotoServer(ThreadedMotoServer):
            def _server_entry(self) -> None:  # moto's own, with the request log around its app
                from moto.moto_server.threaded_moto_server import MotoRequestHandler
                from moto.server import create_backend_app
                from werkzeug.serving import make_server

                # the S3 application itself: moto's dispatcher in front of it finds the service of each
                # request again, listing moto's package directory under a lock shared by every request
                # (a quarter of the server's time in an s3:// run); this server only serves S3
                requests.app = create_backend_app("s3")
                self._server = make_server(self._ip_address, self._port, requests, True,
                                           request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self._server = LoggedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.options = {"endpoint_url": self.endpoint, "key": _CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        "secret": _CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
        self.client().create_bucket(Bucket=BUCKET)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=_CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")

    def url(self, name: str = "buffer") -> str:
        return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/{name}"

    def env(self) -> dict[str, str]:
        """``os.environ`` plus this server as the AWS endpoint and credentials."""
        return {**os.environ, **_CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def keys(self, url: str) -> list[str]:
        prefix = url.removeprefix(f"s3://{BUCKET}/")
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
        return [item["Key"][len(prefix) + 1:] for page in pages for item in page.get("Contents", [])]

    def get(self, url: str, key: str) -> bytes:
        """``key`` under ``url``, read by a client of its own (what ``AzuriteServer.get`` does on Azure)."""
        return self.client().get_object(Bucket=BUCKET, Key=f"{url.removeprefix(f's3://{BUCKET}/')}/{key}")["Body"].read()

    def stop(self) -> None:
        self._server.stop()



def missing_packages() -> list[str]:
    import importlib.util

    return [name for name in ("s3fs", "moto", "flask") if importlib.util.find_spec(name) is None]
