"""The analytical cost model: memory per GPU, step time, tokens/s, MFU and cost of a plan.

One small function per term (memory.py, flops.py, compute.py, comm.py), each citing its source;
estimate.py assembles them, vectorised over plans.
"""

from service.costmodel.estimate import estimate, estimate_table
from service.costmodel.result import Estimate, EstimateTable, MemoryBreakdown, TimeBreakdown

__all__ = ["Estimate", "EstimateTable", "MemoryBreakdown", "TimeBreakdown", "estimate", "estimate_table"]
