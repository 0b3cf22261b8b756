"""``kvtier plan``: capacity planning from the cost model, for this machine or on paper.

For a model (``shapes``), a machine (``hardware``: a ``kvtier calibrate`` profile, or a
GPU preset with or without a CXL tier) and a workload (``workload``), ``predict`` gives the
decode step time of each placement strategy with each resource's busy time (the binding
one is the barrel's short stave), a reused prompt's TTFT from a lower tier (load,
recompute, or both overlapped), and the most sessions a per-token SLO allows with how
their KV splits across device and host memory. ``report`` renders it and draws the
figures. The step model is the runtime's own (``kvtier.runtime.cost``); ``kvtier bench
plan`` checks it against steps kvtier runs here.
"""

from kvtier.plan.hardware import PRESETS, Hardware, from_profile, hardware
from kvtier.plan.predict import STRATEGIES, Step, decode_step, max_sessions, reuse_ttft
from kvtier.plan.report import main, plan, plot, render
from kvtier.plan.shapes import ModelShape, model_shape
from kvtier.plan.workload import Workload, workload

__all__ = [
    "PRESETS",
    "STRATEGIES",
    "Hardware",
    "ModelShape",
    "Step",
    "Workload",
    "decode_step",
    "from_profile",
    "hardware",
    "main",
    "max_sessions",
    "model_shape",
    "plan",
    "plot",
    "render",
    "reuse_ttft",
    "workload",
]
