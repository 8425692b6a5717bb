"""deploy/kuberay/rayjob.yaml: valid against the RayJob CRD's OpenAPI schema (KubeRay v1.7.0, vendored
in tests/cluster/data/ since no PyPI package ships it), with no field the schema does not know (the
API server would drop it silently), the same layout as ray_cluster.yaml, and the security points:
token auth, ClusterIP only, ingress denied from outside the cluster, MLflow on the pod's loopback. The
8-GPU pods get their node's 32 EFA devices; the operator is let in wherever its Helm release lives;
the EFS StorageClass and the pods' fsGroup let the image's user write the shared volume."""

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
    for bad in ("GPU=36", '{"GPU": "many"}', "[36]", '{"GPU": -1}'):
        monkeypatch.setenv(capacity.MAX_ENV, bad)
        with pytest.raises(SpecError, match=f"{capacity.MAX_ENV}: .* is not a JSON object of counts"):
            capacity.capacity("GPU")


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
    assert "deploy/Dockerfile" in TEXT and (ROOT / "deploy/Dockerfile").is_file()  # the image of both files
    assert unknown_commands(TEXT) == []
    in_image = re.findall(r"/home/ray/planner/(\S+)", TEXT)  # the checkout, copied by the Dockerfile
    assert "experiments/llama2-13b-32xh100.yaml" in in_image
    assert [p for p in in_image if not (ROOT / p).exists()] == []
    head = CLUSTER["headGroupSpec"]["template"]["spec"]["containers"]
    mlflow = next(c for c in head if c["name"] == "mlflow")
    assert mlflow["command"][:3] == ["python", "-m", "service"]
    assert unknown_commands(f"python -m service {mlflow['command'][3]}") == []


def _groups() -> dict[str, Any]:
    return {g["groupName"]: g for g in CLUSTER["workerGroupSpecs"]}


def _templates() -> list[dict[str, Any]]:
    return [CLUSTER["headGroupSpec"]["template"]] + [g["template"] for g in CLUSTER["workerGroupSpecs"]]


def test_8_gpu_pods_request_their_nodes_32_efa_devices():
    # The AWS EFA device plugin's resource; EFA is 3,200 Gb/s per p5.48xlarge only with all 32.
    big = _groups()["gpu-8xh100"]["template"]["spec"]["containers"][0]["resources"]
    assert big["requests"]["vpc.amazonaws.com/efa"] == big["limits"]["vpc.amazonaws.com/efa"] == "32"
    small = _groups()["gpu-1xh100"]["template"]["spec"]["containers"][0]["resources"]
    assert "vpc.amazonaws.com/efa" not in small["limits"]  # single-node proxies: no inter-node traffic

    from service.cluster.network import declared_network

    gbps, efa, _ = declared_network(ROOT / "deploy/kuberay/rayjob.yaml")
    assert (gbps, efa) == (3200.0, True)


def test_the_operator_is_let_in_from_its_helm_releases_namespace():
    assert "kuberay-system" not in TEXT  # no namespace assumed
    (rule,) = CLUSTER["networkPolicy"]["head"]["ingressRules"]
    (peer,) = rule["from"]
    # Any namespace, but only the pods the kuberay-operator chart labels (its Deployment's pod labels).
    operator = {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}
    assert peer == {"namespaceSelector": {}, "podSelector": operator}
    assert rule["ports"] == [{"port": 8265, "protocol": "TCP"}]


def test_efs_storage_class_and_write_permission_for_the_images_user():
    storage = next(d for d in DOCS if d["kind"] == "StorageClass")
    claim = next(d for d in DOCS if d["kind"] == "PersistentVolumeClaim")
    assert storage["metadata"]["name"] == claim["spec"]["storageClassName"] == "efs-sc"
    assert storage["provisioner"] == "efs.csi.aws.com" and storage["reclaimPolicy"] == "Retain"
    parameters = storage["parameters"]
    assert parameters["provisioningMode"] == "efs-ap" and parameters["fileSystemId"].startswith("fs-")
    # The access point's user is the image's (`ray`: uid 1000, gid 100, deploy/Dockerfile), group-writable.
    assert (parameters["uid"], parameters["gid"]) == ("1000", "100")
    assert parameters["directoryPerms"][1] == "7"
    for template in _templates():
        assert template["spec"]["securityContext"]["fsGroup"] == 100
