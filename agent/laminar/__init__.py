"""Laminar: a node agent for GPU clusters with fragmented, revocable capacity."""

__version__ = "0.1.0"
