"""A loopback stand-in for the Hugging Face Hub API, for testing pushes without a network.

It answers the calls huggingface_hub 2.4.0 makes for `create_repo`, `upload_folder`,
`repo_info`/`whoami` and the downloads (`hf_hub_download`; `snapshot_download`'s file tree):
repo creation, preupload (upload modes), the NDJSON commit, YAML validation, and the git-LFS
batch / basic-transfer upload. Every request is recorded, and the repos keep their committed
files, so tests can assert on exactly what a client sent.

Preupload answers "regular" (file content inlined as base64 in the commit) unless the server is
built with `lfs_min_size`: then files of at least that many bytes are answered "lfs". Under
huggingface_hub's default xet path an "lfs" answer means an upload to a xet CAS, which this
server does not implement; tests that exercise LFS must set HF_HUB_DISABLE_XET=1.

`serve_in_process` points this interpreter's huggingface_hub at a server for downloads (what
HF_ENDPOINT and HF_HUB_CACHE would set at import), for tests that call a function or a command's
main(argv) in-process instead of starting a process.
"""

import base64
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import yaml

MAX_BODY_BYTES = 64 * 1024 * 1024  # refuse bigger bodies: tests push tiny pipelines
MAX_CHUNKS = 100_000  # bound on the chunked-transfer read loop

_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_ROUTES = [  # (method, regex, handler name); first match wins
    ("POST", r"/api/repos/create", "create_repo"),
    ("GET", r"/api/whoami-v2", "whoami"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("POST", rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("GET", rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
    ("GET", rf"/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?", "repo_info"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
    ("PUT", r"/_lfs/(?P<oid>[0-9a-f]{64})", "lfs_put"),
    ("HEAD", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
    ("GET", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
    ("POST", r"/_lfs/verify/(?P<oid>[0-9a-f]{64})", "lfs_verify"),
]


def files_under(folder) -> dict[str, bytes]:
    """{path relative to `folder`, with / separators: content} of every file under it."""
    import os
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                found[os.path.relpath(path, folder).replace(os.sep, "/")] = fh.read()
    return found


class HubServer:
    """Threaded HTTP server on 127.0.0.1 (free port) with an in-memory Hub.

    Commits record `started_at`/`finished_at` (time.monotonic, comparable across processes on
    Linux) so tests can check that pushes run in the background and never overlap.
    `token`: when set, API calls without `Authorization: Bearer <token>` get 401 (the LFS PUT is
    exempt: on the Hub it goes to a pre-signed storage URL without the Hub token).
    """

    def __init__(
        self, user: str = "test-user", token: str | None = None, lfs_min_size: int | None = None,
        commit_delay: float = 0.0,
    ):
        self.user, self.token, self.lfs_min_size = user, token, lfs_min_size
        self.commit_delay = commit_delay  # seconds a commit takes; lets tests see background/overlap
        self.requests: list[dict] = []  # method, path, query, headers (lower-cased names), body_size
        self.repos: dict[str, dict] = {}  # repo_id -> {private, visibility, files: {path: bytes}, commits}
        self.lfs_objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        handler = type("BoundHubHandler", (_HubHandler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers for tests ---------------------------------------------------------------------
    def add_repo(self, repo_id: str, folder: str) -> None:
        """A model repo holding `folder`'s files, as if pushed in one commit (for download tests)."""
        files = files_under(folder)
        oid = hashlib.sha1(repo_id.encode()).hexdigest()
        with self.lock:
            self.repos[repo_id] = {"private": False, "visibility": "public", "files": files,
                                   "commits": [{"oid": oid, "message": "seeded", "files": sorted(files)}]}

    def commits(self, repo_id: str) -> list[dict]:
        return self.repos[repo_id]["commits"]

    def authorizations(self) -> set[str]:
        return {r["headers"]["authorization"] for r in self.requests if "authorization" in r["headers"]}


def serve_in_process(monkeypatch, server: HubServer, cache_dir) -> None:
    """Downloads in this interpreter go to `server`, into the Hub cache `cache_dir`, online: the
    module globals huggingface_hub reads at call time, set as HF_ENDPOINT, HF_HUB_CACHE and
    HF_HUB_OFFLINE=0 would have set them at import (monkeypatch restores them)."""
    from huggingface_hub import constants, hf_api

    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(hf_api.api, "endpoint", server.url)  # huggingface_hub.model_info & co., made at import
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


class _HubHandler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every reply sets Content-Length
    timeout = 10  # seconds; a stalled client cannot hold a handler thread forever

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        body = self._read_body()
        if body is None:
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        with self.hub.lock:
            self.hub.requests.append(
                {"method": method, "path": split.path, "query": parse_qs(split.query), "headers": headers,
                 "body_size": len(body)}
            )
        for route_method, pattern, name in _ROUTES:
            match = re.fullmatch(pattern, split.path)
            if route_method == method and match:
                if self.hub.token is not None and name != "lfs_put" and not self._authorized(headers):
                    return self._send_json(401, {"error": "Invalid credentials in Authorization header"})
                self.started_at = time.monotonic()
                if name == "commit":
                    time.sleep(self.hub.commit_delay)  # outside the lock: overlapping commits stay visible
                with self.hub.lock:
                    return getattr(self, "_" + name)(body=body, **match.groupdict())
        self._send_json(404, {"error": f"no route for {method} {split.path}"})

    def _authorized(self, headers: dict) -> bool:
        return headers.get("authorization") == f"Bearer {self.hub.token}"

    def _read_body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, total = [], 0
            for _ in range(MAX_CHUNKS):
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()  # blank line after the last chunk (no trailers sent by httpx)
                    return b"".join(chunks)
                total += size
                if total > MAX_BODY_BYTES:
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self._send_json(413, {"error": "chunked body too large"})
            self.close_connection = True
            return None
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._send_json(413, {"error": "body too large"})
            self.close_connection = True
            return None
        return self.rfile.read(length)

    def _send_json(self, status: int, payload, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer has headers only
            self.wfile.write(data)

    def _repo_or_404(self, repo: str) -> dict | None:
        if repo not in self.hub.repos:
            self._send_json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            return None
        return self.hub.repos[repo]

    # -- routes (called with hub.lock held) ------------------------------------------------------
    def _create_repo(self, body: bytes) -> None:
        payload = json.loads(body)
        repo_id = f"{payload.get('organization') or self.hub.user}/{payload['name']}"
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:  # the Hub answers 409 with the URL; exist_ok relies on it
            return self._send_json(409, {"error": "You already created this model repo", "url": url})
        visibility = payload.get("visibility")
        self.hub.repos[repo_id] = {
            "private": visibility == "private", "visibility": visibility, "type": payload.get("type"),
            "files": {}, "commits": [],
        }
        self._send_json(200, {"url": url, "name": repo_id})

    def _whoami(self, body: bytes) -> None:
        self._send_json(200, {"type": "user", "name": self.hub.user, "auth": {"type": "access_token"}})

    def _validate_yaml(self, body: bytes) -> None:
        content = json.loads(body)["content"]
        match = re.match(r"^---\n(.*?)\n---\n", content, re.DOTALL)
        try:
            yaml.safe_load(match.group(1) if match else "")
        except yaml.YAMLError as err:
            return self._send_json(400, {"errors": [{"message": str(err)}], "warnings": []})
        self._send_json(200, {"errors": [], "warnings": []})

    def _resolve(self, body: bytes, repo: str, rev: str, path: str) -> None:
        """A file download (hf_hub_download): HEAD gives the metadata huggingface_hub reads (commit,
        etag, size), GET the bytes; a missing file is 404 EntryNotFound, as on the Hub."""
        if (state := self._repo_or_404(repo)) is None:
            return
        if path not in state["files"]:
            return self._send_json(404, {"error": f"{path} does not exist"}, {"X-Error-Code": "EntryNotFound"})
        data = state["files"][path]
        sha = state["commits"][-1]["oid"] if state["commits"] else "0" * 40
        self.send_response(200)
        for key, value in {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                           "Content-Length": str(len(data)), "Content-Type": "application/octet-stream"}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def _repo_info(self, body: bytes, repo: str, rev: str | None) -> None:
        if (state := self._repo_or_404(repo)) is None:
            return
        sha = state["commits"][-1]["oid"] if state["commits"] else "0" * 40
        siblings = [{"rfilename": path} for path in sorted(state["files"])]
        self._send_json(200, {"id": repo, "sha": sha, "private": state["private"], "siblings": siblings})

    def _tree(self, body: bytes, repo: str, rev: str, path: str | None) -> None:
        """list_repo_tree (snapshot_download lists the files it then fetches): every file under
        `path`, recursively, in one page."""
        if (state := self._repo_or_404(repo)) is None:
            return
        prefix = f"{path.rstrip('/')}/" if path else ""
        entries = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                   for name, data in sorted(state["files"].items()) if name.startswith(prefix)]
        self._send_json(200, entries)

    def _preupload(self, body: bytes, repo: str, rev: str) -> None:
        if self._repo_or_404(repo) is None:
            return
        files = json.loads(body)["files"]
        lfs_min = self.hub.lfs_min_size
        modes = [
            {"path": f["path"], "uploadMode": "lfs" if lfs_min is not None and f["size"] >= lfs_min else "regular",
             "shouldIgnore": False, "oid": None}
            for f in files
        ]
        self._send_json(200, {"files": modes, "commitOid": None})

    def _commit(self, body: bytes, repo: str, rev: str) -> None:
        if (state := self._repo_or_404(repo)) is None:
            return
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = lines[0]["value"] if lines and lines[0]["key"] == "header" else {}
        files, lfs_paths, deleted = {}, [], []
        for item in lines[1:]:
            key, value = item["key"], item["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] not in self.hub.lfs_objects:
                    return self._send_json(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                files[value["path"]] = self.hub.lfs_objects[value["oid"]]
                lfs_paths.append(value["path"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
        oid = hashlib.sha1(f"{repo}:{len(state['commits'])}:{body.hex()[:4096]}".encode()).hexdigest()
        state["files"].update(files)
        for path in deleted:
            state["files"] = {p: c for p, c in state["files"].items() if p != path and not p.startswith(path + "/")}
        state["commits"].append(
            {"oid": oid, "revision": rev, "summary": header.get("summary"), "description": header.get("description"),
             "files": files, "lfs_paths": lfs_paths, "deleted": deleted,
             "started_at": self.started_at, "finished_at": time.monotonic()}
        )
        commit_url = f"{self.hub.url}/{repo}/commit/{oid}"
        self._send_json(200, {"success": True, "commitOid": oid, "commitUrl": commit_url, "pullRequestUrl": None})

    def _lfs_batch(self, body: bytes, repo: str) -> None:
        if self._repo_or_404(repo) is None:
            return
        objects = []
        for obj in json.loads(body)["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.hub.lfs_objects:  # no "actions" = already stored, client skips it
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.url}/_lfs/{obj['oid']}"},
                    "verify": {"href": f"{self.hub.url}/_lfs/verify/{obj['oid']}"},
                }
            objects.append(entry)
        self._send_json(200, {"transfer": "basic", "objects": objects})

    def _lfs_put(self, body: bytes, oid: str) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            return self._send_json(400, {"error": "content does not match its sha256 oid"})
        self.hub.lfs_objects[oid] = body
        self._send_json(200, {})

    def _lfs_verify(self, body: bytes, oid: str) -> None:
        stored = self.hub.lfs_objects.get(oid)
        if stored is None or len(stored) != json.loads(body)["size"]:
            return self._send_json(404, {"error": "object not stored or wrong size"})
        self._send_json(200, {})
