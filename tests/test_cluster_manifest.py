"""deploy/k8s/radixmux.yaml, checked without a cluster.

Every document against Kubernetes' own schemas (``kubernetes-validate``, which
ships them: strict, so a misspelt field fails); then what a schema cannot see:
each Service and router selects the pods meant for it, every instance is
probed on ``/health`` at a port it declares, its arguments are ones radixmux's
parser accepts, and the routers carry the recipe's failover flags.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.specs import FAILOVER_FLAGS
from radixmux.common.server_args import parse_args

kubernetes_validate = pytest.importorskip("kubernetes_validate")

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "radixmux.yaml"
K8S_VERSION = "1.30"
Doc = dict[str, Any]


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def container(deployment: Doc) -> Doc:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def is_router(deployment: Doc) -> bool:
    return "sglang_router.launch_router" in container(deployment)["command"]


def test_every_document_fits_the_kubernetes_schema(docs: list[Doc]) -> None:
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap", "Secret"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_refuses_a_misspelt_field(docs: list[Doc]) -> None:
    deployment = of_kind(docs, "Deployment")[0]
    bad = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_each_deployment_has_a_service_selecting_its_pods(docs: list[Doc]) -> None:
    services = of_kind(docs, "Service")
    for deployment in of_kind(docs, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        mine = [s for s in services if s["spec"]["selector"].items() <= labels.items()]
        assert len(mine) == 1, deployment["metadata"]["name"]
        ports = {p["name"] for p in container(deployment)["ports"]}
        assert all(p["targetPort"] in ports for p in mine[0]["spec"]["ports"])


def instance_argv(deployment: Doc, docs: list[Doc]) -> list[str]:
    """The container's arguments with ``$(VAR)`` filled as the kubelet would."""
    values: dict[str, str] = {}
    config = {c["metadata"]["name"]: c["data"] for c in of_kind(docs, "ConfigMap")}
    for env in container(deployment)["env"]:
        ref = env.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            values[env["name"]] = config[ref["name"]][ref["key"]]
        else:
            values[env["name"]] = env.get("value", "secret-value")
    return [
        re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], a) for a in container(deployment)["args"]
    ]


def test_instances_are_probed_on_health_and_their_flags_parse(docs: list[Doc]) -> None:
    instances = [d for d in of_kind(docs, "Deployment") if not is_router(d)]
    assert len(instances) >= 2  # model sets
    for deployment in instances:
        c = container(deployment)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["resources"]["requests"]["cpu"]
        args = parse_args(instance_argv(deployment, docs))
        assert args.host == "0.0.0.0" and args.api_key and args.models
        assert args.port == c["ports"][0]["containerPort"]


def test_each_router_finds_its_model_set_and_fails_over_quickly(docs: list[Doc]) -> None:
    routers = [d for d in of_kind(docs, "Deployment") if is_router(d)]
    instances = [d for d in of_kind(docs, "Deployment") if not is_router(d)]
    assert len(routers) == len(instances)
    for router in routers:
        args = container(router)["args"]
        start = args.index("--selector") + 1
        end = next(i for i in range(start, len(args)) if args[i].startswith("--"))
        selector = dict(a.split("=", 1) for a in args[start:end])
        chosen = [
            d
            for d in instances
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(chosen) == 1, router["metadata"]["name"]
        pairs = [
            f"{FAILOVER_FLAGS[i]}={FAILOVER_FLAGS[i + 1]}" for i in range(0, len(FAILOVER_FLAGS), 2)
        ]
        assert set(pairs) <= set(args)
