"""Schedules as data: actions, plan generators, lowering, validation and simulation.

Nothing here imports torch.distributed: a plan can be built, checked and timed in any process.
"""

from .action import Action, Kind, Plan, format_plan
from .generate import forward_only, gpipe, one_f_one_b
from .interleaved import interleaved
from .lower import lower, stage_owners
from .registry import NAMES, build
from .replay import PlanError
from .show import grid, parse_plan, timeline_png, timeline_svg
from .simulate import Costs, Simulation, simulate
from .two_bw import two_bw
from .validate import validate
from .zero_bubble import zero_bubble

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
    "grid",
    "interleaved",
    "lower",
    "one_f_one_b",
    "parse_plan",
    "simulate",
    "stage_owners",
    "timeline_png",
    "timeline_svg",
    "two_bw",
    "validate",
    "zero_bubble",
]
