"""A real S3 HTTP endpoint on 127.0.0.1 for tests: moto's server mode behind a `TcpProxy`.

moto's `ThreadedMotoServer` answers the S3 REST API (range reads give 206, `If-None-Match: *`
gives 412 on an existing key), so boto3 runs unmodified. Clients use `endpoint` (the proxy),
which tests can switch off to make the store unreachable; `direct_url` bypasses the proxy.
moto accepts any credentials; `CREDENTIALS` are the ones the fixtures export.
"""

from __future__ import annotations

from typing import Any

from tests.support.tcp_proxy import TcpProxy

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "sparsesync-test-key",
    "AWS_SECRET_ACCESS_KEY": "sparsesync-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    """moto on an ephemeral loopback port, fronted by a switchable proxy."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.proxy: TcpProxy | None = None

    def start(self) -> S3Server:
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.direct_url = f"http://{host}:{port}"
        self.proxy = TcpProxy(host, port).start()
        return self

    @property
    def endpoint(self) -> str:
        assert self.proxy is not None, "start() first"
        return self.proxy.url

    def client(self, *, direct: bool = True) -> Any:
        """A boto3 S3 client for test setup and inspection (direct: not through the proxy)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.direct_url if direct else self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def create_bucket(self, name: str) -> str:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self._moto.stop()
