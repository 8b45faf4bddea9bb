"""deploy/kubernetes/laminard.yaml against the Kubernetes schema, with a real validator.

No API server runs on these machines, so `kubernetes-validate` (the OpenAPI-derived JSON schemas
of each Kubernetes release, in the `dev` extra) checks every document of the manifest, strictly
(an unknown field is an error, as the API server's strict field validation makes it). The test
also checks that it fails on a broken copy, so a validator that passes everything cannot pass
this test, and that the agent's config in the ConfigMap is one the agent accepts.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import laminar.runtime.jobs  # noqa: F401 - registers the job manager's config sections
import laminar.sched.kubernetes  # noqa: F401 - registers [kubernetes]
from laminar.config import validate as validate_config

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "laminard.yaml"
# The newest release this kubernetes-validate ships (pyproject pins >=1.37).
K8S_VERSION = "1.37.0"


def documents() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]
    assert docs, f"{MANIFEST} holds no document"
    return docs


def check(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in {MANIFEST}, found {len(found)}"
    return found[0]


def test_every_document_is_valid_against_the_kubernetes_schema() -> None:
    docs = documents()
    assert {d["kind"] for d in docs} == {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                         "ConfigMap", "DaemonSet"}
    for d in docs:
        check(d)  # raises kubernetes_validate.ValidationError naming the field


@pytest.mark.parametrize("breakage", ["string for a boolean", "unknown field", "container without a name",
                                      "wrong apiVersion"])
def test_a_broken_copy_fails(breakage: str) -> None:
    ds = copy.deepcopy(by_kind(documents(), "DaemonSet"))
    pod = ds["spec"]["template"]["spec"]
    if breakage == "string for a boolean":
        pod["hostNetwork"] = "yes"
    elif breakage == "unknown field":
        pod["hostNetwrok"] = True
    elif breakage == "container without a name":
        del pod["containers"][0]["name"]
    else:
        ds["apiVersion"] = "apps/v0"
    with pytest.raises((kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError)):
        check(ds)


def test_the_daemonset_is_what_the_agent_needs() -> None:
    docs = documents()
    pod = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["hostPID"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    assert "REPLACE-ME" in c["image"]  # a placeholder the docs explain, not an image we ship
    host = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host == {"/sys/fs/bpf", "/sys/fs/cgroup", "/run/laminar", "/var/lib/laminar"}
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    rules = {(g, r): set(rule["verbs"]) for rule in by_kind(docs, "ClusterRole")["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {("", "nodes"): {"get", "patch"}, ("", "pods"): {"get", "list", "watch", "patch"},
                     ("", "pods/eviction"): {"create"}}


def test_the_configmap_holds_a_config_the_agent_accepts() -> None:
    text = by_kind(documents(), "ConfigMap")["data"]["laminard.toml"]
    cfg = validate_config(tomllib.loads(text), "the manifest's ConfigMap")  # ConfigError lists each problem
    assert cfg["kubernetes"]["enabled"] is True
