"""deploy/kubernetes/gateway/: the InferencePool validates offline against the published CRD schema
(vendored in tests/fixtures/crd/ with its source and version), and the picker's Deployment and
Service agree with it, with the engines of deploy/kubernetes/ and with `kvroute epp`'s own flags.

jsonschema checks the CRD's OpenAPI v3 schema; its two CEL rules (``x-kubernetes-validations``)
that concern these fields are checked here by hand, named by their messages."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvroute.cli import build_parser
from kvroute.commands.serve import config_from_args

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "deploy" / "kubernetes" / "gateway"
CRD = ROOT / "tests" / "fixtures" / "crd" / "inference.networking.k8s.io_inferencepools.yaml"

FILES = {
    "inferencepool.yaml": ("inference.networking.k8s.io/v1", "InferencePool"),
    "epp-deployment.yaml": ("apps/v1", "Deployment"),
    "epp-service.yaml": ("v1", "Service"),
    "kustomization.yaml": ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
}


def load(path: Path) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert len(docs) == 1, path
    return docs[0]


def pool_schema() -> dict[str, Any]:
    crd = load(CRD)
    assert crd["spec"]["group"] == "inference.networking.k8s.io"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def pool_errors(pool: dict[str, Any]) -> list[str]:
    """What the API server would reject in ``pool``: the schema, then the CEL rules named below."""
    validator = jsonschema.Draft7Validator(pool_schema())
    errors = [e.message for e in validator.iter_errors(pool)]
    spec = pool.get("spec", {})
    ref = spec.get("endpointPickerRef", {})
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("port is required when kind is 'Service' or unspecified (defaults to 'Service')")
    numbers = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        errors.append("port number must be unique")
    return errors


def epp_container() -> dict[str, Any]:
    (c,) = load(GATEWAY / "epp-deployment.yaml")["spec"]["template"]["spec"]["containers"]
    return c


def test_every_file_and_kustomization() -> None:
    assert {p.name for p in GATEWAY.glob("*.y*ml")} == set(FILES)
    for name, (api, kind) in FILES.items():
        doc = load(GATEWAY / name)
        assert (doc["apiVersion"], doc["kind"]) == (api, kind)
    assert sorted(load(GATEWAY / "kustomization.yaml")["resources"]) == sorted(
        set(FILES) - {"kustomization.yaml"}
    )


def test_inference_pool_validates_against_the_published_crd() -> None:
    assert pool_errors(load(GATEWAY / "inferencepool.yaml")) == []


@pytest.mark.parametrize(
    ("break_it", "needle"),
    [
        (lambda s: s.pop("targetPorts"), "'targetPorts' is a required property"),
        (lambda s: s["targetPorts"].append({"number": 70000}), "70000 is greater than the maximum"),
        (lambda s: s["targetPorts"].append({"number": 8000}), "port number must be unique"),
        (lambda s: s["endpointPickerRef"].pop("port"), "port is required when kind is 'Service'"),
        (lambda s: s["endpointPickerRef"].update(failureMode="Maybe"), "'Maybe' is not one of"),
        (lambda s: s.update(selector="app=vllm"), "'app=vllm' is not of type 'object'"),
    ],
)
def test_the_validation_bites(break_it: Any, needle: str) -> None:
    pool = copy.deepcopy(load(GATEWAY / "inferencepool.yaml"))
    break_it(pool["spec"])
    assert any(needle in e for e in pool_errors(pool)), pool_errors(pool)


def test_pool_picker_and_engines_agree() -> None:
    pool = load(GATEWAY / "inferencepool.yaml")["spec"]
    svc = load(GATEWAY / "epp-service.yaml")
    dep = load(GATEWAY / "epp-deployment.yaml")
    ref = pool["endpointPickerRef"]
    assert ref["name"] == svc["metadata"]["name"]
    (grpc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"  # ext_proc is gRPC: HTTP/2
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    c = epp_container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in ports
    assert ports[grpc_port["targetPort"]] == ref["port"]["number"]
    # the pool's members are the engines' pods, on the port the picker discovers them at
    engines = [d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/engines.yaml").read_text()) if d]
    (eng,) = [d for d in engines if d["kind"] == "Deployment"]
    labels = eng["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    (discover,) = [a for a in c["args"] if a.startswith("--discover=")]
    assert discover.endswith(f":{pool['targetPorts'][0]['number']}")


def test_picker_command_line_is_kvroutes_own() -> None:
    pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")
    from kvroute.server.extproc.service import READY_SERVICES

    c = epp_container()
    assert c["command"] == ["kvroute", "epp"]
    args = build_parser().parse_args(["epp", *c["args"]])
    cfg = config_from_args(args)
    assert cfg.discover == ("dns://vllm-engines:8000",) and cfg.discover_kv_events == "tcp://{host}:5557"
    assert (args.grpc_host, args.grpc_port, args.port) == ("0.0.0.0", 9002, 9090)
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == args.grpc_port
    assert c["livenessProbe"]["grpc"]["service"] == "liveness"
    assert c["readinessProbe"]["grpc"]["service"] in READY_SERVICES
    grace = load(GATEWAY / "epp-deployment.yaml")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > cfg.drain_grace_s + cfg.drain_timeout_s
