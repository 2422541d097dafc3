"""Azurite, Microsoft's Azure Blob Storage emulator, on loopback for the ``az://`` tests.

The Azure counterpart of ``s3_server.py``: one emulator per test session (``azure_server``
fixture in ``conftest.py``), in memory, one container, and a fresh prefix per store
(:meth:`AzuriteServer.url`). Clients reach it through ``storage_options``
(:attr:`AzuriteServer.options`) or ``AZURE_STORAGE_CONNECTION_STRING`` (:meth:`AzuriteServer.env`,
for subprocesses and the CLI). Azurite is a Node.js program from the npm registry, not PyPI, so
it is looked for (:func:`azurite_command`) rather than installed by pip; ``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

CONTAINER = "rlhf-pipeline-tests"
ACCOUNT = "devstoreaccount1"
# Azurite's fixed development account key, published in its documentation: not a secret
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_VERSION = "3.37.0"  # what .ci/run installs and these tests were run against


def azurite_command() -> str | None:
    """``azurite-blob``: ``$AZURITE_BLOB``, else on ``PATH``, else where ``.ci/run`` installs it
    (``${XDG_CACHE_HOME:-~/.cache}/rlhf-pipeline/azurite``); None when none is found."""
    explicit = os.environ.get("AZURITE_BLOB")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    on_path = shutil.which("azurite-blob")
    if on_path:
        return on_path
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    installed = cache / "rlhf-pipeline" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    return str(installed) if os.access(installed, os.X_OK) else None


def missing_requirements() -> list[str]:
    """What the ``az://`` tests lack: the Python packages of the ``azure`` extra, Azurite itself."""
    import importlib.util

    missing = []
    for module, pip in (("adlfs", "adlfs"), ("azure.storage.blob", "azure-storage-blob")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(f"{pip} (pip install -e '.[azure]')")
    if azurite_command() is None:
        missing.append(f"Azurite (npm install azurite@{AZURITE_VERSION} under ~/.cache/rlhf-pipeline/azurite, "
                       f"or set AZURITE_BLOB to its azurite-blob)")
    return missing


def connection_string(endpoint: str, key: str = ACCOUNT_KEY) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")


class AzuriteServer:
    def __init__(self, workdir: Path):
        command = azurite_command()
        with socket.socket() as probe:  # a free port; Azurite cannot be asked for port 0
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self._log = open(workdir / "azurite.log", "wb")  # noqa: SIM115 - open for the server's lifetime
        self._process = subprocess.Popen(
            [command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence", "--silent",
             "--skipApiVersionCheck"],
            cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.endpoint = f"http://127.0.0.1:{port}"
        self.connection_string = connection_string(self.endpoint)
        self.options = {"connection_string": self.connection_string}
        self._wait_until_listening(port)
        self.client().create_container(CONTAINER)

    def _wait_until_listening(self, port: int) -> None:
        deadline = time.monotonic() + 60  # node starts in about a second; a loaded machine is slower
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"Azurite exited with {self._process.returncode}; see {self._log.name}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"Azurite did not listen on 127.0.0.1:{port} within 60 s; see {self._log.name}")

    def client(self):
        """A synchronous ``BlobServiceClient`` on the emulator, for a test's own look at the objects."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def url(self, name: str = "buffer") -> str:
        return f"az://{CONTAINER}/{uuid.uuid4().hex[:12]}/{name}"

    def env(self) -> dict[str, str]:
        """``os.environ`` plus this emulator as the Azure account."""
        return {**os.environ, "AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def blob_name(self, url: str, key: str) -> str:
        return f"{url.removeprefix(f'az://{CONTAINER}/')}/{key}"

    def keys(self, url: str) -> list[str]:
        prefix = url.removeprefix(f"az://{CONTAINER}/") + "/"
        container = self.client().get_container_client(CONTAINER)
        return [blob.name[len(prefix):] for blob in container.list_blobs(name_starts_with=prefix)]

    def put(self, url: str, key: str, body: bytes) -> None:
        """Writes ``key`` under ``url`` unconditionally, as another program would."""
        container = self.client().get_container_client(CONTAINER)
        container.upload_blob(self.blob_name(url, key), body, overwrite=True)

    def get(self, url: str, key: str) -> bytes:
        container = self.client().get_container_client(CONTAINER)
        return container.download_blob(self.blob_name(url, key)).readall()

    def stop(self) -> None:
        # SIGKILL to its session at once: Azurite outlived SIGTERM and SIGINT alike (15 s, waiting on
        # open connections), so a polite stop cost every test session 10 s; it holds nothing worth
        # a clean exit (--inMemoryPersistence)
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._process.wait()
        self._log.close()
