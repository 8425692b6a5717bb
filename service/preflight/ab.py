"""The first-hour A/B (`service preflight --compare`): which plan runs beside the chosen one, and what the
two measured. It informs; the verdict is the chosen plan's alone."""

from __future__ import annotations

from typing import Any

from service.preflight.result import finite
from service.spec.errors import SpecError
from service.spec.experiment import ExperimentSpec
from service.spec.params import ModelParams
from service.spec.plan import Plan


def other_plan(
    spec: ExperimentSpec, compare: str | Plan | None, chosen: Plan, params: ModelParams
) -> Plan | None:
    """The A/B's other plan; a SpecError naming --compare where there is none or it is the choice."""
    from service.planner import Planner
    from service.train.production import choose_plan

    if compare is None:
        return None
    if isinstance(compare, Plan):
        other = compare
    elif compare == "tie":
        found = Planner(spec, top_k=0, params=params).fit().tie_partner
        if found is None:
            raise SpecError("--compare", "nothing ties the chosen plan: there is no A/B to run")
        other = found
    else:
        try:
            other = choose_plan(spec, compare, params)
        except SpecError as e:
            raise SpecError("--compare", e.message) from None
    if other.short() == chosen.short():
        raise SpecError("--compare", f"{other.short()} is the plan under test; name another")
    return other


def ab_summary(production: Any, other: Any) -> dict[str, Any]:
    """The A/B's numbers: each plan's measured and predicted tokens/s, and which ran faster."""
    mine, theirs = (finite(r.last_metrics.get("tokens_per_s")) for r in (production, other))
    ab: dict[str, Any] = {
        "chosen": production.plan.short(),
        "other": other.plan.short(),
        "chosen_tokens_per_s": mine,
        "other_tokens_per_s": theirs,
        "chosen_predicted_tokens_per_s": finite(production.last_metrics.get("predicted_tokens_per_s")),
        "other_predicted_tokens_per_s": finite(other.last_metrics.get("predicted_tokens_per_s")),
        "other_status": other.status,
        "other_reason": other.reason,
        "other_run_dir": other.run_dir,
    }
    if mine and theirs and production.status == other.status == "ok":  # a failed run's speed is no A/B
        ab["other_over_chosen"] = theirs / mine
        faster, slower = (ab["other"], ab["chosen"]) if theirs > mine else (ab["chosen"], ab["other"])
        ab["line"] = (
            f"A/B: {faster} ran {abs(theirs / mine - 1):.1%} faster than {slower} "
            f"({mine:,.0f} vs {theirs:,.0f} tokens/s, {ab['chosen']} first)"
        )
    else:
        failed = other if other.status != "ok" or not theirs else production
        why = failed.reason or ("no tokens/s logged" if failed.status == "ok" else failed.status)
        ab["line"] = f"A/B: {failed.plan.short()} {failed.status}: {why}"
    return ab
