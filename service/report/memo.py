"""The design memo, from a `RunResult` alone: one list of blocks rendered twice, as Markdown and as a
self-contained HTML page (charts inlined as base64 PNG), so both say exactly the same numbers.

Every number says where it comes from: [prior] the analytical cost model's own values (memory before
the proxies calibrate it), [published fit] the cost model with a parameter set fit on published runs (the
shipped one), [calibrated] the cost model after calibration on the proxies, [measured] a proxy run.
"""

from __future__ import annotations

import math
from pathlib import Path

from service.report.charts import draw_all
from service.report.charts_data import CPU_SPEED_WHY, proxy_speed_unused, proxy_text
from service.report.formats import fmt_dollars, fmt_gib, fmt_hours, fmt_tokens, tag, with_interval
from service.report.memo_confidence import confidence_blocks
from service.report.memo_experts import experts, other_engines
from service.report.memo_goodput import goodput_blocks
from service.report.memo_outputs import outputs
from service.report.render import Block, to_html, to_markdown
from service.report.result import (
    ClusterSummary,
    PlanRow,
    RunResult,
)
from service.spec.plan import Plan


def _plan_words(p: Plan) -> str:
    offload = [n for n, on in (("optimizer", p.offload_optimizer), ("parameters", p.offload_params)) if on]
    shape = f"dp {p.dp} × tp {p.tp} × pp {p.pp}"
    shape += f" × cp {p.cp}" if p.cp > 1 else ""
    shape += f", experts split over ep {p.ep}" if p.ep > 1 else ""
    shape += f" and expert tp {p.expert_tp}" if p.expert_tp > 1 else ""
    return (
        f"{shape}, ZeRO-{p.zero_stage}, micro-batch {p.micro_batch} × {p.grad_accum} accumulation steps, "
        f"recompute {p.recompute}, {'offload of ' + ' and '.join(offload) if offload else 'no offload'}, "
        f"{p.precision}"
    )


def _network(c: ClusterSummary) -> str:
    """The network the estimate assumed, where one is crossed: the infra lead checks it against theirs."""
    bw = c.inter_node_bandwidth_gb_per_s
    if not bw or c.num_nodes <= 1:
        return ""
    return f"; between nodes {bw * 8 * c.gpus_per_node:,.0f} Gb/s per node, {bw:g} GB/s per GPU"


def decision(r: RunResult) -> list[Block]:
    sel = r.selected
    if sel is None:
        return [("h2", "Decision"), ("p", f"**No plan meets the budget.** {r.message}")]
    c = r.cluster
    mem = sel.memory_per_gpu_bytes
    text = (
        f"Run **{sel.label}** on {c.num_gpus} × {c.gpu} "
        f"({c.num_nodes} nodes × {c.gpus_per_node}{_network(c)}): "
        f"{_plan_words(sel.plan)}. It trains at {with_interval(sel.tokens_per_s, fmt_tokens, ' tokens/s')} "
        f"(MFU {sel.mfu:.1%}: model FLOPs over the dense peak, bf16 for FP8 plans), "
        f"taking {with_interval(sel.hours, fmt_hours, ' h')} and costing "
        f"{with_interval(sel.dollars, fmt_dollars)} with interruptions, checkpoints and restarts included. "
        f"Memory per GPU is {with_interval(mem, fmt_gib, ' GiB', 'range')} against a limit of "
        f"{fmt_gib(sel.memory_limit_bytes)} GiB ({c.hbm_gib:g} GiB HBM less "
        f"{r.budget.memory_headroom:.0%} headroom)."
    )
    if _network(c):  # the interval is the model's error on this fabric, not a slower one
        text += " The intervals assume that network between nodes; Sensitivity, below, prices slower ones."
    blocks: list[Block] = [("h2", "Decision"), ("p", text)]
    blocks += other_engines(r)
    blocks += goodput_blocks(r)
    budget = ", ".join(f"{k} {v}" for k, v in r.budget.model_dump().items() if v is not None)
    message = r.message if r.message.endswith(".") else f"{r.message}."
    blocks.append(("p", f"Budget: {budget}. {r.plans_ranked:,} valid plans ranked. {message}"))
    return blocks


def _row_cells(row: PlanRow) -> list[str]:
    return [
        row.label,
        row.status,
        row.why,
        f"{fmt_tokens(row.tokens_per_s.value)} {tag(row.tokens_per_s.tag)}",
        fmt_hours(row.hours.value),
        fmt_dollars(row.dollars.value),
        f"{fmt_gib(row.memory_per_gpu_bytes.value)} ({fmt_gib(row.memory_per_gpu_bytes.low)}–"
        f"{fmt_gib(row.memory_per_gpu_bytes.high)}) {tag(row.memory_per_gpu_bytes.tag)}",
        "yes" if row.validated else "",
        ", ".join(row.families),
    ]


def alternatives(r: RunResult) -> list[Block]:
    head = [
        "plan",
        "status",
        "why",
        "tokens/s",
        "hours",
        "dollars",
        "GiB/GPU (range)",
        "proxy ran",
        "families",
    ]
    blocks: list[Block] = [
        ("h2", "Alternatives and why each lost"),
        ("table", head, [_row_cells(row) for row in r.rows]),
    ]
    if len(r.alternatives) > 1:
        blocks += [
            ("h3", "GPU types under the same budget"),
            (
                "table",
                [
                    "GPU",
                    "GPUs",
                    "$/GPU-h",
                    "availability",
                    "best plan",
                    "tokens/s",
                    "hours",
                    "dollars",
                    "outcome",
                ],
                [
                    [
                        a.gpu,
                        str(a.num_gpus),
                        f"{a.price_per_gpu_hour_usd:g}",
                        a.availability,
                        a.selected_label or "-",
                        fmt_tokens(a.tokens_per_s) if a.tokens_per_s else "-",
                        fmt_hours(a.hours) if a.hours else "-",
                        fmt_dollars(a.dollars) if a.dollars else "-",
                        a.outcome,
                    ]
                    for a in r.alternatives
                ],
            ),
        ]
    return blocks


def _mib(x: float | None) -> str:
    return "-" if not x else f"{x / 2**20:,.1f}"


def proxies(r: RunResult) -> list[Block]:
    d = r.proxy_design
    shape = f"Proxy shape: {d.why}. Time terms: {d.time_terms}."
    if not d.choices:  # `run --no-proxies` (or max_proxies 0): the shape they would have, nothing measured
        shape = (
            "**No proxies ran**: every number above is the model's. On this machine `run` would shape "
            f"them so: {d.why}."
        )
    blocks: list[Block] = [
        ("h2", "Validation on proxies"),
        ("p", shape),
        ("p", "What these proxies identify:"),
        ("ul", list(d.identifies)),
        ("p", "What they cannot identify (left to the prior, and to the risks below):"),
        ("ul", list(d.cannot_identify)),
    ]
    if d.choices:
        blocks.append(
            (
                "table",
                ["production plan", "proxy plan", "why this plan gets a proxy"],
                [[c.plan, c.proxy, c.why] for c in d.choices],
            )
        )
        if d.skipped:  # e.g. expert-parallel degrees whose proxies would repeat one that ran
            blocks += [("p", "Plans that got no proxy of their own, and why:"), ("ul", list(d.skipped))]
    blocks += _proxy_table(r)
    v = r.proxy_validation_error
    if v.n:
        act, state = v.activation_bytes_per_rank, v.model_state_bytes_per_rank
        blocks.append(
            (
                "p",
                (
                    f"Proxy error (mean |predicted/measured − 1| over {v.n} proxies): activations "
                    f"{_pct(act.prior)} [prior] → {_pct(act.calibrated)} [calibrated], "
                    f"{_pct(act.out_of_sample)} out of sample (leave one proxy out); model state "
                    f"{_pct(state.prior)} [prior]. {v.note}."
                ),
            )
        )
    c = r.calibration
    fitted = ", ".join(f"{k}: {c.before[k]:.4f} → {c.after[k]:.4f}" for k in c.fitted if k in c.before)
    blocks.append(
        (
            "p",
            f"Calibration: {c.status}; {fitted or 'nothing fitted'}. Time terms: {c.time_terms or 'n/a'}.",
        )
    )
    blocks.append(("img", "proxies", proxy_text(r).caption))
    return blocks


def _proxy_table(r: RunResult) -> list[Block]:
    """What each proxy measured against the model. CPU proxies of a GPU cluster get no tokens/s column:
    gloo on CPU cores says nothing of GPU kernels, NVLink or InfiniBand, so their speed is not used."""
    speed = not proxy_speed_unused(r)
    rows = []
    for p in r.proxies:
        m, pr, pc = p.measured, p.predicted_prior, p.predicted_calibrated
        cells = [
            p.proxy_label,
            p.status + (f": {p.reason[:80]}" if p.reason else ""),
            f"{_mib(m.get('activation_bytes_per_rank'))} [measured]",
            f"{_mib(pr.get('activation_bytes_per_rank'))} [prior]",
            f"{_mib(pc.get('activation_bytes_per_rank'))} [calibrated]" if pc else "-",
            f"{_mib(m.get('model_state_bytes_per_rank'))} / {_mib(pr.get('model_state_bytes_per_rank'))}",
        ]
        if speed:
            cells.append(f"{m.get('tokens_per_s', 0):,.0f} / {pr.get('tokens_per_s', 0):,.0f}")
        rows.append(cells)
    if not rows:
        return []
    head = [
        "proxy",
        "status (ok: the layout built and stepped)",
        "activations MiB",
        "predicted",
        "calibrated",
        "model state MiB measured / prior",
    ]
    if speed:
        head.append("tokens/s measured / prior")
    blocks: list[Block] = [("table", head, rows)]
    if not speed:
        blocks.append(
            (
                "p",
                f"No tokens/s column: {CPU_SPEED_WHY}, so their speed is not used; the GPU plan's speed "
                "comes from the cost model's time parameters, not from these runs. What these proxies "
                "check is that each layout builds and steps, and its memory terms per rank.",
            )
        )
    return blocks


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def extrapolation(r: RunResult) -> list[Block]:
    e = r.extrapolation
    if e is None:
        return []
    keys = ["layers", "hidden_size", "seq_len", "gpus", "device"]
    dkeys = {"layers": "layers", "hidden_size": "width", "seq_len": "sequence", "gpus": "gpus"}
    rows = [
        [
            k,
            str(getattr(e.proxy, k)),
            str(getattr(e.production, k)),
            f"{e.doublings[dkeys[k]]:.1f}"
            if k in dkeys
            else "other type"
            if getattr(e.proxy, k) != getattr(e.production, k)
            else "same",
        ]
        for k in keys
    ]
    return [
        ("h2", "Extrapolation distance"),
        ("table", ["", "proxy", "production", "doublings"], rows),
        (
            "p",
            f"Memory intervals are widened {e.widening:.2f}×. Rule: {e.rule}. Throughput intervals: the "
            "parameter set's out-of-sample residuals, widened per doubling beyond the runs it was fit on.",
        ),
    ]


def goodput(r: RunResult) -> list[Block]:
    g = r.goodput
    if g is None:
        return []
    rows = [
        ["interruption rate", f"{g.interruptions_per_gpu_hour:.3g} per GPU-hour", g.interruption_source],
        ["job MTBF", f"{g.mtbf_hours:,.0f} h", "1 / (rate × GPUs)"],
        ["checkpoint size", f"{g.checkpoint_bytes / 1e9:,.0f} GB", "14 bytes/param (ZeRO §3.1)"],
        ["storage bandwidth", f"{g.storage_bandwidth_gb_per_s:.2f} GB/s", g.storage_source],
        ["checkpoint write", f"{g.checkpoint_write_s:,.0f} s", "size / bandwidth"],
        [
            "checkpoint interval",
            f"{g.checkpoint_interval_hours:.2f} h",
            f"Young/Daly {g.young_daly_interval_hours:.1f} h"
            + (", capped at the run" if g.checkpoint_interval_hours < g.young_daly_interval_hours else ""),
        ],
        ["restart", f"{g.restart_minutes:g} min", "assumption"],
        [
            "expected interruptions",
            f"{g.expected_interruptions:.2g}",
            f"chance of at least one: {1 - math.exp(-g.expected_interruptions):.1%} (Poisson)",
        ],
        [
            "time lost",
            f"{g.checkpoint_hours + g.lost_work_hours + g.restart_hours:.2f} h",
            f"checkpoints {g.checkpoint_hours:.2f} h, lost work {g.lost_work_hours:.2f} h, "
            f"restarts {g.restart_hours:.2f} h",
        ],
        ["goodput", f"{g.goodput:.1%}", g.rule],
    ]
    return [("h2", "Goodput"), ("table", ["", "value", "source / rule"], rows)]


def blocks(r: RunResult) -> list[Block]:
    out: list[Block] = [
        ("h1", f"Design memo: {r.experiment}"),
        (
            "p",
            f"{r.created}. Tags: [prior] the analytical cost model's own values; [published fit] the cost "
            "model with its parameters fit on published runs; [calibrated] after calibration on the "
            "proxies; [measured] measured on a proxy run.",
        ),
    ]
    out += decision(r)
    out += alternatives(r)
    out += experts(r)
    out += [
        (
            "img",
            "families",
            "Hours and dollars of the best plan of each strategy family, 80 % intervals, against the budget",
        ),
        ("img", "memory", "Memory per GPU"),
        ("img", "cost_vs_throughput", "Cost against throughput"),
    ]
    out += proxies(r) + extrapolation(r) + goodput(r) + confidence_blocks(r)
    out += [("h2", "Risks"), ("ul", r.risks or ["none found"])]
    out += [
        ("h2", "Assumptions and sources"),
        ("table", ["assumption", "source"], [[a.what, a.source] for a in r.assumptions]),
    ]
    return out + outputs(r)


def write_memo(result: RunResult, folder: str | Path) -> dict[str, Path]:
    """Writes memo.md, memo.html and the charts under `folder`; returns {name: path}."""
    folder = Path(folder)
    charts = draw_all(result, folder / "charts")
    bl = blocks(result)
    md = folder / "memo.md"
    md.write_text(to_markdown(bl, charts, folder))
    page = folder / "memo.html"
    page.write_text(to_html(bl, charts, f"Design memo: {result.experiment}"))
    return {"markdown": md, "html": page, **{f"chart_{k}": v for k, v in charts.items()}}
