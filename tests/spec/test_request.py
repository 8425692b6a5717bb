"""`PlanRequest` (service/spec/request.py): the plan `estimate` is asked for, resolved in the spec layer,
its errors naming the request's own fields (the CLI adds `--`)."""

from __future__ import annotations

import pytest

from service.spec import SpecError
from service.spec.request import PlanRequest

BASE = dict(model="llama2-13b", gpu="h100-sxm-80gb", gpus=32)


def error(**fields: object) -> SpecError:
    with pytest.raises(SpecError) as info:
        PlanRequest(**{**BASE, **fields}).resolve()  # type: ignore[arg-type]
    return info.value


def test_dp_and_the_global_batch_follow_from_the_gpus_and_the_layout():
    model, cluster, plan, workload = PlanRequest(**BASE, tp=2, pp=2, micro_batch=2, grad_accum=8).resolve()
    assert (plan.dp, plan.tp, plan.pp) == (8, 2, 2) and cluster.num_gpus == 32 and cluster.num_nodes == 4
    assert workload.batch_sequences == 2 * 8 * 8 and model.name == "llama2-13b"


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        (dict(gpus=12), "gpus", "allowed: a multiple of 8, or fewer"),
        (dict(tp=3), "tp", "allowed tp for this model and cluster: 1, 2, 4, 8"),
        (dict(zero=0, offload_optimizer=True), "offload_optimizer", ""),
        (dict(zero_hpz=3, zero=3), "zero_hpz", ""),
        (dict(tokens_to_train=1000.0), "tokens_to_train", "less than one optimizer step"),
        (dict(headroom=1.0), "headroom", "must be in [0, 1)"),
        (dict(model="llama9"), "model", "allowed: codellama-34b"),
        (dict(recompute_modules=("moe",)), "recompute_modules", "or engine megatron"),
    ],
)
def test_each_problem_names_the_request_field(fields, field, words):
    err = error(**fields)
    assert err.field == field and words in err.message, err
