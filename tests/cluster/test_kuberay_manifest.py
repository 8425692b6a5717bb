"""deploy/kuberay/rayjob.yaml: valid against the RayJob CRD's OpenAPI schema (KubeRay v1.7.0, vendored
in tests/cluster/data/ since no PyPI package ships it), with no field the schema does not know (the
API server would drop it silently), the same layout as ray_cluster.yaml, and the security points:
token auth, ClusterIP only, ingress denied from outside the cluster, MLflow on the pod's loopback."""

from __future__ import annotations

import copy
import gzip
import json
import re
from typing import Any

import jsonschema
import pytest
import yaml
from manifest_checks import ROOT, missing_paths, open_to_all, unknown_commands, walk

from service.spec.errors import SpecError

TEXT = (ROOT / "deploy/kuberay/rayjob.yaml").read_text()
DOCS = list(yaml.safe_load_all(TEXT))
JOB = next(d for d in DOCS if d["kind"] == "RayJob")
CLUSTER = JOB["spec"]["rayClusterSpec"]
SCHEMA = json.loads(gzip.decompress((ROOT / "tests/cluster/data/rayjob-v1-openapi.json.gz").read_bytes()))


def unknown_fields(doc: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Keys the structural schema does not declare (kubectl's --validate=strict would reject them)."""
    if isinstance(doc, list) and "items" in schema:
        return [p for i, v in enumerate(doc) for p in unknown_fields(v, schema["items"], f"{path}[{i}]")]
    if not isinstance(doc, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    props, extra = schema.get("properties"), schema.get("additionalProperties")
    out = []
    for key, value in doc.items():
        if props is not None and key in props:
            out += unknown_fields(value, props[key], f"{path}.{key}")
        elif isinstance(extra, dict):
            out += unknown_fields(value, extra, f"{path}.{key}")
        elif props is not None and path != ".metadata":  # ObjectMeta is left open by CRD schemas
            out.append(f"{path}.{key}")
    return out


def test_rayjob_matches_crd_schema():
    jsonschema.Draft7Validator(SCHEMA).validate(JOB)
    assert unknown_fields(JOB, SCHEMA) == []


def test_schema_check_catches_a_typo_and_a_bad_value():
    typo = copy.deepcopy(JOB)
    typo["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplica"] = 4
    assert unknown_fields(typo, SCHEMA) == [".spec.rayClusterSpec.workerGroupSpecs[0].maxReplica"]
    bad = copy.deepcopy(JOB)
    bad["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "none"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(SCHEMA).validate(bad)


def test_same_layout_as_ray_cluster_yaml():
    head = CLUSTER["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in CLUSTER["workerGroupSpecs"]}
    assert set(groups) == {"gpu-8xh100", "gpu-1xh100"}
    big = groups["gpu-8xh100"]
    gpus = big["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert big["minReplicas"] == 0 and big["maxReplicas"] * int(gpus) == 32
    assert groups["gpu-1xh100"]["minReplicas"] == 0
    assert CLUSTER["enableInTreeAutoscaling"] and CLUSTER["autoscalerOptions"]["idleTimeoutSeconds"] > 0


def test_shared_storage_on_every_pod():
    claim = next(d for d in DOCS if d["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    templates = [CLUSTER["headGroupSpec"]["template"]] + [g["template"] for g in CLUSTER["workerGroupSpecs"]]
    for t in templates:
        assert {"name": "shared", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in t[
            "spec"
        ]["volumes"]
        assert {"name": "shared", "mountPath": "/mnt/shared"} in t["spec"]["containers"][0]["volumeMounts"]
    env = yaml.safe_load(JOB["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["SERVICE_SEARCH_DIR"].startswith("/mnt/shared/")
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"


def test_declared_maximum_matches_the_worker_groups():
    env = yaml.safe_load(JOB["spec"]["runtimeEnvYAML"])["env_vars"]
    most = 0
    for group in CLUSTER["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        most += group["maxReplicas"] * int(limits["nvidia.com/gpu"])
    assert json.loads(env["SERVICE_CLUSTER_MAX_RESOURCES"]) == {"GPU": most}


def test_capacity_reads_the_declared_maximum(monkeypatch):
    import ray

    from service.cluster import capacity

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})  # the head alone, no GPU yet
    declared = yaml.safe_load(JOB["spec"]["runtimeEnvYAML"])["env_vars"][capacity.MAX_ENV]
    monkeypatch.setenv(capacity.MAX_ENV, declared)
    assert capacity.capacity("GPU") == capacity.Capacity("GPU", 0.0, 36.0, autoscaled=True)
    assert capacity.max_concurrent_trials(8, "cuda") == 4
    with pytest.raises(SpecError, match="offers at most 36 with autoscaling, 0 now"):
        capacity.max_concurrent_trials(64, "cuda")


def test_security_points():
    assert CLUSTER["authOptions"]["mode"] == "token"
    head = CLUSTER["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and head["enableIngress"] is False
    assert CLUSTER["networkPolicy"]["mode"] in ("DenyAll", "DenyAllIngress")
    assert JOB["spec"]["submissionMode"] == "SidecarMode"  # submits over the head pod's 127.0.0.1
    mlflow = next(c for c in head["template"]["spec"]["containers"] if c["name"] == "mlflow")
    assert "--host=127.0.0.1" in mlflow["args"]
    values = [v for doc in DOCS for _, v in walk(doc) if isinstance(v, str)]
    assert not any(v in ("LoadBalancer", "NodePort") for v in values)
    assert not open_to_all(TEXT) and not any("0.0.0.0" in v for v in values)


def test_referenced_files_and_commands_exist():
    assert missing_paths(TEXT) == []
    assert "deploy/kuberay/Dockerfile" in TEXT and unknown_commands(TEXT) == []
    in_image = re.findall(r"/home/ray/planner/(\S+)", TEXT)  # the checkout, copied by the Dockerfile
    assert "experiments/llama2-13b-32xh100.yaml" in in_image
    assert [p for p in in_image if not (ROOT / p).exists()] == []
    head = CLUSTER["headGroupSpec"]["template"]["spec"]["containers"]
    mlflow = next(c for c in head if c["name"] == "mlflow")
    assert mlflow["command"][:3] == ["python", "-m", "service"]
    assert unknown_commands(f"python -m service {mlflow['command'][3]}") == []
