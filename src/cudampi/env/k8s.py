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

:data:`MPIJOB_SCHEMA` is this module's JSON Schema of the fields the operator's CRD defines for
``spec`` (types, enums and formats as in the CRD) plus the part of the pod template the
generator writes; the tests validate every generated manifest against it.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

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


def load_schema() -> dict[str, Any]:
    """The JSON Schema of a generated MPIJob (``schemas/mpijob-v2beta1.schema.json``)."""
    text = resources.files("cudampi.env").joinpath("schemas/mpijob-v2beta1.schema.json").read_text()
    return dict(json.loads(text))


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
        raise EnvGenError(f"MPIJob does not match the v2beta1 schema at {where}: {e.message}")


# ---------------------------------------------------------------------------------------------
# A small deterministic YAML writer (block style; strings quoted when YAML would retype them).

_PLAIN_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-")
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "~", "y", "n"}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if value is None:
        return "null"
    text = str(value)
    if (
        text
        and set(text) <= _PLAIN_OK
        and text.lower() not in _YAML_WORDS
        and not text[0].isdigit()
        and not text.startswith(("-", ".", "/"))
    ):
        return text
    return json.dumps(text)


def to_yaml(data: Any, indent: int = 0) -> str:
    """Render dicts, lists, strings, ints and bools as block YAML (keys in insertion order)."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            if isinstance(value, (dict, list)) and value:
                lines.append(f"{pad}{_scalar(key)}:")
                lines.append(to_yaml(value, indent + 2).rstrip("\n"))
            else:
                empty = (
                    "{}" if isinstance(value, dict) else "[]" if isinstance(value, list) else None
                )
                lines.append(f"{pad}{_scalar(key)}: {empty or _scalar(value)}")
    elif isinstance(data, list):
        for item in data:
            if isinstance(item, dict) and item:
                first = to_yaml(item, indent + 2).splitlines()
                lines.append(f"{pad}- {first[0].lstrip()}")
                lines.extend(first[1:])
            elif isinstance(item, list) and item:
                lines.append(f"{pad}-")
                lines.append(to_yaml(item, indent + 2).rstrip("\n"))
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    else:
        lines.append(pad + _scalar(data))
    return "\n".join(lines) + "\n"


def mpijob_yaml(spec: EnvSpec, settings: dict[str, str]) -> str:
    doc = mpijob(spec, settings)
    return (
        HEADER
        + f"# kubectl apply -f mpijob.yaml   (needs the Kubeflow MPI Operator, {API_VERSION};\n"
        "# it creates the SSH key Secret <name>-ssh and mounts it at sshAuthMountPath)\n"
        + to_yaml(doc)
    )
