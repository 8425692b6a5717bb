"""Running the service on a Ray cluster: job submission, the MLflow server on the head, cluster capacity.

Imports ray and tracking; imported by the CLI, and `storage` (where outputs go) by every driver.
"""
