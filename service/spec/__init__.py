"""Strict, validated specs shared by every part of the service."""

from service.spec.errors import SpecError
from service.spec.experiment import ExperimentSpec, load_experiment
from service.spec.hardware import ClusterSpec, GPUSpec
from service.spec.model import ModelSpec
from service.spec.plan import Plan
from service.spec.plan_checks import check_plan, plan_problem
from service.spec.proxy import ProxySpec
from service.spec.tracking import TrackingSpec
from service.spec.workload import Budget, Workload

__all__ = [
    "Budget",
    "ClusterSpec",
    "ExperimentSpec",
    "GPUSpec",
    "ModelSpec",
    "Plan",
    "ProxySpec",
    "SpecError",
    "TrackingSpec",
    "Workload",
    "check_plan",
    "load_experiment",
    "plan_problem",
]
