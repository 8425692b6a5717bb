"""`Num`: what the per-term formulas take: a numpy array (one element per plan) or a plain number."""

from typing import TypeAlias

import numpy as np

Num: TypeAlias = np.ndarray | float
