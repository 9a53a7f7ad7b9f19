"""Write deploy/kubernetes/base-job-template.json: prefect-kubernetes' default base job template for a
Kubernetes work pool, with what a Refinery flow run needs (docs/scale-out.md):

- a `gpus` variable (default 1) requested as `nvidia.com/gpu` in the job's container limits: collect (vLLM)
  and train run in the flow run's pod, so the pod holds the GPU both use;
- CPU and memory requests sized for a GPU round (8 CPUs, 32 GiB; variables, as in the default template);
- `REFINERY_STORE` (an `s3://bucket/prefix` root shared by every pod: the store on object storage) and
  `REFINERY_TORCH_THREADS` (the CPU share: models/threads.py) in the environment, and the AWS credentials from a
  Kubernetes secret named by the `aws_secret` variable (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
  optional `AWS_ENDPOINT_URL` keys);
- an image variable defaulting to `refinery:latest` (an image holding this repository and its `gpu` and
  `distributed` extras, built by the user; docs/scale-out.md).

    python deploy/kubernetes/make_template.py        # rewrite the JSON (tests/test_kubernetes.py checks it is current)
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("base-job-template.json")


def template() -> dict:
    from prefect_kubernetes.worker import KubernetesWorker

    t = copy.deepcopy(KubernetesWorker.get_default_base_job_template())
    props = t["variables"]["properties"]
    props["image"]["default"] = "refinery:latest"
    props["cpu_request"]["default"] = "8"
    props["memory_request"]["default"] = "32Gi"
    props["gpus"] = {"type": "integer", "minimum": 0, "default": 1, "title": "GPUs",
                     "description": "nvidia.com/gpu the flow run's pod requests (collect with vLLM and training)"}
    props["store"] = {"type": "string", "default": "s3://refinery/store", "title": "Store",
                      "description": "REFINERY_STORE of the flow run: an s3:// root every pod reaches"}
    props["torch_threads"] = {"type": "string", "pattern": "^[1-9][0-9]*$", "default": "8", "title": "Torch threads",
                              "description": "REFINERY_TORCH_THREADS: the CPU threads torch may use in the pod "
                                             "(a string: Kubernetes environment values are strings)"}
    props["aws_secret"] = {"type": "string", "default": "refinery-s3", "title": "AWS secret",
                           "description": "the Kubernetes secret holding AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY "
                                          "and optionally AWS_ENDPOINT_URL"}
    container = t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"]["nvidia.com/gpu"] = "{{ gpus }}"
    container["envFrom"] = [{"secretRef": {"name": "{{ aws_secret }}", "optional": False}}]
    env = t["job_configuration"]["env"]
    assert env == "{{ env }}", env  # the default passes the pool's env through; ours is added beside it
    container["env"] = [{"name": "REFINERY_STORE", "value": "{{ store }}"},
                        {"name": "REFINERY_TORCH_THREADS", "value": "{{ torch_threads }}"}]
    return t


def main() -> int:
    OUT.write_text(json.dumps(template(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
