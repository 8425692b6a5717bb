"""Units the whole package shares, defined once."""

GIB = 2**30  # bytes in a GiB (memory per GPU, HBM, limits)
