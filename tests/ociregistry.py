"""A real OCI registry on 127.0.0.1 for tests and benchmarks: the CNCF distribution registry
as Debian packages it (`docker-registry`, installed by `make install`), filesystem storage in
a temporary directory, optionally behind htpasswd (basic) auth.

Its access log is kept so a test can count, from the server's side, the bytes it sent for
each blob (`"GET /v2/<repo>/blobs/sha256:<hex> HTTP/1.1" 200 <bytes>`).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

BINARY = "docker-registry"
_BLOB_GET = re.compile(r'"GET /v2/\S+/blobs/(sha256:[0-9a-f]{64}) HTTP/[\d.]+" (\d{3}) (\d+)')


def registry_binary() -> str | None:
    return shutil.which(BINARY)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OciRegistry:
    def __init__(self, root: Path, users: dict[str, str] | None = None) -> None:
        self.root = root
        self.port = _free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.log = root / "registry.log"
        self.users = users or {}
        self._proc: subprocess.Popen[bytes] | None = None

    def _config(self) -> Path:
        lines = [
            "version: 0.1",
            "log:",
            "  level: error",
            "  accesslog:",
            "    disabled: false",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {self.root / 'data'}",
            "  delete:",
            "    enabled: true",
            "http:",
            f"  addr: {self.host}",
            "  secret: neuronctl-tests",
        ]
        if self.users:
            import bcrypt

            htpasswd = self.root / "htpasswd"
            htpasswd.write_text("".join(
                f"{user}:{bcrypt.hashpw(pw.encode(), bcrypt.gensalt(rounds=4)).decode()}\n"
                for user, pw in self.users.items()
            ))
            lines += ["auth:", "  htpasswd:", "    realm: neuronctl-tests",
                      f"    path: {htpasswd}"]
        config = self.root / "config.yml"
        config.write_text("\n".join(lines) + "\n")
        return config

    def start(self) -> OciRegistry:
        binary = registry_binary()
        assert binary is not None
        self.root.mkdir(parents=True, exist_ok=True)
        config = self._config()
        out = open(self.log, "ab")  # noqa: SIM115 - the process writes it until stop()
        self._proc = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=out)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1).close()
                return self
            except urllib.error.HTTPError:  # 401: up, and asking for credentials
                return self
            except OSError:
                assert self._proc.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, "the registry did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)

    def blob_path(self, digest: str) -> Path:
        """Where filesystem storage keeps a blob's bytes (to damage them in a test)."""
        hexdigest = digest.split(":", 1)[1]
        return (self.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256"
                / hexdigest[:2] / hexdigest / "data")

    def served_blob_bytes(self) -> dict[str, int]:
        """Bytes sent per blob digest so far, from the access log (GETs: whole and ranged)."""
        sent: dict[str, int] = {}
        for digest, status, size in _BLOB_GET.findall(self.log.read_text(errors="replace")):
            if status in ("200", "206"):
                sent[digest] = sent.get(digest, 0) + int(size)
        return sent
