"""The Serve config file of a cluster deployment (deploy/serve.yaml) and the KubeRay manifest
that embeds it (deploy/rayservice.yaml): `serve run`'s schema accepts the file, its import paths
resolve to the applications `serve --ray` deploys, its deployments are what the code builds from
the settings in its args (it cannot drift from the code), and the manifest embeds it verbatim.
No Ray cluster: Serve builds applications without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from telerag.cli.main import main
from telerag.config.settings import SettingsError, load_settings

pytest.importorskip("ray", reason="the Serve config needs the `ray` extra")

ROOT = Path(__file__).resolve().parents[1]
SERVE_YAML = ROOT / "deploy" / "serve.yaml"
RAYSERVICE = ROOT / "deploy" / "rayservice.yaml"


def file_settings(config: dict):
    """The settings the file was generated with: its applications' args."""
    (args,) = {yaml.safe_dump(app["args"]) for app in config["applications"]}  # one set of settings for both
    return load_settings(None, yaml.safe_load(args)["settings"])


@pytest.fixture(autouse=True)
def settings_as_shipped(monkeypatch):
    """The defaults as shipped: the suite's own setting for its servers (conftest: nothing kept
    across starts) is not one the checked-in file carries."""
    monkeypatch.delenv("TELERAG_SERVER__CALIBRATION_DIR", raising=False)


def test_the_checked_in_serve_config_is_what_the_code_generates_from_its_settings():
    from telerag.server.ray_serve.serve_config import serve_config_yaml

    text = SERVE_YAML.read_text(encoding="utf-8")
    assert text == serve_config_yaml(file_settings(yaml.safe_load(text))), (
        "deploy/serve.yaml is stale: generate it again with `telerag config serve` (README, deploy/)"
    )


def test_serve_runs_schema_accepts_it_and_its_import_paths_build_both_tiers():
    # Serve's own build (what `serve run` does with the file), private: the check that the file's
    # deployments, read from the deployments the code binds, are what Serve builds from its import paths
    from ray._common.utils import import_attr
    from ray.serve._private.build_app import build_app
    from ray.serve.deployment import deployment_to_schema
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(SERVE_YAML.read_text(encoding="utf-8"))
    schema = ServeDeploySchema.model_validate(config)
    assert [app.name for app in schema.applications] == ["telerag-retrieval", "telerag"]
    for app in config["applications"]:
        built = build_app(import_attr(app["import_path"])(app["args"]), name=app["name"])
        deployments = [deployment_to_schema(d).model_dump(mode="json", exclude_unset=True) for d in built.deployments]
        assert deployments == app["deployments"]
    deployments = {d["name"]: d for app in config["applications"] for d in app["deployments"]}
    assert set(deployments) == {"shard-0", "shard-1", "directory", "inference", "ingress"}
    scaling = {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 16.0}
    assert deployments["inference"]["autoscaling_config"] == scaling
    assert deployments["inference"]["ray_actor_options"]["num_gpus"] == 1.0
    assert (
        deployments["inference"]["request_router_config"]["request_router_class"]
        == "telerag.server.ray_serve.router.ClusterRouter"
    )
    for shard in ("shard-0", "shard-1"):
        assert deployments[shard]["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 1.0}
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}


def test_config_serve_prints_fixed_counts_without_autoscaling_and_no_tier_without_shards(capsys):
    assert main(["config", "serve", "--replicas", "3"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    (app,) = config["applications"]  # no shards: no retrieval tier, each replica's own faiss
    inference = next(d for d in app["deployments"] if d["name"] == "inference")
    assert inference["num_replicas"] == 3 and "autoscaling_config" not in inference
    assert app["args"] == {"settings": {"cluster": {"replicas": 3}}}


def test_api_keys_never_reach_the_file(capsys, monkeypatch):
    monkeypatch.setenv("TELERAG_SERVER__API_KEY", "s3cret")  # the cluster's environment gives them
    assert main(["config", "serve"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "api_key" not in out


def test_an_autoscaling_bound_below_the_count_is_refused():
    with pytest.raises(SettingsError, match=r"cluster\.max_replicas must be 0"):
        load_settings(None, {"cluster": {"replicas": 3, "max_replicas": 2}})
    with pytest.raises(SettingsError, match=r"cluster\.max_shard_replicas must be 0"):
        load_settings(None, {"cluster": {"shard_replicas": 2, "max_shard_replicas": 1}})


def test_the_rayservice_embeds_the_serve_config_and_runs_the_images_with_ray():
    manifest = yaml.safe_load(RAYSERVICE.read_text(encoding="utf-8"))
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert manifest["spec"]["serveConfigV2"] == SERVE_YAML.read_text(encoding="utf-8")
    cluster = manifest["spec"]["rayClusterConfig"]
    ray_extra = next(Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["ray"])
    assert ray_extra.specifier.contains(cluster["rayVersion"])
    assert cluster["enableInTreeAutoscaling"] is True
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text(encoding="utf-8"))
    images = {service["image"] for service in compose["services"].values() if "build" in service}
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["template"]["spec"]["containers"]
        assert container["image"] in images  # built by docker/Dockerfile, with the ray extra (tests/test_deploy.py)
        assert {"mountPath": "/data", "name": "data"} in container["volumeMounts"]  # the datastore at one path everywhere
        assert "wget" not in yaml.safe_dump(container)  # the images have none (KubeRay's default probes use it)
    groups = {group["groupName"]: group for group in cluster["workerGroupSpecs"]}
    inference = groups["inference"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert inference["nvidia.com/gpu"] == "1" and groups["inference"]["maxReplicas"] == 8


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
