"""A stand-in for the Hugging Face Hub on 127.0.0.1, for download tests that never go online.

It implements just what huggingface_hub 2.4 calls for `model_info` and `snapshot_download`:
- GET  /api/models/{repo}[/revision/{rev}]       repository info: sha and file list
- GET  /api/models/{repo}/tree/{rev}[/{path}]    recursive file listing (one page)
- HEAD /{repo}/resolve/{rev}/{file}              X-Repo-Commit, ETag / X-Linked-Etag, sizes
- GET  /{repo}/resolve/{rev}/{file}              the file body
Weights (*.safetensors, *.bin) are served as LFS files, named by their sha256 like the real Hub;
other files carry a git blob sha1. A gated repository answers 401 with X-Error-Code GatedRepo
unless the request carries `Authorization: Bearer <token>` with the repository's token.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")
REPO = r"([^/]+/[^/]+|[^/]+)"
API_RE = re.compile(rf"/api/models/{REPO}(?:/(revision|tree)/([^/]+)(/.*)?)?")
RESOLVE_RE = re.compile(rf"/{REPO}/resolve/([^/]+)/(.+)")


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: body}
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    token: str | None = None  # set: the repository is gated

    def resolve(self, rev: str) -> str | None:
        if rev in self.commits:
            return rev
        return self.refs.get(rev)


def git_blob_sha1(body: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()


class HubServer:
    """Run with `with HubServer() as hub:`; `hub.url` is the endpoint, `hub.requests` the log."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        # shutdown() waits up to one poll interval (0.5 s by default) for the loop to notice
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_commit(
        self,
        repo_id: str,
        files: dict[str, bytes],
        ref: str | None = "main",
        token: str | None = None,
    ) -> str:
        """Add a commit with exactly `files`; point `ref` at it; return its sha."""
        repo = self.repos.setdefault(repo_id, Repo())
        if token:
            repo.token = token
        listing = json.dumps({k: git_blob_sha1(v) for k, v in sorted(files.items())})
        sha = hashlib.sha1(f"{repo_id}:{len(repo.commits)}:{listing}".encode()).hexdigest()
        repo.commits[sha] = dict(files)
        if ref:
            repo.refs[ref] = sha
        return sha

    def add_directory(self, repo_id: str, root: Path, **kw: Any) -> str:
        files = {
            p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()
        }
        return self.add_commit(repo_id, files, **kw)

    def body_gets(self) -> list[str]:
        """Paths of file bodies served (GET on /resolve/): what a re-run must not repeat."""
        return [path for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def do_HEAD(self) -> None:
                server._serve(self, head=True)

            def do_GET(self) -> None:
                server._serve(self, head=False)

        return Handler

    def _serve(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        path = urlsplit(req.path).path
        with self._lock:
            self.requests.append(("HEAD" if head else "GET", path))
        api = re.fullmatch(
            r"/api/models/([^/]+/[^/]+|[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?", path
        )
        resolve = re.fullmatch(r"/([^/]+/[^/]+|[^/]+)/resolve/([^/]+)/(.+)", path)
        if api:
            repo_id, kind, rev, _sub = api.groups()
            self._api(req, unquote(repo_id), kind or "revision", unquote(rev or "main"))
        elif resolve:
            repo_id, rev, file = (unquote(g) for g in resolve.groups())
            self._resolve(req, repo_id, rev, file, head)
        else:
            self._error(req, 404, "RepoNotFound", head)

    def _lookup(
        self, req: BaseHTTPRequestHandler, repo_id: str, rev: str, head: bool
    ) -> tuple[Repo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(req, 401, "RepoNotFound", head)  # the Hub answers 401 for unknown repos
            return None
        if repo.token and req.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(req, 401, "GatedRepo", head)
            return None
        sha = repo.resolve(rev)
        if sha is None:
            self._error(req, 404, "RevisionNotFound", head)
            return None
        return repo, sha

    def _api(self, req: BaseHTTPRequestHandler, repo_id: str, kind: str, rev: str) -> None:
        found = self._lookup(req, repo_id, rev, head=False)
        if found is None:
            return
        repo, sha = found
        files = repo.commits[sha]
        if kind == "tree":
            data: Any = [self._tree_entry(name, body) for name, body in sorted(files.items())]
        else:
            data = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": sha,
                "private": False,
                "gated": "manual" if repo.token else False,
                "siblings": [{"rfilename": name} for name in sorted(files)],
            }
        self._send(req, 200, json.dumps(data).encode(), {"Content-Type": "application/json"})

    @staticmethod
    def _tree_entry(name: str, body: bytes) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "type": "file",
            "path": name,
            "size": len(body),
            "oid": git_blob_sha1(body),
        }
        if name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {
                "oid": hashlib.sha256(body).hexdigest(),
                "size": len(body),
                "pointerSize": 134,
            }
        return entry

    def _resolve(
        self, req: BaseHTTPRequestHandler, repo_id: str, rev: str, file: str, head: bool
    ) -> None:
        found = self._lookup(req, repo_id, rev, head)
        if found is None:
            return
        repo, sha = found
        body = repo.commits[sha].get(file)
        if body is None:
            self._error(req, 404, "EntryNotFound", head, {"X-Repo-Commit": sha})
            return
        headers = {"X-Repo-Commit": sha, "Content-Type": "application/octet-stream"}
        if file.endswith(LFS_SUFFIXES):
            digest = hashlib.sha256(body).hexdigest()
            headers |= {"ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"'}
            headers["X-Linked-Size"] = str(len(body))
        else:
            headers["ETag"] = f'"{git_blob_sha1(body)}"'
        self._send(req, 200, body, headers, head=head)

    def _error(
        self,
        req: BaseHTTPRequestHandler,
        status: int,
        code: str,
        head: bool,
        extra: dict[str, str] | None = None,
    ) -> None:
        body = json.dumps({"error": code}).encode()
        headers = {"X-Error-Code": code, "Content-Type": "application/json", **(extra or {})}
        self._send(req, status, body, headers, head=head)

    @staticmethod
    def _send(
        req: BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        headers: dict[str, str],
        head: bool = False,
    ) -> None:
        req.send_response(status)
        for name, value in headers.items():
            req.send_header(name, value)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        if not head:
            req.wfile.write(body)
