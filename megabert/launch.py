"""Finds out how this process was launched: torchrun, the deepspeed launcher, mpirun
(Open MPI or MPICH/Hydra), SLURM's srun, or nothing at all (a single process).

Every launcher says the same three things differently (rank, world size, local rank);
only torchrun and the deepspeed launcher also give the rendezvous address, so for MPI
rank 0 publishes one over MPI itself, and for SLURM it is the first host of the step.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

from megabert.errors import ConfigError


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # "torchrun" | "deepspeed" | "openmpi" | "mpich" | "slurm" | "single"
    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """'gpu[01-03,07],login1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1'] (zero padding kept)."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(prefix + part)
    return hosts


def _int(env: Mapping[str, str], *names: str, default: Optional[int] = None) -> Optional[int]:
    for n in names:
        if n in env:
            return int(env[n])
    return default


def _port(env: Mapping[str, str]) -> Optional[int]:
    return int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None


def discover_launch(env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """Reads the launcher's environment; a process with none of it is a single process."""
    if "RANK" in env and "WORLD_SIZE" in env:
        # torchrun and the deepspeed launcher both export the torch.distributed variables;
        # the deepspeed launcher is recognised only to name it in logs.
        launcher = "deepspeed" if "DS_ACCELERATOR" in env or "CROSS_RANK" in env else "torchrun"
        return LaunchInfo(launcher, int(env["RANK"]), int(env["WORLD_SIZE"]),
                          _int(env, "LOCAL_RANK", default=0), env.get("MASTER_ADDR"), _port(env))
    if "OMPI_COMM_WORLD_RANK" in env:
        return LaunchInfo("openmpi", int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                          _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0),
                          env.get("MASTER_ADDR"), _port(env))
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return LaunchInfo("mpich", int(env["PMI_RANK"]), int(env["PMI_SIZE"]),
                          _int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK", default=0),
                          env.get("MASTER_ADDR"), _port(env))
    if "PMIX_RANK" in env and "SLURM_PROCID" not in env:
        raise ConfigError("launched by a PMIx launcher without Open MPI or SLURM variables; "
                          "use torchrun, mpirun (Open MPI or MPICH) or srun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        hosts = expand_slurm_nodelist(nodelist) if nodelist else []
        addr = env.get("MASTER_ADDR") or (hosts[0] if hosts else None)
        # One port per job, the same on every task: tasks cannot agree on a random one.
        port = _port(env) or 10000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        return LaunchInfo("slurm", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                          _int(env, "SLURM_LOCALID", default=0), addr, port)
    return LaunchInfo("single", 0, 1, 0, None, None)


def mpi_rendezvous(info: LaunchInfo, timeout):
    """Under mpirun without MASTER_ADDR/PORT, rank 0 opens the rendezvous store (on
    MASTER_PORT, else a port the OS picks while binding it: a port found free and bound
    later can be taken meanwhile) and broadcasts its address over MPI (mpi4py), so
    `mpirun -np N python pretrain_bert.py` just works. Returns (info, store)."""
    import torch.distributed as dist

    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ConfigError(f"launched by mpirun ({info.launcher}) without MASTER_ADDR/MASTER_PORT and mpi4py "
                          f"is not importable ({e}); `pip install mpi4py` or export MASTER_ADDR and MASTER_PORT")
    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.world_size:
        raise ConfigError(f"MPI reports {comm.Get_size()} processes but the launcher said {info.world_size}; "
                          f"is mpi4py built against the same MPI as mpirun?")
    endpoint = store = None
    if comm.Get_rank() == 0:
        host = socket.gethostname()
        try:
            addr = socket.gethostbyname(host)
        except OSError:
            addr = "127.0.0.1"
        addr = info.master_addr or addr
        store = dist.TCPStore(addr, info.master_port or 0, info.world_size, is_master=True, wait_for_workers=False,
                              timeout=timeout)
        endpoint = (addr, store.port)
    addr, port = comm.bcast(endpoint, root=0)
    if store is None:
        store = dist.TCPStore(addr, port, info.world_size, is_master=False, timeout=timeout)
    return LaunchInfo(info.launcher, info.rank, info.world_size, info.local_rank, addr, port), store


def rendezvous_store(info: LaunchInfo, timeout, env: Mapping[str, str] = os.environ):
    """The key-value store the process group meets in. torchrun's agent hosts one store for
    the whole job (TORCHELASTIC_USE_AGENT_STORE) and keeps it across `--max-restarts`, so
    the keys of the failed attempt (rank 0's old gloo address) would still be there and
    the restarted ranks would dial a dead process: each attempt gets its own key prefix
    (TORCHELASTIC_RESTART_COUNT). Elsewhere rank 0 hosts the store at MASTER_ADDR:PORT."""
    import torch.distributed as dist

    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                          is_master=info.rank == 0 and not agent_hosts, timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    return dist.PrefixStore(f"megabert/attempt_{attempt}", store) if attempt else store
