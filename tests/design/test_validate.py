"""What `run` validates and how it shapes the proxies (fast, no Ray)."""

from __future__ import annotations

from pathlib import Path

from service.design.decide import score
from service.design.validate import FAMILIES, choose, cpu_proxy, design_proxy, families_of, proxy_plan_for
from service.spec import Plan, load_experiment
from service.spec.params import ModelParams, load_params
from service.train.proxy_scale import proxy_plan_problem

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = load_experiment(REPO / "experiments" / "llama2-13b-32xh100.yaml")


def test_cpu_proxy_of_13b_is_narrow_short_and_keeps_heads() -> None:
    proxy = cpu_proxy(EXPERIMENT)
    assert proxy.device == "cpu" and proxy.num_workers == 2 and proxy.precision == "fp32"
    hidden = EXPERIMENT.model.hidden_size // proxy.hidden_scale
    assert hidden <= 256 and hidden % EXPERIMENT.model.num_attention_heads == 0
    assert proxy.seq_len == 256 and proxy.vocab_size == EXPERIMENT.model.vocab_size // proxy.hidden_scale
    exp, info = design_proxy(EXPERIMENT, "cuda")  # the experiment asks for a CUDA proxy: kept as is
    assert exp.proxy == EXPERIMENT.proxy and info.device == "cuda"
    one, _ = design_proxy(EXPERIMENT, "cuda", devices=1)  # a one-GPU machine: one worker per trial
    assert one.proxy.num_workers == 1 and one.proxy.num_layers == EXPERIMENT.proxy.num_layers
    tiny = load_experiment(REPO / "experiments" / "tiny-cpu.yaml")
    assert cpu_proxy(tiny) == tiny.proxy  # already a CPU proxy


def test_proxy_plan_keeps_the_structure_on_two_workers() -> None:
    exp, _ = design_proxy(EXPERIMENT, "cpu")
    plan = Plan(
        dp=16, tp=2, zero_stage=1, micro_batch=2, grad_accum=16, recompute="full", sequence_parallel=True
    )
    proxy = proxy_plan_for(plan, exp)
    assert (proxy.dp, proxy.tp, proxy.pp) == (1, 2, 1)  # tp kept on the 2 workers
    assert (proxy.zero_stage, proxy.micro_batch, proxy.recompute) == (1, 2, "full")
    assert proxy.grad_accum == 2 and proxy.sequence_parallel and proxy.precision == "fp32"  # SP runs
    pp = proxy_plan_for(Plan(dp=16, pp=2, zero_stage=1, micro_batch=1, grad_accum=8), exp)
    assert (pp.dp, pp.tp, pp.pp, pp.grad_accum) == (1, 1, 2, 4)
    assert proxy_plan_problem(exp, pp) is None


def test_proxy_plan_keeps_cp_and_hpz_and_drops_what_cannot_run_on_cpu() -> None:
    exp, _ = design_proxy(EXPERIMENT, "cpu")
    cp = proxy_plan_for(Plan(dp=8, tp=2, cp=2, zero_stage=1, micro_batch=1, grad_accum=16), exp)
    # 2 workers: tp 2 first, so no room for cp
    assert (cp.dp, cp.tp, cp.pp, cp.cp) == (1, 2, 1, 1)
    ulysses = proxy_plan_for(Plan(dp=16, cp=2, zero_stage=3, micro_batch=1, grad_accum=4), exp)
    assert (ulysses.dp, ulysses.cp, ulysses.pp) == (1, 2, 1) and proxy_plan_problem(exp, ulysses) is None
    zpp = Plan(
        dp=32,
        zero_stage=3,
        zero_hpz_partition_size=8,
        zero_quantized_weights=True,
        zero_quantized_gradients=True,
        micro_batch=1,
        grad_accum=4,
    )
    proxy = proxy_plan_for(zpp, exp)
    assert (proxy.dp, proxy.zero_hpz_partition_size) == (2, 2)
    assert not (proxy.zero_quantized_weights or proxy.zero_quantized_gradients)  # no CPU quantizer kernel
    assert proxy_plan_problem(exp, proxy) is None


def test_choice_covers_the_families_with_distinct_runnable_proxies() -> None:
    exp, _ = design_proxy(EXPERIMENT, "cpu")
    s = score(
        EXPERIMENT.model,
        EXPERIMENT.cluster,
        EXPERIMENT.workload,
        EXPERIMENT.budget,
        ModelParams(),
        EXPERIMENT.goodput,
    )
    order = [(int(r), s.plans.row(int(r))) for r in s.selection.order]
    choices, _ = choose(order, exp, 4)
    assert len(choices) == 4
    assert choices[0].plan == s.plans.row(s.selection.selected)  # the prior's choice comes first
    assert len({c.proxy_plan.short() for c in choices}) == 4
    assert all(proxy_plan_problem(exp, c.proxy_plan) is None for c in choices)
    covered = {f for c in choices for f in families_of(c.plan)}
    assert {"DP + ZeRO-3", "TP in node + ZeRO-1/2", "pipeline"} <= covered  # FAMILIES order
    more, _ = choose(order, exp, len(FAMILIES) + 3)
    assert {f for c in more for f in families_of(c.plan)} == {name for name, _ in FAMILIES}


def test_the_proxy_error_note_says_what_the_proxies_could_tell() -> None:
    from service.design.calibration import validation_error

    gpu_run = validation_error([], {}, calibrated=True, time_fitted=True, on_cpu=False).note
    assert "time terms are fitted on them" in gpu_run and "device's" in gpu_run
    assert "says nothing" not in gpu_run and "RSS" not in gpu_run
    cpu_for_gpu = validation_error([], {}, calibrated=True, time_fitted=False, on_cpu=True).note
    assert "says nothing about the production GPU" in cpu_for_gpu and "RSS" in cpu_for_gpu


def test_a_moe_plan_keeps_its_experts_split_on_the_proxy_without_tp_or_cp():
    """The MoE proxy (service/train/moe.py) has neither tensor nor context parallelism: ep is kept as far
    as the proxy's ranks and the expert count allow, expert_tp drops to 1."""
    from pathlib import Path

    from service.spec import load_experiment

    root = Path(__file__).resolve().parents[2]
    exp = load_experiment(root / "experiments" / "qwen3-30b-a3b-64xh100.yaml")
    exp = exp.model_copy(update={"proxy": cpu_proxy(exp)})  # 2 CPU workers
    proxy = proxy_plan_for(Plan(dp=32, tp=2, ep=8, expert_tp=2, engine="megatron", zero_stage=1), exp)
    assert (proxy.dp, proxy.tp, proxy.cp, proxy.ep, proxy.expert_tp) == (2, 1, 1, 2, 1)
    ring = proxy_plan_for(Plan(dp=32, cp=2, ep=4, zero_stage=2, grad_accum=16), exp)
    assert (ring.dp, ring.cp, ring.ep) == (2, 1, 2)
    dense = proxy_plan_for(Plan(dp=64, zero_stage=2), exp)
    assert dense.ep == 1


def test_a_moe_run_validates_each_expert_split_its_proxies_can_tell_apart():
    """Qwen3-30B-A3B on 64 H100s: the choice (ep 8, ep 2 on the 2-worker CPU proxy) and the best plan of
    the first EP degree in ranking order whose proxy splits the experts otherwise (a pipeline plan, whose
    proxy stages have one rank: ep 1) run; every other degree's proxy splits them as one of those two
    does, so each is named in the notes with why; the TP and context-parallel families are not claimed,
    the MoE proxy having neither."""
    exp = load_experiment(REPO / "experiments" / "qwen3-30b-a3b-64xh100.yaml")
    proxy_exp, _ = design_proxy(exp, "cpu")
    s = score(exp.model, exp.cluster, exp.workload, exp.budget, load_params(), exp.goodput)
    order = [(int(r), s.plans.row(int(r))) for r in s.selection.order]
    choices, notes = choose(order, proxy_exp, 4)
    assert choices[0].plan == s.plans.row(s.selection.selected)
    assert {c.proxy_plan.ep for c in choices} == {1, 2}  # both expert splits a 2-rank proxy has
    other = next(c for c in choices if c.proxy_plan.ep != choices[0].proxy_plan.ep)
    first = next(rank for rank, (_, p) in enumerate(order, start=1) if p.ep == other.plan.ep)
    assert other.reason.startswith(f"best ep {other.plan.ep} plan (rank {first};")
    chosen_eps = {c.plan.ep for c in choices}
    for ep in {p.ep for _, p in order} - chosen_eps:
        assert any(f"(best ep {ep} plan, rank" in n and "its proxy runs ep" in n for n in notes), ep
    assert all(c.proxy_plan.tp == 1 and c.proxy_plan.cp == 1 for c in choices)
    assert not any("TP in node" in c.reason or "context parallel" in c.reason for c in choices)
    tp_family = "TP in node + ZeRO-1/2"
    assert any(f"best {tp_family} plan" in n and f"is not a {tp_family} plan" in n for n in notes)
    # a plan that runs (here the choice, a cp plan whose proxy has no cp) is never noted as not run
    assert not any(n.startswith(f"{c.plan.short()} (") and "not run" in n for c in choices for n in notes)
