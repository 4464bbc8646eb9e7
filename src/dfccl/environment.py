"""Start-up the way jobs start: one process per GPU, rank and size from the
launcher's environment.

``init_from_env()`` reads the job's layout from the variables that torchrun
(and ``python -m dfccl.launch``), Open MPI's ``mpirun`` and Slurm's ``srun``
set, and the address of the job's rendezvous:

=========  ======================  ======================  ==========================
launcher   rank                    world size              local rank (-> device)
=========  ======================  ======================  ==========================
torchrun   RANK                    WORLD_SIZE              LOCAL_RANK
Open MPI   OMPI_COMM_WORLD_RANK    OMPI_COMM_WORLD_SIZE    OMPI_COMM_WORLD_LOCAL_RANK
Slurm      SLURM_PROCID            SLURM_NTASKS            SLURM_LOCALID
=========  ======================  ======================  ==========================

They are tried in that order (torchrun's variables win where a job sets
several).  The rendezvous is a dfccl store (store.py) that rank 0 serves:

* ``DFCCL_ROOT_ADDR`` (``host`` or ``host:port``) names rank 0's host and the
  port; otherwise ``MASTER_ADDR`` names the host and the port is
  ``DFCCL_ROOT_PORT``, else ``MASTER_PORT + 1`` (``MASTER_PORT`` itself is
  usually taken by torch's own store).  Open MPI and Slurm set neither: give
  one of them (e.g. ``export MASTER_ADDR=$(hostname)`` on the first node).
* ``DFCCL_SECRET`` (64 hex digits) is the shared secret clients prove they
  know (``dfccl.launch`` sets a random one).  Without it the secret is
  derived from the job's id and the rendezvous address: that keeps ranks of
  other jobs out by accident, not a party on the network that can read the
  job's environment -- set DFCCL_SECRET where that matters.
* ``DFCCL_DEVICE`` overrides the device (default: the local rank, modulo
  the visible GPUs on the CUDA backend).

Rank 0 starts the store; every rank then creates the communicator through it
(communicator.py).  Each call of ``init_from_env`` in a process makes a new
communicator; every rank must call it the same number of times.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Mapping

from dfccl._deprecated import renamed_keywords
from dfccl.errors import InvalidArgumentError
from dfccl.options import CommOptions, DaemonOptions
from dfccl.store import StoreServer
from dfccl.unique_id import UniqueId

__all__ = ["JobEnvironment", "job_from_env", "init_from_env", "ROOT_ADDR_ENV", "ROOT_PORT_ENV", "SECRET_ENV",
           "DEVICE_ENV"]

ROOT_ADDR_ENV = "DFCCL_ROOT_ADDR"
ROOT_PORT_ENV = "DFCCL_ROOT_PORT"
SECRET_ENV = "DFCCL_SECRET"
DEVICE_ENV = "DFCCL_DEVICE"

# (launcher, rank, world size, local rank, job id) variable names.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_MCA_ess_base_jobid"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID"),
)


@dataclass(frozen=True)
class JobEnvironment:
    """One process's place in the job, as its launcher described it."""

    launcher: str        # "torchrun", "openmpi" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    root_host: str       # where rank 0 serves the rendezvous store
    root_port: int
    secret: bytes
    device: int | None   # DFCCL_DEVICE, else None (the local rank decides)


def _int_var(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env[name].strip()
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise InvalidArgumentError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def _rendezvous(env: Mapping[str, str], launcher: str) -> tuple[str, int]:
    root = env.get(ROOT_ADDR_ENV, "").strip()
    if root:
        host, port_text = root, None
        if root.startswith("["):                      # [v6]:port
            host, _, rest = root[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else None
        elif root.count(":") == 1:
            host, port_text = root.split(":")
        if port_text:
            try:
                port = int(port_text)
            except ValueError:
                raise InvalidArgumentError(f"{ROOT_ADDR_ENV}={root!r}: the port is not an integer") from None
        elif env.get(ROOT_PORT_ENV, "").strip():
            port = _int_var(env, ROOT_PORT_ENV, 1)
        else:
            raise InvalidArgumentError(f"{ROOT_ADDR_ENV}={root!r} names no port: write host:port or set "
                                       f"{ROOT_PORT_ENV}")
    else:
        host = env.get("MASTER_ADDR", "").strip()
        if not host:
            raise InvalidArgumentError(
                f"dfccl.init_from_env ({launcher} job): no rendezvous address; set {ROOT_ADDR_ENV}=host:port, or "
                f"MASTER_ADDR (rank 0's host) and MASTER_PORT or {ROOT_PORT_ENV}")
        if env.get(ROOT_PORT_ENV, "").strip():
            port = _int_var(env, ROOT_PORT_ENV, 1)
        elif env.get("MASTER_PORT", "").strip():
            port = _int_var(env, "MASTER_PORT", 1) + 1
        else:
            raise InvalidArgumentError(
                f"dfccl.init_from_env ({launcher} job): MASTER_ADDR is set but neither MASTER_PORT nor "
                f"{ROOT_PORT_ENV}")
    if not 1 <= port <= 65535:
        raise InvalidArgumentError(f"rendezvous port {port} is outside 1..65535")
    return host, port


def _secret(env: Mapping[str, str], job_id: str, host: str, port: int) -> bytes:
    text = env.get(SECRET_ENV, "").strip()
    if text:
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            raise InvalidArgumentError(f"{SECRET_ENV} must be hexadecimal (64 digits)") from None
        if len(secret) != 32:
            raise InvalidArgumentError(f"{SECRET_ENV} must be 32 bytes (64 hex digits), not {len(secret)}")
        return secret
    return hashlib.blake2b(f"{job_id}|{host}|{port}".encode(), digest_size=32, person=b"dfccl-job").digest()


def job_from_env(environ: Mapping[str, str] | None = None) -> JobEnvironment:
    """This process's rank, world size, local rank and the job's rendezvous,
    from the launcher's variables (see the module docstring).  Raises
    InvalidArgumentError naming what is missing or malformed."""
    env = os.environ if environ is None else environ
    for launcher, rank_var, size_var, local_var, job_var in _LAUNCHERS:
        present = [v for v in (rank_var, size_var) if env.get(v, "").strip()]
        if not present:
            continue
        if len(present) == 1:
            missing = size_var if present[0] == rank_var else rank_var
            raise InvalidArgumentError(f"dfccl.init_from_env ({launcher} job): {present[0]} is set but {missing} "
                                       "is not")
        rank = _int_var(env, rank_var, 0)
        size = _int_var(env, size_var, 1)
        if rank >= size:
            raise InvalidArgumentError(f"{rank_var}={rank} is outside 0..{size - 1} ({size_var}={size})")
        local = _int_var(env, local_var, 0) if env.get(local_var, "").strip() else None
        if local is None:
            if size > 1 and not env.get(DEVICE_ENV, "").strip():
                raise InvalidArgumentError(f"dfccl.init_from_env ({launcher} job): {local_var} is not set (it picks "
                                           f"the device; set it, or {DEVICE_ENV})")
            local = 0
        host, port = _rendezvous(env, launcher)
        device = _int_var(env, DEVICE_ENV, 0) if env.get(DEVICE_ENV, "").strip() else None
        return JobEnvironment(launcher, rank, size, local, host, port,
                              _secret(env, env.get(job_var, ""), host, port), device)
    raise InvalidArgumentError(
        "dfccl.init_from_env: no launcher variables found; set RANK and WORLD_SIZE (torchrun, python -m "
        "dfccl.launch), or run under Open MPI (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE) or Slurm (SLURM_PROCID, "
        "SLURM_NTASKS)")


# Rank 0's store servers, by (port, secret): several init_from_env calls in
# one process share one server (each gets its own uid, so its own keys).
_servers: dict[tuple[int, bytes], StoreServer] = {}
_calls = 0
_lock = threading.Lock()


def _close_servers() -> None:
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for s in servers:
        s.close()


atexit.register(_close_servers)


def _serve(job: JobEnvironment) -> None:
    with _lock:
        if (job.root_port, job.secret) in _servers:
            return
        bind = "::" if ":" in job.root_host else "0.0.0.0"
        _servers[(job.root_port, job.secret)] = StoreServer(bind, job.secret, job.root_port)


def unique_id_from_env(job: JobEnvironment) -> UniqueId:
    """The id of the next communicator of the job (rank 0 starts the store
    on first use).  The n-th call in every process names the same one."""
    global _calls
    with _lock:
        _calls += 1
        number = _calls
    if job.rank == 0:
        _serve(job)
    uid = hashlib.blake2b(job.secret + number.to_bytes(8, "big"), digest_size=16, person=b"dfccl-job-uid").digest()
    return UniqueId(job.root_host, job.root_port, job.secret, uid)


@renamed_keywords(context_options="daemon_options")
def init_from_env(*, backend: str | None = None, device: int | None = None, options: CommOptions | None = None,
                  daemon_options: DaemonOptions | None = None, timeout: float | None = None,
                  environ: Mapping[str, str] | None = None):
    """A communicator of every process of the job, this process as its rank
    (see the module docstring for the variables read).

    Args:
        backend: "cuda", "sim" or None (cuda where a GPU is visible).
        device: default DFCCL_DEVICE, else the local rank (modulo the visible
            GPUs on the CUDA backend).
        options: how the communicator moves data.
        daemon_options: how the device's daemon runs.
        timeout: start-up deadline in seconds (default
            communicator.DEFAULT_STARTUP_TIMEOUT).
        environ: the variables to read (default os.environ).

    Returns:
        The Communicator of this process's rank.
    """
    from dfccl import runtime
    from dfccl.communicator import DEFAULT_STARTUP_TIMEOUT, Communicator

    job = job_from_env(environ)
    backend = runtime.resolve_backend(backend)
    if device is None:
        device = job.device
    if device is None:
        device = job.local_rank % max(1, runtime.device_count(backend)) if backend == "cuda" else job.local_rank
    return Communicator(unique_id_from_env(job), job.rank, job.world_size, device=device, backend=backend,
                        options=options, daemon_options=daemon_options,
                        timeout=DEFAULT_STARTUP_TIMEOUT if timeout is None else timeout)
