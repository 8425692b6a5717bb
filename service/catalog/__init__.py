"""Model and GPU catalogs: one YAML file per item under `models/` and `gpus/` (engine rules under
`engines/`, cost-model parameter sets under `params/`, published runs scored outside the fit under
`checks/`, read by service/calibrate/nearest.py). The loaders are spec's (`service/spec/entries.py`)."""

from service.spec.entries import gpu_names, load_gpu, load_model, model_names

__all__ = ["gpu_names", "load_gpu", "load_model", "model_names"]
