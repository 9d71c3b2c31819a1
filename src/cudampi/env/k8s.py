"""The Kubernetes route: a Kubeflow MPI Operator ``MPIJob`` (``kubeflow.org/v2beta1``).

Facts from the operator (kubeflow/mpi-operator, ``pkg/controller/mpi_job_controller.go`` and
``manifests/base/kubeflow.org_mpijobs.yaml``):

- it creates a Secret ``<job>-ssh`` (``id_rsa``, ``id_rsa.pub``, ``authorized_keys``) and mounts it
  at ``spec.sshAuthMountPath`` in the launcher and every worker: that is the SSH secret, and the
  image's ``MODE=ssh`` uses ``id_rsa`` as sshd's host key and ``authorized_keys`` for login;
- for ``mpiImplementation: OpenMPI`` it sets ``OMPI_MCA_orte_default_hostfile`` (the workers,
  ``slotsPerWorker`` slots each), ``OMPI_MCA_orte_keep_fqdn_hostnames`` and
  ``OMPI_MCA_plm_rsh_args=-o ConnectionAttempts=10`` on the launcher;
- ``launcherCreationPolicy: WaitForWorkersReady`` starts the launcher only once every worker
  pod is Ready, so mpirun's ssh does not race the workers' sshd.

:func:`validate_mpijob` checks a manifest against the operator's own CustomResourceDefinition
(vendored in ``schemas/``, its release named there) with the fields the API server would prune
made errors, plus what the operator's validation adds (:data:`OPERATOR_RULES`); every generated
manifest is checked before it is written.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from cudampi.config import UCX_PRELOAD
from cudampi.env.docker import ENTRYPOINT, UID, USER, image_env
from cudampi.env.pip import HEADER
from cudampi.env.recommended import mpirun_flags
from cudampi.env.spec import EnvSpec
from cudampi.errors import EnvGenError

API_VERSION = "kubeflow.org/v2beta1"

MPI_IMPLEMENTATION = {"openmpi": "OpenMPI", "mpich": "MPICH"}


def launcher_args(spec: EnvSpec, settings: dict[str, str]) -> list[str]:
    """mpirun's argv on the launcher: ranks, placement, and what the remote ranks need."""
    if spec.mpi == "openmpi":
        forward = ["-x", "PATH"]
        if spec.gpu:
            preload = "LD_PRELOAD=" + image_env(spec, settings)[UCX_PRELOAD]
            forward = ["-x", preload, "-x", "UCX_MODULE_DIR", *forward]
        forward += [a for k in settings if not k.startswith("OMPI_MCA_") for a in ("-x", k)]
        return [
            "mpirun",
            "-n",
            str(spec.ranks),
            *mpirun_flags(spec.ranks_per_node_resolved),
            *forward,
            *spec.command,
        ]
    env_flags = ["-genvlist", ",".join(settings)] if settings else []
    return [
        "mpiexec",
        "-n",
        str(spec.ranks),
        *mpirun_flags(spec.ranks_per_node_resolved, "mpich"),
        *env_flags,
        *spec.command,
    ]


def mpijob(spec: EnvSpec, settings: dict[str, str]) -> dict[str, Any]:
    """The MPIJob as plain data (render with :func:`to_yaml`)."""
    home = f"/home/{USER}"
    security = {
        "runAsUser": UID,
        "runAsGroup": UID,
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
    }
    dshm = {"name": "dshm", "emptyDir": {"medium": "Memory"}}

    def container(
        name: str, mode: str, args: list[str] | None, limits: dict[str, Any]
    ) -> dict[str, Any]:
        c: dict[str, Any] = {
            "name": name,
            "image": spec.image,
            "imagePullPolicy": "IfNotPresent",
            "command": [ENTRYPOINT],
            "env": [
                {"name": "MODE", "value": mode},
                {"name": "SSH_PORT", "value": str(spec.ssh_port)},
            ],
            "resources": {"limits": limits, "requests": limits},
            "securityContext": security,
            # NCCL and UCX use /dev/shm between the ranks of a pod; the default is 64 MiB.
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }
        if args:
            c["args"] = args
        if mode == "ssh":
            c["ports"] = [{"name": "ssh", "containerPort": spec.ssh_port, "protocol": "TCP"}]
        return c

    worker_limits: dict[str, Any] = {"cpu": spec.cpus_per_task * spec.ranks_per_node_resolved}
    if spec.gpu:
        worker_limits = {"nvidia.com/gpu": spec.gpus_per_node, **worker_limits}
    return {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": {
            "name": spec.name,
            "labels": {
                "app.kubernetes.io/name": spec.name,
                "app.kubernetes.io/managed-by": "cudampi",
            },
        },
        "spec": {
            "slotsPerWorker": spec.ranks_per_node_resolved,
            "mpiImplementation": MPI_IMPLEMENTATION[spec.mpi],
            "sshAuthMountPath": f"{home}/.ssh",
            "launcherCreationPolicy": "WaitForWorkersReady",
            "runPolicy": {
                "cleanPodPolicy": "Running",
                "backoffLimit": 0,
                "ttlSecondsAfterFinished": 3600,
            },
            "mpiReplicaSpecs": {
                "Launcher": {
                    "replicas": 1,
                    "restartPolicy": "Never",
                    "template": {
                        "spec": {
                            "containers": [
                                container(
                                    "launcher",
                                    "train",
                                    launcher_args(spec, settings),
                                    {"cpu": 1, "memory": "2Gi"},
                                )
                            ],
                            "volumes": [dshm],
                        }
                    },
                },
                "Worker": {
                    "replicas": spec.nodes,
                    "restartPolicy": "Never",
                    "template": {
                        "spec": {
                            "containers": [container("worker", "ssh", None, worker_limits)],
                            "volumes": [dshm],
                        }
                    },
                },
            },
        },
    }


CRD = "schemas/kubeflow.org_mpijobs.yaml"
"""The operator's CustomResourceDefinition, vendored (its header names the release)."""

REPLICA_RULES: dict[str, Any] = {
    "required": ["replicas", "restartPolicy", "template"],
    "properties": {
        "restartPolicy": {"enum": ["Never", "OnFailure"]},
        "template": {
            "required": ["spec"],
            "properties": {"spec": {"properties": {"containers": {"minItems": 1}}}},
        },
    },
}
OPERATOR_RULES: dict[str, Any] = {
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "spec": {
            "required": ["mpiReplicaSpecs", "slotsPerWorker", "sshAuthMountPath", "runPolicy"],
            "properties": {
                "slotsPerWorker": {"minimum": 0},
                "runPolicy": {
                    "required": ["cleanPodPolicy"],
                    "properties": {"cleanPodPolicy": {"enum": ["None", "Running", "All"]}},
                },
                "mpiReplicaSpecs": {
                    "required": ["Launcher"],
                    "properties": {
                        "Launcher": {
                            "allOf": [REPLICA_RULES, {"properties": {"replicas": {"const": 1}}}]
                        },
                        "Worker": {
                            "allOf": [REPLICA_RULES, {"properties": {"replicas": {"minimum": 1}}}]
                        },
                    },
                },
            },
        }
    },
}
"""What the operator checks beyond its CRD when it takes an MPIJob (kubeflow/mpi-operator
``pkg/apis/kubeflow/validation/validation.go``, v0.8.0), as schema: a Launcher with one
replica, Workers with at least one, a restart policy it knows, a container each, slots per
worker, a clean-pod policy it knows and the SSH mount path."""


def _closed(schema: Any) -> Any:
    """The CRD's schema with the API server's pruning made an error: an object with
    ``properties`` and no ``additionalProperties`` (nor ``x-kubernetes-preserve-unknown-fields``)
    loses unknown fields silently on the server; here a field the generator misspells fails."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def load_schema() -> dict[str, Any]:
    """The JSON Schema a generated MPIJob must match: the operator's CRD (its
    ``openAPIV3Schema`` for :data:`API_VERSION`, unknown fields refused), its group, version and
    kind, and :data:`OPERATOR_RULES`."""
    crd = yaml.safe_load(resources.files("cudampi.env").joinpath(CRD).read_text())
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    (version,) = [v for v in crd["spec"]["versions"] if f"{group}/{v['name']}" == API_VERSION]
    identity = {"properties": {"apiVersion": {"const": API_VERSION}, "kind": {"const": kind}}}
    return {"allOf": [_closed(version["schema"]["openAPIV3Schema"]), identity, OPERATOR_RULES]}


def validate_mpijob(doc: Any, schema: dict[str, Any] | None = None) -> None:
    """Raise :class:`EnvGenError` naming the first field that does not match the schema."""
    try:
        import jsonschema
    except ModuleNotFoundError:
        raise EnvGenError("validating an MPIJob needs jsonschema: pip install jsonschema") from None
    validator = jsonschema.Draft7Validator(schema or load_schema())
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "(top)"
        raise EnvGenError(
            f"MPIJob does not match the MPI Operator's {API_VERSION} schema at {where}: {e.message}"
        )


class _Dumper(yaml.SafeDumper):
    """Block YAML as Kubernetes' examples write it: lists indented under their key, and a value
    used twice (requests = limits) written twice, never as an anchor and an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def to_yaml(data: Any) -> str:
    """Block YAML of plain data (PyYAML), keys in their order, long strings on one line."""
    return str(yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=1 << 16))


def mpijob_yaml(spec: EnvSpec, settings: dict[str, str]) -> str:
    doc = mpijob(spec, settings)
    return (
        HEADER
        + f"# kubectl apply -f mpijob.yaml   (needs the Kubeflow MPI Operator, {API_VERSION};\n"
        "# it creates the SSH key Secret <name>-ssh and mounts it at sshAuthMountPath)\n"
        + to_yaml(doc)
    )
