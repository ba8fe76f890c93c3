"""A stand-in for the Hugging Face Hub on 127.0.0.1, for the tests that push (export, examples)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandInHub:
    """A STAND-IN for the Hugging Face Hub on 127.0.0.1 (not the Hub): it implements just the four endpoints that
    ``create_repo`` and ``upload_folder`` of huggingface_hub 2.4 call, answers every file as a "regular" upload
    (base64 inside the commit), records each request, and keeps the committed files."""

    def __init__(self, missing_repo: bool = False) -> None:
        self.calls: list[dict] = []
        self.files: dict[str, bytes] = {}
        self.missing_repo = missing_repo
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.calls.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                status, payload, headers = hub.answer(self.path, body, f"http://{self.headers['Host']}")
                data = json.dumps(payload).encode()
                self.send_response(status)
                for key, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def answer(self, path: str, body: bytes, base: str) -> tuple[int, dict, dict]:
        if path == "/api/repos/create":
            request = json.loads(body)
            return 200, {"url": f"{base}/{request['organization']}/{request['name']}"}, {}
        if path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}, {}
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/main", path.split("?")[0])
        if match and self.missing_repo:
            return 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
        if match and match.group(2) == "preupload":
            files = json.loads(body)["files"]
            return (
                200,
                {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
                {},
            )
        if match:
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            oid = hashlib.sha1(body).hexdigest()
            return 200, {"commitUrl": f"{base}/{match.group(1)}/commit/{oid}", "commitOid": oid}, {}
        return 404, {"error": f"the stand-in Hub does not implement {path}"}, {}

    def __enter__(self) -> StandInHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def reach_stand_in(monkeypatch, hub: StandInHub) -> None:
    """Point this process's huggingface_hub at ``hub``, in online mode, whatever the machine's environment says:
    huggingface_hub reads ``HF_HUB_OFFLINE`` once, at import, so the test lifts it there too."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
