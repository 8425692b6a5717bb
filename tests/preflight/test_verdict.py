"""`service preflight` without Ray: bus bandwidth as nccl-tests defines it, which collectives a plan uses,
the thresholds (stated before measuring, from the plan's own estimate), the verdict line, the measured
run in the runs format `calibrate` reads, and the CLI's output and exit-status contract."""

from __future__ import annotations

import json
import math

import pytest

from service.calibrate.crossval import calibrate
from service.calibrate.runs import load_runs
from service.costmodel.estimate import estimate
from service.planner import Planner
from service.preflight import collectives as coll
from service.preflight.record import RUNS_FILE, runs_document, write_runs_file
from service.preflight.verdict import (
    DEFAULT_BANDWIDTH_FRACTION,
    Thresholds,
    default_thresholds,
    failures,
    verdict_line,
    with_overrides,
)
from service.spec import ClusterSpec, Plan, load_experiment
from service.spec.param_bands import PUBLISHED_FIT_PARAMS
from service.spec.params import ModelParams, load_params, save_params
from service.train.production import choose_plan, full_scale

TINY = "experiments/tiny-cpu.yaml"


@pytest.fixture(scope="module")
def tiny():
    spec = load_experiment(TINY)
    return full_scale(spec), choose_plan(spec)


def test_bus_bandwidth_is_nccl_tests_definition():
    assert coll.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert coll.bus_factor("all_gather", 8) == coll.bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert coll.bus_factor("send_recv", 2) == 1.0 and coll.bus_factor("all_reduce", 1) == 0.0
    # 1 GB all-reduced among 4 ranks in 1 s: algbw 1 GB/s, busbw 1.5 GB/s
    assert coll.bus_bandwidth_bytes_per_s("all_reduce", 4, 1e9, 1.0) == pytest.approx(1.5e9)
    with pytest.raises(ValueError):
        coll.bus_factor("broadcast", 2)


def test_the_collectives_follow_the_zero_stage_and_layout():
    ops = lambda **kw: [op for op, _ in coll.plan_collectives(Plan(micro_batch=1, **kw))]  # noqa: E731
    assert ops(dp=4, zero_stage=0) == ["all_reduce"]
    assert ops(dp=4, zero_stage=1) == ["all_reduce", "all_gather"]  # DeepSpeed: bucket all-reduce
    assert ops(dp=4, zero_stage=3) == ["all_reduce", "all_gather", "reduce_scatter"]
    assert ops(dp=1, tp=2, zero_stage=0) == ["all_reduce"]
    assert ops(dp=1, pp=2, zero_stage=0) == ["all_reduce", "send_recv"]


def test_topology_groups_a_node_and_one_rank_per_node():
    one = coll.topology(["a", "a"])
    assert one.nodes == 1 and one.groups == {"intra_node": [[0, 1]]}
    two = coll.topology(["a", "a", "b", "b"])
    assert two.groups == {"intra_node": [[0, 1], [2, 3]], "inter_node": [[0, 2], [1, 3]]}
    assert coll.topology(["a", "b"]).groups == {"inter_node": [[0, 1]]}  # one GPU per node


def test_assumed_bandwidth_is_the_catalog_link_times_the_bus_efficiency(tiny):
    experiment, _ = tiny
    params = load_params()
    cpu = experiment.cluster
    got = coll.assumed_bus_bandwidth_bytes_per_s("intra_node", 2, cpu, params)
    assert got == pytest.approx(
        cpu.gpu.intra_node_bandwidth_gb_per_s * 1e9 * params["intra_node_bus_efficiency"]
    )
    h100 = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    inter = coll.assumed_bus_bandwidth_bytes_per_s("inter_node", 4, h100, params)
    nic = h100.gpu.inter_node_bandwidth_gb_per_s * 1e9 * params["inter_node_bus_efficiency"]
    assert inter == pytest.approx(nic)


def test_thresholds_come_from_the_tiny_experiments_own_estimate(tiny):
    experiment, plan = tiny
    t = default_thresholds(experiment, plan)
    e = estimate(experiment.model, experiment.cluster, plan, experiment.workload)
    assert (
        t.min_tokens_per_s == pytest.approx(e.tokens_per_s_interval[0])
        and t.min_tokens_per_s < e.tokens_per_s
    )
    assert t.max_memory_bytes == 4 * 2**30  # the CPU workers' cap, under the catalog's 24 GiB
    assert t.min_storage_gb_per_s == pytest.approx(experiment.goodput.bandwidth_gb_per_s(plan.num_gpus))
    assert t.min_bandwidth_fraction == DEFAULT_BANDWIDTH_FRACTION
    high = with_overrides(t, min_tokens_per_s=1e12, max_memory_bytes=None)
    assert high.min_tokens_per_s == 1e12 and high.max_memory_bytes == t.max_memory_bytes
    assert high.sources["min_tokens_per_s"] == "given on the command line"


def _measured(**kw):
    base = {
        "tokens_per_s": 4000.0,
        "peak_memory_bytes": 2**30,
        "collectives": [
            {"op": "all_reduce", "scope": "intra_node", "bus_gb_per_s": 1.0, "assumed_bus_gb_per_s": 1.4}
        ],
        "storage_gb_per_s": 0.5,
    }
    return {**base, **kw}


def test_verdict_go_and_each_no_go_reason():
    t = Thresholds(min_tokens_per_s=3000, max_memory_bytes=4 * 2**30, min_storage_gb_per_s=0.244)
    assert failures(t, _measured()) == [] and verdict_line([]) == "GO"
    slow = failures(t, _measured(tokens_per_s=100.0))
    assert slow == ["tokens/s 100 < 3,000"]
    assert verdict_line(slow) == "NO-GO: tokens/s 100 < 3,000"
    assert "peak memory 5.00 GiB > 4.00 GiB" in failures(t, _measured(peak_memory_bytes=5 * 2**30))
    link = [{"op": "all_gather", "scope": "inter_node", "bus_gb_per_s": 0.1, "assumed_bus_gb_per_s": 1.0}]
    (reason,) = failures(t, _measured(collectives=link))
    assert reason.startswith("all_gather inter_node bus bandwidth 0.1 GB/s < 0.5")
    assert failures(t, _measured(storage_gb_per_s=0.01)) == [
        "checkpoint write 0.01 GB/s < 0.244 GB/s (goodput model)"
    ]
    assert failures(t, _measured(error="oom")) == ["run failed: oom"]
    off = Thresholds(min_bandwidth_fraction=None)  # every check off
    assert failures(off, _measured(tokens_per_s=1.0, storage_gb_per_s=1e-9, collectives=link)) == []


def test_the_measured_run_loads_and_calibrates(tiny, tmp_path):
    experiment, plan = tiny
    doc = runs_document(experiment, plan, "fp32", 3000.0, run_id="preflight-x", when="2026-12-05")
    path = write_runs_file(doc, tmp_path)
    assert path.name == RUNS_FILE
    (run,) = load_runs(path)
    assert run.tokens_per_s_per_gpu == pytest.approx(3000.0 / plan.num_gpus)
    assert (
        run.plan.short() == plan.short() and run.cluster.gpu.name == "cpu" and run.model == experiment.model
    )
    row = doc["measurements"][0]
    assert row["approximate"] and "fp32" in row["assumptions"][0]  # the CPU computed in fp32
    # The run's attention kernel as the workload says (torch 2.13's SDPA: cuDNN's, where a GPU has it).
    assert doc["sources"][row["source"]]["cudnn_attention"] is experiment.workload.cudnn_attention
    params, cv = calibrate([run], ModelParams(), PUBLISHED_FIT_PARAMS, name="pf", crossval=False)
    assert cv is None and params.fit_runs == 1 and params.fit_on == [row["source"]]
    # ... and re-plans: `plan --params` on the set fit on the cluster's own run names it and moves the
    # measured plan's estimate towards what the cluster measured.
    replanned = Planner(experiment, params=save_params(params, tmp_path / "pf.yaml"), top_k=0).fit()
    assert replanned.selected is not None
    assert replanned.to_dict()["params"]["name"] == "pf"
    before = estimate(experiment.model, experiment.cluster, plan, experiment.workload).tokens_per_s
    after = estimate(
        experiment.model, experiment.cluster, plan, experiment.workload, params=params
    ).tokens_per_s
    assert abs(math.log(after / 3000.0)) < abs(math.log(before / 3000.0))


def _fake_result(reasons: list[str]):
    from service.preflight.first_hour import PreflightResult

    return PreflightResult(
        experiment="tiny-cpu",
        plan="dp1-tp1-pp2-z0-mb4-ga2-rc:none",
        verdict=verdict_line(reasons),
        reasons=reasons,
        thresholds=Thresholds().model_dump(),
        production={
            "status": "ok",
            "steps": 5,
            "tokens_per_s": 4000.0,
            "step_time_s": 0.13,
            "peak_memory_bytes": 2**30,
        },
        collectives=[],
        checkpoint={},
        out_dir="/nowhere",
    )


@pytest.mark.parametrize(("reasons", "code"), [([], 0), (["tokens/s 1 < 2"], 1)])
def test_cli_prints_one_json_document_and_exits_by_verdict(monkeypatch, capsys, reasons, code):
    import service.preflight.first_hour as run_module
    from service.cli.main import main

    seen = {}

    class Stub:
        def __init__(self, experiment, plan, **kw):
            seen.update(kw)

        def fit(self):
            return _fake_result(reasons)

    monkeypatch.setattr(run_module, "Preflight", Stub)
    assert main(["preflight", TINY, "--json", "--min-tokens-per-s", "5", "--max-memory-gib", "2"]) == code
    doc = json.loads(capsys.readouterr().out)  # exactly one document
    assert doc["go"] is (code == 0) and doc["verdict"] == ("GO" if code == 0 else "NO-GO: tokens/s 1 < 2")
    assert seen["overrides"]["min_tokens_per_s"] == 5 and seen["overrides"]["max_memory_bytes"] == 2 * 2**30
    assert main(["preflight", TINY]) == code
    assert capsys.readouterr().out.strip().splitlines()[-1] == doc["verdict"]  # the verdict: last line


def test_invalid_input_exits_2(capsys):
    from service.cli.main import main

    assert main(["preflight", TINY, "--plan", "dp9-nope"]) == 2
    assert "'dp9-nope' is not a valid plan" in capsys.readouterr().err
    assert main(["preflight", TINY, "--compare", "dp9-nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --compare") and "'dp9-nope' is not a valid plan" in err
    chosen = Planner(TINY).fit().selected.plan.short()
    assert main(["preflight", TINY, "--compare", chosen]) == 2
    assert "is the plan under test" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["preflight", TINY, "--steps", "0"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        main(["preflight", TINY, "--min-tokens-per-s", "nan"])
