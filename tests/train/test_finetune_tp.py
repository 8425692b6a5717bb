"""`service train --weights DIR --data FILE` with tensor- and context-parallel plans (issue #31): each
rank loads its slices of the local Hugging Face checkpoint into the service's TP layers (with cp, the
whole model, partitioned at load under ZeRO-3), and the export gathers them back into a checkpoint
`from_pretrained` reloads.

Fast: the lazy slice reader gives `torch.chunk`'s pieces. Two gloo processes build (1) the tp2
sequence-parallel stack from the checkpoint: its logits are the Hugging Face model's and the gathered
state dict is the checkpoint, bitwise; (2) the cp2 (Ulysses) stack: the same, and its ranks' labelled
losses make the whole sequence's. Slow: a tp2 and a cp2 ZeRO-3 fine-tune (`ProductionRun`) on 2 CPU
workers start from the checkpoint (the first loss is the Hugging Face model's on the same batch), lower
the loss, log the evaluation loss, and export weights that reload with the trained model's logits. Their
workers are local processes (tests/train/local_workers.py): what is tested is what the layout loads,
trains and exports; the same run under Ray Train, restart included, is test_finetune.py's ZeRO-3 one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from service.cluster.ports import free_port
from service.spec import Plan
from service.train import hf_data
from service.train.production import ProductionRun
from tests.train import local_workers
from tests.train.test_finetune import (
    MODEL,
    _texts,
    experiment_file,
    save_checkpoint,
    write_jsonl,
)

TP2 = Plan(dp=1, tp=2, zero_stage=1, micro_batch=4, grad_accum=1, precision="fp32")
CP2_Z3 = Plan(dp=1, cp=2, zero_stage=3, micro_batch=4, grad_accum=1, precision="fp32")
STEPS = 6
EVAL_EVERY = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


# --- fast ------------------------------------------------------------------------------------------


def test_a_tied_embedding_is_refused_for_tensor_parallel_plans():
    from service.spec.errors import SpecError
    from service.spec.model import ModelSpec
    from service.train.checkpoint_checks import check_layout

    untied, tied = ModelSpec(**MODEL), ModelSpec(**MODEL, tie_word_embeddings=True)
    with pytest.raises(SpecError) as err:
        check_layout(TP2, tied)
    assert str(err.value).startswith("--weights: the model ties its embeddings (model.tie_word_embeddings)")
    check_layout(TP2, untied)  # untied: loads
    check_layout(TP2.model_copy(update={"tp": 1, "dp": 2}), tied)  # tp = 1: loads


def test_the_slice_reader_gives_torch_chunks(checkpoint):
    from safetensors.torch import load_file

    from service.train.weights import CheckpointReader

    whole = load_file(str(checkpoint / "model.safetensors"))
    reader = CheckpointReader(checkpoint)
    name = "model.layers.0.self_attn.k_proj.weight"
    for dim in (0, 1):
        for rank in (0, 1):
            got = reader.read(name, torch.float32, dim, rank, 2)
            assert torch.equal(got, whole[name].chunk(2, dim=dim)[rank])
    assert torch.equal(reader.read("model.norm.weight", torch.float32), whole["model.norm.weight"])


# --- slow: the loaded stack on 2 gloo processes ----------------------------------------------------


def _load_worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    import deepspeed
    import torch.distributed as dist

    from service.spec.model import ModelSpec
    from service.train.model import build_model
    from service.train.weights import tensor_parallel_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        plan = Plan(dp=1, tp=world, sequence_parallel=True, zero_stage=1, micro_batch=2, precision="fp32")
        stack, _ = build_model(ModelSpec(**MODEL), 0, plan, torch.float32, weights=folder)
        q = stack.hf_model.model.layers[0].self_attn.q_proj.weight  # type: ignore[union-attr]
        assert q.shape == (32, 64) and getattr(q, "tensor_model_parallel", False)
        torch.manual_seed(1)
        ids = torch.randint(0, MODEL["vocab_size"], (2, 16))  # type: ignore[call-overload]
        with torch.no_grad():
            logits = stack(ids)
        state = tensor_parallel_state_dict(stack.hf_model, rank)  # type: ignore[arg-type]
        if rank == 0:
            torch.save({"ids": ids, "logits": logits, "state": state}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def _cp_worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    import deepspeed
    import torch.distributed as dist

    from service.spec.model import ModelSpec
    from service.train.model import build_model
    from service.train.weights import gathered_state_dict, probe_logits

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        plan = Plan(dp=1, cp=world, zero_stage=1, micro_batch=2, grad_accum=1, precision="fp32")
        stack, _ = build_model(ModelSpec(**MODEL), 0, plan, torch.float32, weights=folder)
        torch.manual_seed(1)
        ids = torch.randint(0, MODEL["vocab_size"], (2, 16))  # type: ignore[call-overload]
        labels = ids.clone()
        labels[0, :5] = hf_data.IGNORE_INDEX  # a prompt: no loss on its tokens
        labels[1, 9:12] = hf_data.IGNORE_INDEX  # masked positions inside the second rank's chunk
        batch = torch.stack([ids, labels], dim=1)
        with torch.no_grad():
            mean = hf_data.labelled_loss(stack, batch)
            total = hf_data.labelled_loss(stack, batch, reduction="sum")
        shares = torch.tensor(
            [float(mean), float(total), hf_data.target_count(stack, batch)], dtype=torch.float64
        )
        dist.all_reduce(shares)
        logits = probe_logits(stack, ids)
        state = gathered_state_dict(stack.hf_model, rank)  # type: ignore[arg-type]
        if rank == 0:
            torch.save({"batch": batch, "shares": shares, "logits": logits, "state": state}, out)
    finally:
        dist.destroy_process_group()


def test_cp2_stack_holds_the_checkpoint_and_splits_the_labelled_loss(checkpoint, tmp_path):
    """cp2 (Ulysses): each rank holds the whole checkpoint; the gathered logits are the Hugging Face
    model's; the ranks' labelled losses average to the whole sequence's, with masked targets falling
    in either chunk, and their sums and target counts add up to the whole sequence's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "cp2.pt"
    local_workers.start(_cp_worker, (2, free_port(), str(checkpoint), str(out)), nprocs=2)
    got = torch.load(out)
    whole = load_file(str(checkpoint / "model.safetensors"))
    assert got["state"].keys() == whole.keys() and all(torch.equal(got["state"][k], whole[k]) for k in whole)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    batch = got["batch"]
    with torch.no_grad():
        expected = model(input_ids=batch[:, 0]).logits
        mean = float(hf_data.labelled_loss(model, batch))
        total = float(hf_data.labelled_loss(model, batch, reduction="sum"))
    torch.testing.assert_close(got["logits"], expected, atol=1e-5, rtol=1e-5)
    mean_of_ranks, sum_of_ranks, targets = got["shares"].tolist()
    assert targets == hf_data.target_count(model, batch) == 2 * 15 - 4 - 3  # position 0 is no target
    assert abs(mean_of_ranks / 2 - mean) < 1e-5 and abs(sum_of_ranks - total) < 1e-4


def test_tp2_stack_holds_the_checkpoint_slices(checkpoint, tmp_path):
    """tp2 with sequence parallelism: logits equal the Hugging Face model's, and gathering the slices
    gives back every tensor of the checkpoint exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tp2.pt"
    local_workers.start(_load_worker, (2, free_port(), str(checkpoint), str(out)), nprocs=2)
    got = torch.load(out)
    whole = load_file(str(checkpoint / "model.safetensors"))
    assert got["state"].keys() == whole.keys()
    assert all(torch.equal(got["state"][k], whole[k]) for k in whole)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids=got["ids"]).logits
    torch.testing.assert_close(got["logits"], expected, atol=1e-5, rtol=1e-5)


# --- slow: tp2 and cp2 fine-tuning on 2 local CPU workers -----------------------------------------


@pytest.mark.slow
@pytest.mark.xdist_group("trials")  # as tests/conftest.py puts every tests/train module
@pytest.mark.parametrize("plan", [TP2, CP2_Z3], ids=["tp2", "cp2-z3"])
def test_finetune_starts_from_the_checkpoint_and_exports_reloadable_weights(checkpoint, tmp_path, plan):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from service.train.weights import PROBE_FILE

    data = write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in _texts()])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
        result = ProductionRun(
            experiment_file(tmp_path),
            plan,
            steps=STEPS,
            storage_path=tmp_path / "runs",
            run_name="ft",
            weights=checkpoint,
            data=data,
            eval_every=EVAL_EVERY,
            launch=local_workers.launch,
        ).fit()
    assert result.status == "ok", result.reason
    print(f"losses {result.losses} eval {result.eval_losses} wall {result.wall_s:.1f}s")
    assert len(result.losses) == STEPS and result.losses[-1] < result.losses[0]
    assert sorted(result.eval_losses) == [3, 6] and result.eval_losses[6] < result.eval_losses[3]

    # The first step's loss is the checkpoint's own on the first micro-batch (dp = 1: samples 0..3).
    run_dir = tmp_path / "runs" / "ft"
    train, _ = hf_data.splits(str(run_dir / "data"), seed=yaml_seed(experiment_file(tmp_path)))
    batch = torch.stack([torch.from_numpy(train.sample(i)) for i in range(plan.micro_batch)])
    before = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        first = float(hf_data.labelled_loss(before, batch))
    print(f"first step loss {result.losses[0]:.6f}, checkpoint's loss on that batch {first:.6f}")
    assert abs(result.losses[0] - first) < 1e-5  # the checkpoint's weights, not a fresh init

    exported = Path(result.hf_model_dir or "")
    assert exported == run_dir / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)  # whole again
    assert len(AutoTokenizer.from_pretrained(exported)) == len(AutoTokenizer.from_pretrained(checkpoint))
    probe = torch.load(exported.parent / PROBE_FILE)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
        untrained = before(input_ids=probe["input_ids"]).logits
    diff = float((logits - probe["logits"]).abs().max())
    print(f"exported-vs-trained logits max |diff| {diff:.3g}")
    assert diff < 1e-4  # the plan computes in fp32 on CPU
    assert float((untrained - logits).abs().max()) > 1e-3  # trained


def yaml_seed(path: Path) -> int:
    """The experiment's proxy seed (what the packed data's order is drawn with)."""
    from service.spec.experiment import load_experiment

    return int(load_experiment(path).proxy.seed)
