"""Calibration: fit the cost model's named parameters on measured runs, score the fit out of sample
(leave-one-source-out), and derive the prediction intervals every estimate carries."""

from service.calibrate.fit import Calibration, fit, predict_activations, predict_runs
from service.calibrate.runs import MeasuredRun, load_dataset, load_runs

__all__ = [
    "Calibration",
    "MeasuredRun",
    "fit",
    "load_dataset",
    "load_runs",
    "predict_activations",
    "predict_runs",
]
