"""A FAKE Kubernetes API server for tests: no API server runs on these machines.

``FakeApiServer`` is an ``http.server`` on 127.0.0.1 over real TLS (a throw-away CA and a
certificate for 127.0.0.1 made with ``cryptography``, so the agent's client checks a real
certificate against ``ca_file``), with a bearer token it checks. It serves only what Laminar's
Kubernetes backend asks, as the real API server answers it:

- ``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>``: a PodList of the pods given;
- ``GET /api/v1/nodes/<node>``: the node; ``PATCH`` of it (strategic merge: ``spec.unschedulable``
  and ``metadata.annotations``, a null removes) applied to it;
- ``PATCH /api/v1/namespaces/<ns>/pods/<name>`` (merge patch of annotations) applied to the pod;
- ``POST /api/v1/namespaces/<ns>/pods/<name>/eviction``: the answers scripted for the pod
  (``evictions[ref] = [429, 429, 201]``: a PodDisruptionBudget that holds twice), 201 when none.

Every request is recorded (``requests``: method, path, content type, body as JSON).
"""

from __future__ import annotations

import contextlib
import datetime
import http.server
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Seen:
    method: str
    path: str
    content_type: str
    body: Any


def make_tls(tmp: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key) files in ``tmp``: a CA that signed a
    certificate for 127.0.0.1."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lm-fake-kube-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lm-fake-kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_file, cert_file, key_file = tmp / "lm-fake-ca.crt", tmp / "lm-fake-apiserver.crt", tmp / "lm-fake-apiserver.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    return ca_file, cert_file, key_file


def pod(ns: str, name: str, uid: str, node: str, annotations: dict[str, str] | None = None,
        run_as: int | None = None) -> dict[str, Any]:
    """A pod object as the API server lists it (the fields Laminar reads, and a few more)."""
    spec: dict[str, Any] = {"nodeName": node, "containers": [{"name": "main", "image": "example/train:1"}]}
    if run_as is not None:
        spec["securityContext"] = {"runAsUser": run_as, "runAsGroup": run_as}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": ns, "name": name, "uid": uid, "annotations": dict(annotations or {})},
            "spec": spec, "status": {"phase": "Running"}}


class FakeApiServer:
    """See the module docstring. ``url``, ``token_file``, ``ca_file`` are what the agent's
    ``[kubernetes]`` section names."""

    def __init__(self, tmp: Path, node: str, token: str = "lm-fake-token") -> None:
        self.node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "annotations": {}},
                     "spec": {}}
        self.pods: list[dict[str, Any]] = []
        self.evictions: dict[str, list[int]] = {}
        self.requests: list[Seen] = []
        self.token = token
        self.token_file = tmp / "lm-fake-token"
        self.token_file.write_text(token + "\n")
        self.ca_file, cert, key = make_tls(tmp)
        self.lock = threading.Lock()
        self.delay_s = 0.0  # answers held this long (a slow server)
        self.list_pad = 0  # bytes of padding in the pod list (a huge answer)
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _answer(self, code: int, doc: Any) -> None:
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                u = urlsplit(self.path)
                with fake.lock:
                    fake.requests.append(Seen(method, self.path, self.headers.get("Content-Type", ""), body))
                if fake.delay_s:
                    threading.Event().wait(fake.delay_s)
                if self.headers.get("Authorization") != f"Bearer {fake.token}":
                    return self._answer(401, {"kind": "Status", "code": 401, "message": "Unauthorized"})
                code, doc = fake.route(method, u.path, parse_qs(u.query), body)
                self._answer(code, doc)

            def do_GET(self) -> None:  # noqa: N802
                self._handle("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._handle("POST")

            def do_PATCH(self) -> None:  # noqa: N802
                self._handle("PATCH")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="lm-fake-apiserver", daemon=True)

    def route(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        parts = [unquote(p) for p in path.strip("/").split("/")]
        with self.lock:
            if method == "GET" and parts == ["api", "v1", "pods"]:
                sel = query.get("fieldSelector", [""])[0]
                node = sel.removeprefix("spec.nodeName=")
                items = [p for p in self.pods if p["spec"].get("nodeName") == node]
                doc: dict[str, Any] = {"apiVersion": "v1", "kind": "PodList", "items": items}
                if self.list_pad:
                    doc["metadata"] = {"pad": "x" * self.list_pad}
                return 200, doc
            if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4 and parts[3] == self.node["metadata"]["name"]:
                if method == "PATCH":
                    merge(self.node, body)
                return 200, self.node
            if parts[:3] == ["api", "v1", "namespaces"] and len(parts) >= 6 and parts[4] == "pods":
                ref = f"{parts[3]}/{parts[5]}"
                found = [p for p in self.pods if f"{p['metadata']['namespace']}/{p['metadata']['name']}" == ref]
                if not found:
                    return 404, {"kind": "Status", "code": 404, "message": f"pods \"{parts[5]}\" not found"}
                if method == "PATCH" and len(parts) == 6:
                    merge(found[0], body)
                    return 200, found[0]
                if method == "POST" and parts[6:] == ["eviction"]:
                    script = self.evictions.get(ref) or [201]
                    code = script.pop(0) if len(script) > 1 else script[0]
                    if code == 429:
                        return 429, {"kind": "Status", "code": 429, "reason": "TooManyRequests",
                                     "message": "Cannot evict pod as it would violate the pod's disruption budget."}
                    return code, {"kind": "Status", "code": code, "status": "Success"}
            return 404, {"kind": "Status", "code": 404, "message": f"no route {method} {path}"}

    def seen(self, method: str, part: str = "") -> list[Seen]:
        with self.lock:
            return [r for r in self.requests if r.method == method and part in r.path]

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def merge(target: dict[str, Any], patch: Any) -> None:
    """A JSON merge patch (RFC 7386), which for these fields is what a strategic merge does too."""
    if not isinstance(patch, dict):
        return
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            merge(target[k], v)
        else:
            target[k] = v if not isinstance(v, dict) else json.loads(json.dumps(v))


@contextlib.contextmanager
def fake_api_server(tmp: Path, node: str) -> Iterator[FakeApiServer]:
    srv = FakeApiServer(tmp, node)
    srv.start()
    try:
        yield srv
    finally:
        srv.close()
