"""`run_proxy`: one proxy trial end to end (check, predict, train on Ray, collect), never raising for a
failed trial; `classify_failure` turns whatever a trial died of into ok/oom/killed/invalid/failed and one
line."""

from __future__ import annotations

import functools
import json
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.spec.experiment import ExperimentSpec
from service.spec.plan import Plan
from service.spec.record import Metrics, Observation
from service.train.ds_config import deepspeed_config
from service.train.proxy_scale import predict_proxy, proxy_model, proxy_plan, proxy_plan_problem
from service.train.ray_session import ensure_ray
from service.train.worker import LOG_FILE

if TYPE_CHECKING:
    from service.train.worker import WorkerConfig

# Runs a trial's workers without Ray Train: given what every worker receives, how many there are and
# how many restarts from the latest checkpoint it may make, returns when they are done and raises what
# one died of (tests/train/local_workers.py).
Launch = Callable[["WorkerConfig", int, int], None]

__all__ = ["ProxyResult", "classify_failure", "ensure_ray", "read_log", "run_proxy"]

Status = Literal["ok", "oom", "killed", "invalid", "failed"]
SUMMARY_KEYS = (
    "tokens_per_s",
    "step_time_s",
    "model_state_bytes_per_rank",
    "activation_bytes_per_rank",
    "peak_memory_bytes_per_rank",
)

# Memory ran out, in the words of whoever ran out of it: torch's allocators (CUDA, CPU under the worker's
# RLIMIT_AS cap: "DefaultCPUAllocator: can't allocate memory" / "not enough memory"), Python's
# MemoryError, C++'s bad_alloc, the kernel's ENOMEM, or Ray's memory monitor naming its own kill.
# Not "OOM" on its own: Ray's hint for any dead worker says "(1) the process was killed by the OOM
# killer ...", true of every SIGKILL it cannot explain (see `classify_failure`).
_OOM = re.compile(
    r"OutOfMemoryError|\bMemoryError\b|(CUDA|HIP)( error)?:? out of memory|"
    r"DefaultCPUAllocator: (can't allocate memory|not enough memory)|can't allocate memory|"
    r"Cannot allocate memory|std::bad_alloc|CUBLAS_STATUS_ALLOC_FAILED|"
    r"killed due to (the node running low on memory|memory pressure)",
    re.IGNORECASE,
)
# A worker process that died without raising: killed by a signal, crashed, or its actor gone.
_KILLED = re.compile(
    r"worker process has died|The actor died unexpectedly|actor is dead|WorkerCrashedError|"
    r"ActorDiedError|Worker exit type|died unexpectedly|killed by signal|\bSIG(KILL|TERM|INT|HUP)\b|"
    r"exit(ed)? (with )?(code|status) -?(9|15|137|139)\b|health check failed",
    re.IGNORECASE,
)
# A worker that crashed on its own (a bug, possibly the plan's): `failed`, not `killed`.
_CRASHED = re.compile(r"\bSIG(SEGV|BUS|ABRT|ILL|FPE)\b|Segmentation fault|core dumped|Fatal Python error")
# Ray's guesses at why any worker died, which name the OOM killer and SIGSEGV whatever happened.
_RAY_HINT = re.compile(r"Some common causes include:[^\n]*")
_RAISED = re.compile(
    r"^[\w.]*(Error|Exception|Exit|Interrupt)\b(: |$)"
)  # "RuntimeError: ...", not "Error Snippet"
_TIMEOUT = re.compile(r"timed? ?out|timeout|deadline exceeded", re.IGNORECASE)
_INVALID = re.compile(
    r"not supported|unsupported|is not divisible|must be divisible|Check batch related", re.I
)


class ProxyResult(BaseModel):
    """What one proxy trial measured, next to what the planner predicted for it."""

    model_config = ConfigDict(extra="forbid")

    status: Status
    reason: str = ""
    losses: list[float] = Field(default_factory=list, description="Loss of every step, in order.")
    restarts: int = Field(0, description="Times Ray Train restarted the workers from a checkpoint.")
    measured: Metrics = Field(default_factory=Metrics, description="The last step's measurements.")
    predicted: Metrics = Field(default_factory=Metrics, description="The cost model's, for this proxy.")
    plan: Plan | None = Field(description="The plan run; None when the input described no valid plan.")
    precision: str = Field("", description="What the proxy computed in (a CPU proxy: proxy.precision).")
    ds_config: dict[str, Any] = Field(default_factory=dict)
    run_dir: str = ""
    device_fallback: str = Field(
        "", description="Why the workers ran on CPU/gloo although a GPU was asked for; empty if they did not."
    )
    submit_to_first_step_s: float | None = Field(None, description="From fit() to the first step's end.")
    wall_s: float = 0.0

    @classmethod
    def invalid(cls, reason: str, plan: Plan | None = None) -> ProxyResult:
        """The result of a plan that cannot run (nothing was started), with the one-line reason."""
        return cls(status="invalid", reason=reason, plan=plan)


def _one_line(text: str, pattern: re.Pattern[str] | None = None) -> str:
    """The line of `text` that says the most: the last matching `pattern`, else the last non-empty one."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        return ""
    hits = [ln for ln in lines if pattern and pattern.search(ln)]
    return (hits[-1] if hits else lines[-1])[:400]


def classify_failure(error: BaseException | str) -> tuple[str, str]:
    """("oom" | "killed" | "failed" | "invalid", one-line reason) for what a trial raised.

    Ray wraps a worker's exception in its own (the worker traceback is in the message), so the text,
    causes included, is searched, for the worker's own evidence only: `oom` needs an allocator's error
    (torch's `OutOfMemoryError` / "CUDA out of memory", "DefaultCPUAllocator: can't allocate memory"
    under the worker's memory cap, `MemoryError`) or Ray's memory monitor naming its kill; a worker
    process that died without one is `killed` (Ray's generic hint for a dead worker, "(1) the process
    was killed by the OOM killer ...", is no evidence of memory: it comes with every SIGKILL), unless it
    crashed by itself (SIGSEGV, SIGABRT: `failed`). DeepSpeed refusing a configuration is `invalid`;
    everything else (a collective timing out, an exception) is `failed`.

    Example:
        >>> classify_failure("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to "
        ...                  "allocate 8388608 bytes")[0]
        'oom'
        >>> classify_failure("The actor is dead because its worker process has died. Worker exit type: "
        ...                  "SYSTEM_ERROR Some common causes include: (1) the process was killed by the "
        ...                  "OOM killer due to high memory usage")[0]
        'killed'
    """
    parts = [str(error)]
    if isinstance(error, BaseException):
        parts.insert(0, type(error).__name__)
        cause = error.__cause__ or error.__context__
        while cause is not None and len(parts) < 10:
            parts += [type(cause).__name__, str(cause)]
            cause = cause.__cause__ or cause.__context__
    text = "\n".join(parts)
    if _OOM.search(text):
        return "oom", _one_line(text, _OOM)
    evidence = _RAY_HINT.sub("", text)
    if _CRASHED.search(evidence):
        return "failed", "crashed: " + _one_line(evidence, _CRASHED)
    if _KILLED.search(evidence):  # before timeouts: the ranks left waiting on a dead one time out too
        return "killed", _death_line(text)
    if _TIMEOUT.search(text):
        return "failed", "collective timed out: " + _one_line(text, _TIMEOUT)
    if _INVALID.search(text):
        return "invalid", _one_line(text, _INVALID)
    return "failed", _one_line(text, _RAISED)


def _death_line(text: str) -> str:
    """One line on a worker that died without raising: which (rank, pid), and Ray's exit type and
    detail, without Ray's list of possible causes."""
    rank = re.search(r"world_rank=(\d+)|\[Rank (\d+) Error", text)
    pid = re.search(r"\bpid[=:]\s*(\d+)", text)
    who = "a worker"
    if rank:
        who = f"worker rank {rank.group(1) or rank.group(2)}"
    if pid:
        who += f" (pid {pid.group(1)})"
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    detail = re.search(r"Worker exit detail: (.*?)(?:\s*Some common causes include|$)", text, re.M)
    said = "; ".join(
        part
        for part in (
            f"exit type {exit_type.group(1)}" if exit_type else "",
            detail.group(1).strip() if detail else "",
        )
        if part
    )
    said = said or _one_line(text, _KILLED)
    return f"killed: {who} died without an error of its own (no memory error reported): {said}"[:400]


def read_log(run_dir: str | Path) -> tuple[list[dict[str, Any]], int]:
    """Steps logged by rank 0 (the last record of each step: a resumed run repeats steps) and restarts."""
    path = Path(run_dir) / LOG_FILE
    if not path.exists():
        return [], 0
    records = [r for r in map(_record, path.read_text().splitlines()) if r is not None]
    starts = sum(r["event"] == "start" for r in records)
    steps: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["event"] == "step":
            steps[int(r["step"])] = r
    return [steps[k] for k in sorted(steps)], max(starts - 1, 0)


def _record(line: str) -> dict[str, Any] | None:
    """One step-log line as its record. A worker killed mid-write leaves a partial line, and the restarted
    worker's first record lands on the end of it: that record is kept, the partial one dropped."""
    try:
        return dict(json.loads(line)) if line.strip() else None
    except json.JSONDecodeError:
        at = line.rfind('{"event"')
        if at > 0:
            return _record(line[at:])
        return None


def _safe_name(plan: Plan) -> str:
    return "proxy-" + re.sub(r"[^A-Za-z0-9_.-]", "_", plan.short()) + time.strftime("-%Y%m%d-%H%M%S")


def run_proxy(
    experiment: ExperimentSpec,
    plan: Plan,
    *,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    inject_failure_at_step: int | None = None,
    storage_path: str | None = None,
    run_name: str | None = None,
    max_failures: int | None = None,
    stall: dict[str, float] | None = None,
    launch: Launch | None = None,
) -> ProxyResult:
    """Runs `plan` at proxy scale on Ray and returns what it measured; never raises for a failed trial.

    With `inject_failure_at_step` the trial gets one restart (`max_failures` defaults to 1 then, else
    0) and a checkpoint every step unless `checkpoint_every` says otherwise. A MoE proxy's prediction is
    priced at the load its experts measured (`predict_proxy`'s `moe_load`). `launch` runs the same
    workers some other way than Ray Train (the tests' local processes).
    """
    from service.train.trainer import ray_trainer, trial_config

    started = time.time()
    base = ProxyResult.invalid("", plan)
    problem = proxy_plan_problem(experiment, plan)
    if problem:
        return ProxyResult.invalid(problem, plan)
    ds_config = deepspeed_config(proxy_plan(experiment, plan), experiment.proxy, proxy_model(experiment))
    try:
        predicted = predict_proxy(experiment, plan)
    except Exception as err:  # the measurement still has value without the model's side
        predicted = Metrics()
        base = base.model_copy(update={"reason": f"no prediction: {type(err).__name__}: {err}"})
    if inject_failure_at_step is not None:
        checkpoint_every = 1 if checkpoint_every is None else checkpoint_every
        max_failures = 1 if max_failures is None else max_failures
    storage_path = storage_path or tempfile.mkdtemp(prefix="proxy-runs-")
    run_name = run_name or _safe_name(plan)
    config = trial_config(
        experiment,
        plan,
        run_dir=Path(storage_path) / run_name,
        steps=steps,
        checkpoint_every=checkpoint_every,
        inject_failure_at_step=inject_failure_at_step,
        stall=stall,
    )
    fit: Callable[[], Any]
    if launch is None:
        ensure_ray(num_cpus=max(2, plan.num_gpus))
        trainer = ray_trainer(
            experiment,
            config,
            plan.num_gpus,
            run_name=run_name,
            storage_path=storage_path,
            max_failures=max_failures or 0,
        )
        fit = trainer.fit
    else:
        fit = functools.partial(launch, config, plan.num_gpus, max_failures or 0)
    status, reason = "ok", base.reason
    fit_start = time.time()
    try:
        fit()
    except Exception as err:  # a failed trial is a result, not an exception (Ray wraps the worker's)
        status, reason = classify_failure(err)
    result = _result_from_log(Path(storage_path) / run_name, fit_start)
    if predicted and result.measured.moe_load is not None:  # like for like: at the load the experts ran
        predicted = predict_proxy(experiment, plan, result.measured.moe_load)
    return result.model_copy(
        update={
            "status": status,
            "reason": reason,
            "predicted": predicted or result.predicted,
            "plan": plan,
            "precision": proxy_plan(experiment, plan).precision,
            "ds_config": ds_config,
            "wall_s": time.time() - started,
        }
    )


def _result_from_log(run_dir: Path, fit_start: float) -> ProxyResult:
    """Losses, restarts and the last step's measurements, from rank 0's step log."""
    records, restarts = read_log(run_dir)
    last = records[-1].get("metrics", {}) if records else {}
    observed = Observation.from_report(last)  # the one place a step report's names are read
    return ProxyResult(
        status="ok",
        plan=None,
        losses=[float(r["loss"]) for r in records],
        restarts=restarts,
        measured=observed.measured,
        predicted=observed.predicted,
        run_dir=str(run_dir),
        device_fallback=str(last.get("device_fallback", "")),
        submit_to_first_step_s=(records[0]["time"] - fit_start) if records else None,
    )
