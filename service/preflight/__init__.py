"""`service preflight`: before the long run, measure the plan on its cluster and decide go / no-go.

- `run.Preflight`: a few steps of the chosen plan (`ProductionRun`), the collectives it uses and a
  checkpoint save and load, measured on the cluster's workers; the verdict and a measured run.
- `verdict`: the thresholds, stated before measuring, and the one-line verdict.
- `collectives`: which collectives a plan uses, bus bandwidth (nccl-tests' definition) and the cost
  model's assumed figure.
- `record`: the measured run in the runs format `calibrate` reads.
- `ab`: the first-hour A/B (`--compare`): the other plan, and which of the two ran faster.
- `result`: `PreflightResult` and its human summary.
"""

from __future__ import annotations

from service.preflight.verdict import Thresholds, default_thresholds, failures, verdict_line

__all__ = ["Thresholds", "default_thresholds", "failures", "verdict_line"]
