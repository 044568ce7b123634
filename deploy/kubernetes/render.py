#!/usr/bin/env python3
"""Renders splitserve's Kubernetes manifests as one YAML stream on stdout:

    python3 deploy/kubernetes/render.py [-f overlay.yaml ...] [--set key.path=value ...]

The templates (base/*.yaml) are plain Kubernetes YAML whose strings may hold placeholders,
filled from values.yaml, then each -f file in order (mappings merged key by key, anything
else replaced), then each --set (its value read as YAML: 3 is a number, [a, b] a list):
- a whole string `${a.b}` becomes the value a.b, of whatever type; a mapping entry whose
  value is null is left out, so a null value leaves that field to Kubernetes' default;
- `${a.b}` within a longer string becomes the value's text;
- a list item `${*a.b}` becomes the items of the list a.b (nothing for an empty list).
Kubernetes' own `$(VAR)` (the container's environment, expanded by the kubelet) stays as
written. What the templates need beyond values.yaml (the cluster file, the membership
flags, the CTXs' KV endpoints, the environment) is derived here. Values are data: they are
never searched for placeholders. Only PyYAML is needed, so it runs wherever kubectl does.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
VALUES = HERE / "values.yaml"
TEMPLATES = HERE / "base"
PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")
SPLICE = re.compile(r"\$\{\*([A-Za-z0-9_.]+)\}")
MEMBERSHIPS = ("etcd", "register")
DEVICES = ("auto", "cpu", "cuda")
UID = 10001                      # the image's `splitserve` user (deploy/Dockerfile)


class RenderError(ValueError):
    """Values the manifests cannot be rendered from; the message names the value."""


# -- values -------------------------------------------------------------------------------
def merge(base: dict, over: dict) -> dict:
    """base with over's entries: mappings merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_set(assignment: str) -> dict:
    """`a.b=value` as the mapping {a: {b: value}}, the value read as YAML."""
    path, sep, text = assignment.partition("=")
    if not sep or not path:
        raise RenderError(f"--set takes key.path=value, got {assignment!r}")
    value = yaml.safe_load(text)
    for key in reversed(path.split(".")):
        value = {key: value}
    return value


def load_values(files=(), sets=()) -> dict:
    """values.yaml, then each file, then each --set assignment."""
    values = yaml.safe_load(VALUES.read_text())
    for path in files:
        values = merge(values, yaml.safe_load(Path(path).read_text()) or {})
    for assignment in sets:
        values = merge(values, parse_set(assignment))
    return values


def lookup(values: dict, path: str):
    node = values
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise RenderError(f"the templates use {path!r}, which the values lack")
        node = node[key]
    return node


# -- what the templates need beyond the values ------------------------------------------------
def labels(component: str) -> dict:
    return {"app.kubernetes.io/name": "splitserve", "app.kubernetes.io/part-of": "splitserve",
            "app.kubernetes.io/component": component}


def cluster_file(values: dict) -> str:
    """The orchestrator's cluster file: values' orchestrator.cluster on every address and
    the Service's port. The secrets stay out of it: they come from the environment."""
    cluster = dict(values["orchestrator"]["cluster"], host="0.0.0.0", port=values["ports"]["http"])
    leaked = {"api_key", "internal_secret"} & set(cluster)
    if leaked:
        raise RenderError(f"orchestrator.cluster must not hold {', '.join(sorted(leaked))}: "
                          f"the Secret {values['secret']['name']} provides it")
    return yaml.safe_dump(cluster, sort_keys=False)


def membership_args(values: dict) -> tuple[list[str], list[str]]:
    """(the orchestrator's, every worker's) membership flags."""
    ports = values["ports"]
    if values["membership"] == "etcd":
        flag = f"--membership=etcd://splitserve-etcd:{ports['etcdClient']}/{values['etcd']['prefix']}"
        return [flag], [flag]
    return [], [f"--register=http://splitserve-orchestrator-internal:{ports['http']}"]


def engine_args(worker: dict) -> list[str]:
    model = [f"--model={worker['model']}"] if worker.get("model") else []
    device = [f"--device={worker['device']}"] if worker["device"] != "auto" else []
    return model + device + list(worker["args"])


def ctx_kv_host(values: dict, pod: str) -> str:
    """The name a CTX pod's KV server binds and advertises (--kv-host): its own name under
    the headless Service, which the pod's /etc/hosts holds from its start."""
    return f"{pod}.splitserve-ctx.$(POD_NAMESPACE).svc.{values['clusterDomain']}"


def kv_peers(values: dict) -> str:
    """The KV endpoints of every CTX the StatefulSet may run: a GEN takes KV from these
    names only, so they are written exactly as the CTXs advertise them."""
    return ",".join(f"tcp://{ctx_kv_host(values, f'splitserve-ctx-{i}')}:{values['ports']['kv']}"
                    for i in range(values["ctx"]["maxReplicas"]))


def etcd_initial_cluster(values: dict) -> str:
    peer = values["ports"]["etcdPeer"]
    return ",".join(f"splitserve-etcd-{i}=http://splitserve-etcd-{i}.splitserve-etcd-peer:{peer}"
                    for i in range(values["etcd"]["replicas"]))


def from_field(name: str, path: str) -> dict:
    """An environment variable the kubelet sets from the pod (the downward API)."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def from_secret(name: str, secret: str, key: str, optional: bool) -> dict:
    ref = {"name": secret, "key": key, **({"optional": True} if optional else {})}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def environment(values: dict) -> dict:
    secret = values["secret"]
    return {
        "podEnv": [from_field("POD_NAME", "metadata.name"),
                   from_field("POD_NAMESPACE", "metadata.namespace"),
                   from_field("POD_IP", "status.podIP")],
        # The API key is optional (no key: clients need none); the internal secret is not.
        "secretEnv": [
            from_secret("SPLITSERVE_INTERNAL_SECRET", secret["name"],
                        secret["internalSecretKey"], optional=False),
            from_secret("SPLITSERVE_API_KEY", secret["name"], secret["apiKeyKey"], optional=True)],
        # HOME on the writable /tmp volume: the C kernels' cache (~/.cache) lives there.
        "commonEnv": [{"name": "SPLITSERVE_LOG_LEVEL", "value": str(values["logLevel"])},
                      {"name": "HOME", "value": "/tmp"}],
    }


def worker_probes(values: dict) -> dict:
    """/health is 200 once the engine serves: the startup probe waits out the model load,
    liveness restarts a worker whose engine stays stalled or dead."""
    health = {"path": "/health", "port": "http"}
    return {
        "startup": {"httpGet": health, "periodSeconds": 5,
                    "failureThreshold": max(1, values["worker"]["startupSeconds"] // 5)},
        "readiness": {"httpGet": health, "periodSeconds": 5, "failureThreshold": 2},
        "liveness": {"httpGet": health, "periodSeconds": 10, "failureThreshold": 6},
    }


def check(values: dict) -> None:
    if values["membership"] not in MEMBERSHIPS:
        raise RenderError(f"membership must be one of {', '.join(MEMBERSHIPS)}, "
                          f"got {values['membership']!r}")
    if values["worker"]["device"] not in DEVICES:
        raise RenderError(f"worker.device must be one of {', '.join(DEVICES)}, "
                          f"got {values['worker']['device']!r}")
    if values["membership"] == "register" and values["orchestrator"]["replicas"] != 1:
        raise RenderError("membership register lives in one orchestrator: "
                          "orchestrator.replicas must be 1 (or use membership etcd)")
    if not 1 <= values["ctx"]["replicas"] <= values["ctx"]["maxReplicas"]:
        raise RenderError("ctx.replicas must be 1 to ctx.maxReplicas")
    if values["etcd"]["replicas"] % 2 != 1:
        raise RenderError("etcd.replicas must be odd (1 or 3): a quorum is a majority")


def derived(values: dict) -> dict:
    check(values)
    text = cluster_file(values)
    orchestrator, worker = membership_args(values)
    return {
        "labels": {c: labels(c) for c in ("orchestrator", "ctx", "gen", "etcd")},
        "clusterFile": text,
        "clusterFileDigest": hashlib.sha256(text.encode()).hexdigest(),
        "orchestratorMembershipArgs": orchestrator,
        "workerMembershipArgs": worker,
        "engineArgs": engine_args(values["worker"]),
        "ctxKvHost": ctx_kv_host(values, "$(POD_NAME)"),
        "kvPeers": kv_peers(values),
        "etcdInitialCluster": etcd_initial_cluster(values),
        "workerProbes": worker_probes(values),
        "podSecurityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                               "fsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "containerSecurityContext": {"allowPrivilegeEscalation": False,
                                     "readOnlyRootFilesystem": True,
                                     "capabilities": {"drop": ["ALL"]}},
        **environment(values),
    }


# -- templates --------------------------------------------------------------------------------
def text(value, path: str) -> str:
    if isinstance(value, (dict, list)) or value is None:
        raise RenderError(f"{path!r} is used within a string, so it must be a scalar")
    return str(value).lower() if isinstance(value, bool) else str(value)


def fill(node, values: dict):
    """node with its placeholders replaced (the module's docstring)."""
    if isinstance(node, dict):
        filled = ((key, fill(value, values)) for key, value in node.items())
        return {key: value for key, value in filled if value is not None}
    if isinstance(node, list):
        out = []
        for item in node:
            splice = SPLICE.fullmatch(item) if isinstance(item, str) else None
            if splice is None:
                out.append(fill(item, values))
                continue
            items = lookup(values, splice[1])
            if not isinstance(items, list):
                raise RenderError(f"{splice[1]!r} is spliced into a list, so it must be one")
            out.extend(copy.deepcopy(items))
        return out
    if isinstance(node, str):
        whole = PLACEHOLDER.fullmatch(node)
        if whole:     # a copy: a value used twice must not become a YAML alias
            return copy.deepcopy(lookup(values, whole[1]))
        return PLACEHOLDER.sub(lambda m: text(lookup(values, m[1]), m[1]), node)
    return node


def templates(values: dict) -> list[Path]:
    names = ["orchestrator", "ctx", "gen",
             "etcd" if values["membership"] == "etcd" else "register"]
    return [TEMPLATES / f"{name}.yaml" for name in names]


def render(values: dict) -> list[dict]:
    """Every Kubernetes object, in the order they are applied."""
    values = {**values, **derived(values)}
    return [fill(doc, values) for path in templates(values)
            for doc in yaml.safe_load_all(path.read_text()) if doc]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the cluster file) as YAML block literals."""


_Dumper.add_representer(str, lambda dumper, s: dumper.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def dump(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Renders splitserve's Kubernetes manifests as one YAML stream on stdout.")
    parser.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                        help="a values file merged over values.yaml (overlays/*.yaml or "
                             "your own); several apply in order")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="one value, after the files, e.g. --set gen.replicas=4")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(dump(render(load_values(args.values, args.set))))
    except RenderError as exc:
        parser.error(str(exc))
    except (KeyError, TypeError) as exc:    # a value an overlay took away or reshaped
        parser.error(f"a value is missing or not of the shape values.yaml gives it ({exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
