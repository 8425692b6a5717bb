"""`service train --weights DIR --data FILE` with a pipeline-parallel plan (issue #31): each stage of the
`PipelineModule` reads only the layers it owns from the local Hugging Face checkpoint, and the export
gathers every stage back into a checkpoint `from_pretrained` reloads.

Fast: pipeline plans pass `check_layout`; context-parallel plans and a tied embedding under a pipeline are
refused in one line naming the field. Slow: (1) two gloo processes build the pp2 pipeline from the
checkpoint: each stage holds exactly its partition's tensors, equal to the checkpoint's, and the gathered
state dict is the checkpoint, bitwise; (2) a pp2 fine-tune on 2 local CPU workers
(tests/train/local_workers.py; test_finetune.py runs a fine-tune under Ray Train) starts from the
checkpoint (its first loss is the Hugging Face model's on the same micro-batches), lowers the loss, logs
an evaluation loss equal to the exported model's on the held-out split, and exports weights that reload
with the trained pipeline's logits.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from service.cluster.ports import free_port
from service.spec import Plan
from service.spec.errors import SpecError
from service.spec.model import ModelSpec
from service.train import hf_data
from service.train.checkpoint_checks import check_layout
from service.train.production import ProductionRun
from tests.train import local_workers
from tests.train.test_finetune import MODEL, _texts, experiment_file, save_checkpoint, write_jsonl
from tests.train.test_finetune_tp import yaml_seed

PP2 = Plan(dp=1, pp=2, zero_stage=1, micro_batch=2, grad_accum=2, precision="fp32")
STEPS = 6
EVAL_EVERY = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


# --- fast ------------------------------------------------------------------------------------------


def test_pipeline_and_context_parallel_plans_load():
    untied = ModelSpec(**MODEL)
    check_layout(PP2, untied)
    check_layout(Plan(dp=1, tp=2, pp=2, zero_stage=1, micro_batch=2, grad_accum=2), untied)
    check_layout(Plan(dp=1, cp=2, zero_stage=3, micro_batch=2, grad_accum=1), untied)  # test_finetune_tp.py


def test_a_tied_embedding_is_refused_for_pipeline_plans():
    with pytest.raises(SpecError) as err:
        check_layout(PP2, ModelSpec(**MODEL, tie_word_embeddings=True))
    message = str(err.value)
    assert message.startswith("--weights: the model ties its embeddings (model.tie_word_embeddings)")
    assert "pipeline" in message and "pp=2" in message and "\n" not in message


# --- slow: the loaded pipeline on 2 gloo processes ---------------------------------------------------


TP2_PP2_SP = Plan(dp=1, tp=2, pp=2, sequence_parallel=True, zero_stage=1, micro_batch=2, precision="fp32")


def _load_worker(rank: int, world: int, port: int, folder: str, out: str, plan: Plan) -> None:
    import deepspeed
    import torch.distributed as dist

    from service.train.model import build_model
    from service.train.weights import tensor_parallel_shards
    from service.train.weights_pp import pipeline_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        pipeline, _ = build_model(ModelSpec(**MODEL), 0, plan, torch.float32, weights=folder)
        lm = pipeline.hf_model  # type: ignore[union-attr]
        held = {n: p.detach().clone() for n, p in lm.named_parameters() if not p.is_meta}
        # what this stage holds is its module's parameters, no more (the rest of the model stays meta)
        assert {id(p) for p in pipeline.parameters()} == {id(p) for p in lm.parameters() if not p.is_meta}
        split = {n: d for n, (d, _) in tensor_parallel_shards(lm).items() if n in held}
        hooked = {n for n, p in lm.named_parameters() if not p.is_meta and p._backward_hooks}
        state = pipeline_state_dict(pipeline, rank)
        mine = ([int(x) for x in pipeline.parts], held, split, hooked)
        parts: list[object] = [None] * world if rank == 0 else []
        dist.gather_object(mine, parts if rank == 0 else None, dst=0)
        if rank == 0:
            torch.save({"ranks": parts, "state": state}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("plan", [PP2, TP2_PP2_SP], ids=["pp2", "tp2-pp2-sp"])
def test_stages_hold_their_layers_of_the_checkpoint(checkpoint, tmp_path, plan):
    """Stage 0: the embedding and layer 0; stage 1: layer 1, the final norm and lm_head (the module's
    own partition of [embed, layer 0, layer 1, head]); each tensor equal to the checkpoint's (with tp2 the
    rank's `torch.chunk` of it; with sequence parallelism the norms keep their gradient sums), and the
    gathered state dict is the whole checkpoint."""
    from safetensors.torch import load_file

    out, world = tmp_path / "stages.pt", plan.num_gpus
    local_workers.start(_load_worker, (world, free_port(), str(checkpoint), str(out), plan), nprocs=world)
    got = torch.load(out)
    whole = load_file(str(checkpoint / "model.safetensors"))
    layer = {i: {k for k in whole if k.startswith(f"model.layers.{i}.")} for i in (0, 1)}
    owned = [{"model.embed_tokens.weight", *layer[0]}, {*layer[1], "model.norm.weight", "lm_head.weight"}]
    for rank, (parts, held, split, hooked) in enumerate(got["ranks"]):
        stage, tp_rank = divmod(rank, plan.tp)  # topology axes pipe, data, model (dp = 1)
        assert parts == [0, 2, 4] and set(held) == owned[stage]
        assert bool(split) == (plan.tp > 1)
        for name, tensor in held.items():
            expected = whole[name].chunk(plan.tp, split[name])[tp_rank] if name in split else whole[name]
            assert torch.equal(tensor, expected), name
        norms = {n for n in held if "norm" in n}
        assert hooked == (norms if plan.sequence_parallel else set())
    assert got["state"].keys() == whole.keys()
    assert all(torch.equal(got["state"][k], whole[k]) for k in whole)


# --- slow: pp2 fine-tuning on 2 local CPU workers -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.xdist_group("trials")  # as tests/conftest.py puts every tests/train module
def test_pp2_finetune_starts_from_the_checkpoint_and_exports_reloadable_weights(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from service.train.weights import PROBE_FILE

    data = write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in _texts()])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
        result = ProductionRun(
            experiment_file(tmp_path),
            PP2,
            steps=STEPS,
            storage_path=tmp_path / "runs",
            run_name="pp2",
            weights=checkpoint,
            data=data,
            eval_every=EVAL_EVERY,
            launch=local_workers.launch,
            max_failures=0,  # the export after the last evaluation must not need a restart to pass
        ).fit()
    assert result.status == "ok", result.reason
    assert result.restarts == 0
    print(f"losses {result.losses} eval {result.eval_losses} wall {result.wall_s:.1f}s")
    assert len(result.losses) == STEPS and result.losses[-1] < result.losses[0]
    assert sorted(result.eval_losses) == [3, 6] and result.eval_losses[6] < result.eval_losses[3]

    # The first step's loss is the checkpoint's own: the mean over its 2 micro-batches (samples 0-1, 2-3).
    run_dir = tmp_path / "runs" / "pp2"
    train, held_out = hf_data.splits(str(run_dir / "data"), seed=yaml_seed(experiment_file(tmp_path)))
    before = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        micro = [torch.stack([torch.from_numpy(train.sample(i)) for i in (j, j + 1)]) for j in (0, 2)]
        first = sum(float(hf_data.labelled_loss(before, b)) for b in micro) / len(micro)
    print(f"first step loss {result.losses[0]:.6f}, checkpoint's loss on that batch {first:.6f}")
    assert abs(result.losses[0] - first) < 1e-5  # the checkpoint's weights, not a fresh init

    exported = Path(result.hf_model_dir or "")
    assert exported == run_dir / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    probe = torch.load(exported.parent / PROBE_FILE)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
        untrained = before(input_ids=probe["input_ids"]).logits
    diff = float((logits - probe["logits"]).abs().max())
    print(f"exported-vs-trained logits max |diff| {diff:.3g}")
    assert diff < 1e-4  # the plan computes in fp32 on CPU
    assert float((untrained - logits).abs().max()) > 1e-3  # trained

    # The pipeline's last evaluation (after step 6) is the exported model's loss per target token.
    assert held_out is not None
    blocks = torch.from_numpy(np.stack([held_out.block(i) for i in range(len(held_out))]))
    with torch.no_grad():
        total = float(hf_data.labelled_loss(model, blocks, reduction="sum"))
    expected = total / float((blocks[:, 1, 1:] != hf_data.IGNORE_INDEX).sum())
    print(f"eval loss {result.eval_losses[6]:.6f}, exported model's {expected:.6f}")
    assert abs(result.eval_losses[6] - expected) < 1e-4
