"""deploy/kubernetes renders, offline, objects that the Kubernetes API schemas accept
(kubernetes-validate's, strict: an unknown field fails) and that agree with splitserve
itself: every container command is one the CLI parses, probes and Services reach the ports
the flags listen on, a GEN's --kv-peers names every CTX's KV endpoint exactly, and the
secrets come from a Secret, never written into a manifest."""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from splitserve.cli import build_parser
from splitserve.kv.peers import KVPeers
from splitserve.orchestrator.cluster import ClusterConfig

# The oldest Kubernetes the manifests are for (the first to enable the orchestrator's preStop
# `sleep` action by default) and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30", "1.37")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SECRET_VARIABLES = {"SPLITSERVE_INTERNAL_SECRET", "SPLITSERVE_API_KEY"}
# What the kubelet puts in a pod's $(POD_...) for these tests: a CTX pod's name is replaced
# per pod where it matters.
POD = {"POD_IP": "10.1.2.3", "POD_NAME": "splitserve-x-0", "POD_NAMESPACE": "serving"}


def _load_render():
    spec = importlib.util.spec_from_file_location("splitserve_k8s_render", DEPLOY / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()

MODELS = "[{name: models, persistentVolumeClaim: {claimName: models, readOnly: true}}]"
MODELS_MOUNT = "[{name: models, mountPath: /models, readOnly: true}]"
VARIANTS = {
    "default": ([], []),
    "single": (["overlays/single.yaml"], []),
    "gpu": (["overlays/gpu.yaml"], []),
    "gpu-single": (["overlays/single.yaml", "overlays/gpu.yaml"], []),
    "etcd3-scaled": ([], ["etcd.replicas=3", "ctx.replicas=3", "gen.replicas=4",
                          "orchestrator.serviceType=LoadBalancer", "worker.model=/models/llama",
                          "orchestrator.cluster.model=/models/llama",
                          f"worker.volumes={MODELS}", f"worker.volumeMounts={MODELS_MOUNT}",
                          f"orchestrator.volumes={MODELS}",
                          f"orchestrator.volumeMounts={MODELS_MOUNT}"]),
}


def values_of(variant: str) -> dict:
    files, sets = VARIANTS[variant]
    return render.load_values([DEPLOY / f for f in files], sets)


@pytest.fixture(params=sorted(VARIANTS))
def variant(request) -> str:
    return request.param


@functools.cache
def _rendered(variant: str) -> list[dict]:
    return render.render(values_of(variant))


def objects(variant: str) -> list[dict]:
    return copy.deepcopy(_rendered(variant))


def containers(objs: list[dict]):
    """(workload, container) for every container of every pod template."""
    for obj in objs:
        template = obj.get("spec", {}).get("template")
        if template:
            for container in template["spec"]["containers"]:
                yield obj, container


def expand(arg: str, env: dict) -> str:
    """The kubelet's $(VAR) expansion of a container argument."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


@functools.cache
def parser() -> argparse.ArgumentParser:
    return build_parser()


def parse(container: dict, env: dict = POD):
    """The container's command line as `splitserve` parses it (an invalid one exits)."""
    return parser().parse_args([expand(a, env) for a in container["args"]])


def named_port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(variant, version):
    objs = objects(variant)
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget",
            "ConfigMap"} <= {o["kind"] for o in objs}
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


def test_a_misspelt_field_fails_validation():
    deployment = by_kind(objects("default"), "Deployment")["splitserve-gen"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_worker_commands_parse_and_listen_where_probes_and_services_look(variant):
    objs = objects(variant)
    workers = [(w, c) for w, c in containers(objs) if c["args"][0] == "serve"]
    assert {c["name"] for _, c in workers} == {"ctx", "gen"}
    for workload, container in workers:
        args = parse(container)
        assert args.role == container["name"]
        assert args.host == POD["POD_IP"]
        assert args.port == named_port(container, "http")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        if args.role == "ctx":
            assert args.kv_port == named_port(container, "kv")
            service = by_kind(objs, "Service")[workload["spec"]["serviceName"]]
            assert service["spec"]["clusterIP"] == "None"
            assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "kv"}


def test_device_and_gpus_follow_the_gpu_overlay():
    for variant, device, gpus in (("default", "auto", None), ("gpu", "cuda", 1)):
        for _, container in containers(objects(variant)):
            if container["args"][0] == "serve":
                assert parse(container).device == device
                assert container["resources"]["limits"].get("nvidia.com/gpu") == gpus


def test_every_ctx_a_gen_may_pull_from_is_in_its_kv_peers(variant):
    objs = objects(variant)
    ctx = by_kind(objs, "StatefulSet")["splitserve-ctx"]
    gen = by_kind(objs, "Deployment")["splitserve-gen"]
    gen_args = parse(gen["spec"]["template"]["spec"]["containers"][0])
    peers = KVPeers(gen_args.kv_peers)
    most = values_of(variant)["ctx"]["maxReplicas"]
    for i in range(most + 1):
        pod = dict(POD, POD_NAME=f"splitserve-ctx-{i}")
        ctx_args = parse(ctx["spec"]["template"]["spec"]["containers"][0], pod)
        endpoint = f"tcp://{ctx_args.kv_host}:{ctx_args.kv_port}"
        assert ctx_args.kv_host == (f"splitserve-ctx-{i}.splitserve-ctx.serving.svc."
                                    f"{values_of(variant)['clusterDomain']}")
        assert peers.allows(endpoint) == (i < most)


def test_orchestrator_reads_its_cluster_file_from_the_config_map(variant):
    objs = objects(variant)
    (deployment, container), = [(w, c) for w, c in containers(objs)
                                if c["args"][0] == "orchestrator"]
    args = parse(container)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "cluster-file")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "cluster-file")
    config_map = by_kind(objs, "ConfigMap")[volume["configMap"]["name"]]
    key = Path(args.config).relative_to(mount["mountPath"]).as_posix()
    config = ClusterConfig.from_dict(yaml.safe_load(config_map["data"][key]))
    assert config.port == named_port(container, "http")
    assert config.host == "0.0.0.0"
    assert config.context_servers.urls == () and config.generation_servers.urls == ()
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    service = by_kind(objs, "Service")["splitserve"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_membership_is_etcd_or_one_orchestrator_workers_register_with(variant):
    objs = objects(variant)
    values = values_of(variant)
    argv = [a for _, c in containers(objs) for a in c["args"]]
    statefulsets = by_kind(objs, "StatefulSet")
    if values["membership"] == "etcd":
        url = f"etcd://splitserve-etcd:{values['ports']['etcdClient']}/{values['etcd']['prefix']}"
        assert argv.count(f"--membership={url}") == 3      # orchestrator, ctx, gen
        assert statefulsets["splitserve-etcd"]["spec"]["replicas"] == values["etcd"]["replicas"]
        assert "splitserve-etcd" in by_kind(objs, "Service")
    else:
        assert "splitserve-etcd" not in statefulsets
        assert by_kind(objs, "Deployment")["splitserve-orchestrator"]["spec"]["replicas"] == 1
        for _, container in containers(objs):
            if container["args"][0] == "serve":
                assert parse(container).register == "http://splitserve-orchestrator-internal:8000"
        service = by_kind(objs, "Service")["splitserve-orchestrator-internal"]
        assert service["spec"]["publishNotReadyAddresses"] is True


def test_register_membership_refuses_several_orchestrators():
    values = render.load_values([DEPLOY / "overlays/single.yaml"], ["orchestrator.replicas=2"])
    with pytest.raises(render.RenderError, match="orchestrator.replicas must be 1"):
        render.render(values)


def test_secrets_are_referenced_never_inlined(variant):
    objs = objects(variant)
    assert "Secret" not in {o["kind"] for o in objs}
    secret = values_of(variant)["secret"]["name"]
    for _, container in containers(objs):
        assert not [a for a in container["args"] if a.startswith(("--api-key", "--internal-secret"))]
        if container["name"] == "etcd":
            continue
        env = {e["name"]: e for e in container["env"]}
        for name in SECRET_VARIABLES:
            assert "value" not in env[name]
            assert env[name]["valueFrom"]["secretKeyRef"]["name"] == secret
    cluster = yaml.safe_load(by_kind(objs, "ConfigMap")["splitserve-orchestrator"]["data"]
                             ["cluster.yaml"])
    assert not {"api_key", "internal_secret"} & set(cluster)


def test_a_secret_in_the_cluster_values_is_refused():
    values = render.load_values(sets=["orchestrator.cluster.api_key=sk-123"])
    with pytest.raises(render.RenderError, match="api_key"):
        render.render(values)


def test_selectors_find_their_pods(variant):
    objs = objects(variant)
    pods = [w["spec"]["template"]["metadata"]["labels"] for w, _ in containers(objs)]
    for obj in objs:
        if obj["kind"] in ("Service", "PodDisruptionBudget", "Deployment", "StatefulSet"):
            selector = obj["spec"]["selector"]
            labels = selector if obj["kind"] == "Service" else selector["matchLabels"]
            assert sum(labels.items() <= pod.items() for pod in pods) == 1, obj["metadata"]


# What a stopping worker may take before it exits, beyond its drain: leaving the membership
# (server/registration.py waits 6 s at most), its leases' pulls, its listener's close.
LEAVE_SECONDS = 6.0
CLOSE_SECONDS = 5.0


def test_termination_leaves_room_for_the_worker_to_leave_and_drain():
    objs = objects("single")
    for workload, container in containers(objs):
        pod = workload["spec"]["template"]["spec"]
        if container["args"][0] == "serve":
            # a CLI without the drain stops in LEAVE + CLOSE; with it the drain comes on top
            drain = getattr(parse(container), "drain_grace_seconds", 0.0)
            assert pod["terminationGracePeriodSeconds"] > LEAVE_SECONDS + drain + CLOSE_SECONDS
        elif container["name"] == "orchestrator":   # its preStop pause counts in its grace
            pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert pod["terminationGracePeriodSeconds"] > pause + CLOSE_SECONDS


def test_placeholders_fill_typed_values_text_and_splices():
    values = {"n": 3, "flags": ["--a", "--b"], "gone": None, "name": "x"}
    template = {"replicas": "${n}", "args": ["serve", "${*flags}", "--name=${name}-${n}"],
                "storage": "${gone}"}
    assert render.fill(template, values) == {"replicas": 3,
                                             "args": ["serve", "--a", "--b", "--name=x-3"]}
    for bad in ({"x": "${missing}"}, {"x": ["${*n}"]}, {"x": "a-${flags}"}):
        with pytest.raises(render.RenderError):
            render.fill(bad, values)


def test_command_line_renders_overlays_and_sets(capsys):
    assert render.main(["-f", str(DEPLOY / "overlays/single.yaml"), "--set", "gen.replicas=5"]) == 0
    objs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert by_kind(objs, "Deployment")["splitserve-gen"]["spec"]["replicas"] == 5
