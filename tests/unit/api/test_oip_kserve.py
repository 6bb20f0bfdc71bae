"""docker/kserve: the ServingRuntime and InferenceService agree with each other, with the
Dockerfile and with the routes the app serves (KServe itself is not run here)."""

from __future__ import annotations

from pathlib import Path

import yaml

from app.api.main import create_app
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[3]


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "docker" / "kserve" / name).read_text())


def test_the_runtime_serves_the_protocol_on_its_declared_port():
    runtime, service = load("servingruntime.yaml"), load("inferenceservice.yaml")
    assert runtime["kind"] == "ServingRuntime" and runtime["spec"]["protocolVersions"] == ["v2"]
    (container,) = runtime["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    port = int(env["YOLOPIPE_PORT"])
    assert container["name"] == "kserve-container" and container["args"] == ["serve"]
    assert "ENTRYPOINT [\"yolopipe\"]" in (ROOT / "Dockerfile").read_text()
    assert [p["containerPort"] for p in container["ports"]] == [port]
    assert env["YOLOPIPE_WEIGHTS"].startswith("/mnt/models/")  # where KServe's storage initializer puts the model
    app_paths = set(create_app(Settings(), inference=None).openapi()["paths"])  # type: ignore[arg-type]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == port and container[probe]["httpGet"]["path"] in app_paths
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["artifacts"] == "/artifacts" and "YOLOPIPE_ARTIFACTS_DIR=/artifacts" in (ROOT / "Dockerfile").read_text()
    predictor = service["spec"]["predictor"]["model"]
    assert predictor["runtime"] == runtime["metadata"]["name"] and predictor["protocolVersion"] == "v2"
    assert predictor["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
