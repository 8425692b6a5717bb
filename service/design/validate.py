"""What to validate on proxies, and how the proxies are shaped so each model term they can identify is.

Choice: the plan the prior ranking selects; for a mixture-of-experts model the best-ranked plan of each
expert-parallel degree (the memo's EP families) whose proxy splits the experts differently from those
already chosen (a proxy has few ranks: on 2 CPU workers ep 4, 8 and 16 all run as ep 2, and a pipeline
plan's proxy may have no rank to spare for EP); then the best-ranked plan of every strategy family not
yet covered (pure DP + ZeRO-3; TP inside a node + ZeRO-1/2; pipeline; with and without activation
recompute; with and without offload; pure DP + ZeRO-0/1/2; context parallelism), up to `max_proxies`
distinct proxy plans. Each plan passed over before `max_proxies` is reached says why in the notes.

Proxy shape: the production architecture with fewer layers on fewer workers, the plan's structure
kept (ZeRO stage, offload, micro-batch, recompute; tp and pp as far as the workers allow). On a GPU
of the production type the width is kept; on CPU it is narrowed (`hidden_scale`, heads kept) and the
sequence shortened so a trial takes seconds, which is why CPU proxies calibrate memory terms only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.report.proxy_records import ProxyDesign
from service.spec.experiment import ExperimentSpec
from service.spec.plan import Plan
from service.spec.proxy import ProxySpec

# Strategy families: (name, test). "no recompute" / "no offload" give the other side of each lever.
FAMILIES: tuple[tuple[str, Callable[[Plan], bool]], ...] = (
    ("DP + ZeRO-3", lambda p: p.tp == 1 and p.pp == 1 and p.cp == 1 and p.zero_stage == 3),
    ("TP in node + ZeRO-1/2", lambda p: p.tp > 1 and p.zero_stage in (1, 2)),
    ("pipeline", lambda p: p.pp > 1),
    ("recompute", lambda p: p.recompute != "none"),
    ("no recompute", lambda p: p.recompute == "none"),
    ("offload", lambda p: p.offload_optimizer or p.offload_params),
    ("no offload", lambda p: not (p.offload_optimizer or p.offload_params)),
    ("DP + ZeRO-0/1/2", lambda p: p.tp == 1 and p.pp == 1 and p.cp == 1 and p.zero_stage < 3),
    ("context parallel", lambda p: p.cp > 1),
)

FAMILY_TESTS = dict(FAMILIES)

CPU_MAX_WIDTH = 256  # a narrowed CPU proxy keeps hidden_size at or below this
CPU_SEQ_LEN = 256
CPU_WORKERS = 2
CPU_LAYERS = 4
CPU_MIN_VOCAB = 256

IDENTIFIES_CPU = [
    "model-state bytes per rank for each ZeRO stage and offload (DeepSpeed's own tensors, counted)",
    "saved-activation bytes per token per layer, with and without recompute (fits activation_memory_scale)",
    "pipeline micro-batches in flight, logits and loss buffers",
    "that DeepSpeed builds and steps each layout (Megatron-style tp and sequence parallelism, Ulysses cp, "
    "pp via PipelineModule, offload, hpZ)",
]
CANNOT_IDENTIFY_CPU = [
    "GPU time terms: GEMM and flash-attention efficiency, NVLink / InfiniBand bus efficiency, collective "
    "latency (CPU time says nothing about H100 time; these keep the published-set parameters)",
    "inter-node effects and anything that appears only beyond one node",
    "CUDA framework overhead and allocator fragmentation (taken from the GPU catalog)",
    "flash-attention's kernel workspace at production sequence length (CPU SDPA, shorter sequences)",
]
IDENTIFIES_GPU = [
    *IDENTIFIES_CPU,
    "GEMM / attention efficiency and per-step overheads on the production GPU type (time terms fitted)",
    "intra-node (NVLink) collectives of the proxy's node",
]
CANNOT_IDENTIFY_GPU = [
    "inter-node (InfiniBand) collectives and ring latency at the production GPU count",
    "stragglers and failures that appear only at full scale",
]


def families_of(plan: Plan) -> list[str]:
    return [name for name, test in FAMILIES if test(plan)]


def cpu_proxy(experiment: ExperimentSpec) -> ProxySpec:
    """The experiment's proxy moved to CPU: narrow enough to run in seconds, structure kept."""
    if experiment.proxy.device == "cpu":
        return experiment.proxy
    model = experiment.model
    scale = 1
    while model.hidden_size // scale > CPU_MAX_WIDTH:
        nxt = scale * 2
        if model.hidden_size % nxt or (model.hidden_size // nxt) % model.num_attention_heads:
            break
        scale = nxt
    return ProxySpec(
        num_layers=min(CPU_LAYERS, model.num_layers),
        hidden_scale=scale,
        # The vocabulary narrows with the width, so the logits do not drown the layers' activations.
        vocab_size=max(CPU_MIN_VOCAB, model.vocab_size // scale),
        seq_len=min(CPU_SEQ_LEN, experiment.workload.seq_len),
        num_workers=CPU_WORKERS,
        device="cpu",
        precision="fp32",
        steps=4,
        warmup_steps=2,
        seed=experiment.proxy.seed,
    )


def design_proxy(
    experiment: ExperimentSpec, device: str, devices: int | None = None
) -> tuple[ExperimentSpec, ProxyDesign]:
    """(the experiment with the proxy that will run, its design for the memo).

    `device`: "cuda" when a GPU is here and the experiment asks for a CUDA proxy; anything else runs
    the CPU proxy. `devices`: GPUs here; a CUDA proxy asking for more workers gets this many.
    """
    on_gpu = device == "cuda" and experiment.proxy.device == "cuda"
    proxy = experiment.proxy if on_gpu else cpu_proxy(experiment)
    if on_gpu and devices and proxy.num_workers > devices:
        proxy = proxy.model_copy(update={"num_workers": devices})
    exp = experiment.model_copy(update={"proxy": proxy})
    model = experiment.model.scaled(num_layers=proxy.num_layers, hidden_scale=proxy.hidden_scale)
    info = ProxyDesign(
        device=proxy.device,
        gpu=experiment.cluster.gpu.name if on_gpu else "cpu",
        num_layers=proxy.num_layers,
        hidden_size=model.hidden_size,
        hidden_scale=proxy.hidden_scale,
        num_attention_heads=model.num_attention_heads,
        seq_len=proxy.seq_len or experiment.workload.seq_len,
        num_workers=proxy.num_workers,
        precision=proxy.precision if proxy.device == "cpu" else "the plan's",
        steps=proxy.steps,
        warmup_steps=proxy.warmup_steps,
        time_terms="fitted on the proxies" if on_gpu else "kept at the published-set parameters",
        why=(
            "a GPU of the production type is here: full width, fewer layers, one node"
            if on_gpu
            else (
                (
                    "the experiment's proxy section asks for CPU workers"
                    if experiment.proxy.device == "cpu"
                    else "the experiment asks for CUDA proxies and this machine has no GPU"
                )
                + ": narrowed "
                f"{experiment.model.hidden_size}→{model.hidden_size}, vocabulary "
                f"{experiment.model.vocab_size}→{proxy.vocab_size or experiment.model.vocab_size}, "
                f"{proxy.num_layers} layers, "
                f"sequence {proxy.seq_len or experiment.workload.seq_len}, {proxy.num_workers} CPU workers"
            )
        ),
        identifies=IDENTIFIES_GPU if on_gpu else IDENTIFIES_CPU,
        cannot_identify=CANNOT_IDENTIFY_GPU if on_gpu else CANNOT_IDENTIFY_CPU,
    )
    return exp, info


def proxy_plan_for(plan: Plan, experiment: ExperimentSpec) -> Plan:
    """`plan` at proxy scale: tp, cp and pp as far as the proxy's workers and layers allow, dp fills the rest.

    grad_accum is capped (2 without a pipeline, 4 with one) to keep trials short: activations peak per
    micro-batch without a pipeline, and a pipeline needs at least pp micro-batches in flight. The proxy's
    Ulysses attention runs without a pipeline and without sequence parallelism
    (service/train/context_parallel.py), so a cp plan keeps its cp and drops those two. A MoE plan keeps
    its ep as far as the proxy's ranks and experts allow, without tp or cp (the MoE proxy has neither).
    ZeRO++ keeps hpZ (its group shrunk to divide dp); shard groups (FSDP's HSDP; the proxy runs
    DeepSpeed) and, on CPU, the quantized weights/gradients (no CPU kernel) cannot run and are dropped:
    the memo's proxy row shows the plan that ran.
    """
    proxy, model = experiment.proxy, experiment.model
    workers = proxy.num_workers

    def largest(limit: int, ok: Callable[[int], bool]) -> int:
        return max(d for d in range(1, max(limit, 1) + 1) if ok(d))

    # The MoE proxy runs DeepSpeed's MoE layer without tensor or context parallelism (service/train/moe.py).
    moe = model.moe
    tp_cap, cp_cap = (1, 1) if moe is not None else (plan.tp, plan.cp)
    tp = largest(min(tp_cap, workers), lambda d: workers % d == 0 and model.num_attention_heads % d == 0)
    heads = model.num_attention_heads // tp
    seq = proxy.seq_len or experiment.workload.seq_len
    cp = largest(
        min(cp_cap, workers // tp), lambda d: (workers // tp) % d == 0 and heads % d == 0 and seq % d == 0
    )
    pp_max = 1 if cp > 1 else min(plan.pp, workers // tp, proxy.num_layers)
    pp = largest(pp_max, lambda d: (workers // tp) % d == 0 and proxy.num_layers % d == 0)
    dp = workers // (tp * pp * cp)
    # Experts split over as many of the stage's ranks as the plan's ep and the expert count allow.
    experts = moe.num_experts if moe is not None else 1
    ep = largest(min(plan.ep, dp * cp * tp), lambda d: experts % d == 0 and (dp * cp * tp) % d == 0)
    grad_accum = min(plan.grad_accum, 2) if pp == 1 else min(max(plan.grad_accum, pp), 4)
    on_cpu = proxy.device == "cpu"
    fields = plan.model_dump()
    fields.update(
        tp=tp,
        pp=pp,
        cp=cp,
        dp=dp,
        grad_accum=grad_accum,
        sequence_parallel=plan.sequence_parallel and tp > 1 and cp == 1,
        precision=proxy.precision if on_cpu else plan.precision,
        zero_hpz_partition_size=largest(min(plan.zero_hpz_partition_size, dp), lambda d: dp % d == 0),
        shard_group_size=0,
        zero_quantized_weights=plan.zero_quantized_weights and not on_cpu,
        zero_quantized_gradients=plan.zero_quantized_gradients and not on_cpu,
        ep=ep,
        expert_tp=1,
    )
    return Plan(**fields)  # validated: a proxy plan DeepSpeed cannot run fails here, naming the field


@dataclass(frozen=True)
class Choice:
    """A production plan picked for validation, its proxy plan and why it was picked."""

    row: int
    plan: Plan
    proxy_plan: Plan
    reason: str


def choose(
    plans: list[tuple[int, Plan]], experiment: ExperimentSpec, max_proxies: int
) -> tuple[list[Choice], list[str]]:
    """(choices, notes): `plans` is the ranking (row, plan), best first; notes say what was skipped."""
    from service.train.proxy_scale import proxy_plan_problem

    chosen: list[Choice] = []
    notes: list[str] = []
    seen: dict[str, str] = {}  # proxy plan → the production plan it stands for

    def take(row: int, plan: Plan, reason: str, family: str | None = None) -> str | None:
        """Chooses `plan`, or says why not: its proxy cannot run, is one already chosen, or is no longer
        a plan of the `family` it was picked for (the MoE proxy has no tp or cp)."""
        proxy = proxy_plan_for(plan, experiment)
        if family is not None and not FAMILY_TESTS[family](proxy):
            return f"its proxy {proxy.short()} is not a {family} plan"
        if proxy.short() in seen:
            return f"its proxy {proxy.short()} is the one of {seen[proxy.short()]}"
        problem = proxy_plan_problem(experiment, proxy)
        if problem:
            notes.append(f"{plan.short()} ({reason}): no proxy: {problem}")
            return f"no proxy: {problem}"
        seen[proxy.short()] = plan.short()
        chosen.append(Choice(row, plan, proxy, reason))
        return None

    if plans:
        take(plans[0][0], plans[0][1], "the prior ranking's choice")
    if experiment.model.moe is not None:
        # The best plan of each expert-parallel degree, best-ranked degree first; a degree whose proxy
        # splits the experts as a chosen proxy does adds nothing the proxies can tell apart.
        firsts: dict[int, tuple[int, int, Plan]] = {}
        for rank, (row, plan) in enumerate(plans, start=1):
            firsts.setdefault(plan.ep, (rank, row, plan))
        for ep, (rank, row, plan) in firsts.items():
            if len(chosen) >= max_proxies:
                break
            if any(c.plan.ep == ep for c in chosen):
                continue
            proxy = proxy_plan_for(plan, experiment)
            same = next((c for c in chosen if c.proxy_plan.ep == proxy.ep), None)
            if same is not None:
                stage = proxy.dp * proxy.cp * proxy.tp  # the ranks of a proxy stage, over which ep splits
                notes.append(
                    f"{plan.short()} (best ep {ep} plan, rank {rank}): not run: its proxy runs ep {proxy.ep} "
                    f"(its stages have {stage} rank{'s' if stage > 1 else ''}), as the proxy of "
                    f"{same.plan.short()} does"
                )
                continue
            take(row, plan, f"best ep {ep} plan (rank {rank}; ep {proxy.ep} on the proxy)")
    for name, test in FAMILIES:
        if len(chosen) >= max_proxies:
            break
        if any(test(c.proxy_plan) for c in chosen):
            continue
        lost = None  # the family's best plan whose proxy loses what makes it the family
        for rank, (row, plan) in enumerate(plans, start=1):
            if not test(plan):
                continue
            why_not = take(row, plan, f"best {name} plan (rank {rank})", family=name)
            if why_not is None:
                break
            runs = plan.short() in seen.values()  # chosen for another reason: its proxy runs all the same
            if lost is None and why_not.endswith(f"is not a {name} plan") and not runs:
                lost = f"{plan.short()} (best {name} plan, rank {rank}): not run: {why_not}"
        else:
            if lost is not None:
                notes.append(lost)
    return chosen[:max_proxies], notes
