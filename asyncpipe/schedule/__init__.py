"""Schedules as data: actions, plan generators, lowering, validation and simulation.

Nothing here imports torch.distributed: a plan can be built, checked and timed in any process.
"""

from .action import Action, Kind, Plan, format_plan
from .generate import forward_only, gpipe, one_f_one_b
from .lower import lower, stage_owners
from .registry import NAMES, build
from .replay import PlanError
from .simulate import Costs, Simulation, simulate
from .validate import validate

__all__ = [
    "NAMES",
    "Action",
    "Costs",
    "Kind",
    "Plan",
    "PlanError",
    "Simulation",
    "build",
    "forward_only",
    "format_plan",
    "gpipe",
    "lower",
    "one_f_one_b",
    "simulate",
    "stage_owners",
    "validate",
]
