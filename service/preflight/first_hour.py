"""`Preflight`: the first hour on the cluster, before the money is spent.

1. Thresholds are fixed first (service/preflight/verdict.py) from the plan's own estimate, the cost
   model's bus bandwidths and the goodput model's storage bandwidth (or given).
2. `ProductionRun` runs the chosen plan for a few steps at full scale, exactly as `service train` would
   (its worker, its step log, its final checkpoint on the cluster's storage): tokens/s, step time and
   the busiest rank's peak memory are read from rank 0's step log.
3. A second Ray Train job on the same workers (service/preflight/probe.py) times the collectives the
   plan uses, inside a node and across nodes, and a checkpoint load (the production run's) and save.
4. With `compare` (the memo's near-tie: "tie", or a plan label), the other plan runs the same steps
   on the same workers: an A/B that says which of the two the cluster runs faster. It informs, it does
   not vote: the verdict is the chosen plan's.
5. The verdict: `GO`, or `NO-GO: <reasons>`; what was measured is written as measured runs
   (`preflight_run.yaml`, the runs format `calibrate` reads: the chosen plan, and the A/B's other plan)
   and as `preflight.json` in the output folder.

Example:
    >>> result = Preflight("experiments/tiny-cpu.yaml", steps=5).fit()  # doctest: +SKIP
    >>> result.verdict, result.runs_file                                 # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, TextIO

from service.preflight import collectives as coll
from service.preflight.ab import ab_summary, other_plan
from service.preflight.probe import PROBE_FILE, probe_loop_per_worker
from service.preflight.record import runs_document, write_runs_file
from service.preflight.result import MIB, PreflightResult, finite, main_line
from service.preflight.verdict import Thresholds, default_thresholds, failures, verdict_line, with_overrides
from service.spec.errors import SpecError
from service.spec.experiment import ExperimentSpec, load_experiment
from service.spec.params import ModelParams, load_params
from service.spec.plan import Plan
from service.spec.strict_json import non_finite_replaced
from service.spec.units import GIB

RESULT_FILE = "preflight.json"
__all__ = ["RESULT_FILE", "Preflight", "PreflightResult", "main_line"]


def _latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint folder Ray Train persisted for the run (one with rank 0's worker state)."""
    found = [p.parent for p in run_dir.glob("checkpoint_*/worker_rank0.pt")]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


class Preflight:
    """Preflight of `plan` (default: the planner's selection) for the experiment on its cluster.

    Args:
        experiment: `ExperimentSpec` or a path to its YAML.
        plan: "selected", a plan label (`service plan` prints them) or a `Plan`.
        steps: optimizer steps of the production run (default: the proxy's warm-up steps + 3 timed).
        out_dir: where `preflight_run.yaml` and `preflight.json` go (default
            `<repo>/ray_results/preflight/<experiment>`).
        storage_path: the cluster's shared storage for the run's checkpoints and step log (default:
            the production run's, $SERVICE_STORAGE_PATH else `<repo>/ray_results/production`).
        params: parameter set (path or `ModelParams`) for the estimate and the bus efficiencies
            (default: the shipped set).
        overrides: threshold values replacing the defaults (`Thresholds` field names).
        message_mib: collective buffer size (default 8 MiB on CPU, 256 MiB on GPU: bandwidth-bound).
        repeats: timed calls per collective (after 3 warm-up calls).
        compare: the A/B's other plan: "tie" (the best plan on paper among the others in the choice's
            tie group, `PlanResult.tie_partner`), a plan label or a `Plan`; None: no A/B.
        track: log the production run to MLflow.
        keep_checkpoints: keep the run's checkpoint on the storage (default: removed once timed).
        log: where the thresholds and progress are written (None: nowhere).
    """

    def __init__(
        self,
        experiment: ExperimentSpec | str | Path,
        plan: str | Plan = "selected",
        *,
        steps: int | None = None,
        out_dir: str | Path | None = None,
        storage_path: str | Path | None = None,
        params: ModelParams | str | Path | None = None,
        overrides: dict[str, float | None] | None = None,
        message_mib: float | None = None,
        repeats: int | None = None,
        compare: str | Plan | None = None,
        track: bool = True,
        keep_checkpoints: bool = False,
        log: TextIO | None = None,
    ):
        from service.cluster.storage import results_root
        from service.tracking.uri import repo_root
        from service.train.production import ProductionRun

        spec = experiment if isinstance(experiment, ExperimentSpec) else load_experiment(experiment)
        warmup = spec.proxy.warmup_steps
        if steps is not None and steps <= warmup:  # the worker would time its warm-up steps instead
            raise SpecError(
                "--steps", f"must exceed the {warmup} warm-up steps (proxy.warmup_steps), got {steps}"
            )
        if message_mib is not None and not (math.isfinite(message_mib) and message_mib > 0):
            raise SpecError("--message-mib", f"must be a positive number, got {message_mib}")
        self.params = params if isinstance(params, ModelParams) else load_params(params)
        self.steps = steps or spec.proxy.warmup_steps + 3
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        # the plan (chosen under `params`, as `plan --params` chooses it) and the full-scale spec
        probe = ProductionRun(spec, plan, steps=self.steps, track=False, params=self.params)
        self.plan, self.experiment = probe.plan, probe.experiment
        label = self.plan.short().replace(":", "_")
        self.run_name = f"preflight-{spec.name}-{label}-{self.stamp}"
        self.production = ProductionRun(
            spec,
            self.plan,
            steps=self.steps,
            storage_path=storage_path,
            run_name=self.run_name,
            checkpoint_every=self.steps,  # only the final checkpoint (the one the probe loads)
            max_failures=0,
            track=track,
            progress=log is not None,
            params=self.params,
        )
        self.storage_path = self.production.storage_path
        self.compare: ProductionRun | None = None
        other = other_plan(spec, compare, self.plan, self.params)
        if other is not None:
            self.compare = ProductionRun(
                spec,
                other,
                steps=self.steps,
                storage_path=storage_path,
                run_name=f"{self.run_name}-ab",
                checkpoint_every=self.steps,
                max_failures=0,
                track=track,
                progress=log is not None,
                params=self.params,
            )
        results = results_root(repo_root() / "ray_results")
        self.out_dir = Path(out_dir or results / "preflight" / spec.name).resolve()
        try:  # before the first hour is spent, not after: the verdict must have somewhere to go
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SpecError("--out", f"{self.out_dir}: {err.strerror or err}") from None
        self.thresholds: Thresholds = with_overrides(
            default_thresholds(self.experiment, self.plan, self.params), **(overrides or {})
        )
        cuda = self.experiment.proxy.device == "cuda"
        self.message_bytes = int((message_mib or (256.0 if cuda else 8.0)) * MIB)
        self.repeats = repeats or (20 if cuda else 10)
        self.log, self.keep_checkpoints = log, keep_checkpoints

    def _say(self, text: str) -> None:
        if self.log is not None:
            self.log.write(text + "\n")
            self.log.flush()

    def stated_thresholds(self) -> str:
        t = self.thresholds
        parts = [
            f"tokens/s >= {t.min_tokens_per_s:,.0f}" if t.min_tokens_per_s is not None else "tokens/s: off",
            f"peak memory <= {t.max_memory_bytes / GIB:.2f} GiB" if t.max_memory_bytes else "memory: off",
            f"bus bandwidth >= {t.min_bandwidth_fraction:g} × assumed"
            if t.min_bandwidth_fraction is not None
            else "bandwidth: off",
            f"checkpoint write >= {t.min_storage_gb_per_s:.3g} GB/s"
            if t.min_storage_gb_per_s is not None
            else "checkpoint: off",
        ]
        return f"preflight {self.plan.short()}: thresholds (stated before measuring): " + ", ".join(parts)

    def fit(self) -> PreflightResult:
        from service.train.ray_session import ensure_ray

        started = time.monotonic()
        self._say(self.stated_thresholds())
        own_ray = ensure_ray(num_cpus=self.plan.num_gpus + 1)  # + the Train controller's
        try:
            check = getattr(self.production, "_check_local_gpus", None)  # refuses a run a local Ray
            if own_ray and check is not None:  # lacks GPUs for, rather than waiting forever
                check()
            production = self.production.fit()
            probe = self._probe(Path(production.run_dir))
            other = None
            if self.compare is not None:
                self._say(f"A/B: {self.compare.plan.short()} for the same {self.steps} steps")
                other = self.compare.fit()
            if not self.keep_checkpoints:  # at full scale a checkpoint is the model state: TBs
                for run in filter(None, (production, other)):
                    for folder in Path(run.run_dir).glob("checkpoint_*"):
                        shutil.rmtree(folder, ignore_errors=True)
        finally:
            if own_ray:
                import ray

                ray.shutdown()
        return self._result(production, probe, time.monotonic() - started, other)

    def _probe(self, run_dir: Path) -> dict[str, Any]:
        """Runs the collectives and checkpoint job; its JSON answer, or {"error": ...}."""
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from service.train.proxy_trial import classify_failure
        from service.train.trainer import device_aware_torch_config, worker_config

        self._say("preflight: timing collectives and a checkpoint on the workers")
        out = run_dir / PROBE_FILE
        ckpt = _latest_checkpoint(run_dir)
        worker = worker_config(self.experiment, self.plan, run_dir=str(run_dir), steps=self.steps)
        worker = worker.model_copy(update={"ds_settings": self.production.ds_settings})
        config = {
            "worker": worker.model_dump(mode="json"),
            "ops": [op for op, _ in coll.plan_collectives(self.plan)],
            "message_bytes": self.message_bytes,
            "repeats": self.repeats,
            "load_from": str(ckpt) if ckpt else None,
            "save_to": str(run_dir / "preflight-checkpoint"),
            "out": str(out),
        }
        proxy = self.experiment.proxy
        use_gpu = proxy.device == "cuda"
        timeout_s = max(1, math.ceil(proxy.collective_timeout_s))
        trainer = TorchTrainer(
            probe_loop_per_worker,
            train_loop_config=config,
            torch_config=device_aware_torch_config(timeout_s)
            if use_gpu
            else TorchConfig("gloo", timeout_s=timeout_s),
            scaling_config=ScalingConfig(
                num_workers=self.plan.num_gpus, use_gpu=use_gpu, resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(
                name=f"{self.run_name}-probe",
                storage_path=str(self.storage_path),
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        try:
            trainer.fit()
        except Exception as err:  # Ray wraps the worker's error
            return {"error": classify_failure(err)[1]}
        if not out.exists():
            return {"error": "the probe wrote no result"}
        return dict(json.loads(out.read_text()))

    def _collective_rows(self, probe: dict[str, Any]) -> list[dict[str, Any]]:
        why = dict(coll.plan_collectives(self.plan))
        rows = []
        for scope, ops in probe.get("collectives", {}).get("scopes", {}).items():
            for op, m in ops.items():
                n = int(m["group_size"])
                assumed = coll.assumed_bus_bandwidth_bytes_per_s(
                    scope, n, self.experiment.cluster, self.params
                )
                rows.append(
                    {
                        "op": op,
                        "scope": scope,
                        "why": why.get(op, ""),
                        "group_size": n,
                        "groups": int(m["groups"]),
                        "message_bytes": int(m["message_bytes"]),
                        "seconds": m["seconds"],
                        "alg_gb_per_s": m["alg_gb_per_s"],
                        "bus_gb_per_s": m["bus_gb_per_s"],
                        "assumed_bus_gb_per_s": assumed / 1e9,
                        "ratio": m["bus_gb_per_s"] / (assumed / 1e9) if assumed > 0 else None,
                    }
                )
        return rows

    def _checkpoint_row(self, probe: dict[str, Any]) -> dict[str, Any]:
        from service.spec.production import checkpoint_bytes

        c = dict(probe.get("checkpoint", {}))
        if "error" in probe and not c:
            c["error"] = f"probe failed: {probe['error']}"
        spec = self.experiment
        assumed_gb_s = float(spec.goodput.bandwidth_gb_per_s(self.plan.num_gpus))
        model_bytes = checkpoint_bytes(spec.model, self.plan.precision)
        c["assumed_storage_gb_per_s"] = assumed_gb_s
        c["goodput_checkpoint_bytes"] = model_bytes
        c["goodput_write_s"] = model_bytes / (assumed_gb_s * 1e9)
        if c.get("bytes") and c.get("save_s"):
            c["write_gb_per_s"] = c["bytes"] / c["save_s"] / 1e9
            c["projected_write_s"] = model_bytes / (c["write_gb_per_s"] * 1e9)  # the goodput model's bytes
        if c.get("bytes") and c.get("load_s"):
            c["read_gb_per_s"] = c["bytes"] / c["load_s"] / 1e9
        return c

    def _result(
        self, production: Any, probe: dict[str, Any], wall_s: float, other: Any = None
    ) -> PreflightResult:
        from service.train.proxy_scale import proxy_plan
        from service.train.proxy_trial import read_log

        m = production.last_metrics
        records, _ = read_log(production.run_dir)
        by_rank = next((r["detail"].get("memory_by_rank") for r in records if "detail" in r), None)
        prod = {
            "status": production.status,
            "reason": production.reason,
            "steps": production.steps,
            "tokens_per_s": finite(m.get("tokens_per_s")),
            "step_time_s": finite(m.get("step_time_s")),
            "peak_memory_bytes": finite(m.get("measured_peak_memory_bytes_per_rank")),
            "peak_memory_bytes_by_rank": [row[-1] for row in by_rank] if by_rank else [],
            "model_state_bytes": finite(m.get("measured_model_state_bytes_per_rank")),
            "predicted_tokens_per_s": finite(m.get("predicted_tokens_per_s")),
            "final_loss": production.losses[-1] if production.losses else None,  # checked by `failures`
            "run_dir": production.run_dir,
            "mlflow_run_id": production.mlflow_run_id,
            "wall_s": production.wall_s,
        }
        rows = self._collective_rows(probe)
        ckpt = self._checkpoint_row(probe)
        measured: dict[str, Any] = {
            "tokens_per_s": prod["tokens_per_s"],
            "peak_memory_bytes": prod["peak_memory_bytes"],
            "collectives": rows,
            "storage_gb_per_s": ckpt.get("write_gb_per_s"),
            "checkpoint_error": ckpt.get("error"),
            "final_loss": prod["final_loss"],
        }
        notes: list[str] = []
        if production.status != "ok":
            measured["error"] = production.reason or production.status
        elif prod["tokens_per_s"] is None:
            measured["error"] = "the production run logged no tokens/s"
        if "error" in probe and not rows:
            measured["error"] = "; ".join(filter(None, [measured.get("error"), f"probe: {probe['error']}"]))
        if probe.get("fallback"):
            notes.append(str(probe["fallback"]))
        reasons = failures(self.thresholds, measured)
        runs_file = None
        ab = ab_summary(production, other) if other is not None else None
        # Only a run that finished every step is a measurement calibrate may fit on: a failed one's last
        # tokens/s is whatever its last step logged before the failure.
        if prod["tokens_per_s"] and self._completed(production):
            ran = proxy_plan(self.experiment, self.plan).precision
            when = time.strftime("%Y-%m-%d %H:%M:%S")
            try:
                document = runs_document(
                    self.experiment,
                    self.plan,
                    ran,
                    prod["tokens_per_s"],
                    run_id=self.run_name,
                    when=when,
                    notes=f"{production.steps} steps, step time {prod['step_time_s']:.4g} s; "
                    f"verdict {verdict_line(reasons)}",
                )
                if ab is not None and ab["other_tokens_per_s"] and self._completed(other):
                    document["measurements"] += runs_document(
                        self.experiment,
                        other.plan,
                        proxy_plan(self.experiment, other.plan).precision,
                        ab["other_tokens_per_s"],
                        run_id=f"{self.run_name}-ab",
                        when=when,
                        notes=f"{other.steps} steps, the A/B beside {self.plan.short()}",
                    )["measurements"]
                runs_file = str(write_runs_file(document, self.out_dir))
            except (SpecError, OSError) as err:  # the verdict is still written and printed
                notes.append(f"no runs file: {err}")
        result = PreflightResult(
            experiment=self.experiment.name,
            plan=self.plan.short(),
            verdict=verdict_line(reasons),
            reasons=reasons,
            thresholds=self.thresholds.model_dump(),
            production=prod,
            collectives=rows,
            checkpoint=ckpt,
            out_dir=str(self.out_dir),
            runs_file=runs_file,
            ab=ab,
            wall_s=wall_s,
            notes=notes,
        )
        summary = non_finite_replaced(result.summary(), lambda _: None)  # strict JSON, as --json prints
        (self.out_dir / RESULT_FILE).write_text(json.dumps(summary, indent=2))
        return result

    def _completed(self, run: Any) -> bool:
        """Whether `run` finished every step it was asked for."""
        return bool(run.status == "ok" and run.steps >= self.steps)
