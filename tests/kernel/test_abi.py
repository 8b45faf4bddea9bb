"""The Python mirrors of bpf/laminar.h match the BTF of the compiled objects exactly.

Reads `bpftool -j btf dump file <object>` (raw BTF as JSON) and compares, for every struct in
laminar.bpf.abi.STRUCTS, its size and each member's name and byte offset, and each member's
size where BTF gives one. A change on either side without the other fails here.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
from functools import cache
from typing import Any

import pytest

from laminar.bpf import abi
from laminar.bpf.libbpf import object_path

pytestmark = pytest.mark.kernel

OBJECTS = ("netguard", "pressure")


@cache
def btf_types(obj: str) -> dict[int, dict[str, Any]]:
    out = subprocess.run(
        ["bpftool", "-j", "btf", "dump", "file", str(object_path(obj))], check=True, capture_output=True, text=True
    ).stdout
    return {t["id"]: t for t in json.loads(out)["types"]}


def btf_size(types: dict[int, dict[str, Any]], type_id: int) -> int:
    """Byte size of a BTF type, following typedefs/qualifiers; arrays multiply."""
    t = types[type_id]
    kind = t["kind"]
    if kind in ("TYPEDEF", "VOLATILE", "CONST", "RESTRICT", "TYPE_TAG"):
        return btf_size(types, t["type_id"])
    if kind == "ARRAY":
        return t["nr_elems"] * btf_size(types, t["type_id"])
    return int(t["size"])


def find_struct(name: str) -> tuple[str, dict[int, dict[str, Any]], dict[str, Any]]:
    for obj in OBJECTS:
        types = btf_types(obj)
        for t in types.values():
            if t["kind"] == "STRUCT" and t.get("name") == name:
                return obj, types, t
    raise AssertionError(f"struct {name} is in the BTF of none of {OBJECTS}")


@pytest.mark.parametrize("cname", sorted(abi.STRUCTS))
def test_struct_matches_btf(cname: str) -> None:
    mirror = abi.STRUCTS[cname]
    obj, types, st = find_struct(cname)
    assert ctypes.sizeof(mirror) == st["size"], f"{cname}: Python {ctypes.sizeof(mirror)} bytes, {obj}.bpf.o {st['size']}"
    btf_members = [(m["name"], m["bits_offset"] // 8, btf_size(types, m["type_id"])) for m in st["members"]]
    py_members = [
        (f[0], getattr(mirror, f[0]).offset, getattr(mirror, f[0]).size) for f in mirror._fields_
    ]
    assert py_members == btf_members, f"{cname}: Python fields differ from {obj}.bpf.o BTF"


def test_every_object_struct_is_mirrored() -> None:
    """Each lm_* struct the objects carry has a mirror (a new struct in laminar.h needs one)."""
    seen = {
        t["name"]
        for obj in OBJECTS
        for t in btf_types(obj).values()
        if t["kind"] == "STRUCT" and str(t.get("name", "")).startswith("lm_")
    }
    assert seen <= set(abi.STRUCTS), f"unmirrored structs: {sorted(seen - set(abi.STRUCTS))}"
    assert set(abi.STRUCTS) <= seen


@pytest.mark.parametrize("obj", OBJECTS)
def test_map_value_types_match_schemas(obj: str) -> None:
    """The BTF value type of each map in the object is the struct MAP_SCHEMAS names for it."""
    types = btf_types(obj)
    maps = next(t for t in types.values() if t["kind"] == "DATASEC" and t["name"] == ".maps")
    names = {ctypes.c_uint64: 8, ctypes.c_uint32: 4}
    for var in maps["vars"]:
        v = types[var["type_id"]]
        name = v["name"]
        key_t, value_t = abi.MAP_SCHEMAS[name]
        members = {m["name"]: m for m in types[v["type_id"]]["members"]}
        if "value" not in members:  # ring buffer: no key/value types
            assert key_t is None, name
            continue
        ptr = types[members["value"]["type_id"]]
        assert ptr["kind"] == "PTR"
        assert btf_size(types, ptr["type_id"]) == ctypes.sizeof(value_t), name
        kptr = types[members["key"]["type_id"]]
        assert key_t is not None
        assert btf_size(types, kptr["type_id"]) == ctypes.sizeof(key_t), name
        target = types[ptr["type_id"]]
        if target["kind"] == "STRUCT":
            assert abi.STRUCTS[target["name"]] is value_t, name
        else:
            assert value_t in names, name
