"""A small client of the Kubernetes API server, as a pod's service account reaches it.

HTTPS only, the server checked against the service account's CA (``ca_file``), the bearer token
read again for every request (bound tokens rotate: the kubelet rewrites the file) and bounded
(``TOKEN_MAX``). Every request is bounded in time (``timeout_s``, the whole request: connect,
send, the answer read) and in the bytes of its answer (``max_bytes``); a larger answer is an
error, never read on. The calls block: the agent runs them off its event loop
(:class:`laminar.offloop.Lane`, ``KubeApi.call``).

``api_url`` empty means the in-cluster address, ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``
(the kubelet sets both in every container).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..offloop import Lane, LaneBusy

TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"
CA_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
TOKEN_MAX = 64 * 1024
# A node's pod list: at most a few hundred pods (kubelet --max-pods, 110 by default) of a few KiB
# to a few tens of KiB each. 16 MiB is far past that and still cheap to hold once.
LIST_BYTES_MAX = 16 * 1024 * 1024
# Any other answer (a Status, a patched object) is small.
ANSWER_BYTES_MAX = 1024 * 1024
TIMEOUT_S = 10.0


class KubeApiError(RuntimeError):
    """The API server could not be reached, or answered past a bound; the message says which
    request and why."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    doc: Any = None  # the body parsed, when the request asked for it (parsed off the loop)

    def json(self) -> Any:
        if self.doc is not None:
            return self.doc
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError) as e:
            raise KubeApiError(f"the API server's answer ({self.status}) is not JSON: {e}") from None

    def message(self) -> str:
        """The ``message`` of a Status answer, else the first bytes of the body."""
        try:
            doc = json.loads(self.body)
            if isinstance(doc, dict) and isinstance(doc.get("message"), str):
                return doc["message"][:300]
        except (ValueError, UnicodeDecodeError):
            pass
        return self.body[:300].decode("utf-8", "replace")


def in_cluster_url(env: dict[str, str] | None = None) -> str:
    """``https://host:port`` from KUBERNETES_SERVICE_HOST/PORT; raises KubeApiError without them."""
    env = dict(os.environ) if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise KubeApiError("[kubernetes] api_url is empty and KUBERNETES_SERVICE_HOST is not set (not in a pod?): "
                           "give api_url = \"https://HOST:PORT\"")
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"https://{host}:{port}"


def check_url(url: str) -> str | None:
    """Why ``url`` is not an API server address Laminar accepts, or None (for the config)."""
    if url == "":
        return None
    u = urlsplit(url)
    if u.scheme != "https" or not u.hostname:
        return "expected https://HOST[:PORT] (the token is never sent in clear), or empty for the in-cluster address"
    if u.path not in ("", "/") or u.query or u.fragment or u.username:
        return "expected https://HOST[:PORT] with nothing after the port"
    return None


def read_bounded(path: str, limit: int, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise KubeApiError(f"cannot read the {what} {path}: {e.strerror}") from None
    if len(data) > limit:
        raise KubeApiError(f"the {what} {path} is larger than {limit} bytes")
    return data


class KubeApi:
    """See the module docstring. ``request`` blocks; ``call`` runs it on the lane."""

    def __init__(self, url: str, token_file: str = TOKEN_FILE, ca_file: str = CA_FILE,
                 timeout_s: float = TIMEOUT_S, lane: Lane | None = None) -> None:
        self.url = url
        self.token_file = token_file
        self.ca_file = ca_file
        self.timeout_s = timeout_s
        # two requests at once at most: the tick's list and a reclaim's eviction or patch
        self.lane = lane or Lane("kube-api", workers=2, timeout_s=timeout_s + 1.0, per_owner=2)
        self._ctx: ssl.SSLContext | None = None

    def _context(self) -> ssl.SSLContext:
        if self._ctx is None:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
            try:
                ctx.load_verify_locations(cafile=self.ca_file)
            except (OSError, ssl.SSLError) as e:
                raise KubeApiError(f"cannot load the API server's CA {self.ca_file}: {e}") from None
            self._ctx = ctx
        return self._ctx

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                max_bytes: int = ANSWER_BYTES_MAX, parse: bool = False) -> Answer:
        """One request (blocking), bounded as the module says; ``parse``: a 200's body parsed
        as JSON here too (a pod list of megabytes is not parsed on the event loop). Raises
        KubeApiError."""
        url = self.url or in_cluster_url()
        u = urlsplit(url)
        if u.scheme != "https" or not u.hostname:
            raise KubeApiError(f"API server address {url!r}: expected https://HOST[:PORT]")
        token = read_bounded(self.token_file, TOKEN_MAX, "service account token").decode("ascii", "replace").strip()
        deadline = time.monotonic() + self.timeout_s
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json", "User-Agent": "laminard"}
        if data is not None:
            headers["Content-Type"] = content_type
        what = f"{method} {path}"
        conn = http.client.HTTPSConnection(u.hostname, u.port or 443, timeout=self.timeout_s, context=self._context())
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise KubeApiError(f"{what}: the answer is {length} bytes, more than the {max_bytes} allowed")
            chunks: list[bytes] = []
            got = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KubeApiError(f"{what}: no whole answer within {self.timeout_s:g} s")
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                chunk = resp.read1(64 * 1024)
                if not chunk:
                    break
                got += len(chunk)
                if got > max_bytes:
                    raise KubeApiError(f"{what}: the answer is more than the {max_bytes} bytes allowed")
                chunks.append(chunk)
            ans = Answer(resp.status, b"".join(chunks))
            return Answer(ans.status, ans.body, ans.json()) if parse and ans.status == 200 else ans
        except (OSError, http.client.HTTPException, ssl.SSLError) as e:
            if isinstance(e, TimeoutError | socket.timeout):
                raise KubeApiError(f"{what} to {url}: no answer within {self.timeout_s:g} s") from None
            raise KubeApiError(f"{what} to {url}: {e}") from None
        finally:
            conn.close()

    async def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                   max_bytes: int = ANSWER_BYTES_MAX, parse: bool = False) -> Answer:
        """:meth:`request` off the event loop. Raises KubeApiError (a lane timeout or a stuck
        earlier request included)."""
        try:
            return await self.lane.run("api", self.request, method, path, body, content_type, max_bytes,
                                       parse)
        except (TimeoutError, LaneBusy) as e:
            raise KubeApiError(f"{method} {path}: {e}") from None
