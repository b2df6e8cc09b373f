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
    def __init__(self, root: Path, users: dict[str, str] | None = None,
                 tokens: TokenServer | None = None) -> None:
        self.root = root
        self.tokens = tokens
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
        if self.tokens is not None:
            lines += ["auth:", "  token:", f"    realm: {self.tokens.realm}",
                      "    service: neuronctl-test-registry", "    issuer: neuronctl-tests",
                      f"    rootcertbundle: {self.tokens.bundle}"]
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


class TokenServer:
    """The bearer-token flow of Docker Hub, GHCR or Harbor, for the distribution registry's
    `auth: token:` (registry/auth/token/token.go: an RS256 JWT whose x5c certificate the
    registry's rootcertbundle holds, `access` granting actions per repository). It grants a
    request with the right basic credentials every action its scope asks for."""

    def __init__(self, root: Path, users: dict[str, str]) -> None:
        import datetime
        import threading
        from http.server import ThreadingHTTPServer

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self.users = users
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "neuronctl-test-tokens")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        root.mkdir(parents=True, exist_ok=True)
        self.bundle = root / "token-cert.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.scopes: list[str] = []  # every scope asked for, granted or not
        server = self
        handler = _token_handler(server)
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.realm = f"http://127.0.0.1:{self._http.server_address[1]}/token"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._http.shutdown()

    def token(self, service: str, scopes: list[str]) -> str:
        import base64
        import json as jsonlib

        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        der = self.cert.public_bytes(serialization.Encoding.DER)
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(der).decode()]}
        now = int(time.time())
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        claims = {"iss": "neuronctl-tests", "sub": "ci", "aud": service, "exp": now + 600,
                  "nbf": now - 10, "iat": now, "jti": str(now) + str(len(self.scopes)),
                  "access": access}
        signing = f"{b64(jsonlib.dumps(header).encode())}.{b64(jsonlib.dumps(claims).encode())}"
        signature = self.key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{b64(signature)}"


def _token_handler(server: TokenServer) -> type:
    import base64
    import json as jsonlib
    from http.server import BaseHTTPRequestHandler
    from urllib.parse import parse_qs, urlparse

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            query = parse_qs(urlparse(self.path).query)
            scopes = query.get("scope", [])
            server.scopes.extend(scopes)
            auth = self.headers.get("Authorization", "")
            try:
                user, _, password = base64.b64decode(auth.removeprefix("Basic ")).decode()\
                    .partition(":")
            except ValueError:
                user = password = ""
            if not auth.startswith("Basic ") or server.users.get(user) != password:
                self.send_response(401)
                self.end_headers()
                return
            body = jsonlib.dumps({"token": server.token(query["service"][0], scopes)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler
