"""What `run` weighs beside the headline, as typed records `RunResult` keeps: the expected goodput and
checkpoint interval, the sensitivity scenarios, the tie group and the fit's evidence for the choice, a
mixture of experts' expert layout, and the other clusters priced."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class IntervalCost(BaseModel):
    """Expected wall-clock when checkpointing every `interval_hours` instead of at the optimum."""

    model_config = ConfigDict(frozen=True)

    label: str  # "Young/Daly optimum", "1 h", "30 min", "15 min"
    interval_hours: float
    wall_hours: float  # expected, same rule as Goodput.rule
    extra_vs_optimum: float  # fraction: wall_hours / the optimum's wall_hours - 1


class Goodput(BaseModel):
    """Expected time lost to interruptions for the selected plan (Young/Daly checkpoint interval)."""

    model_config = ConfigDict(frozen=True)

    interruptions_per_gpu_hour: float
    interruption_source: str
    mtbf_hours: float
    checkpoint_bytes: float
    storage_bandwidth_gb_per_s: float
    storage_source: str
    checkpoint_write_s: float
    young_daly_interval_hours: float
    checkpoint_interval_hours: float
    restart_minutes: float
    expected_interruptions: float
    checkpoint_hours: float
    lost_work_hours: float
    restart_hours: float
    goodput: float  # useful training hours / wall-clock hours
    rule: str
    num_gpus: int = 0  # the cluster the rate was chosen for (0: a result written before it was recorded)
    failure_free_hours: float = 0.0  # H
    interval_costs: list[IntervalCost] = Field(default_factory=list)  # the optimum, then shorter intervals


class Scenario(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    selected_label: str | None
    nominal_status: str  # the nominal choice's status in this scenario
    nominal_regret: float  # how much worse the nominal choice is than this scenario's best (fraction)
    objective_value: float | None  # the scenario's choice's, in the objective's unit
    nominal_value: float | None = None  # the nominal choice's in this scenario, in the objective's unit


class Sensitivity(BaseModel):
    model_config = ConfigDict(frozen=True)

    scenarios: list[Scenario]
    nominal_label: str | None
    chosen_label: str | None
    flips: list[str]  # scenarios whose best plan differs from the nominal choice
    note: str
    flip: str = ""  # what would flip the decision, in one line
    budget_margin: str = ""  # the throughput below which the choice breaks the budget


class TieGroup(BaseModel):
    """Plans the model cannot order (within its resolution of the best), and why the choice won."""

    model_config = ConfigDict(frozen=True)

    resolution: float  # log ratio: the parameter set's offset-free scatter
    members: list[str]  # plan labels, the choice first
    note: str


class Evidence(BaseModel):
    """Where the fit stands for the chosen plan: its software stack, whether the fit saw it, and the
    nearest fitted runs with the model's out-of-sample error on each."""

    model_config = ConfigDict(frozen=True)

    stack: str
    gpu: str
    stack_fitted: bool
    interval_note: str
    nearest: list[str]
    outside_fit: list[str] = Field(
        default_factory=list,
        description="The nearest published runs no parameter was fit on, with the shipped set's error.",
    )


class ExpertFamily(BaseModel):
    """The best plan of one expert-parallel degree: what choosing that EP would give."""

    model_config = ConfigDict(frozen=True)

    ep: int
    label: str
    tokens_per_s: float
    all_to_all_share: float  # exposed dispatch and combine over the step time
    host_wait_share: float = 0.0  # MoE block passes waiting for the host, over the step time


class ImbalanceCase(BaseModel):
    """The choice and its speed at one load imbalance (Workload.moe_load_imbalance)."""

    model_config = ConfigDict(frozen=True)

    imbalance: float
    selected_label: str | None
    chosen_tokens_per_s: float  # the run's choice, re-scored at this imbalance


class ExpertParallelism(BaseModel):
    """A mixture-of-experts model's expert layout: why this EP, what the all-to-all costs, and how the
    choice moves with the load imbalance."""

    model_config = ConfigDict(frozen=True)

    ep: int
    expert_tp: int
    all_to_all_share: float
    host_wait_share: float = 0.0
    load_imbalance: float
    router: str
    families: list[ExpertFamily]  # the best plan of each EP degree that meets the budget, best first
    imbalance: list[ImbalanceCase]


class OtherEngines(BaseModel):
    """The model's best plan on the engines the experiment lists but `run` does not launch: a choice the
    memo names without proving it on proxies."""

    model_config = ConfigDict(frozen=True)

    engines: list[str]
    label: str | None  # None: no plan of theirs meets the budget
    tokens_per_s: float | None = None
    hours: float | None = None
    dollars: float | None = None
    over_chosen: float | None = None  # its tokens/s over the chosen plan's


class Alternative(BaseModel):
    model_config = ConfigDict(frozen=True)

    gpu: str
    num_gpus: int
    price_per_gpu_hour_usd: float
    availability: str = ""
    selected_label: str | None
    tokens_per_s: float | None = None
    hours: float | None = None
    dollars: float | None = None
    outcome: str  # "selected", or why it lost
