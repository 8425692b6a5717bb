"""DeepSpeed's ZeRO-3 with full recompute: the recomputed forward gathers a block's weights again, and
DeepSpeed keeps them for backward only when the modules in between hold fewer than
`stage3_max_reuse_distance` elements (data_parallel.regathered_fraction)."""

from dataclasses import replace

import pytest

from service.catalog import load_model
from service.costmodel import comm, estimate
from service.costmodel.data_parallel import regathered_fraction, regathered_modules
from service.spec import ClusterSpec, Plan, Workload
from service.spec.params import ModelParams
from service.spec.zero import ZeroKnobs

GPT3 = load_model("gpt3-175b")
A100 = ClusterSpec(gpu="a100-sxm-80gb", num_nodes=192).gpu
PRIOR = ModelParams()


def test_the_share_gathered_again_follows_the_modules_after_each_one():
    # GPT-3 175B (h 12288): QKV 3h², out h², MLP in 4h², MLP out 4h². Only MLP out's backward follows its
    # recomputed forward closely enough (nothing in between); MLP in has 2 × 4h² = 1.2e9 in between.
    assert regathered_fraction(GPT3, 1, 10**9)[0] == pytest.approx(8 / 12)
    assert regathered_modules(GPT3, 1, 10**9)[0] == 3
    # Llama-2-70B: gate, up and down are kept (2 × 2 × 235M = 0.94e9 < 1e9 before gate's backward); the
    # four attention projections (q, o 67M; k, v 8.4M) are gathered again.
    llama70 = load_model("llama2-70b")
    attention = 2 * 8192 * 8192 + 2 * 8192 * 1024
    assert regathered_fraction(llama70, 1, 10**9)[0] == pytest.approx(
        attention / (attention + 3 * 8192 * 28672)
    )
    assert regathered_fraction(load_model("llama2-13b"), 1, 10**9)[0] == 0.0  # 13B blocks fit the limit
    assert regathered_fraction(GPT3, [1, 2, 8], 10**12).tolist() == [
        0.0,
        0.0,
        0.0,
    ]  # a larger limit keeps all


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_only_deepspeeds_full_recompute_pays_the_third_gather(monkeypatch, engine):
    """1,536 ranks, one sequence each: the collectives outlast the compute, so the regathered bytes show
    whole: two thirds of a backward gather of the 175B weights (bf16) per micro-batch."""
    cluster = ClusterSpec(gpu="a100-sxm-80gb", num_nodes=192)
    work = Workload(seq_len=2048, global_batch_sequences=1536, tokens_to_train=1e9)

    def dp_comm(recompute: str) -> float:
        plan = Plan(dp=1536, zero_stage=3, micro_batch=1, grad_accum=1, recompute=recompute, engine=engine)
        return estimate(GPT3, cluster, plan, work, params=PRIOR).time_breakdown_s.dp_comm

    limited = dp_comm("full"), dp_comm("selective")
    knobs = ZeroKnobs.for_model(GPT3)
    monkeypatch.setattr(
        ZeroKnobs, "for_model", classmethod(lambda cls, m: replace(knobs, stage3_max_reuse_distance=10**12))
    )
    unlimited = dp_comm("full"), dp_comm("selective")
    assert limited[1] == unlimited[1]  # selective recompute re-runs attention only, kept for backward
    if engine == "fsdp":
        assert limited[0] == unlimited[0]  # FSDP recomputes inside the unit whose backward gather it uses
        return
    weights = 2.0 * GPT3.num_params
    gather = float(comm.all_gather_time_s(weights, 1536, 1, 8, A100, 4 * GPT3.num_layers))
    assert limited[0] - unlimited[0] == pytest.approx(2 / 3 * gather, rel=1e-6)
