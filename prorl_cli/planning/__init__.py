"""Capacity planning (``prorl plan``): what a cluster shape delivers for a workload, on a simulated clock.

:mod:`~prorl_cli.planning.workload` reads the workload (a results file or a
sim_agent-style description), :mod:`~prorl_cli.planning.simulator` runs it on
simulated backends (the sim engine's GPU model), :mod:`~prorl_cli.planning.plan`
sweeps the jobs in flight and recommends one. docs/training.md, "Planning capacity".
"""

from prorl_cli.planning.plan import RULE, RULE_NO_SIGNAL, Plan, Prediction, make_plan, recommend
from prorl_cli.planning.simulator import ClusterShape, SimResult, simulate
from prorl_cli.planning.workload import Call, PlanError, RolloutShape, Workload

__all__ = [
    "RULE", "RULE_NO_SIGNAL", "Call", "ClusterShape", "Plan", "PlanError", "Prediction", "RolloutShape", "SimResult", "Workload",
    "make_plan", "recommend", "simulate",
]
