"""Running the service on a Ray cluster: job submission, cluster capacity, storage, ports.

Imports ray and spec; imported by the CLI, and `storage` (where outputs go) by every driver.
"""
