"""The container route: a multi-stage Dockerfile, its entrypoint and the sshd configuration.

The image is the PyPI route frozen: the build stage installs the hash-locked MPI stack into
``/opt/venv`` and then torch; the runtime stage copies the venv onto the same slim Python base,
adds OpenSSH and runs as the non-root user ``mpiuser``. ``MODE`` picks what it does:

- ``train`` (default): run the command (``CMD``) with the CUDA UCX preloaded;
- ``ssh``: sshd in the foreground on ``SSH_PORT``, public-key login only (multi-node mpirun;
  the Kubeflow MPI Operator mounts the job's key pair at ``~/.ssh``);
- ``jupyter``: JupyterLab on port 8888 behind a token (``JUPYTER_TOKEN``, generated if unset).

The health check (:func:`healthcheck_sh`) is cheap enough to run every 30 s: what ``MODE``
serves answers; ``cudampi doctor`` is the full check, run by hand.

Host keys. Every container of a job serves the job's own key pair (``~/.ssh/id_rsa``, the MPI
Operator's secret) as its sshd host key, and the image's ssh client trusts that key and no
other (``KnownHostsCommand`` = :func:`known_hosts_sh`, ``StrictHostKeyChecking yes``): the
client checks every host key, and only a host that holds the job's private key passes.
"""

from __future__ import annotations

import json

from cudampi.config import UCX_PRELOAD
from cudampi.env import source
from cudampi.env.pip import HEADER, ucx_preload
from cudampi.env.spec import EnvSpec
from cudampi.errors import EnvGenError

VENV = "/opt/venv"
USER = "mpiuser"
UID = 1000
ENTRYPOINT = "/usr/local/bin/cudampi-entrypoint"
KNOWN_HOSTS = "/usr/local/bin/cudampi-known-hosts"
HEALTHCHECK = "/usr/local/bin/cudampi-healthcheck"


def site_packages(spec: EnvSpec) -> str:
    return f"{VENV}/lib/python{spec.python}/site-packages"


def image_env(spec: EnvSpec, settings: dict[str, str]) -> dict[str, str]:
    """Every ENV of the runtime stage, in order (a CPU image has no GPU or UCX variables)."""
    env = {
        "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "VIRTUAL_ENV": VENV,
        # Jupyter's terminals start $SHELL (else sh).
        "SHELL": "/bin/bash",
        "MODE": "train",
        "SSH_PORT": str(spec.ssh_port),
    }
    if spec.gpu:
        env.update(
            {
                # The NVIDIA container runtime injects the driver into images that ask for it.
                "NVIDIA_VISIBLE_DEVICES": "all",
                "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
                UCX_PRELOAD: ucx_preload(site_packages(spec)),
                "UCX_MODULE_DIR": f"{site_packages(spec)}/libucx/lib/ucx",
            }
        )
    env.update(settings)
    return env


def session_env(spec: EnvSpec, settings: dict[str, str]) -> dict[str, str]:
    """What the image's processes see however they start (``docker exec``, a login shell, an
    ssh session): its ENV without MODE (what the entrypoint does) and SHELL (sshd sets it)."""
    return {k: v for k, v in image_env(spec, settings).items() if k not in ("MODE", "SHELL")}


def cudampi_install(spec: EnvSpec) -> tuple[str, str]:
    """``(COPY lines or "", pip argument)`` that install cudampi in the build stage.

    The build context is the generated folder itself, so a local source must be inside it; a
    checkout above it (:func:`cudampi.env.source.checkout`) is the context instead, and its
    project files are copied."""
    if source.checkout(spec):
        files = " ".join(source.PROJECT_FILES)
        return f"COPY {files} ./cudampi/\nCOPY src ./cudampi/src\n", "./cudampi"
    req = source.requirement(spec)
    if not source.is_local_path(req):
        return "", req
    rel = req.removeprefix("./")
    if req.startswith("/") or rel.startswith("..") or "/../" in rel:
        raise EnvGenError(
            f"source {spec.source!r} is outside the generated folder, which is the image's build "
            "context: copy it into the folder and name it relative to it, give a URL or a "
            "requirement, name the cudampi checkout that holds the folder (..), or leave source "
            "empty to bundle this cudampi's wheel"
        )
    return f"COPY {rel} ./\n", "./" + rel.rsplit("/", 1)[-1]


def _context(spec: EnvSpec, folder: str | None) -> tuple[str, str]:
    """(how to build, the prefix of the folder's own files in the build context)."""
    if not source.checkout(spec):
        return (
            "# Build with this folder as the context (it holds everything the image needs):\n"
            f"#   docker build -t {spec.image} .\n",
            "",
        )
    if folder is None:
        raise EnvGenError(
            f"source {spec.source!r} is the checkout that holds the folder, the image's build "
            "context: the Dockerfile names its files by the folder's place in it, so generate "
            "it with the folder (cudampi env write --out DIR)"
        )
    return (
        f"# Build in the cudampi checkout (the context; it is {spec.source} from here), from its "
        "sources:\n"
        f"#   docker build -f {folder}/Dockerfile -t {spec.image} .\n",
        f"{folder}/",
    )


def dockerfile(spec: EnvSpec, settings: dict[str, str], folder: str | None = None) -> str:
    """The Dockerfile; its build context is its own folder (``docker build -t IMAGE DIR``), or
    the checkout that holds the folder at ``folder`` when the source is that checkout."""
    env = image_env(spec, settings)
    copy_cudampi, cudampi_arg = cudampi_install(spec)
    how, here = _context(spec, folder)
    env_lines = " \\\n    ".join(f"{k}={_quote(v)}" for k, v in env.items())
    cmd = json.dumps(list(spec.command))
    apt = "openssh-server openssh-client"
    # Docker's /dev/shm is 64 MiB: the ranks' shared memory (MPI, NCCL, UCX) and torch's
    # DataLoader workers need more (cudampi doctor's /dev/shm check says so).
    gpus = ("--gpus all " if spec.gpu else "") + "--shm-size=8g "
    return f"""# syntax=docker/dockerfile:1
{HEADER}{how}# Run:  docker run {gpus}{spec.image}                       (MODE=train: the CMD below)
#       docker run {gpus}-e MODE=ssh -v $PWD/job-ssh:/home/{USER}/.ssh:ro {spec.image}
#         (job-ssh: the job's id_rsa, id_rsa.pub and authorized_keys, owned by uid {UID})
#       docker run {gpus}-e MODE=jupyter -e JUPYTER_TOKEN=... -p 8888:8888 {spec.image}
ARG BASE_IMAGE={spec.base_image_resolved}

FROM ${{BASE_IMAGE}} AS build
# A site's pip settings for this stage only, none kept in the image (a CA bundle, a wheel folder,
# a mirror): podman build -v $PWD/site:/mnt:ro --build-arg PIP_CONFIG_FILE=/mnt/pip.conf ...
ARG PIP_CONFIG_FILE
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv {VENV}
ENV PATH={VENV}/bin:$PATH
WORKDIR /src
COPY {here}requirements.lock {here}requirements.txt ./
# 1+2+3. The MPI wheel, mpi4py's binary wheel, numpy{" and the CUDA UCX" if spec.gpu else ""}: exact files, hash-checked;
# 4. then torch and the extras (the pins of 1-3 are already satisfied).
RUN pip install --require-hashes --only-binary :all: --no-deps -r requirements.lock \\
    && pip install -r requirements.txt
# cudampi itself; the pins above already satisfy its MPI dependencies.
{copy_cudampi}RUN pip install {cudampi_arg} \\
    && python -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"

FROM ${{BASE_IMAGE}} AS runtime
# Debian's security archive drops superseded versions, so exact apt pins break rebuilds; the
# base image tag fixes the release and the Python stack is pinned by hash above.
# hadolint ignore=DL3008
RUN apt-get update \\
    && apt-get install -y --no-install-recommends {apt} \\
    && rm -rf /var/lib/apt/lists/* \\
    && useradd --create-home --uid {UID} --shell /bin/bash {USER} \\
    && mkdir -p {spec.workdir} /home/{USER}/.ssh /home/{USER}/.sshd \\
    && chown {USER}:{USER} {spec.workdir} /home/{USER}/.ssh /home/{USER}/.sshd \\
    && chmod 700 /home/{USER}/.ssh /home/{USER}/.sshd
COPY {here}ssh_config /etc/ssh/ssh_config.d/cudampi.conf
COPY {here}sshd_config /etc/cudampi/sshd_config
COPY --chmod=0755 {here}entrypoint.sh {ENTRYPOINT}
COPY --chmod=0755 {here}known_hosts.sh {KNOWN_HOSTS}
COPY --chmod=0755 {here}healthcheck.sh {HEALTHCHECK}
COPY {here}profile.sh /etc/profile.d/cudampi.sh
COPY --from=build {VENV} {VENV}
ENV {env_lines}
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER {UID}:{UID}
WORKDIR {spec.workdir}
EXPOSE {spec.ssh_port} 8888
# Cheap, so it can run often: what MODE serves answers (no MPI job; `cudampi doctor` is the
# full check, run it by hand: docker exec CONTAINER cudampi doctor).
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \\
    CMD ["{HEALTHCHECK}"]
ENTRYPOINT ["{ENTRYPOINT}"]
CMD {cmd}
"""


def healthcheck_sh(spec: EnvSpec) -> str:
    """The image's HEALTHCHECK: what ``MODE`` serves answers, in well under a second."""
    return f"""#!/bin/bash
{HEADER}# The image's HEALTHCHECK, cheap enough to run every 30 s: no MPI job, no doctor.
# MODE=ssh: sshd accepts connections. MODE=jupyter: JupyterLab does. MODE=train: the MPI stack
# loads (mpi4py binds the wheel's libmpi; no MPI_Init), the job's progress being its own.
set -eu
answers() {{ exec 3<>"/dev/tcp/127.0.0.1/$1"; }}
case "${{MODE:-train}}" in
  ssh) answers "${{SSH_PORT:-{spec.ssh_port}}}" ;;
  jupyter) answers 8888 ;;
  *) exec python -c "import cudampi, mpi4py; mpi4py.rc(initialize=False); from mpi4py import MPI" ;;
esac
"""


def _quote(value: str) -> str:
    if value and all(c.isalnum() or c in "/._:,=-+" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def entrypoint_sh(spec: EnvSpec) -> str:
    """The image's entrypoint: MODE=train|ssh|jupyter."""
    return f"""#!/bin/bash
{HEADER}# MODE=train (default): run the command with the CUDA UCX preloaded (ranks started
#   locally inherit it; for other nodes pass it on: mpirun -x LD_PRELOAD -x UCX_MODULE_DIR).
# MODE=ssh: sshd in the foreground, public-key login only, for multi-node mpirun. Its host key
#   is the job's key pair (~/.ssh/id_rsa), which the image's ssh client trusts (and no other).
# MODE=jupyter: JupyterLab on :8888 with a token (JUPYTER_TOKEN; one is generated if unset);
#   options given as the command go to it (--ServerApp.x=y), a command does not.
set -euo pipefail

die() {{ echo "cudampi-entrypoint: $*" >&2; exit 2; }}

case "${{MODE:-train}}" in
  train)
    [ "$#" -gt 0 ] || die "MODE=train needs a command (the image's CMD or docker run ... CMD)"
    if [ -n "${{{UCX_PRELOAD}:-}}" ]; then
      export LD_PRELOAD="${{{UCX_PRELOAD}}}${{LD_PRELOAD:+:$LD_PRELOAD}}"
    fi
    exec "$@"
    ;;
  ssh)
    ssh_dir="${{SSH_AUTH_DIR:-$HOME/.ssh}}"
    [ -s "$ssh_dir/authorized_keys" ] \\
      || die "MODE=ssh needs $ssh_dir/authorized_keys (mount a public key there: password login is off)"
    host_key="${{SSH_HOST_KEY:-$ssh_dir/id_rsa}}"
    if [ ! -r "$host_key" ]; then
      echo "cudampi-entrypoint: no job key pair at $host_key: a host key is made for this" \\
        "container, and the image's ssh client (which trusts only the job's key) refuses it" >&2
      host_key="$HOME/.sshd/ssh_host_ed25519_key"
      [ -r "$host_key" ] || ssh-keygen -q -t ed25519 -N '' -f "$host_key"
    fi
    exec /usr/sbin/sshd -D -e -f /etc/cudampi/sshd_config -p "${{SSH_PORT:-{spec.ssh_port}}}" \\
      -h "$host_key" -o "AuthorizedKeysFile=$ssh_dir/authorized_keys"
    ;;
  jupyter)
    command -v jupyter >/dev/null \\
      || die "MODE=jupyter needs JupyterLab in the image: build it with the 'jupyter' extra"
    if [ -z "${{JUPYTER_TOKEN:-}}" ]; then
      JUPYTER_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(24))')
      echo "cudampi-entrypoint: JUPYTER_TOKEN was not set; this session's token: $JUPYTER_TOKEN" >&2
    fi
    export JUPYTER_TOKEN
    # Options (--ServerApp.x=y) go to JupyterLab; a command is the image's CMD (the training
    # command of MODE=train), not for JupyterLab.
    case "${{1:-}}" in --*) ;; *) set -- ;; esac
    exec jupyter lab --no-browser --ip=0.0.0.0 --port=8888 --ServerApp.root_dir="$PWD" "$@"
    ;;
  *)
    die "MODE=${{MODE}} is not one of train, ssh, jupyter"
    ;;
esac
"""


def profile_sh(spec: EnvSpec, settings: dict[str, str]) -> str:
    """``/etc/profile.d/cudampi.sh``: login shells (Jupyter's terminals, ssh logins) get the
    image's environment back after ``/etc/profile`` has reset PATH."""
    env = session_env(spec, settings)
    path = env.pop("PATH").split(":")[0]
    exports = "\n".join(f"export {k}='{v}'" for k, v in env.items())
    return f"""# shellcheck shell=sh
{HEADER}# Login shells (Jupyter's terminals, ssh logins) reset PATH in /etc/profile, then read this.
case ":$PATH:" in
  *":{path}:"*) ;;
  *) PATH="{path}:$PATH" ;;
esac
export PATH
{exports}
"""


def known_hosts_sh(spec: EnvSpec) -> str:
    """The ssh client's ``KnownHostsCommand``: the job's public key, vouched for the host asked.

    ``$1`` is the host as known_hosts names it (``[worker-1]:2222``). Prints nothing when the
    job's key pair is not there, and the client then refuses the host."""
    return f"""#!/bin/sh
{HEADER}# KnownHostsCommand of the image's ssh client (/etc/ssh/ssh_config.d/cudampi.conf). Every host
# of the job serves the job's key pair as its sshd host key (cudampi-entrypoint, MODE=ssh), so
# the job's public key, and only it, is the known host key of the host asked ($1).
set -eu
key="${{SSH_HOST_KEY:-${{SSH_AUTH_DIR:-$HOME/.ssh}}/id_rsa}}"
if [ -r "$key.pub" ]; then
  pub=$(cat "$key.pub")
elif [ -r "$key" ]; then
  pub=$(ssh-keygen -y -f "$key")
else
  exit 0
fi
# shellcheck disable=SC2086 # split "type base64 [comment]" into its fields
set -- "$1" $pub
printf '%s %s %s\\n' "$1" "$2" "$3"
"""


def sshd_config(spec: EnvSpec, settings: dict[str, str]) -> str:
    """sshd for a non-root user: key-only, no PAM, no privilege separation needed."""
    setenv = " ".join(f'"{k}={v}"' for k, v in session_env(spec, settings).items())
    return f"""{HEADER}# sshd for MODE=ssh, run as {USER}: public keys only.
Port {spec.ssh_port}
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AuthenticationMethods publickey
PermitRootLogin no
PermitEmptyPasswords no
# PAM needs root; key-only login does not need it.
UsePAM no
# Kubernetes mounts the key Secret with group/other read bits; StrictModes would refuse it.
StrictModes no
PidFile none
PrintMotd no
X11Forwarding no
AllowAgentForwarding no
AllowTcpForwarding no
# ssh sessions get the image's environment, as `docker exec` does: the daemons mpirun starts
# over ssh find the venv's prted and python, and their ranks see the image's settings.
SetEnv {setenv}
"""


def ssh_config(spec: EnvSpec) -> str:
    """Client side, for mpirun's ssh between the job's containers."""
    return f"""{HEADER}# ssh between the job's containers: the port of MODE=ssh, keys only, no prompts. Host keys
# are checked: every host of the job serves the job's key pair as its host key, and
# cudampi-known-hosts vouches for that key only, so a host without the job's key is refused.
Host *
    Port {spec.ssh_port}
    BatchMode yes
    PasswordAuthentication no
    StrictHostKeyChecking yes
    KnownHostsCommand {KNOWN_HOSTS} %H
    LogLevel ERROR
    ConnectionAttempts 10
"""
