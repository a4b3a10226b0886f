"""Who this process is inside a Slurm allocation, from Slurm's environment.

``hostname`` is not enough: several Slurm nodes may share a host (and do in
the tests), so the node name comes from ``SLURMD_NODENAME``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


@dataclass(frozen=True)
class SlurmIdentity:
    """This task's place in Slurm: job, array task, node, CPUs and GPUs it was given."""

    job_id: str | None = None  # this task's own job id (each array task has one)
    array_job_id: str | None = None
    array_task_id: int | None = None
    node_name: str | None = None
    cpus: int | None = None
    gpus: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES, as Slurm set it
    restart_count: int = 0  # how often this job was requeued
    #: This task's rank in its ``srun`` step and the step's task count (both None outside a step).
    step_rank: int | None = None
    step_tasks: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmIdentity:
        env = os.environ if env is None else env
        gpus = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        return cls(
            job_id=env.get("SLURM_JOB_ID") or None,
            array_job_id=env.get("SLURM_ARRAY_JOB_ID") or None,
            array_task_id=_int(env.get("SLURM_ARRAY_TASK_ID")),
            node_name=env.get("SLURMD_NODENAME") or None,
            cpus=_int(env.get("SLURM_CPUS_PER_TASK")),
            gpus=gpus,
            restart_count=_int(env.get("SLURM_RESTART_COUNT")) or 0,
            # SLURM_STEP_NUM_TASKS is set in an srun step only (the batch script sees SLURM_NTASKS alone).
            step_rank=_int(env.get("SLURM_PROCID")) if env.get("SLURM_STEP_NUM_TASKS") else None,
            step_tasks=_int(env.get("SLURM_STEP_NUM_TASKS")),
        )

    @property
    def in_slurm(self) -> bool:
        return self.job_id is not None

    @property
    def task_ref(self) -> str | None:
        """How squeue and scancel name this task (``123_4`` for an array task, else ``123``)."""
        if self.array_job_id is not None and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def member_id(self, role: str, index: int | None = None) -> str:
        """A stable name for a node or backend: the same after a requeue, so it rejoins as itself.

        ``<role>-<array task id>``, else ``<role>-<job id>``; in an ``srun`` step of several tasks
        (``srun -n 4 prorl serve node``) each task adds its rank (``node-123.2``): tasks sharing one
        name would take it from each other at every registration.
        """
        if index is None:
            index = self.array_task_id
        if index is not None:
            name = f"{role}-{index}"
        else:
            name = f"{role}-{self.job_id}" if self.job_id else f"{role}-{os.getpid()}"
        if self.step_tasks is not None and self.step_tasks > 1 and self.step_rank is not None:
            name += f".{self.step_rank}"
        return name

    def describe(self) -> str:
        parts = [f"job {self.task_ref}"]
        if self.node_name:
            parts.append(f"on {self.node_name}")
        if self.cpus:
            parts.append(f"{self.cpus} CPUs")
        if self.gpus:
            parts.append(f"GPUs {','.join(self.gpus)}")
        if self.restart_count:
            parts.append(f"restart {self.restart_count}")
        return ", ".join(parts)


def child_env() -> dict[str, str]:
    """This environment without the broker job's Slurm variables (sbatch would take them for the new job's)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SUBMITIT_"))}
