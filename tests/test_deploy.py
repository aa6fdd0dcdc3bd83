"""Deployment files: docker-compose, Dockerfiles, Kubernetes manifests, Prometheus, Grafana.

Structural checks that need no container engine or cluster: every loraplex process is
configured only through ``LORAPLEX_*`` variables that ``Settings`` knows and can parse,
services start in the right order, the Kubernetes manifests validate against the API
schemas (``kubernetes-validate``, strict: unknown fields are errors), and every dashboard
panel queries a ``loraplex_`` metric.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from loraplex.settings import PREFIX, Settings
from loraplex_cli.main import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.30"
SETTINGS_KEYS = {PREFIX + f.name.upper() for f in dataclasses.fields(Settings)}
OUR_IMAGES = {"loraplex", "loraplex-worker", "loraplex-cuda"}
CONTROL_IMAGE = ("loraplex", "Dockerfile")
"""The image without torch (``pip install .``): gateway, migrate, admin."""
WORKER_IMAGES = {"loraplex-worker": "Dockerfile.worker", "loraplex-cuda": "Dockerfile.cuda"}
"""Images with the engine extra (``pip install '.[engine]'``)."""
VLLM_IMAGE = "vllm/vllm-openai"
"""vLLM's own image: the one third-party container in a loraplex pod (beside ``loraplex vllm-agent``)."""


# --- docker-compose ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _ours(svc: dict[str, Any]) -> bool:
    return "build" in svc or str(svc.get("image", "")).split(":")[0] in OUR_IMAGES


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_has_the_whole_system(compose):
    services = compose["services"]
    for name in ("postgres", "redis", "migrate", "gateway", "worker-1", "worker-2"):
        assert name in services, name
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file(), name


COMPOSE_SECRETS = {"LORAPLEX_JWT_SECRET": "j" * 64, "LORAPLEX_WORKER_SECRET": "w" * 64, "POSTGRES_PASSWORD": "p" * 32}
"""What an operator puts in .env (compose requires every one of them)."""
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def _interpolate(value: str, environ: dict[str, str]) -> str:
    """``${VAR}``, ``${VAR:-default}`` and ``${VAR:?message}`` as docker compose resolves them."""
    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        got = environ.get(name, "")
        if op in (":?", "?") and not got:
            raise LookupError(f"{name}: {arg}")
        return got or (arg if op in (":-", "-") else "")
    return _VAR.sub(one, value)


def test_compose_loraplex_services_use_only_known_settings(compose):
    for name, svc in compose["services"].items():
        if not _ours(svc):
            continue
        env = _env(svc)
        assert env, f"{name} has no environment"
        unknown = sorted(set(env) - SETTINGS_KEYS)
        assert not unknown, f"{name}: not LORAPLEX_* settings: {unknown}"
        # Resolve ${VAR...} as compose would with the operator's .env, then parse like the processes do.
        settings = Settings.from_env({k: _interpolate(v, COMPOSE_SECRETS) for k, v in env.items()})
        db, redis = urlsplit(settings.database_url), urlsplit(settings.redis_url)
        assert (db.scheme, db.hostname) == ("postgresql+asyncpg", "postgres"), name
        assert db.password == COMPOSE_SECRETS["POSTGRES_PASSWORD"], name
        assert (redis.scheme, redis.hostname) == ("redis", "redis"), name
        assert settings.jwt_secret == COMPOSE_SECRETS["LORAPLEX_JWT_SECRET"], name
        assert settings.worker_secret == COMPOSE_SECRETS["LORAPLEX_WORKER_SECRET"], name


SECRETISH = re.compile(r"SECRET|PASSWORD|TOKEN|_KEY$")


def test_compose_takes_every_secret_from_the_environment(compose):
    """No secret value is written in the repository: each is a required ${VAR:?...} variable."""
    required: set[str] = set()
    for name, svc in compose["services"].items():
        for key, value in _env(svc).items():
            for var, op, _ in _VAR.findall(value):
                if SECRETISH.search(var):
                    assert op == ":?", f"{name}: {key} must be ${{{var}:?...}} (no default in the repo)"
                    required.add(var)
            if SECRETISH.search(key):
                assert _VAR.fullmatch(value), f"{name}: {key} is written in the compose file"
            if key == "LORAPLEX_DATABASE_URL":
                password = urlsplit(_interpolate(value, COMPOSE_SECRETS)).password
                assert password and password not in value, f"{name}: the database password is written here"
            if any(SECRETISH.search(var) for var, _, _ in _VAR.findall(value)):
                with pytest.raises(LookupError):  # compose refuses to start without .env
                    _interpolate(value, {})
    assert required == set(COMPOSE_SECRETS)
    example = dict(line.split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert example == dict.fromkeys(COMPOSE_SECRETS, ""), "the .env.example lists each variable, with no value"
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines(), "a filled-in .env must never be committed"


def test_compose_publishes_only_the_gateway(compose):
    services = compose["services"]
    for name in ("worker-1", "worker-2", "postgres", "redis", "migrate"):
        assert not services[name].get("ports"), f"{name} must be reachable on the compose network only"
        assert services[name].get("network_mode") != "host", name
    gateway = Settings.from_env(_env(services["gateway"]))
    assert services["gateway"]["ports"] == [f"{gateway.gateway_port}:{gateway.gateway_port}"]


def test_compose_third_party_images_use_their_own_env_only(compose):
    services = compose["services"]
    assert set(_env(services["postgres"])) <= {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"}
    assert not _env(services["redis"])
    assert set(_env(services.get("grafana", {}))) <= {"GF_AUTH_ANONYMOUS_ENABLED", "GF_AUTH_ANONYMOUS_ORG_ROLE"}


def test_compose_commands_are_loraplex_commands(compose):
    for name, svc in compose["services"].items():
        if _ours(svc):
            assert svc["command"][0] in COMMANDS, name
    services = compose["services"]
    assert services["migrate"]["command"] == ["migrate"]
    assert services["gateway"]["command"] == ["gateway"]
    assert services["worker-1"]["command"] == services["worker-2"]["command"] == ["worker"]


def test_compose_start_order_and_healthchecks(compose):
    services = compose["services"]
    allowed = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions"
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec["condition"] in allowed, name
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} health, which has no check"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("gateway", "worker-1", "worker-2"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "healthcheck" in services[name], name
    assert "/readyz" in " ".join(services["gateway"]["healthcheck"]["test"])
    for name in ("worker-1", "worker-2"):
        assert "/health" in " ".join(services[name]["healthcheck"]["test"])


def test_compose_workers_have_distinct_identities_they_can_be_reached_at(compose):
    services = compose["services"]
    seen_ids, seen_urls = set(), set()
    for name in ("worker-1", "worker-2"):
        s = Settings.from_env(_env(services[name]))
        assert s.worker_id and s.worker_id not in seen_ids
        assert s.worker_url == f"http://{name}:{s.worker_port}", "advertised URL must be the service name"
        assert s.worker_host == "0.0.0.0"
        assert s.model.startswith("/var/lib/loraplex/models/")
        mounts = {v.split(":")[1] for v in services[name]["volumes"]}
        assert str(Path(s.model).parent) in mounts, "the model volume is not mounted where LORAPLEX_MODEL points"
        seen_ids.add(s.worker_id)
        seen_urls.add(s.worker_url)
    gateway = Settings.from_env(_env(services["gateway"]))
    assert gateway.gateway_host == "0.0.0.0"
    assert f"{gateway.gateway_port}:{gateway.gateway_port}" in services["gateway"]["ports"]


def test_compose_bind_mounts_exist(compose):
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in compose["volumes"], f"{name} uses undeclared volume {src}"


def test_compose_vllm_profile_runs_vllm_beside_its_agent(compose):
    services = compose["services"]
    vllm, agent = services["vllm"], services["vllm-agent"]
    assert vllm["profiles"] == agent["profiles"] == ["vllm"]
    assert vllm["image"].split(":")[0] == VLLM_IMAGE and not vllm.get("ports"), "vLLM is not published"
    assert agent["image"].split(":")[0] == CONTROL_IMAGE[0], "the agent runs from the image without torch"
    args = _agent_args({"args": agent["command"]})
    flags = vllm["command"]
    for flag in ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--enable-prompt-tokens-details"):
        assert flag in flags, flag
    assert args.vllm_url == f"http://vllm:{flags[flags.index('--port') + 1]}"
    assert args.url == f"http://vllm-agent:{args.port}" and args.host == "0.0.0.0"
    assert _env(vllm)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    # the registry's base model as the bundled workers name it: same name and revision
    assert args.model == Settings.from_env(_env(services["worker-1"])).model
    cache = Settings.from_env(_env(agent)).adapter_cache_dir
    mounts = {name: {v.split(":")[1]: v for v in services[name]["volumes"]} for name in ("vllm", "vllm-agent")}
    assert mounts["vllm"][cache].split(":")[0] == mounts["vllm-agent"][cache].split(":")[0]
    assert mounts["vllm"][cache].endswith(":ro")
    assert agent["depends_on"]["vllm"]["condition"] == "service_healthy"


def _docker_compose_available() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _docker_compose_available(), reason="docker compose plugin not installed")
def test_docker_compose_config_parses():
    cmd = ["docker", "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"]
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_SECRETS}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env | COMPOSE_SECRETS)
    assert proc.returncode == 0, proc.stderr
    missing = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    assert missing.returncode != 0 and "LORAPLEX_JWT_SECRET" in missing.stderr + missing.stdout


# --- Dockerfiles ---------------------------------------------------------------------------

def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.worker", "Dockerfile.cuda"])
def test_dockerfile_references_existing_paths_and_commands(name):
    path = DEPLOY / name
    ins = _instructions(path)
    stages = [rest for op, rest in ins if op == "FROM"]
    assert len(stages) >= 2, "multi-stage build expected"
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    included = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for op, rest in ins:
        if op == "COPY" and "--from=" not in rest:
            parts = [p for p in rest.split() if not p.startswith("--")]
            for src in parts[:-1]:
                assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
                assert src.rstrip("/") in included, f"{name}: {src} is excluded by the .dockerignore"
        if op == "RUN":
            for cmd in re.findall(r"\bloraplex ([a-z-]+)", rest):
                assert cmd in COMMANDS or cmd.startswith("-"), f"{name}: unknown command loraplex {cmd}"
    assert ("ENTRYPOINT", '["loraplex"]') in ins
    cmd = json.loads(next(rest for op, rest in ins if op == "CMD"))
    assert cmd[0] in COMMANDS
    user = [rest for op, rest in ins if op == "USER"]
    assert user and not user[-1].startswith(("root", "0")), "the image must not run as root"
    env = " ".join(rest for op, rest in ins if op == "ENV")
    for key in re.findall(r"\b(LORAPLEX_[A-Z_]+)=", env):
        assert key in SETTINGS_KEYS, f"{name}: {key} is not a setting"
    if name == "Dockerfile.cuda":
        assert "nvidia/cuda:" in path.read_text()
    else:
        assert stages[-1].startswith("${PYTHON_IMAGE}") and "ARG PYTHON_IMAGE=python:3.11-slim" in path.read_text()


def _pip_installs(name: str) -> list[str]:
    """The arguments of every ``pip install`` in a Dockerfile's RUN lines."""
    runs = [rest for op, rest in _instructions(DEPLOY / name) if op == "RUN"]
    return [m.strip() for run in runs for m in re.findall(r"\bpip install ([^&;]+)", run)]


def test_the_gateway_image_carries_no_torch():
    installs = _pip_installs(CONTROL_IMAGE[1])
    assert installs == ["."], "the control-plane image installs the project without extras, and nothing else"
    text = (DEPLOY / CONTROL_IMAGE[1]).read_text()
    assert "pip show torch" in text, "the build fails if the resolution ever brings torch"
    assert json.loads(next(rest for op, rest in _instructions(DEPLOY / CONTROL_IMAGE[1]) if op == "CMD")) == ["gateway"]


@pytest.mark.parametrize("name", sorted(WORKER_IMAGES.values()))
def test_worker_images_install_torch_first_then_the_engine_extra(name):
    installs = _pip_installs(name)
    assert len(installs) == 2 and '"torch==${TORCH_VERSION}"' in installs[0], installs
    assert installs[1] == "'.[engine]'", installs
    assert json.loads(next(rest for op, rest in _instructions(DEPLOY / name) if op == "CMD")) == ["worker"]


def test_compose_runs_the_gateway_without_torch_and_workers_with_the_engine(compose):
    services = compose["services"]
    for name in ("gateway", "migrate"):
        svc = services[name]
        assert svc["image"].split(":")[0] == CONTROL_IMAGE[0], name
        assert svc["build"]["dockerfile"] == f"deploy/{CONTROL_IMAGE[1]}", name
    for name in ("worker-1", "worker-2", "fetch-demo"):
        svc = services[name]
        image = svc["image"].split(":")[0]
        assert image in WORKER_IMAGES and svc["build"]["dockerfile"] == f"deploy/{WORKER_IMAGES[image]}", name


# --- Kubernetes ----------------------------------------------------------------------------

def _k8s_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict[str, Any]]:
    """``"Kind/name" -> manifest`` for every manifest file (the kustomization excluded)."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        for doc in _k8s_docs(f):
            key = f"{doc['kind']}/{doc['metadata']['name']}"
            assert key not in out, f"duplicate {key}"
            out[key] = doc
    return out


def test_k8s_manifests_validate_strictly(k8s):
    for key, doc in k8s.items():
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{key}: {exc.message}")


def test_k8s_validation_catches_a_broken_manifest(k8s):
    import copy

    broken = copy.deepcopy(k8s["Deployment/loraplex-gateway"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest_but_the_secret_template(k8s):
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert set(kust["resources"]) == files
    assert kust["namespace"] == "loraplex"


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl not installed")
def test_kustomize_build_validates():
    proc = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert len(docs) >= 10
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "loraplex", doc["metadata"]["name"]


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def _workloads(k8s: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in k8s.items() if v["kind"] in ("Deployment", "StatefulSet", "Job")}


def test_k8s_containers_are_hardened_and_sized(k8s):
    for key, doc in _workloads(k8s).items():
        pod = _pod_spec(doc)
        assert pod["securityContext"]["runAsNonRoot"] is True, key
        for c in pod.get("initContainers", []) + pod["containers"]:
            if c["image"].split(":")[0] != VLLM_IMAGE:
                assert c["image"].split(":")[0] in OUR_IMAGES, key
                assert c["args"][0] in COMMANDS, f"{key}: {c['args']} is not a loraplex command"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, key
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], key
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), key
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), key


def test_k8s_settings_come_from_the_configmap_and_the_named_secret(k8s):
    config = k8s["ConfigMap/loraplex-config"]["data"]
    assert set(config) <= SETTINGS_KEYS, sorted(set(config) - SETTINGS_KEYS)
    Settings.from_env({k: v for k, v in config.items()})  # every value parses
    secret = k8s["Secret/loraplex-secrets"]["stringData"]
    assert set(secret) <= SETTINGS_KEYS
    assert {"LORAPLEX_DATABASE_URL", "LORAPLEX_JWT_SECRET", "LORAPLEX_WORKER_SECRET"} <= set(secret)
    assert not set(secret) & set(config), "a secret must not also sit in the ConfigMap"
    for key, doc in _workloads(k8s).items():
        for c in _pod_spec(doc).get("initContainers", []) + _pod_spec(doc)["containers"]:
            if c["image"].split(":")[0] == VLLM_IMAGE:
                assert "envFrom" not in c, f"{key}: vLLM gets no loraplex settings or secrets"
                continue
            refs = c["envFrom"]
            assert {"configMapRef": {"name": "loraplex-config"}} in refs, key
            for item in c.get("env", []):
                assert item["name"] in SETTINGS_KEYS or item["name"].startswith("POD_"), item["name"]
        main = _pod_spec(doc)["containers"][0]
        assert {"secretRef": {"name": "loraplex-secrets"}} in main["envFrom"], key


def test_k8s_gateway_probes_scaling_and_disruption_budget(k8s):
    dep = k8s["Deployment/loraplex-gateway"]
    c = _pod_spec(dep)["containers"][0]
    assert c["args"] == ["gateway"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    config = Settings.from_env(k8s["ConfigMap/loraplex-config"]["data"])
    assert port == config.gateway_port
    labels = dep["spec"]["template"]["metadata"]["labels"]
    svc = k8s["Service/loraplex-gateway"]
    assert svc["spec"]["selector"].items() <= labels.items()
    hpa = k8s["HorizontalPodAutoscaler/loraplex-gateway"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "loraplex-gateway"}
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    pdb = k8s["PodDisruptionBudget/loraplex-gateway"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()


def test_k8s_workers_get_a_gpu_and_a_stable_advertised_url(k8s):
    sts = k8s["StatefulSet/loraplex-worker"]
    headless = k8s["Service/loraplex-worker"]
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    pod = _pod_spec(sts)
    c = pod["containers"][0]
    assert c["args"] == ["worker"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["LORAPLEX_WORKER_ID"]["value"] == "$(POD_NAME)"
    url = env["LORAPLEX_WORKER_URL"]["value"]
    config = Settings.from_env(k8s["ConfigMap/loraplex-config"]["data"])
    assert url == f"http://$(POD_NAME).{headless['metadata']['name']}.$(POD_NAMESPACE).svc:{config.worker_port}"
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert port == config.worker_port == headless["spec"]["ports"][0]["port"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert str(Path(env["LORAPLEX_MODEL"]["value"]).parent) in mounts
    assert config.resolved_adapter_root() in mounts


def _env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize(("key", "var"), [("Deployment/loraplex-gateway", "LORAPLEX_GATEWAY_HOST"),
                                          ("StatefulSet/loraplex-worker", "LORAPLEX_WORKER_HOST")])
def test_k8s_processes_bind_their_pod_ip_only(k8s, key, var):
    env = _env_of(_pod_spec(k8s[key])["containers"][0])
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env[var]["value"] == "$(POD_IP)"
    assert var not in k8s["ConfigMap/loraplex-config"]["data"], "a shared listen address would override nothing"


def test_k8s_workers_accept_traffic_only_from_gateways_and_prometheus(k8s):
    policies = [d for d in k8s.values() if d["kind"] == "NetworkPolicy"]
    worker_labels = k8s["StatefulSet/loraplex-worker"]["spec"]["template"]["metadata"]["labels"]
    gateway_labels = k8s["Deployment/loraplex-gateway"]["spec"]["template"]["metadata"]["labels"]
    mine = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= worker_labels.items()]
    assert len(mine) == 1, "one NetworkPolicy selects the worker pods"
    spec = mine[0]["spec"]
    assert "Ingress" in spec["policyTypes"]
    worker = _pod_spec(k8s["StatefulSet/loraplex-worker"])["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    sources = []
    for rule in spec["ingress"]:
        assert rule.get("from"), "a rule without 'from' admits every pod"
        for port in rule["ports"]:
            assert ports.get(port["port"], port["port"]) == ports["http"]
        for peer in rule["from"]:
            assert "ipBlock" not in peer
            sources.append(peer)
    same_namespace_gateways = [p for p in sources if "namespaceSelector" not in p
                               and p["podSelector"]["matchLabels"].items() <= gateway_labels.items()]
    assert same_namespace_gateways, "gateway pods must be admitted"
    others = [p for p in sources if p not in same_namespace_gateways]
    assert all(p["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"} for p in others), others


def _agent_args(container: dict[str, Any]) -> Any:
    """The agent container's arguments as ``loraplex vllm-agent`` parses them."""
    import argparse

    from vllm_agent.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(container["args"])


def test_k8s_vllm_pods_run_vllm_beside_its_agent(k8s):
    sts, svc = k8s["StatefulSet/loraplex-vllm"], k8s["Service/loraplex-vllm"]
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    pod = _pod_spec(sts)
    agent, vllm = pod["containers"]
    assert agent["image"].split(":")[0] == CONTROL_IMAGE[0], "the agent runs from the image without torch"
    assert vllm["image"].split(":")[0] == VLLM_IMAGE
    args = _agent_args(agent)
    assert args.command == "vllm-agent" and args.worker_id == "$(POD_NAME)"
    ports = {p["name"]: p["containerPort"] for c in (agent, vllm) for p in c["ports"]}
    dns = f"http://$(POD_NAME).{svc['metadata']['name']}.$(POD_NAMESPACE).svc"
    assert args.vllm_url == f"{dns}:{ports['vllm']}" and args.url == f"{dns}:{ports['agent']}"
    assert args.port == ports["agent"] and args.host == "$(POD_IP)"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    flags = vllm["args"]
    for flag in ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--enable-prompt-tokens-details"):
        assert flag in flags, flag
    assert flags[flags.index("--port") + 1] == str(ports["vllm"]) and flags[flags.index("--host") + 1] == "$(POD_IP)"
    assert flags[flags.index("--model") + 1] == args.model, "the agent reads the model vLLM serves"
    assert _env_of(vllm)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "true"
    # vLLM reads the adapter directories the agent wrote: the cache at one path in both
    cache = _env_of(agent)["LORAPLEX_ADAPTER_CACHE_DIR"]["value"]
    mounts = {c["name"]: {m["mountPath"]: m for m in c["volumeMounts"]} for c in (agent, vllm)}
    assert mounts["agent"][cache]["name"] == mounts["vllm"][cache]["name"]
    assert mounts["vllm"][cache].get("readOnly") is True


def test_k8s_only_gateways_reach_vllm_and_its_agent(k8s):
    labels = k8s["StatefulSet/loraplex-vllm"]["spec"]["template"]["metadata"]["labels"]
    gateway_labels = k8s["Deployment/loraplex-gateway"]["spec"]["template"]["metadata"]["labels"]
    mine = [p for p in k8s.values() if p["kind"] == "NetworkPolicy"
            and p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert len(mine) == 1, "one NetworkPolicy selects the vLLM pods"
    spec = mine[0]["spec"]
    assert "Ingress" in spec["policyTypes"]
    admitted: dict[str, set[str]] = {}
    for rule in spec["ingress"]:
        assert rule.get("from"), "a rule without 'from' admits every pod"
        for peer in rule["from"]:
            assert "ipBlock" not in peer
            who = "gateway" if "namespaceSelector" not in peer and \
                peer["podSelector"]["matchLabels"].items() <= gateway_labels.items() else \
                peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
            admitted.setdefault(who, set()).update(p["port"] for p in rule["ports"])
    assert admitted == {"gateway": {"vllm", "agent"}, "prometheus": {"vllm"}}


def test_k8s_secret_template_holds_no_secret(k8s):
    for key, value in k8s["Secret/loraplex-secrets"]["stringData"].items():
        assert "CHANGE-ME" in value, f"{key}: the template must hold placeholders only"


def test_k8s_runs_the_gateway_without_torch_and_workers_with_the_engine(k8s):
    def images(key: str) -> set[str]:
        pod = _pod_spec(k8s[key])
        return {c["image"].split(":")[0] for c in pod.get("initContainers", []) + pod["containers"]}

    assert images("Deployment/loraplex-gateway") == images("Job/loraplex-migrate") == {CONTROL_IMAGE[0]}
    assert images("StatefulSet/loraplex-worker") <= set(WORKER_IMAGES)
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = {i["name"] for i in kust["images"]}
    assert images("Deployment/loraplex-gateway") | images("StatefulSet/loraplex-worker") <= listed


def test_k8s_migrate_job(k8s):
    job = k8s["Job/loraplex-migrate"]
    c = _pod_spec(job)["containers"][0]
    assert c["args"] == ["migrate"]
    assert _pod_spec(job)["restartPolicy"] in ("OnFailure", "Never")


# --- Prometheus and Grafana ----------------------------------------------------------------

def test_prometheus_scrapes_gateway_and_every_compose_worker(compose):
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prom["global"]["scrape_interval"]
    targets = {}
    for job in prom["scrape_configs"]:
        assert job["job_name"] and job.get("metrics_path", "/metrics") == "/metrics"
        for sc in job["static_configs"]:
            for t in sc["targets"]:
                host, port = t.split(":")
                targets[host] = int(port)
    services = compose["services"]
    gateway = Settings.from_env(_env(services["gateway"]))
    # The gateway's metrics port, reachable from Prometheus's container, never its public port.
    assert targets["gateway"] == gateway.gateway_metrics_port != gateway.gateway_port
    assert gateway.gateway_metrics_host == "0.0.0.0"
    assert not any(str(p).endswith(f":{gateway.gateway_metrics_port}") for p in services["gateway"].get("ports", []))
    for name in ("worker-1", "worker-2"):
        assert targets[name] == Settings.from_env(_env(services[name])).worker_port


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is missing: apt-get install prometheus (.ci/run installs it)", pytrace=False)
    return tool


def test_alert_rules_pass_promtool_check_and_their_unit_tests():
    prom = DEPLOY / "prometheus"
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        r = subprocess.run([_promtool(), *args], cwd=prom, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    for cfg in ("prometheus.yml", "prometheus-k8s.yml"):
        assert yaml.safe_load((prom / cfg).read_text())["rule_files"] == ["alerts.yml"]


def test_every_alert_names_a_metric_loraplex_exports(compose):
    """A renamed metric would leave its alert silent forever: every series an alert reads is one
    the gateway or the worker exports."""
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    names = {re.sub(r"_(total|bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"loraplex_[a-z_]+", e)}
    source = "".join(p.read_text() for d in ("gateway", "engine", "registry") for p in (ROOT / d).rglob("*.py"))
    missing = sorted(n for n in names if f'"{n}"' not in source)
    assert not missing, f"alerts read metrics nothing exports: {missing}"
    assert len(names) >= 10
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts


def test_prometheus_kubernetes_variant_discovers_annotated_pods(k8s):
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert keep and keep[0]["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    for key in ("Deployment/loraplex-gateway", "StatefulSet/loraplex-worker"):
        ann = k8s[key]["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        port = int(ann["prometheus.io/port"])
        assert port in {p["containerPort"] for p in _pod_spec(k8s[key])["containers"][0]["ports"]}
    config = Settings.from_env(k8s["ConfigMap/loraplex-config"]["data"])
    ann = k8s["Deployment/loraplex-gateway"]["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == config.gateway_metrics_port != config.gateway_port
    assert config.gateway_metrics_host == "0.0.0.0"
    exposed = {p["targetPort"] for p in k8s["Service/loraplex-gateway"]["spec"]["ports"]}
    assert exposed == {"http"}


DASHBOARD_METRIC = re.compile(r"\b(loraplex_[a-z0-9_]+)")


def _balanced(expr: str) -> bool:
    depth = {"(": 0, "{": 0, "[": 0}
    closing = {")": "(", "}": "{", "]": "["}
    for ch in expr:
        if ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            if depth[closing[ch]] < 0:
                return False
    return all(v == 0 for v in depth.values())


def test_dashboard_panels_each_query_a_loraplex_metric():
    dash = json.loads((DEPLOY / "grafana" / "loraplex-dashboard.json").read_text())
    assert dash["uid"] and dash["title"]
    panels = dash["panels"]
    assert len(panels) >= 10
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            assert DASHBOARD_METRIC.search(expr), f"{p['title']}: {expr}"
            assert _balanced(expr), f"{p['title']}: unbalanced {expr}"
            for call in re.findall(r"\brate\(([^()]*)\)", expr):
                assert re.search(r"\[[^\]]+\]$", call), f"{p['title']}: rate() without a range: {expr}"
                for m in DASHBOARD_METRIC.findall(call):
                    assert m.endswith(("_total", "_bucket")), f"{p['title']}: rate() over a non-counter {m}"
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("per tenant", "429", "p99", "first token", "tokens/s", "queue", "kv", "tier", "evictions"):
        assert topic in titles, topic


# Metrics the dashboard reads that the exporters do not define yet (panels show "no data").
PENDING_METRICS = {
    "loraplex_worker_adapters_resident",  # gauge {worker, tier=device|host|disk}
    "loraplex_worker_adapter_loads",  # counter {worker, tier}
    "loraplex_worker_adapter_evictions",  # counter {worker, tier}
}


@pytest.mark.parametrize(("prefix", "exporter"), [("loraplex_gateway_", "gateway/metrics.py"),
                                                  ("loraplex_worker_", "engine/metrics.py")])
def test_dashboard_metrics_match_the_exporters(prefix, exporter):
    """The metrics the dashboard reads are the ones the gateway / worker exporters define."""
    source = ROOT / exporter
    assert source.is_file(), f"{exporter} is gone: point this test at the module that defines the metrics"
    defined = set(re.findall(r'"(' + prefix + r'[a-z0-9_]+)"', source.read_text()))
    dash = (DEPLOY / "grafana" / "loraplex-dashboard.json").read_text()
    known = defined | PENDING_METRICS
    missing = sorted(m for m in set(DASHBOARD_METRIC.findall(dash)) if m.startswith(prefix)
                     and m not in known and re.sub(r"_(total|bucket|sum|count)$", "", m) not in known)
    assert not missing, missing


@pytest.mark.parametrize(("app", "paths"), [("gateway/app.py", ("/healthz", "/readyz")),
                                            ("engine/api.py", ("/health", "/metrics"))])
def test_probe_and_scrape_paths_are_routes_of_the_apps(app, paths):
    """Every path a healthcheck, probe or scrape uses is served by the process it targets."""
    source = ROOT / app
    assert source.is_file(), f"{app} is gone: point this test at the module that serves the routes"
    text = source.read_text()
    for path in paths:
        assert f'Route("{path}"' in text, f"{app} serves no {path}"
