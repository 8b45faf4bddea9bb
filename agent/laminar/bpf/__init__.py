"""Laminar's BPF side in Python: libbpf through cffi (:mod:`laminar.bpf.libbpf`) and the
map ABI of ``bpf/laminar.h`` mirrored as ctypes structures (:mod:`laminar.bpf.abi`).

The compiled CO-RE objects live in ``objects/`` (``make bpf``); :func:`laminar.bpf.libbpf.object_path`
finds them. Maps are pinned by name under ``/sys/fs/bpf/laminar/`` (configurable); see
``docs/bpf-maps.md`` for each map.
"""
