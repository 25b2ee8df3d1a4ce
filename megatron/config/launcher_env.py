"""Rank, world size and rendezvous address from SLURM or OpenMPI when no launcher set them.

torchrun and the DeepSpeed launcher export, for every process they start,

    RANK  WORLD_SIZE  LOCAL_RANK  LOCAL_WORLD_SIZE  MASTER_ADDR  MASTER_PORT

and `tds.device.init_distributed` / `megatron.config.resolution.resolve_args` read those. `srun python
pretrain_gpt2.py ...` (one task per GPU) and `mpirun python pretrain_gpt2.py ...` start the processes
themselves and export their own names instead. `fill_launcher_env` maps them, once, at the start of an entry
point (`megatron.training.pretrain.run`), so the resolution and torch.distributed agree:

    source    rank            world size     local rank       local world size                 master address
    SLURM     SLURM_PROCID    SLURM_NTASKS   SLURM_LOCALID    SLURM_NTASKS_PER_NODE, or the    first host of
                                                              node's SLURM_TASKS_PER_NODE      SLURM_JOB_NODELIST
    OpenMPI   OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE                         (SLURM's, if in a job)

Precedence: the launcher's own variables (RANK and WORLD_SIZE both set: torchrun inside an sbatch script)
win and nothing changes; then OpenMPI (mpirun inside a SLURM job also inherits the batch shell's SLURM_*);
then a SLURM job step (srun: SLURM_STEP_ID set). Only absent variables are filled, so an exported
MASTER_ADDR or MASTER_PORT wins. MASTER_PORT defaults to 10000 + SLURM_JOB_ID mod 20000 (below Linux's
ephemeral ports; two steps of one job that run at the same time need their own MASTER_PORT), else 29500.

Torch-free: the preflight and `megatron.config` import no torch.
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping, MutableMapping, Optional, Tuple

from megatron.errors import UserError
from megatron.logging_utils import print_line

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_PORT = 29500


def expand_hostlist(hostlist: str) -> List[str]:
    """SLURM's compressed host list, expanded: 'node[01-03,07],gpu5' -> node01 node02 node03 node07 gpu5.

    Ranges keep their zero padding; several bracket groups in one name multiply ('r[1-2]n[1-2]' -> r1n1 r1n2
    r2n1 r2n2), as `scontrol show hostnames` does."""
    hosts: List[str] = []
    for name in _split_top_level(hostlist):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            if not literal and not ranges:
                continue
            expanded = [prefix + literal for prefix in expanded]
            if ranges:
                expanded = [prefix + item for prefix in expanded for item in _expand_ranges(ranges, hostlist)]
        hosts.extend(expanded)
    return hosts


def _split_top_level(hostlist: str) -> List[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(hostlist[start:i])
            start = i + 1
    parts.append(hostlist[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(ranges: str, hostlist: str) -> List[str]:
    items = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise UserError(f"SLURM host list {hostlist!r}: cannot read the range {part!r}")
        width = len(lo)
        items.extend(str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1))
    return items


def tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """The task count of node `node_index` in SLURM_TASKS_PER_NODE's form: '4(x2),2' -> 4, 4, 2."""
    counts: List[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise UserError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r}: cannot read {part!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_index, len(counts) - 1)]


def _slurm_port(env: Mapping[str, str]) -> str:
    job = env.get("SLURM_JOB_ID", "")
    return str(10000 + int(job) % 20000) if job.isdigit() else str(DEFAULT_PORT)


def _slurm_master(env: Mapping[str, str]) -> Optional[str]:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    return expand_hostlist(nodelist)[0] if nodelist else None


def from_slurm(env: Mapping[str, str]) -> Dict[str, str]:
    """The launcher's variables for a task of a SLURM job step (srun)."""
    local_size = env.get("SLURM_NTASKS_PER_NODE")
    if local_size is None:
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or env["SLURM_NTASKS"]
        local_size = str(tasks_on_node(per_node, int(env.get("SLURM_NODEID", "0"))))
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "LOCAL_WORLD_SIZE": local_size,
            "MASTER_ADDR": _slurm_master(env) or "127.0.0.1", "MASTER_PORT": _slurm_port(env)}


def from_openmpi(env: Mapping[str, str]) -> Dict[str, str]:
    """The launcher's variables for a process started by OpenMPI's mpirun. Across nodes the master address
    is the SLURM job's first host, or must be exported (mpirun -x MASTER_ADDR=<the host of rank 0>)."""
    size, local_size = env["OMPI_COMM_WORLD_SIZE"], env.get("OMPI_COMM_WORLD_LOCAL_SIZE", env["OMPI_COMM_WORLD_SIZE"])
    master = _slurm_master(env) if "SLURM_JOB_ID" in env else None
    if master is None and "MASTER_ADDR" not in env:
        if int(local_size) < int(size):
            raise UserError(f"mpirun started {size} processes over several nodes ({local_size} on this one) but "
                            f"MASTER_ADDR is not set: export it, e.g. mpirun -x MASTER_ADDR=<host of rank 0> "
                            f"-x MASTER_PORT=29500 ...")
        master = "127.0.0.1"
    out = {"RANK": env["OMPI_COMM_WORLD_RANK"], "WORLD_SIZE": size,
           "LOCAL_RANK": env.get("OMPI_COMM_WORLD_LOCAL_RANK", env["OMPI_COMM_WORLD_RANK"]),
           "LOCAL_WORLD_SIZE": local_size,
           "MASTER_PORT": _slurm_port(env) if "SLURM_JOB_ID" in env else str(DEFAULT_PORT)}
    if master is not None:
        out["MASTER_ADDR"] = master
    return out


def launcher_env(env: Mapping[str, str]) -> Tuple[str, Dict[str, str]]:
    """(source, the variables to set where absent): source is 'launcher', 'OpenMPI', 'SLURM' or 'none'."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return "launcher", {}
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return "OpenMPI", from_openmpi(env)
    # a task of a job step; the batch shell of an sbatch script has SLURM_PROCID=0 but no step id
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        return "SLURM", from_slurm(env)
    return "none", {}


def fill_launcher_env(environ: MutableMapping[str, str], announce: bool = True) -> str:
    """Set the launcher's variables that `environ` lacks from SLURM's or OpenMPI's; returns the source.
    With `announce`, rank 0 prints one line naming it."""
    source, values = launcher_env(environ)
    for key, value in values.items():
        environ.setdefault(key, value)
    if announce and environ.get("RANK", "0") == "0":
        print_line(describe(source, environ))
    return source


def describe(source: str, env: Mapping[str, str]) -> str:
    """The start-up line: where the rank came from, the world size and the rendezvous."""
    where = {"launcher": "the launcher's RANK/WORLD_SIZE (torchrun, deepspeed)",
             "OpenMPI": "OpenMPI's OMPI_COMM_WORLD_*", "SLURM": "SLURM's SLURM_PROCID/SLURM_NTASKS (srun)",
             "none": "no launcher or scheduler variables"}[source]
    if source == "none" and "WORLD_SIZE" not in env:
        return f"ranks: from {where}: a single process"
    return (f"ranks: from {where}: world size {env.get('WORLD_SIZE', '1')}, "
            f"{env.get('LOCAL_WORLD_SIZE', '?')} per node, rendezvous {env.get('MASTER_ADDR', '127.0.0.1')}:"
            f"{env.get('MASTER_PORT', DEFAULT_PORT)}")
