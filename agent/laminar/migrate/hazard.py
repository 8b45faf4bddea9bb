"""Calibrating the departure hazard from the SkyPilot spot traces (``../shared/data/spot-traces``).

The model itself is pure policy, :mod:`laminar.policy.hazard`; this module reads trace files
into it, and re-exports the model's names at their old path (issue 32, stage 1)::

    from laminar.migrate.hazard import calibrate_from_spot_traces
    model = calibrate_from_spot_traces("/work/shared/data/spot-traces/preemption/1-node/aws-04-22-2023")
    model.survival(t, 3600)          # probability a node survives the next hour from time t

The 1-node preemption traces hold one state per tick of ``gap_seconds``: ``0`` the launched
instance is running, ``1`` it is preempted (as the traces' own simulator reads them). A
departure is a tick where a running instance becomes preempted; exposure is the running ticks.
The traces record only their start date (in the directory name, e.g. ``aws-04-22-2023``), so
tick 0 is taken as 00:00 UTC of that date unless ``start_ts`` says otherwise.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from laminar.policy.hazard import *  # noqa: F403  (the model's names at their old path)
from laminar.policy.hazard import (
    DEFAULT_BIN_STRENGTH_H,
    DEFAULT_PRIOR_RATE_PER_H,
    DEFAULT_PRIOR_STRENGTH_H,
    DEFAULT_SMOOTH_BINS,
    HazardError,
    HazardModel,
)

# -- spot traces ---------------------------------------------------------------------------

_DATE_DIR = re.compile(r"(\d{2})-(\d{2})-(\d{4})$")


@dataclass(frozen=True)
class SpotTrace:
    """One 1-node preemption trace: ``preempted[i]`` is the state during tick ``i``, which starts
    at ``start_ts + i * gap_s``."""

    name: str
    gap_s: float
    start_ts: float
    preempted: tuple[bool, ...]

    @property
    def duration_s(self) -> float:
        return self.gap_s * len(self.preempted)

    def departures(self) -> list[float]:
        """Times (Unix seconds) at which a running instance became preempted."""
        p = self.preempted
        return [self.start_ts + i * self.gap_s for i in range(1, len(p)) if p[i] and not p[i - 1]]

    def up_intervals(self) -> list[tuple[float, float]]:
        """The [start, end) intervals (Unix seconds) during which the instance ran."""
        out: list[tuple[float, float]] = []
        start: float | None = None
        for i, pre in enumerate(self.preempted):
            t = self.start_ts + i * self.gap_s
            if not pre and start is None:
                start = t
            elif pre and start is not None:
                out.append((start, t))
                start = None
        if start is not None:
            out.append((start, self.start_ts + self.duration_s))
        return out


def trace_start_ts(path: Path) -> float | None:
    """00:00 UTC of the date in the name of the trace's directory (``aws-04-22-2023``), if any."""
    for part in reversed(path.parts[:-1]):
        m = _DATE_DIR.search(part)
        if m:
            mm, dd, yyyy = (int(g) for g in m.groups())
            try:
                return datetime(yyyy, mm, dd, tzinfo=UTC).timestamp()
            except ValueError as e:
                raise HazardError(f"hazard: {path}: directory {part!r} names no real date (MM-DD-YYYY): {e}") from None
    return None


def load_spot_trace(path: str | Path, start_ts: float | None = None) -> SpotTrace:
    """Reads one 1-node preemption trace (JSON ``{"metadata": {"gap_seconds": N}, "data": [0|1, ...]}``).

    Raises HazardError naming the file and the offending value when the file is not such a
    trace (a file under an ``availability`` directory is an availability trace: its 1 means
    available), or when no start time is given and the directory names no date."""
    p = Path(path)
    if "availability" in p.parts:
        raise HazardError(
            f"hazard: {p} is an availability trace (1 = an instance is available, not preempted); "
            "calibrate from the preemption traces (preemption/1-node)"
        )
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HazardError(f"hazard: cannot read spot trace {p}: {e}") from None
    if not isinstance(doc, dict) or "data" not in doc or "metadata" not in doc:
        raise HazardError(f"hazard: {p} is not a spot trace: expected an object with 'metadata' and 'data'")
    gap = doc["metadata"].get("gap_seconds") if isinstance(doc["metadata"], dict) else None
    if not isinstance(gap, (int, float)) or isinstance(gap, bool) or not math.isfinite(gap) or gap <= 0:
        raise HazardError(f"hazard: {p}: metadata.gap_seconds must be a finite number > 0, got {gap!r}")
    data = doc["data"]
    if not isinstance(data, list) or not data:
        raise HazardError(f"hazard: {p}: 'data' must be a non-empty list")
    for i, x in enumerate(data):
        if x not in (0, 1) or isinstance(x, bool):
            raise HazardError(
                f"hazard: {p}: data[{i}] = {x!r}; a 1-node preemption trace holds 0 (running) or 1 "
                "(preempted) — multi-node and availability traces are not departure traces"
            )
    if start_ts is None:
        start_ts = trace_start_ts(p)
        if start_ts is None:
            raise HazardError(f"hazard: {p}: no date (MM-DD-YYYY) in its directory names; pass start_ts")
    return SpotTrace(name=p.stem, gap_s=float(gap), start_ts=float(start_ts), preempted=tuple(bool(x) for x in data))


def spot_trace_files(path: str | Path) -> list[Path]:
    """The 1-node preemption trace files at ``path`` (a file, or a directory searched
    recursively for ``preemption/1-node/**.json``), sorted. Raises HazardError if none."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise HazardError(f"hazard: spot trace path {p} does not exist")
    files = sorted(f for f in p.rglob("*.json") if "preemption" in f.parts and "1-node" in f.parts)
    if not files:
        raise HazardError(f"hazard: no 1-node preemption traces (preemption/1-node/*/*.json) under {p}")
    return files


def model_from_traces(
    traces: Sequence[SpotTrace],
    provider: str = "default",
    prior_rate_per_h: float = DEFAULT_PRIOR_RATE_PER_H,
    prior_strength_h: float = DEFAULT_PRIOR_STRENGTH_H,
    smooth_bins: int = DEFAULT_SMOOTH_BINS,
    bin_strength_h: float = DEFAULT_BIN_STRENGTH_H,
) -> HazardModel:
    """A model with the given prior and the evidence (up time, departures) of ``traces``."""
    m = HazardModel(provider, prior_rate_per_h, prior_strength_h, smooth_bins, bin_strength_h)
    for tr in traces:
        for t0, t1 in tr.up_intervals():
            m.observe_exposure(t0, t1)
        for ts in tr.departures():
            m.observe_reclaim(ts)
    return m


def calibrate_from_spot_traces(
    path: str | Path,
    provider: str | None = None,
    prior_rate_per_h: float = DEFAULT_PRIOR_RATE_PER_H,
    prior_strength_h: float = DEFAULT_PRIOR_STRENGTH_H,
    smooth_bins: int = DEFAULT_SMOOTH_BINS,
    bin_strength_h: float = DEFAULT_BIN_STRENGTH_H,
) -> HazardModel:
    """A hazard model calibrated on every 1-node preemption trace at ``path`` (a file or a
    directory, e.g. ``.../spot-traces`` or ``.../preemption/1-node/aws-04-22-2023``).

    The provider defaults to the last path component (the trace set's name). Raises
    HazardError if no trace is found or a file is not a 1-node preemption trace."""
    p = Path(path)
    traces = [load_spot_trace(f) for f in spot_trace_files(p)]
    return model_from_traces(
        traces,
        provider=provider or p.stem,
        prior_rate_per_h=prior_rate_per_h,
        prior_strength_h=prior_strength_h,
        smooth_bins=smooth_bins,
        bin_strength_h=bin_strength_h,
    )
