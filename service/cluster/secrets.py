"""Credentials in the environment (cloud keys, model-hub tokens) stay out of Ray's runtime envs, and so
out of Ray's logs.

Ray Tune puts the driver's AWS credentials into every trial's `runtime_env.env_vars`
(ray/tune/execution/class_cache.py: `ENV_VARS_TO_PROPAGATE` lists AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SECURITY_TOKEN and AWS_SESSION_TOKEN; `_ActorClassCache.get` copies those
set in `os.environ`), and Ray's runtime-env agent writes each runtime env it creates or drops, values
and all, to `<session>/logs/runtime_env_agent.log` ("Creating runtime env: ...", "Unused runtime env
...", ray/_private/runtime_env/agent/runtime_env_agent.py). Ray 2.60 has no setting that turns the copy
off, so `keep_secrets_out_of_trials` takes the secret names out of that set. A trial still has the
credentials where its node has them: the workers of a local Ray inherit the service's environment
through the raylet, without a runtime env, so nothing is written down.

Example:
    >>> is_secret("AWS_SECRET_ACCESS_KEY"), is_secret("HF_TOKEN"), is_secret("RAY_ADDRESS")
    (True, True, False)
"""

from __future__ import annotations

import re

# Names that are credentials whatever their spelling elsewhere; the pattern catches the rest.
SECRET_ENV_VARS = frozenset(
    {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SECURITY_TOKEN",
        "AWS_SESSION_TOKEN",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "WANDB_API_KEY",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_TOKEN",
        "RAY_AUTH_TOKEN",
    }
)
_SECRET_PATTERN = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY")


def is_secret(name: str) -> bool:
    """Whether an environment variable of this name holds a credential."""
    return name in SECRET_ENV_VARS or bool(_SECRET_PATTERN.search(name.upper()))


def keep_secrets_out_of_trials() -> list[str]:
    """Stops Ray Tune copying credentials into its trials' runtime envs (see the module docstring);
    returns the names it took out (none on a second call). Imports Ray Tune's small class-cache module."""
    from ray.tune.execution import class_cache

    names = getattr(class_cache, "ENV_VARS_TO_PROPAGATE", None)
    if not isinstance(names, (set, frozenset)):  # a Ray that no longer copies them this way
        return []
    removed = sorted(n for n in names if is_secret(n))
    if removed:
        class_cache.ENV_VARS_TO_PROPAGATE = {n for n in names if not is_secret(n)}
    return removed
