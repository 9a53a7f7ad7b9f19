"""The Kubernetes work pool (deploy/kubernetes, docs/scale-out.md), checked without a cluster: the base job
template is current with its generator, prefect-kubernetes renders it into a Job whose pod requests the GPU and
carries the store, the thread budget and Prefect's own environment; the deployments are the process pool's."""

import json
import sys
import uuid
from pathlib import Path

import pytest
import yaml

pytest.importorskip("prefect_kubernetes")

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"


def test_the_template_is_what_its_generator_writes(tmp_path):
    committed = (K8S / "base-job-template.json").read_text()
    sys.path.insert(0, str(K8S))
    try:
        import make_template
    finally:
        sys.path.remove(str(K8S))
    assert json.loads(committed) == make_template.template(), "rerun python deploy/kubernetes/make_template.py"


def test_a_flow_run_becomes_a_gpu_job_with_the_store(prefect_api):
    import asyncio

    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads((K8S / "base-job-template.json").read_text())
    values = {"env": {"EXTRA": "1"}, "store": "s3://bucket/refinery", "gpus": 2}  # a deployment's job variables
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, values))
    run = FlowRun(flow_id=uuid.uuid4(), name="r")
    config.prepare_for_flow_run(run)
    container = config.job_manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["image"] == "refinery:latest"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert all(isinstance(v, str) for v in env.values()), env  # the Kubernetes API takes only strings here
    assert env["REFINERY_STORE"] == "s3://bucket/refinery" and env["REFINERY_TORCH_THREADS"] == "8"
    assert env["EXTRA"] == "1" and env["PREFECT__FLOW_RUN_ID"] == str(run.id)  # Prefect's env kept
    assert container["envFrom"] == [{"secretRef": {"name": "refinery-s3", "optional": False}}]


def test_the_kubernetes_deployments_are_the_process_pools():
    local = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    k8s = yaml.safe_load((K8S / "prefect.yaml").read_text())["deployments"]

    def shape(ds):
        return [(d["name"], d["entrypoint"], d.get("schedules")) for d in ds]

    assert shape(k8s) == shape(local)
    assert {d["work_pool"]["name"] for d in k8s} == {"refinery-kubernetes"}
    assert all((REPO / d["entrypoint"].split(":")[0]).exists() for d in k8s)


def test_prefect_accepts_the_template_for_a_kubernetes_pool():
    # the same validation `prefect work-pool create --type kubernetes --base-job-template` runs
    from prefect.client.schemas.actions import WorkPoolCreate

    template = json.loads((K8S / "base-job-template.json").read_text())
    pool = WorkPoolCreate(name="refinery-kubernetes", type="kubernetes", base_job_template=template)
    assert pool.base_job_template["variables"]["properties"]["gpus"]["default"] == 1
