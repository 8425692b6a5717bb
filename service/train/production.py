"""`ProductionRun`: the chosen plan at full scale, with the proxies' worker, on the cluster's storage.

Shaped like Ray's trainers: construct, `fit()`, get a `ProductionResult`. Full scale is the
experiment's own model and cluster: every layer, every GPU (`cluster.num_nodes × gpus_per_node`),
the plan as the planner selected it (or one picked by label). Ray Train runs the same
`train_loop_per_worker` as the proxies; it checkpoints after the last step and every `checkpoint_every`
steps (default: Young's interval, as the memo's goodput section computes it) to
`storage_path` (the cluster's shared storage: `SERVICE_STORAGE_PATH`) and, after a node or worker
loss, restarts from the latest checkpoint up to `max_failures` times (Ray Train's `FailureConfig`),
the data loader included, so the loss trajectory continues exactly. The driver (this process, never
a worker) follows rank 0's step log on that storage, logs each step to MLflow and shows one line of
progress.

By default the model starts from random initialisation on the proxy section's data. With `weights` (a
local Hugging Face checkpoint folder) it fine-tunes that checkpoint instead (service/train/weights.py:
plans with cp = 1: ZeRO 0-3, partitioned at load under ZeRO-3; tp and pp ranks read their own slices),
on `data` (local JSON-lines, Parquet or Arrow files, tokenised with the checkpoint's tokenizer and packed by
the driver before the workers start:
service/train/hf_data.py), with an evaluation loss every `eval_every` steps and at the end, and writes the
trained weights in Hugging Face format to `<storage>/<run_name>/hf_model/` (logged to MLflow as an
artifact when small). The MLflow run's `init` tag says which: `random` or the checkpoint folder.

Example:
    >>> result = ProductionRun("experiments/tiny-cpu.yaml", steps=20).fit()  # doctest: +SKIP
    >>> result.status, result.losses[-1], result.mlflow_run_id                 # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.spec.errors import SpecError
from service.spec.experiment import ExperimentSpec, load_experiment
from service.spec.params import ModelParams
from service.spec.plan import Plan
from service.train.production_follow import ProductionMlflowRun, StepFollower, step_numbers

if TYPE_CHECKING:
    from service.train.proxy_trial import Launch
    from service.train.weights import FineTune

STORAGE_ENV = "SERVICE_STORAGE_PATH"


def full_scale(experiment: ExperimentSpec) -> ExperimentSpec:
    """The experiment with its `proxy` section set to the production run itself: every layer, every GPU,
    the workload's sequence length and the model's vocabulary (a proxy's shorter ones would be measured,
    checked for memory and recorded as the production run's)."""
    cluster, model = experiment.cluster, experiment.model
    update: dict[str, Any] = {
        "num_layers": model.num_layers,
        "num_workers": cluster.num_nodes * cluster.gpus_per_node,
        "device": "cpu" if cluster.gpu.name == "cpu" else "cuda",
        "seq_len": None,
        "vocab_size": None,
    }
    if "hidden_scale" in type(experiment.proxy).model_fields:
        update["hidden_scale"] = 1
    return experiment.model_copy(update={"proxy": experiment.proxy.model_copy(update=update)})


def trainer_problem(experiment: ExperimentSpec, plan: Plan) -> str | None:
    """Why this service's trainer cannot run `plan` of `experiment` at full scale (None when it can):
    its MoE model is DeepSpeed's MoE layer on Llama blocks, without tensor-parallel layers around it or
    Ulysses attention beside it (service/train/proxy_scale.py `_moe_proxy_problem`)."""
    from service.train.proxy_scale import _moe_proxy_problem

    if experiment.model.moe is None:
        return None
    problem = _moe_proxy_problem(plan)
    return (
        f"this service's trainer runs no such layout ({problem}); train it with your own script"
        if problem
        else None
    )


def choose_plan(experiment: ExperimentSpec, label: str = "selected", params: Any = None) -> Plan:
    """The planner's selected plan under `params` (None: the shipped set), or the valid plan whose label
    (`Plan.short()`) is `label`."""
    from service.planner import Planner

    result = Planner(experiment, top_k=0 if label == "selected" else 1_000_000, params=params).fit()
    if label == "selected":
        if result.selected is None:
            raise SpecError("--plan", f"no plan meets the budget ({result.message}); pick one by label")
        return result.selected.plan
    for ranked in result.ranked:
        if ranked.plan.short() == label:
            return ranked.plan
    raise SpecError("--plan", f"{label!r} is not a valid plan of {experiment.name} (see `service plan`)")


@dataclass
class ProductionResult:
    plan: Plan
    status: str  # ok, or failed (with reason)
    reason: str
    steps: int
    losses: list[float]
    restarts: int
    run_dir: str
    mlflow_run_id: str | None
    wall_s: float
    last_metrics: dict[str, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)  # step → evaluation loss (fine-tuning)
    hf_model_dir: str | None = None  # the trained weights in Hugging Face format (fine-tuning)


class ProductionRun:
    """Runs `plan` (default: the planner's selection) for the experiment at full scale.

    Args:
        experiment: `ExperimentSpec` or a path to its YAML.
        plan: "selected" or a plan label such as `dp2-tp1-pp1-z1-mb2-ga1-rc:none`, or a `Plan`.
        steps: optimizer steps (default: the workload's tokens ÷ tokens per step).
        storage_path: checkpoints and the step log (default: $SERVICE_STORAGE_PATH, else
            `<repo>/ray_results/production`); the same storage_path and run_name resume a run.
        run_name: default `<experiment>-<plan>`.
        checkpoint_every: steps between checkpoints (default: the proxy section's, else Young's interval
            over the predicted step time); the last step is always saved (the trained weights).
        max_failures: restarts from the latest checkpoint after a lost worker or node.
        track: log to MLflow from the driver.
        progress: one progress line on stderr.
        inject_failure_at_step: test hook: kill one worker once at this step.
        weights: a local Hugging Face checkpoint folder to fine-tune (default: random initialisation);
            its config must match the experiment's model; plans with cp = 1 only.
        data: with `weights`, local JSON-lines / Parquet / Arrow file(s) (a path, glob, folder or
            comma-separated list) with a `text_field` or prompt/completion pairs (default: proxy.data).
        text_field: the field holding the text (when the data has no prompt/completion pairs).
        eval_fraction: share of the packed sequences held out for evaluation.
        eval_every: steps between evaluations (default: at the end only).
        launch: runs the workers some other way than Ray Train, given their `WorkerConfig`, the worker
            count and the restarts allowed (the tests' local processes; `run_proxy` takes the same).
    """

    def __init__(
        self,
        experiment: ExperimentSpec | str | Path,
        plan: str | Plan = "selected",
        *,
        steps: int | None = None,
        storage_path: str | Path | None = None,
        run_name: str | None = None,
        checkpoint_every: int | None = None,
        max_failures: int = 3,
        track: bool = True,
        progress: bool = False,
        inject_failure_at_step: int | None = None,
        weights: str | Path | None = None,
        data: str | None = None,
        text_field: str = "text",
        eval_fraction: float = 0.05,
        eval_every: int | None = None,
        launch: Launch | None = None,
        params: ModelParams | None = None,
    ):

        spec = experiment if isinstance(experiment, ExperimentSpec) else load_experiment(experiment)
        if spec.workload.fused_cross_entropy:  # its memory was priced without the logits this worker keeps
            raise SpecError(
                "workload.fused_cross_entropy",
                "this service's trainer computes the loss from materialised logits; train with your own "
                "script and its fused loss (launch.sh), or set it false",
            )
        self.experiment = full_scale(spec)
        self.params = params
        self.plan = plan if isinstance(plan, Plan) else choose_plan(spec, plan, params)
        problem = trainer_problem(spec, self.plan)
        if problem:
            raise SpecError("--plan", f"{self.plan.short()}: {problem}")
        if steps is not None and steps <= 0:
            raise SpecError("--steps", f"must be positive, got {steps}")
        self.steps = steps or self._workload_steps()
        self.storage_path = Path(storage_path or self._default_storage() / "production").resolve()
        self.run_name = run_name or f"{spec.name}-{self.plan.short().replace(':', '_')}"
        self.checkpoint_every = (
            checkpoint_every or self.experiment.proxy.checkpoint_every or self._young_daly_steps()
        )
        self.max_failures, self.track, self.progress = max_failures, track, progress
        self.inject_failure_at_step = inject_failure_at_step
        self.weights = str(Path(weights).resolve()) if weights is not None else None
        self.data, self.text_field = data, text_field
        self.eval_fraction, self.eval_every = eval_fraction, eval_every or 0
        self.launch = launch
        self._rows = self._check_finetune()

    @property
    def ds_settings(self) -> dict[str, Any]:
        """The production DeepSpeed settings (learning rate and schedule over this run's steps, overlap):
        the same the written ds_config.json holds (train.ds_config.production_settings)."""
        from service.train.ds_config import production_settings

        return production_settings(self.experiment, self.steps)

    def predicted(self) -> dict[str, float]:
        """The cost model's numbers for this run on the experiment's own cluster, under `params` (the ones
        the preflight's thresholds come from), as the worker reports them beside its measurements. A
        proxy's prediction prices one node of proxy workers (service/train/proxy_scale.py)."""
        from service.costmodel import estimate
        from service.spec.record import PREDICTED
        from service.train.proxy_scale import PREDICTED_QUANTITIES, per_rank_metrics

        e = self.experiment
        try:
            est = estimate(e.model, e.cluster, self.plan, e.workload, e.budget.memory_headroom, self.params)
        except SpecError:  # a plan the cost model cannot price still runs; its prediction is NaN
            return {PREDICTED + q: math.nan for q in PREDICTED_QUANTITIES}
        return per_rank_metrics(est).prefixed(PREDICTED)

    def _check_finetune(self) -> Any:
        """Refuses, in one line and before anything is written, what a fine-tuning run cannot do; returns
        the data's rows (read once here, tokenised and packed by `fit`)."""
        from service.train import checkpoint_checks, hf_data
        from service.train.proxy_scale import proxy_model, proxy_seq_len

        if self.weights is None:
            for flag, value in (("--data", self.data), ("--eval-every", self.eval_every or None)):
                if value is not None:
                    raise SpecError(flag, "needs --weights (the checkpoint to fine-tune, with its tokenizer)")
            return None
        checkpoint_checks.check_layout(self.plan, proxy_model(self.experiment))
        checkpoint_checks.check_checkpoint(
            self.weights, proxy_model(self.experiment), proxy_seq_len(self.experiment)
        )
        if self.eval_every < 0:
            raise SpecError("--eval-every", f"must be positive, got {self.eval_every}")
        if not 0 <= self.eval_fraction < 1:
            raise SpecError("--eval-fraction", f"must be in [0, 1), got {self.eval_fraction}")
        if self.eval_every and not self.eval_fraction:  # nothing held out: no evaluation would run
            raise SpecError("--eval-every", "needs --eval-fraction above 0 (the share held out to evaluate)")
        if self.data is None:
            return None
        return hf_data.load_rows(self.data, self.text_field)

    def _finetune_config(self, run_dir: Path) -> FineTune | None:
        """The workers' `finetune` section: the checkpoint, the packed data (written here, once, before
        the workers start: the same data and seed give the same files, so a resumed run reads what the
        interrupted one did) and where the trained weights go."""
        from service.train import hf_data
        from service.train.proxy_scale import proxy_model, proxy_seq_len
        from service.train.run_identity import check_identity, run_identity
        from service.train.weights import EXPORT_DIR, FineTune

        if self.weights is None:
            check_identity(run_dir, {"plan": self.plan.short(), "init": "random"})
            return None
        data_dir, packed = None, None
        if self.data is not None:
            packed = hf_data.prepare(
                self.data,
                self.weights,
                seq_len=proxy_seq_len(self.experiment),
                seed=self.experiment.proxy.seed,
                eval_fraction=self.eval_fraction,
                vocab_size=proxy_model(self.experiment).vocab_size,
                text_field=self.text_field,
                rows=self._rows,
            )
        identity = {"plan": self.plan.short(), "init": self.weights, **run_identity(self.weights, packed)}
        check_identity(run_dir, identity)
        if packed is not None:
            data_dir = str(hf_data.write(packed, run_dir / "data"))
        return FineTune(
            weights=self.weights,
            data_dir=data_dir,
            eval_every=self.eval_every,
            export_dir=str(run_dir / EXPORT_DIR),
        )

    def _young_daly_steps(self) -> int:
        """Steps between checkpoints when none is asked for: Young's interval (the memo's goodput
        section, service/design/goodput.py) over the cost model's step time for this plan, at most the run's
        length (then the run saves only after its last step, which every production run does)."""
        from service.costmodel.estimate import estimate
        from service.spec.production import checkpoint_bytes

        spec = self.experiment
        try:
            step_s = estimate(spec.model, spec.cluster, self.plan, spec.workload).step_time_s
        except SpecError:  # a plan the cost model cannot price: keep a checkpoint every step
            return 1
        ckpt = checkpoint_bytes(spec.model, self.plan.precision)
        hours = spec.goodput.young_daly_hours(self.plan.num_gpus, ckpt)
        return max(1, min(self.steps, int(hours * 3600.0 // max(step_s, 1e-9))))

    @staticmethod
    def _default_storage() -> Path:
        from service.cluster.storage import folder_root
        from service.tracking.uri import repo_root

        return folder_root(repo_root() / "ray_results", "train")

    def _workload_steps(self) -> int:
        return max(1, int(self.experiment.workload.steps_to_train))  # as the shipped config's schedule

    def fit(self) -> ProductionResult:
        from service.train.ray_session import ensure_ray

        if self.launch is not None:
            return self._fit()
        own_ray = ensure_ray(num_cpus=self.plan.num_gpus + 1)  # + the Train controller's
        try:
            if own_ray:
                self._check_local_gpus()
            return self._fit()
        finally:
            if own_ray:
                import ray

                ray.shutdown()

    def _check_local_gpus(self) -> None:
        """A Ray started here has this machine's GPUs and no autoscaler: a run needing more would wait
        for them forever, so it is refused in one line. (On a cluster, RAY_ADDRESS, the autoscaler may
        still add the nodes, and Ray Train waits for them.)"""
        import ray

        if self.experiment.proxy.device != "cuda":
            return
        have = int(ray.cluster_resources().get("GPU", 0))
        if have < self.plan.num_gpus:
            raise SpecError(
                "plan",
                f"{self.plan.short()} needs {self.plan.num_gpus} GPUs and the local Ray started here has "
                f"{have}: run it on a cluster (python -m service submit -- python -m service train ...)",
            )

    def _fit(self) -> ProductionResult:
        from service.train.proxy_trial import classify_failure, read_log
        from service.train.trainer import ray_trainer, trial_config
        from service.train.weights import EXPORT_DIR

        started = time.monotonic()
        run_dir = self.storage_path / self.run_name
        self.storage_path.mkdir(parents=True, exist_ok=True)
        finetune = self._finetune_config(run_dir)
        tags = {"init": self.weights or "random", **({"data": self.data} if self.data else {})}
        tracker = ProductionMlflowRun(self.experiment, self.plan, self.run_name, tags) if self.track else None
        config = trial_config(
            self.experiment,
            self.plan,
            run_dir=run_dir,
            steps=self.steps,
            checkpoint_every=self.checkpoint_every,
            inject_failure_at_step=self.inject_failure_at_step,
            save_final=True,
            predicted=self.predicted(),
        ).model_copy(update={"finetune": finetune, "ds_settings": self.ds_settings})
        if self.launch is None:
            fit = ray_trainer(
                self.experiment,
                config,
                self.plan.num_gpus,
                run_name=self.run_name,
                storage_path=str(self.storage_path),
                max_failures=self.max_failures,
                proxy=False,
            ).fit
        else:
            fit = functools.partial(self.launch, config, self.plan.num_gpus, self.max_failures)
        status, reason = "ok", ""
        with StepFollower(run_dir, self.steps, tracker, sys.stderr if self.progress else None):
            try:
                fit()
            except Exception as err:  # Ray wraps the worker's error; report it in one line
                status, reason = classify_failure(err)
        records, restarts = read_log(run_dir)
        hf_model = run_dir / EXPORT_DIR if finetune is not None and status == "ok" else None
        if hf_model is not None and not (hf_model / "config.json").is_file():
            status, reason, hf_model = "failed", f"the workers wrote no trained weights to {hf_model}", None
        if tracker is not None:
            if hf_model is not None:
                tracker.log_model(hf_model)
            tracker.finish(status)
        numbers = [(int(r["step"]), step_numbers(r)) for r in records]
        evals = {step: n["eval_loss"] for step, n in numbers if "eval_loss" in n}
        return ProductionResult(
            plan=self.plan,
            status=status,
            reason=reason,
            steps=int(records[-1]["step"]) if records else 0,
            losses=[float(r["loss"]) for r in records],
            restarts=restarts,
            run_dir=str(run_dir),
            mlflow_run_id=tracker.run_id if tracker else None,
            wall_s=time.monotonic() - started,
            last_metrics=step_numbers(records[-1]) if records else {},
            eval_losses=evals,
            hf_model_dir=str(hf_model) if hf_model is not None else None,
        )
