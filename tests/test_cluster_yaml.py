"""ray_cluster.yaml is a valid Ray autoscaler config (checked against the schema Ray ships)."""

from pathlib import Path

import jsonschema
import ray.autoscaler
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_yaml_matches_ray_schema():
    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    import json

    schema = json.loads(schema_path.read_text())
    config = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    gpu = config["available_node_types"]["gpu-8xh100"]
    assert gpu["resources"]["GPU"] == 8 and gpu["max_workers"] * 8 == 32
