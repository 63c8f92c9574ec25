"""Azurite (Azure Blob Storage) and the gcp-storage-emulator (GCS) as local server processes.

Started, health-checked and stopped like :class:`~blobdata.testing.servers.LocalS3Server` (same
base class): 127.0.0.1, free ports, a log file in a temporary directory, stopped by PID.

    with LocalAzurite() as az:                        # needs `npm install -g azurite`
        fs = adlfs.AzureBlobFileSystem(**az.storage_options)
    with LocalGCSEmulator() as gcs:                   # pip install gcp-storage-emulator
        gcs.create_bucket("data")
"""

from __future__ import annotations

import contextlib
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from .servers import _ServerProcess, _tcp_open, find_executable, find_free_port

__all__ = ["AZURITE_ACCOUNT", "AZURITE_KEY", "LocalAzurite", "LocalGCSEmulator"]

#: Azurite's documented development account and its well-known public key (not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


# ----------------------------------------------------------------------------------------- Azurite


class LocalAzurite(_ServerProcess):
    """Azurite's blob service on 127.0.0.1 (``azurite-blob`` from npm), with the dev account.

    ``connection_string`` uses the documented ``devstoreaccount1`` account and its public key.
    """

    name = "azurite"

    def __init__(self) -> None:
        super().__init__()
        self.port = 0

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT};"
        )

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``adlfs.AzureBlobFileSystem``."""
        return {"connection_string": self.connection_string}

    def _command(self, tmpdir: Path) -> list[str]:
        exe = find_executable("azurite-blob")
        if exe is None:
            raise RuntimeError("azurite-blob not found: install it with `npm install -g azurite`")
        self.port = find_free_port()
        return [
            exe, "--loose", "--skipApiVersionCheck", "--disableTelemetry",
            "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--location", str(tmpdir / "data"), "--silent",
        ]  # fmt: skip

    def service_client(self) -> Any:
        """An ``azure.storage.blob.BlobServiceClient`` for this Azurite (timeouts of 10 s)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(
            self.connection_string, connection_timeout=10, read_timeout=10, retry_total=0
        )

    def _healthy(self) -> bool:
        if not _tcp_open(self.port):
            return False
        try:
            client = self.service_client()
            list(client.list_containers(results_per_page=1))
            return True
        except Exception:
            return False

    def create_bucket(self, name: str) -> None:
        """Create container ``name`` (an existing one is fine)."""
        from azure.core.exceptions import ResourceExistsError

        with contextlib.suppress(ResourceExistsError):
            self.service_client().create_container(name)

    def __enter__(self) -> LocalAzurite:
        self.start()
        return self


# -------------------------------------------------------------------------------------------- GCS


class LocalGCSEmulator(_ServerProcess):
    """The ``gcp-storage-emulator`` on 127.0.0.1, in memory.

    gcsfs must run with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` against it (blobdata's ``get_fs``
    sets it), or its bucket-type probe stalls for 60 s.
    """

    name = "gcs-emulator"

    def __init__(self) -> None:
        super().__init__()
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``gcsfs.GCSFileSystem``."""
        return {"endpoint_url": self.endpoint_url, "token": "anon"}

    def _command(self, tmpdir: Path) -> list[str]:
        self.port = find_free_port()
        return [
            sys.executable, "-m", "gcp_storage_emulator", "start",
            "--host", "127.0.0.1", "--port", str(self.port), "--in-memory",
        ]  # fmt: skip

    def _request(self, method: str, path: str, body: bytes | None = None, timeout_s: float = 10.0) -> bytes:
        req = urllib.request.Request(self.endpoint_url + path, data=body, method=method)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            data: bytes = resp.read()
            return data

    def _healthy(self) -> bool:
        if not _tcp_open(self.port):
            return False
        try:
            self._request("GET", "/storage/v1/b?project=test", timeout_s=2.0)
            return True
        except (OSError, urllib.error.URLError):
            return False

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` through the JSON API (an existing one is fine)."""
        try:
            self._request("POST", "/storage/v1/b?project=test", json.dumps({"name": name}).encode())
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        """Upload one object through the JSON API's simple media upload."""
        name = urllib.parse.quote(key, safe="")
        req = urllib.request.Request(
            f"{self.endpoint_url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
            data=data,
            method="POST",
            headers={"Content-Type": "application/octet-stream"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()

    def delete_object(self, bucket: str, key: str) -> None:
        """Delete one object through the JSON API."""
        name = urllib.parse.quote(key, safe="")
        self._request("DELETE", f"/storage/v1/b/{bucket}/o/{name}")

    def __enter__(self) -> LocalGCSEmulator:
        self.start()
        return self
