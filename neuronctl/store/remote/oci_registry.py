"""One OCI repository's registry API through oras-py (oras.provider.Registry): its auth
(docker config.json `auths`, `credsStore` and `credHelpers`, bearer-token and basic
challenges), its blob existence check and chunked upload. What neuronctl adds: a timeout on
every request, no silent minutes of retries (oras retries any failure five times with
backoff), reads capped at the size the caller expects, and one-line errors.

Credentials, first found wins: $ORAS_USER/$ORAS_PASS (oras-py's names), then
$DOCKER_CONFIG/config.json or ~/.docker/config.json (what `docker login` and `oras login`
write), with its credential helpers.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from functools import cached_property
from http.cookiejar import DefaultCookiePolicy
from pathlib import Path
from typing import Any

import requests

from neuronctl.errors import NeuronctlError
from neuronctl.store.remote.errors import RemoteArtifactError, RemoteUnreachableError
from neuronctl.store.remote.oci_ref import PLAIN_HTTP_ENV, OciRef

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MAX_OCI_MANIFEST_BYTES = 4 * 1024 * 1024  # the limit registries apply to a manifest
CONNECT_TIMEOUT = 15.0
READ_TIMEOUT = 120.0  # seconds without a byte from the registry
UPLOAD_CHUNK = 64 * 1024 * 1024
HTTP_CHUNK = 1024 * 1024
USER_ENV, PASSWORD_ENV = "ORAS_USER", "ORAS_PASS"


class _Session(requests.Session):
    """Every request gets a timeout: a registry that stops answering is an error, not a
    hang."""

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs.setdefault("timeout", (CONNECT_TIMEOUT, READ_TIMEOUT))
        return super().request(method, url, *args, **kwargs)


def _client_class() -> Any:
    import oras.provider

    class Client(oras.provider.Registry):  # type: ignore[misc]
        def do_request(
            self,
            url: str,
            method: str = "GET",
            data: Any = None,
            headers: dict[str, str] | None = None,
            json: dict[str, Any] | None = None,
            stream: bool = False,
        ) -> requests.Response:
            headers = dict(headers or {})
            basic = getattr(self.auth, "_basic_auth", None)
            if self.auth_kind == "basic" and not basic:
                # No credentials to answer its challenge with: the 401 is the answer.
                return self.session.request(  # type: ignore[no-any-return]
                    method, url, data=data, json=json, headers=headers, stream=stream,
                    verify=self._tls_verify,
                )
            if self.auth_kind == "basic":
                # Up front: a challenge per request would send every upload chunk twice.
                headers.setdefault("Authorization", f"Basic {basic}")
            # The undecorated request: oras's retry wraps any failure in minutes of backoff.
            undecorated = oras.provider.Registry.do_request.__wrapped__
            sent = getattr(self.auth, "token", None)
            response = undecorated(self, url, method, data, dict(headers), json, stream)
            if response.status_code == 401 and self.auth_kind == "token":
                # oras answers a new challenge with the token it holds: one of another scope
                # (pull, where an upload needs push). Drop it to get one for this scope,
                # once for all the threads that were refused with it.
                response.close()
                with self.refresh_lock:
                    if self.auth.token == sent:
                        self.auth.token = None
                    response = undecorated(self, url, method, data, dict(headers), json, stream)
            return response  # type: ignore[no-any-return]

    return Client


def docker_configs() -> list[str]:
    """$DOCKER_CONFIG/config.json when set; oras-py adds ~/.docker/config.json itself."""
    folder = os.environ.get("DOCKER_CONFIG")
    return [os.path.join(folder, "config.json")] if folder else []


class Registry:
    """The registry API of one repository (`ref.registry`/`ref.repository`)."""

    def __init__(self, ref: OciRef) -> None:
        self.ref = ref
        self.scheme = "http" if ref.plain_http() else "https"
        self.base = f"{self.scheme}://{ref.registry}/v2/{ref.repository}"

    @cached_property
    def client(self) -> Any:
        kind = self._challenge_kind()
        client = _client_class()(hostname=self.ref.registry, insecure=self.scheme == "http",
                                 auth_backend=kind)
        client.auth_kind = kind
        client.refresh_lock = threading.Lock()
        session = _Session()
        session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        client.session = client.auth.session = session
        client.auth.load_configs(self.container(client), configs=docker_configs())
        user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
        if user and password:
            client.auth.set_basic_auth(user, password)
        return client

    def container(self, client: Any = None) -> Any:
        """oras's parsed reference, set field by field: its own parser reads a first path
        component with a dot in it as a registry name."""
        import oras.container

        container = oras.container.Container("placeholder")
        container.registry = self.ref.registry
        namespace, _, name = self.ref.repository.rpartition("/")
        container.namespace = namespace or None
        container.repository = name
        return container

    def _challenge_kind(self) -> str:
        """`basic` for a registry that asks for basic auth (htpasswd), else `token` (the
        bearer-token flow of Docker Hub, GHCR, ECR, Harbor...): oras-py needs to be told."""
        response = self._send(lambda: _Session().get(f"{self.scheme}://{self.ref.registry}/v2/"))
        challenge = response.headers.get("WWW-Authenticate", "")
        response.close()
        return "basic" if challenge.lower().startswith("basic") else "token"

    # -- requests ----------------------------------------------------------------------------

    def _send(self, call: Any) -> requests.Response:
        try:
            response: requests.Response = call()
        except requests.exceptions.SSLError as exc:
            raise RemoteUnreachableError(
                f"registry {self.ref.registry}: TLS failed ({_first_line(exc)})",
                f"a registry without TLS: set {PLAIN_HTTP_ENV}=1 (plain HTTP is used without "
                "asking only for a registry on this host)",
            ) from None
        except requests.exceptions.RequestException as exc:
            raise RemoteUnreachableError(
                f"registry {self.ref.registry}: {_first_line(exc)}",
                "check the URL and the network" + self._http_hint(),
            ) from None
        except ValueError as exc:  # oras's way of saying a request failed
            if "authentication" in str(exc).lower():
                raise self._denied(str(exc)) from None
            raise RemoteUnreachableError(
                f"registry {self.ref.registry}: {_first_line(exc)}",
                "check the URL, the credentials and the registry's logs",
            ) from None
        return response

    def _http_hint(self) -> str:
        return "" if self.scheme == "http" else f" (a registry without TLS: {PLAIN_HTTP_ENV}=1)"

    def _denied(self, reason: str) -> RemoteUnreachableError:
        return RemoteUnreachableError(
            f"registry {self.ref.registry} refused the credentials for {self.ref.repository}: "
            f"{reason}",
            f"log in (`docker login {self.ref.registry}` or `oras login`), or set "
            f"{USER_ENV} and {PASSWORD_ENV}; DOCKER_CONFIG names another config.json",
        )

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        response = self._send(
            lambda: self.client.do_request(f"{self.base}/{path}", method, **kwargs)
        )
        if response.status_code in (401, 403):
            response.close()
            raise self._denied(f"HTTP {response.status_code}")
        return response

    def _fail(self, response: requests.Response, what: str) -> NeuronctlError:
        detail = _registry_error(response)
        response.close()
        return RemoteUnreachableError(
            f"registry {self.ref.registry}: {what}: HTTP {response.status_code}{detail}",
            "check the URL, the credentials and the registry's logs",
        )

    # -- manifests ---------------------------------------------------------------------------

    def get_manifest(self, reference: str, accept: str = OCI_MANIFEST) -> tuple[bytes, str] | None:
        """The manifest bytes at a tag or digest and their digest, None when there is none.
        Read no further than the registries' own limit; a digest reference is checked."""
        response = self.request(
            "GET", f"manifests/{reference}", headers={"Accept": accept}, stream=True
        )
        if response.status_code == 404:
            response.close()
            return None
        if response.status_code != 200:
            raise self._fail(response, f"manifest {reference}")
        data = b"".join(self.read_capped(response, MAX_OCI_MANIFEST_BYTES, f"manifest {reference}"))
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise RemoteArtifactError(
                f"{self.ref.store_url}@{reference}: the registry sent a manifest with digest "
                f"{digest}",
                "the registry is damaged or not the one you meant",
            )
        return data, digest

    def put_manifest(self, data: bytes, reference: str, media_type: str = OCI_MANIFEST) -> bool:
        """Put a manifest (or an index) at a tag or digest. True when the registry says it
        indexed the manifest's `subject` itself (the `OCI-Subject` header of a registry with
        the referrers API: distribution-spec "Pushing Manifests with Subject")."""
        response = self.request(
            "PUT", f"manifests/{reference}", data=data, headers={"Content-Type": media_type}
        )
        if response.status_code not in (200, 201):
            raise self._fail(response, f"push manifest {reference}")
        response.close()
        return bool(response.headers.get("OCI-Subject"))

    def referrers(self, digest: str, artifact_type: str) -> bytes | None:
        """The registry's list of the manifests whose `subject` is `digest` (an image index),
        None when it has no referrers API (a 404: distribution-spec "Listing Referrers"). Only
        the first page: a registry pages a list of hundreds, and neuronctl reads a few."""
        query = urllib.parse.quote(artifact_type, safe="")
        response = self.request("GET", f"referrers/{digest}?artifactType={query}",
                                headers={"Accept": OCI_INDEX}, stream=True)
        if response.status_code == 404:
            response.close()
            return None
        if response.status_code != 200:
            raise self._fail(response, f"referrers of {digest[:19]}")
        return b"".join(self.read_capped(response, MAX_OCI_MANIFEST_BYTES,
                                         f"referrers of {digest[:19]}"))

    def tags(self) -> list[str]:
        try:
            return list(self.client.get_tags(self.container()))
        except ValueError as exc:  # oras raises this for a repository the registry lacks
            if "404" in str(exc) or "NAME_UNKNOWN" in str(exc):
                return []
            raise self._denied(str(exc)) from None

    # -- blobs -------------------------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:
        response = self.request("HEAD", f"blobs/{digest}")
        response.close()
        return response.status_code == 200

    def put_blob(self, source: Path, digest: str, size: int) -> None:
        """Upload a file's bytes as a blob, in chunks (oras-py's chunked upload: no blob is
        read into memory whole)."""
        layer = {"digest": digest, "size": size}
        response = self._send(
            lambda: self.client.chunked_upload(
                str(source), self.container(), layer, chunk_size=UPLOAD_CHUNK
            )
        )
        if response.status_code not in (201, 202, 200):
            raise self._fail(response, f"upload {source.name}")

    def put_bytes(self, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.has_blob(digest):
            return digest
        with tempfile.TemporaryDirectory(prefix="neuronctl-oci-") as tmp:
            path = Path(tmp) / "blob"
            path.write_bytes(data)
            self.put_blob(path, digest, len(data))
        return digest

    def open_blob(self, digest: str, start: int = 0) -> requests.Response:
        """A blob's body from byte `start` on (206), or whole (200) where the registry
        ignores the Range."""
        headers = {"Range": f"bytes={start}-"} if start else {}
        response = self.request("GET", f"blobs/{digest}", stream=True, headers=headers)
        if response.status_code == 206 and not response.headers.get(
            "Content-Range", ""
        ).startswith(f"bytes {start}-"):
            response.close()
            raise RemoteArtifactError(f"{self.ref.store_url}: blob {digest[:19]}…: the "
                                      "registry answered another range than asked")
        if response.status_code not in (200, 206):
            raise self._fail(response, f"blob {digest[:19]}")
        return response

    def read_capped(self, response: requests.Response, cap: int, what: str) -> Iterator[bytes]:
        """A response body, refused as soon as it passes `cap` bytes (a registry's sizes and
        lengths are claims, not facts)."""
        total = 0
        try:
            for chunk in response.iter_content(HTTP_CHUNK):
                total += len(chunk)
                if total > cap:
                    raise RemoteArtifactError(
                        f"{self.ref.store_url}: {what} is over {cap} bytes",
                        "the registry sent more than the artifact says; push it again",
                    )
                yield chunk
        except requests.exceptions.RequestException as exc:
            raise RemoteUnreachableError(
                f"registry {self.ref.registry}: {what}: {_first_line(exc)}",
                "check the network; pull again to resume (verified layers are kept)",
            ) from None
        finally:
            response.close()

    def read_blob(self, digest: str, size: int, what: str) -> bytes:
        """A small blob (config, signature), capped at its descriptor's size and checked
        against its digest."""
        data = b"".join(self.read_capped(self.open_blob(digest), size, what))
        if len(data) != size or "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise RemoteArtifactError(
                f"{self.ref.store_url}: {what} does not match its digest {digest[:19]}…",
                "the registry's copy is damaged; push the artifact again",
            )
        return data


def _registry_error(response: requests.Response) -> str:
    try:
        errors = response.json().get("errors") or []
        return f" ({errors[0].get('code')}: {errors[0].get('message')})" if errors else ""
    except (ValueError, AttributeError, IndexError):
        return ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:300]
