"""Root's view of an agent under attack: does ``status`` answer, does the kill-switch act?

:class:`RootLiveness` runs in a thread beside an attack. Every ``period_s`` it asks the agent's
admin socket (root's, as laminarctl would) for ``GET /v1/status``, and flips the kill-switch of
one root job on and off (``POST /v1/killswitch``): the two things an operator needs while a
user, a job or a peer misbehaves. It records each call's latency; :meth:`check` fails the test
when one call took longer than the liveness bound or failed.

The bound is a liveness bound (a second or two), far from the figures: a stalled event loop
holds these calls for minutes. Measured latencies belong in a benchmark (bench/abuse.py), not in
an assertion.

Usage::

    with RootLiveness(agent.sock, job_id) as live:
        ... the attack ...
    live.check(bound_s=2.0)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import TracebackType

from agentproc import api_request


def admin_path(sock: Path) -> Path:
    """The admin socket beside a control socket (``laminard.sock`` -> ``laminard.admin.sock``)."""
    s = str(sock)
    return Path(s[:-len(".sock")] + ".admin.sock" if s.endswith(".sock") else s + ".admin")


class RootLiveness:
    def __init__(self, sock: Path, job: str | None = None, period_s: float = 0.1,
                 call_timeout_s: float = 30.0) -> None:
        """`sock`: the agent's control socket (the admin socket beside it is used); `job`: a
        running job whose kill-switch is flipped (None: only ``status`` is asked)."""
        self.sock = admin_path(sock) if admin_path(sock).exists() else sock
        self.job = job
        self.period_s = period_s
        self.call_timeout_s = call_timeout_s
        self.status_s: list[float] = []
        self.killswitch_s: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lm-root-liveness", daemon=True)

    def __enter__(self) -> RootLiveness:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(self.call_timeout_s + 5)
        if self.job is not None:  # never leave the job cut
            try:
                api_request(self.sock, "POST", "/v1/killswitch",
                            json.dumps({"action": "off", "scope": "job", "job": self.job}), timeout=10)
            except OSError:
                pass

    def _call(self, method: str, path: str, body: str | None, into: list[float]) -> None:
        t0 = time.monotonic()
        try:
            status, raw = api_request(self.sock, method, path, body, timeout=self.call_timeout_s)
        except OSError as e:
            self.failures.append(f"{method} {path}: {e!r} after {time.monotonic() - t0:.3f} s")
            return
        took = time.monotonic() - t0
        into.append(took)
        if status >= 300:
            self.failures.append(f"{method} {path}: {status} {raw[:200]!r}")

    def _run(self) -> None:
        on = False
        while not self._stop.is_set():
            self._call("GET", "/v1/status", None, self.status_s)
            if self.job is not None:
                on = not on
                self._call("POST", "/v1/killswitch",
                           json.dumps({"action": "on" if on else "off", "scope": "job", "job": self.job}),
                           self.killswitch_s)
            self._stop.wait(self.period_s)

    def worst(self) -> tuple[float, float]:
        """The slowest status and kill-switch call seen (0 where none was made)."""
        return max(self.status_s, default=0.0), max(self.killswitch_s, default=0.0)

    def check(self, bound_s: float = 2.0, min_calls: int = 3) -> None:
        """Fails when a call failed, took longer than `bound_s`, or fewer than `min_calls` status
        calls were made (the probe itself was starved)."""
        assert not self.failures, f"root's calls failed during the attack: {self.failures[:5]}"
        assert len(self.status_s) >= min_calls, f"only {len(self.status_s)} status calls completed"
        st, ks = self.worst()
        assert st <= bound_s, f"root's status took {st:.3f} s during the attack (liveness bound {bound_s} s)"
        assert ks <= bound_s, f"root's kill-switch took {ks:.3f} s during the attack (liveness bound {bound_s} s)"
