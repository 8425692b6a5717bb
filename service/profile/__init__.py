"""Operator profile of this machine's device: matmul, attention, bandwidth, per-op overhead and Adam,
timed over a model's shapes and turned into the GPU catalog's speed fields.

    >>> from service.profile import load_profile
    >>> load_profile("benchmarks/results/cpu_profile.yaml").gpu_overrides()  # doctest: +SKIP
    {'peak_tflops_fp32': ..., 'gemm_efficiency_max': ..., ...}

`run_profile` imports torch when called, never at import.
"""

from service.profile.catalog import catalog_entry_yaml, write_catalog_entry
from service.profile.profiler import ProfileConfig, default_config, run_profile
from service.profile.record import Profile, load_profile

__all__ = [
    "Profile",
    "ProfileConfig",
    "catalog_entry_yaml",
    "default_config",
    "load_profile",
    "run_profile",
    "write_catalog_entry",
]
