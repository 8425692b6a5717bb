"""The valid-plan counts other tests quote (2,730 for Llama-2-13B on 32 GPUs, 3,894 for Llama-2-70B on
1,024), and the candidate counts they are drawn from (46,200 and 193,200), derived independently: a
brute-force loop over every layout, written from the rules as they are documented (DeepSpeed's limits
and the cluster/workload identities), not from the enumerator's code."""

from __future__ import annotations

import itertools

import pytest

from service.catalog import load_model
from service.plans.enumerate import enumerate_plans
from service.spec import ClusterSpec, Workload

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # powers of two up to the planner's cap


def brute_force_count(
    layers: int,
    heads: int,
    kv_heads: int,
    gpus: int,
    per_node: int,
    batch: int,
    seq: int = 4096,
    quantized: bool = False,
) -> int:
    """Plans (bf16) that can run, counted one by one. The documented rules:
    - dp·tp·pp·cp = GPUs with cp ≤ 16; tp divides the attention and the KV heads, and divides (≤) the
      GPUs of a node; pp ≤ the layers (a stage may hold one block more than another);
      DeepSpeed-Ulysses' cp divides the heads per TP rank and the sequence;
    - micro_batch·grad_accum·dp = the global batch (grad_accum a positive integer);
    - parameter offload needs ZeRO-3; optimizer offload needs ZeRO ≥ 1; an hpZ group (a node's GPUs)
      divides the dp·cp ZeRO ranks; ZeRO++'s quantized collectives (qwZ + qgZ) only when asked for, as
      two more ZeRO-3 variants (with hpZ and without) under ZeRO-3's rules;
    - DeepSpeed's pipeline engine takes ZeRO 0-1; AutoTP takes ZeRO 0-2; tensor-parallel layers run
      inside the pipeline engine (Megatron-DeepSpeed); sequence parallelism needs tp > 1;
    - the service's DeepSpeed runs Ulysses cp > 1 without a pipeline and without sequence parallelism.
    """
    count = 0
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    layouts = [
        (dp, tp, gpus // (dp * tp * cp), cp)
        for dp in divisors
        for tp in divisors
        for cp in divisors
        if cp <= 16 and gpus % (dp * tp * cp) == 0
    ]
    for dp, tp, pp, cp in layouts:  # every (dp, tp, pp, cp) with dp·tp·pp·cp = GPUs
        if heads % tp or kv_heads % tp or per_node % tp or pp > layers or (heads // tp) % cp or seq % cp:
            continue
        # ZeRO 0-3, and ZeRO-3 with hpZ in a node (several nodes; the quantized collectives are opt-in)
        zeros = [(z, 1, 0) for z in range(4)] + [(3, per_node, 0)]
        zeros += [(3, per_node, 0), (3, 1, 0)] if quantized else []  # the same rules with qwZ + qgZ
        for (zero, hpz, mics), off_opt, off_par, _recompute, sp, mb in itertools.product(
            zeros, (False, True), (False, True), range(3), (False, True), MICRO_BATCHES
        ):
            if (off_par and zero != 3) or (off_opt and zero == 0):
                continue
            if (dp * cp) % hpz or (mics and (dp * cp) % mics):  # hpZ / MiCS groups split the ZeRO ranks
                continue
            if (pp > 1 and zero > 1) or (tp > 1 and zero == 3) or (sp and tp == 1):
                continue
            if cp > 1 and (pp > 1 or sp):
                continue
            if batch % (mb * dp) == 0:
                count += 1
    return count


def candidate_count(gpus: int) -> int:
    """The cross product the planner scores before any rule, counted from the choices it documents
    (one GPU type, bf16, several nodes): every (dp, tp, cp) of divisors with cp ≤ 16 and pp the rest,
    times ZeRO 0-3 or ZeRO-3 with hpZ (5), optimizer offload (2), parameter offload (2), recompute none /
    selective / full (3), sequence parallelism (2) and the 7 micro-batch sizes."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    layouts = sum(
        1 for dp in divisors for tp in divisors for cp in divisors if cp <= 16 and gpus % (dp * tp * cp) == 0
    )
    return layouts * 5 * 2 * 2 * 3 * 2 * len(MICRO_BATCHES)


@pytest.mark.parametrize(("gpus", "expected"), [(32, 46200), (1024, 193200)])
def test_candidate_counts_match_the_documented_cross_product(gpus: int, expected: int):
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=gpus // 8, gpus_per_node=8)
    workload = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=2e9)
    assert candidate_count(gpus) == expected  # the number other tests quote comes from the choices
    assert enumerate_plans(load_model("llama2-13b"), cluster, workload).candidates == expected


@pytest.mark.parametrize(
    ("model", "nodes", "batch", "expected"),
    [("llama2-13b", 4, 128, 2730), ("llama2-70b", 128, 1024, 3894)],
)
def test_enumerator_counts_match_a_brute_force_count(model: str, nodes: int, batch: int, expected: int):
    spec = load_model(model)
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=nodes, gpus_per_node=8)
    brute = brute_force_count(
        spec.num_layers, spec.num_attention_heads, spec.kv_heads, cluster.num_gpus, 8, batch
    )
    assert brute == expected  # the number the planner tests quote comes from the rules, not the code
    workload = Workload(seq_len=4096, global_batch_sequences=batch, tokens_to_train=2e9)
    assert len(enumerate_plans(spec, cluster, workload).plans) == brute


def test_the_quantized_collectives_count_other_tests_quote():
    spec = load_model("llama2-13b")
    args = (spec.num_layers, spec.num_attention_heads, spec.kv_heads, 32, 8, 128)
    assert brute_force_count(*args, quantized=True) - brute_force_count(*args) == 432
