"""deploy/kubernetes/: every manifest parses, and what it says about the router matches the code.

No cluster: the manifests are read with PyYAML; the router's flags go through kvroute's own argument
parser and config merge (``kvroute serve``), the ConfigMap through its YAML loader, probe and scrape
paths are checked against the routes a :class:`RouterServer` registers (built, never started), and the
alert rules' metric names against what that server's registry exports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from kvroute.cli import build_parser
from kvroute.commands import serve
from kvroute.commands.settings import config_from_mapping, features_from_mapping, load_config_file
from kvroute.errors import UserError
from kvroute.server import app as app_module
from kvroute.server.app import RouterServer
from kvroute.server.config import RouterConfig
from kvroute.server.observe.exporter import render_metrics
from kvroute.server.sync.peers import parse_peer_endpoint
from kvroute.server.workers import WorkerCollector

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
ALERTS = ROOT / "deploy" / "prometheus" / "kvroute-alerts.yml"

MANIFESTS: dict[str, list[tuple[str, str]]] = {
    "router-configmap.yaml": [("v1", "ConfigMap")],
    "router-deployment.yaml": [("apps/v1", "Deployment")],
    "router-pdb.yaml": [("policy/v1", "PodDisruptionBudget")],
    "router-service.yaml": [("v1", "Service")],
    "router-peers-service.yaml": [("v1", "Service")],
    "engines.yaml": [("v1", "Service"), ("apps/v1", "Deployment")],
    "podmonitor.yaml": [("monitoring.coreos.com/v1", "PodMonitor")],
    "prometheusrule.yaml": [("monitoring.coreos.com/v1", "PrometheusRule")],
    "admin-secret.yaml": [("v1", "Secret")],
    "kustomization.yaml": [("kustomize.config.k8s.io/v1beta1", "Kustomization")],
}
"""Every YAML file of deploy/kubernetes/ and the (apiVersion, kind) of its documents, in order."""

NOT_APPLIED = {"kustomization.yaml", "admin-secret.yaml"}  # the secret: see its comment


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text(encoding="utf-8")) if d is not None]


def obj(kind: str, name: str) -> dict[str, Any]:
    found = [d for f in MANIFESTS for d in load(f) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def router_deployment() -> dict[str, Any]:
    return obj("Deployment", "kvroute")


def router_container() -> dict[str, Any]:
    (c,) = [c for c in router_deployment()["spec"]["template"]["spec"]["containers"] if c["name"] == "router"]
    return c


def engine_container() -> dict[str, Any]:
    (c,) = obj("Deployment", "vllm")["spec"]["template"]["spec"]["containers"]
    return c


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def flag(args: list[str], name: str) -> str:
    """The value of ``--name=VALUE`` in a container's args (exactly one)."""
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def selects(selector: dict[str, str], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return bool(selector) and selector.items() <= labels.items()


def service_port(service: dict[str, Any], name: str) -> dict[str, Any]:
    (p,) = [p for p in service["spec"]["ports"] if p["name"] == name]
    return p


def dns_name_is_service(name: str, service: str) -> bool:
    """``NAME`` (of dns://NAME:PORT) resolves, from a pod of the same namespace, to Service ``service``:
    the short name, or a longer form ``service.NAMESPACE[.svc[.cluster.local]]``."""
    labels = name.rstrip(".").split(".")
    return labels[0] == service and labels[2:3] in ([], ["svc"])


def parse_serve_args() -> argparse.Namespace:
    """The router container's command line through kvroute's own parser (raises on an unknown flag or a
    bad value)."""
    c = router_container()
    assert c["command"][:2] == ["kvroute", "serve"], c["command"]
    return build_parser().parse_args([*c["command"][1:], *c["args"]])


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RouterConfig:
    """The router's effective config: the container's flags merged over the ConfigMap's file, as
    ``kvroute serve`` does it (the file written where the flag expects it, under tmp_path)."""
    monkeypatch.delenv(serve.ADMIN_TOKEN_ENV, raising=False)
    args = parse_serve_args()
    cm = obj("ConfigMap", "kvroute-config")
    mount_dir, key = args.config.rsplit("/", 1)
    local = tmp_path / key
    local.write_text(cm["data"][key], encoding="utf-8")
    args.config = str(local)
    # the --config path is the ConfigMap's key in the volume mounted there
    spec = router_deployment()["spec"]["template"]["spec"]
    (mount,) = [m for m in router_container()["volumeMounts"] if m["mountPath"] == mount_dir]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == cm["metadata"]["name"] and "items" not in volume["configMap"]
    return serve.config_from_args(args)


async def built(config: RouterConfig) -> RouterServer:
    """A router for ``config``, built but not started (no port, no loops)."""
    return RouterServer(config, background=False)


def get_routes(server: RouterServer) -> set[str]:
    return {r.resource.canonical for r in server.make_app().router.routes() if r.method == "GET"}


# ---- the files --------------------------------------------------------------------------------


def test_every_manifest_parses_with_the_expected_kinds() -> None:
    assert {p.name for p in K8S.glob("*.y*ml")} == set(MANIFESTS)
    for name, kinds in MANIFESTS.items():
        docs = load(name)
        assert [(d["apiVersion"], d["kind"]) for d in docs] == kinds, name
        for d in docs:
            if d["kind"] != "Kustomization":
                assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]), name


def test_kustomization_lists_every_manifest_but_the_admin_secret() -> None:
    (k,) = load("kustomization.yaml")
    assert sorted(k["resources"]) == sorted(set(MANIFESTS) - NOT_APPLIED)


def test_the_container_runs_the_kvroute_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts[router_container()["command"][0]] == "kvroute.cli:main"


# ---- the router's command line and config ------------------------------------------------------


def test_router_flags_exist_in_kvroute_serve() -> None:
    args = parse_serve_args()
    assert args.command == "serve" and args._run is serve.run
    assert args.workers == 2 and args.host == "0.0.0.0"
    with pytest.raises(UserError):  # the same parser refuses what it does not know
        build_parser().parse_args(["serve", *router_container()["args"], "--no-such-flag"])
    for a in router_container()["args"]:  # one `--flag=value` item each: readable, and parsed as one
        assert a.startswith("--") and "=" in a, a


def test_configmap_loads_with_the_router_config_loader(tmp_path: Path) -> None:
    (cm,) = load("router-configmap.yaml")
    (key,) = cm["data"]
    text = cm["data"][key]
    config_from_mapping(yaml.safe_load(text), key)
    (tmp_path / key).write_text(text, encoding="utf-8")
    cfg = load_config_file(tmp_path / key)
    assert cfg.policy == "lmetric"
    # the alert rules' score and hot-spot metrics need these features
    assert cfg.features is not None and cfg.features.monitor is not None and cfg.features.hotspot is not None


def test_effective_config(config: RouterConfig) -> None:
    assert config.validate() is config
    assert config.workers == 2 and config.policy == "lmetric" and config.admin_token is None
    assert config.features is not None and config.features.monitor is not None


def test_admin_token_comes_from_the_secret_by_env() -> None:
    (env,) = [e for e in router_container()["env"] if e["name"] == serve.ADMIN_TOKEN_ENV]
    ref = env["valueFrom"]["secretKeyRef"]
    secret = obj("Secret", ref["name"])
    assert ref["key"] in secret["stringData"] and ref.get("optional") is True
    assert not any(a.startswith("--admin-token") for a in router_container()["args"])


# ---- ports, Services, DNS ----------------------------------------------------------------------


def test_container_ports_match_the_flags(config: RouterConfig) -> None:
    p = ports(router_container())
    assert p["http"] == config.port
    assert config.peer_bind is not None
    _, host, peer_port = parse_peer_endpoint(config.peer_bind, dns=False)
    assert p["peers"] == peer_port and host in ("0.0.0.0", "*", "::")


def test_client_service_reaches_the_http_port() -> None:
    svc = obj("Service", "kvroute")
    assert svc["spec"]["type"] == "ClusterIP" and selects(svc["spec"]["selector"], router_deployment())
    assert service_port(svc, "http")["targetPort"] in ports(router_container())


def test_peers_resolve_to_the_headless_peers_service(config: RouterConfig) -> None:
    svc = obj("Service", "kvroute-peers")
    spec = svc["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    assert selects(spec["selector"], router_deployment())
    port = service_port(svc, "peers")
    assert config.peer_bind is not None
    bind_port = parse_peer_endpoint(config.peer_bind, dns=False)[2]
    assert port["port"] == bind_port and ports(router_container())[port["targetPort"]] == bind_port
    assert config.peers
    for peer in config.peers:
        scheme, name, peer_port = parse_peer_endpoint(peer)
        assert scheme == "dns" and dns_name_is_service(name, "kvroute-peers") and peer_port == bind_port


def test_engines_service_matches_the_router_discovery(config: RouterConfig) -> None:
    svc = obj("Service", "vllm-engines")
    engines = obj("Deployment", "vllm")
    assert svc["spec"]["clusterIP"] == "None" and not svc["spec"].get("publishNotReadyAddresses", False)
    assert selects(svc["spec"]["selector"], engines)
    engine_ports = ports(engine_container())
    (source,) = config.discover
    assert source.startswith("dns://")
    name, _, port = source.removeprefix("dns://").rpartition(":")
    assert dns_name_is_service(name, svc["metadata"]["name"])
    http = service_port(svc, "http")
    assert int(port) == http["port"] == engine_ports[http["targetPort"]]
    # KV events: the router's template, filled with an engine's address, is the engine's PUB port
    assert config.discover_kv_events is not None
    events = urlparse(config.discover_kv_events.format(host="10.1.2.3"))
    kv = service_port(svc, "kv-events")
    assert events.scheme == "tcp" and events.hostname == "10.1.2.3"
    assert events.port == kv["port"] == engine_ports[kv["targetPort"]]


def test_engines_publish_kv_events_where_the_router_listens(config: RouterConfig) -> None:
    c = engine_container()
    assert c["command"] == ["vllm", "serve"]
    kv = json.loads(flag(c["args"], "kv-events-config"))
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    endpoint = urlparse(kv["endpoint"])
    assert endpoint.scheme == "tcp" and endpoint.netloc.split(":")[0] == "*"
    assert config.discover_kv_events is not None
    assert endpoint.port == urlparse(config.discover_kv_events.format(host="h")).port
    assert int(flag(c["args"], "port")) == ports(c)["http"]
    assert int(flag(c["args"], "block-size")) == config.block_size
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health" and c[probe]["httpGet"]["port"] == "http"


# ---- probes, shutdown, disruption --------------------------------------------------------------


async def test_probe_paths_are_router_routes(config: RouterConfig) -> None:
    server = await built(config)
    try:
        routes = get_routes(server)
        c = router_container()
        probes = {p: c[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
        for probe in probes.values():
            assert probe["path"] in routes and probe["port"] in ports(c)
        assert probes["readinessProbe"]["path"] == "/health"
        # with no healthy engine /health is 503 (not ready), while the liveness path stays 200: the
        # kubelet must not restart a router because the engines are down
        assert (await server.health(None)).status == 503  # type: ignore[arg-type]
        assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/livez"
        assert (await server.livez(None)).status == 200  # type: ignore[arg-type]
        server.draining = True  # a drain (SIGTERM) makes the pod unready, never "dead"
        assert (await server.health(None)).status == 503  # type: ignore[arg-type]
        assert (await server.livez(None)).status == 200  # type: ignore[arg-type]
    finally:
        await server.stop()


def test_termination_grace_covers_the_drain(config: RouterConfig) -> None:
    spec = router_deployment()["spec"]["template"]["spec"]
    need = config.drain_grace_s + config.drain_timeout_s + app_module._ABORT_WAIT_S
    assert spec["terminationGracePeriodSeconds"] > need
    assert config.drain_grace_s >= 5  # endpoints take seconds to propagate; there is no preStop hook
    assert "lifecycle" not in router_container()


def test_replicas_spread_and_disruption_budget() -> None:
    d = router_deployment()
    assert d["spec"]["replicas"] == 2
    affinity = d["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["podAffinityTerm"]["labelSelector"]["matchLabels"], d)
    pdb = obj("PodDisruptionBudget", "kvroute")
    assert selects(pdb["spec"]["selector"]["matchLabels"], d)
    assert 1 <= pdb["spec"]["minAvailable"] < d["spec"]["replicas"]


# ---- monitoring --------------------------------------------------------------------------------


async def test_podmonitor_scrapes_a_router_route(config: RouterConfig) -> None:
    pm = obj("PodMonitor", "kvroute")
    assert selects(pm["spec"]["selector"]["matchLabels"], router_deployment())
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports(router_container())
    server = await built(config)
    try:
        assert endpoint["path"] in get_routes(server)
    finally:
        await server.stop()


def test_prometheusrule_is_the_alert_rules_file() -> None:
    rule = obj("PrometheusRule", "kvroute")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]


async def test_alert_rules_use_metrics_the_router_exports(config: RouterConfig) -> None:
    """Names from the registry of a router with the deployed config (peers and all), plus the quota
    feature (off in the ConfigMap; its alert waits for it) and the ``--workers`` worker metric."""
    assert config.features is not None
    quota = features_from_mapping({"quota": {"tokens_per_s": 1, "burst": 1}}).quota
    cfg = dataclasses.replace(config, features=dataclasses.replace(config.features, quota=quota))
    server = await built(cfg)
    try:
        server.registry.register(WorkerCollector(1, cfg.workers))
        text = render_metrics(server.registry).decode()
    finally:
        await server.stop()
    exported = set(re.findall(r"^(kvroute_\w+)[{ ]", text, re.M))
    exported |= set(re.findall(r"^# TYPE (kvroute_\w+) ", text, re.M))
    assert "kvroute_peers" in exported and "kvroute_worker_info" in exported  # the whole registry
    rule = obj("PrometheusRule", "kvroute")
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    used = {n for e in exprs for n in re.findall(r"\bkvroute_\w+", e)}
    assert used and used <= exported, used - exported


def test_guide_shows_the_deployed_command_line() -> None:
    """The router guide's two-replica `kvroute serve` line is the Deployment's command line."""
    text = (ROOT / "docs" / "guide" / "router.md").read_text(encoding="utf-8").replace("\\\n", " ")
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip().startswith("kvroute serve --config /etc/kvroute")
    ]
    assert len(lines) == 1
    readme = build_parser().parse_args(shlex.split(lines[0])[1:])
    assert vars(readme) == vars(parse_serve_args())
