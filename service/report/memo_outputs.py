"""The memo's Outputs section: the DeepSpeed config, the launch command (the real fine-tune and the
first-hour preflight), your own training script's command and what it must build, the MLflow run."""

from __future__ import annotations

from service.report.render import Block
from service.report.result import RunResult


def own_script_note(r: RunResult) -> str:
    """What a training script must do for the shipped config to hold: DeepSpeed checks train_batch_size
    against micro-batch × accumulation × its data-parallel size, which is the world size unless the
    script passes an `mpu` (tensor-parallel groups) or a PipelineModule."""
    plan = r.selected_plan
    if plan is None:
        return ""
    tp, pp, cp, dp = plan.tp, plan.pp, plan.cp, plan.dp
    if tp == pp == cp == 1:
        return ""
    parts = [f"{tp}-way tensor-parallel layers and passes their `mpu`"] if tp > 1 else []
    parts += [f"a {pp}-stage `PipelineModule`"] if pp > 1 else []
    parts += [f"{cp}-way Ulysses attention"] if cp > 1 else []
    return (
        f" (train.py builds {' and '.join(parts)} to deepspeed.initialize: the config's train_batch_size "
        f"counts dp = {dp} ranks, not all {dp * tp * pp * cp})"
    )


def outputs(r: RunResult) -> list[Block]:
    blocks: list[Block] = [("h2", "Outputs")]
    launch = f"launch: `{r.launch_command}`"
    if r.launch_command and "service train" in r.launch_command and r.experts is not None:
        launch += (
            " — it trains this plan from random initialisation on the experiment's `proxy.data` tokens, to "
            "prove the layout, memory and speed (`SMOKE_TEST=1` in `launch.sh`); this service's trainer "
            "loads no mixture-of-experts checkpoint, so the training run itself is your own script's"
        )
    elif r.launch_command and "service train" in r.launch_command:
        launch += (
            " — with `--weights DIR --data FILES` it fine-tunes your own Hugging Face checkpoint on your "
            "data (JSON lines, Parquet or Arrow; a model with tied embeddings needs tp and pp 1), "
            "with an evaluation split and the trained weights exported in Hugging Face format; without "
            "them it trains this plan from random initialisation on the experiment's `proxy.data` tokens, "
            "to prove the layout, memory and speed. `launch.sh` submits it with `WEIGHTS=... DATA=...` set, "
            "or `SMOKE_TEST=1` for a 20-step proof, and refuses with neither. "
            "It checkpoints at Young's interval and after the last step"
        )
    items = [f"DeepSpeed config (full scale): {r.ds_config_path}", launch]
    if r.launch_command and " service train " in r.launch_command:
        preflight = r.launch_command.replace(" service train ", " service preflight ")
        items.append(
            f"first hour: `{preflight}` on the cluster measures the collectives the plan uses, times a "
            "few steps and a checkpoint save and load, and says GO or NO-GO against the thresholds it "
            "prints first (the interval's low end, the memory limit, the assumed bandwidth and storage "
            "rate); what it measured is a runs file `calibrate` reads"
            + (
                "; `--compare tie` also runs the tie group's best plan on paper for the same steps: the A/B "
                "the Ties section names, whose numbers join the runs file"
                if r.ties is not None and len(r.ties.members) > 1
                else ""
            )
        )
    if r.deepspeed_command and r.deepspeed_command != r.launch_command:
        items.append(f"or with your own training script: `{r.deepspeed_command}`" + own_script_note(r))
    if r.mlflow_run_id:
        items.append(f"MLflow parent run {r.mlflow_run_id} ({r.tracking_uri}); proxy trials are its children")
    blocks.append(("ul", [i for i in items if "None" not in i]))
    return blocks
