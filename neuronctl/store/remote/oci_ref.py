"""`oci://REGISTRY/REPO[:TAG][@sha256:DIGEST]`: an OCI registry, as in Helm, KServe and Flux.

fsspec reads `oci://` as Oracle Cloud Object Storage (`oci://bucket@namespace/path`, the
ocifs package); neuronctl never hands an `oci://` URL to fsspec, and refuses Oracle's form
with the way to reach that storage instead (its S3-compatible endpoint).

Plain HTTP (no TLS) only for a registry on this host (localhost, 127.0.0.0/8, [::1]) or
when $NEURONCTL_OCI_PLAIN_HTTP is 1; 0 there means TLS even on this host.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, replace

from neuronctl.errors import UsageError

SCHEME = "oci"
PLAIN_HTTP_ENV = "NEURONCTL_OCI_PLAIN_HTTP"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:]+\])(?::[0-9]{{1,5}})?"
# The distribution reference grammar: lowercase path components, a tag, a sha256 digest.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
TAG = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
DIGEST = r"sha256:[0-9a-f]{64}"
_URL = re.compile(
    rf"(?P<registry>{_HOST})/(?P<repository>{_COMPONENT}(?:/{_COMPONENT})*)"
    rf"(?::(?P<tag>{TAG}))?(?:@(?P<digest>{DIGEST}))?"
)
GRAMMAR = "oci://REGISTRY/REPO[:TAG|@sha256:DIGEST], e.g. oci://registry.example.com/neuron/llama"
ORACLE_HINT = (
    "neuronctl's oci:// is an OCI registry; for Oracle Cloud Object Storage use its "
    "S3-compatible endpoint: s3://BUCKET/PREFIX with "
    "AWS_ENDPOINT_URL=https://NAMESPACE.compat.objectstorage.REGION.oraclecloud.com"
)


def is_oci(url: str) -> bool:
    return url.split("://", 1)[0].lower() == SCHEME and "://" in url


@dataclass(frozen=True)
class OciRef:
    registry: str  # host[:port]
    repository: str
    tag: str | None = None
    digest: str | None = None  # sha256:<hex>; wins over the tag

    @property
    def store_url(self) -> str:
        return f"{SCHEME}://{self.registry}/{self.repository}"

    @property
    def reference(self) -> str | None:
        return self.digest or self.tag

    def at(self, reference: str) -> OciRef:
        """The same repository at a tag or a digest."""
        if re.fullmatch(DIGEST, reference):
            return replace(self, tag=None, digest=reference)
        return replace(self, tag=reference, digest=None)

    def __str__(self) -> str:
        if self.digest:
            return f"{self.store_url}@{self.digest}"
        return f"{self.store_url}:{self.tag}" if self.tag else self.store_url

    def plain_http(self) -> bool:
        """Whether to talk HTTP without TLS: this host's registry, or when asked."""
        asked = os.environ.get(PLAIN_HTTP_ENV, "").strip().lower()
        if asked in ("1", "true", "yes"):
            return True
        if asked in ("0", "false", "no"):
            return False
        return registry_is_loopback(self.registry)


def registry_is_loopback(registry: str) -> bool:
    host = registry.rsplit(":", 1)[0] if not registry.startswith("[") else registry
    host = host.split("]")[0].lstrip("[")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_oci_url(url: str) -> OciRef:
    """An `oci://` URL, or a UsageError saying what is wrong with it (Oracle's object storage
    form included)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() != SCHEME:
        raise UsageError(f"{url!r} is not an oci:// URL", GRAMMAR)
    rest = rest.rstrip("/")
    host = rest.split("/", 1)[0]
    if "@" in host:
        raise UsageError(
            f"{url!r} looks like Oracle Cloud Object Storage (oci://BUCKET@NAMESPACE/...)",
            ORACLE_HINT,
        )
    match = _URL.fullmatch(rest)
    if match is None:
        raise UsageError(f"{url!r} is not an OCI reference", GRAMMAR)
    return OciRef(**match.groupdict())
