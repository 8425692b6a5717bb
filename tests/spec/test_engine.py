"""Each engine's rule table (service/catalog/engines/) against the limits its own code or docs state.

DeepSpeed and PyTorch are installed, so their limits are read from their source and types, not copied
from the table; Megatron-Core is not installed, so its row is checked for a citation per field and for
the behaviour the planner derives from it.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from service.spec import Plan, SpecError
from service.spec.engine import ENGINES, EngineRules, engine_rules, engines_with
from service.spec.errors import validate_as


def test_every_engine_has_a_table_with_a_source_for_every_field():
    for name in ENGINES:
        rules = engine_rules(name)
        assert rules.name == name
        fields = set(EngineRules.model_fields) - {"name", "sources", "why"}
        assert set(rules.sources) == fields
        assert all(len(text) > 20 for text in rules.sources.values())  # a citation, not a placeholder


def test_a_table_without_a_source_is_refused_with_the_field_named():
    data = engine_rules("fsdp").model_dump()
    del data["sources"]["offload"]
    with pytest.raises(SpecError, match="no source for offload"):
        validate_as(EngineRules, data, "fsdp.yaml")


def test_deepspeed_pipeline_engine_refuses_zero_2_and_3_and_runs_plain_1f1b():
    from deepspeed.runtime.pipe import engine
    from deepspeed.runtime.zero.config import ZeroStageEnum

    source = re.sub(r"\s+", "", inspect.getsource(engine))
    assert "assertself.zero_optimization_stage()<ZeroStageEnum.gradients" in source
    assert engine_rules("deepspeed").max_zero_stage_with_pp == int(ZeroStageEnum.gradients) - 1
    # The schedules PipelineEngine builds: 1F1B for training, one for inference; nothing interleaved.
    assert set(re.findall(r"schedule\.(\w+Schedule)\(", source)) == {"TrainSchedule", "InferenceSchedule"}
    assert not engine_rules("deepspeed").interleaved_pipeline
    # DualPipeV (two stages per rank) runs only for a DualPipeVModule, which the proxy never builds.
    train = Path(__file__).parents[2] / "service" / "train"
    assert not any("DualPipeV" in f.read_text() for f in train.glob("*.py"))


def test_deepspeed_has_zero_plus_plus_and_separate_offloads():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    keys = set(DeepSpeedZeroConfig.model_fields)
    assert {"zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients"} <= keys
    assert {"offload_optimizer", "offload_param"} <= keys  # two settings, not one
    assert engines_with("zero_plus_plus") == ["deepspeed"]
    # MiCS is gone (deepspeedai/DeepSpeed#8489): no config key, and the config parser names it removed.
    import inspect

    import deepspeed.runtime.config as ds_runtime_config

    assert not any(key.startswith("mics") for key in keys)
    assert "MiCS ZeRO-3 sharding has been removed" in inspect.getsource(ds_runtime_config)
    assert not engine_rules("deepspeed").shard_groups
    assert engine_rules("deepspeed").offload == "separate"


def test_fsdp_sharding_strategies_and_offload_match_its_row():
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy

    # NO_SHARD ~ 0, SHARD_GRAD_OP ~ 2, FULL_SHARD ~ 3 (HYBRID_* replicate those across groups): no stage 1.
    assert {"NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"} <= set(ShardingStrategy.__members__)
    assert engine_rules("fsdp").zero_stages == (0, 2, 3)
    # CPUOffload has one switch, offload_params, that moves parameters, gradients and optimizer step.
    assert set(CPUOffload.__dataclass_fields__) == {"offload_params"}
    assert engine_rules("fsdp").offload == "together"
    # HSDP: HYBRID_SHARD in FSDP1; FSDP2 all-reduces across replicas after every backward unless told not to.
    from torch.distributed.fsdp import FSDPModule

    assert "HYBRID_SHARD" in ShardingStrategy.__members__
    assert "HSDP" in (FSDPModule.set_requires_all_reduce.__doc__ or "")
    assert engines_with("shard_groups") == ["fsdp"] and engine_rules("fsdp").replica_sync == "micro_batch"


def test_torch_pipelining_has_the_interleaved_schedule_the_fsdp_row_allows():
    import torch.distributed.pipelining as pipelining

    assert hasattr(pipelining, "ScheduleInterleaved1F1B")
    assert engine_rules("fsdp").interleaved_pipeline


def test_the_overlaps_belong_to_megatron_and_need_sequence_parallel():
    assert engines_with("comm_overlap") == engines_with("tp_comm_overlap") == ["megatron"]
    overlaps = {"comm_overlap": True, "tp_comm_overlap": True}
    assert Plan(dp=4, tp=2, sequence_parallel=True, engine="megatron", **overlaps).tp_comm_overlap
    with pytest.raises(ValueError, match=r"tp_comm_overlap: .*\(TE userbuffers\) needs engine megatron"):
        Plan(dp=4, tp=2, sequence_parallel=True, tp_comm_overlap=True, engine="fsdp")


def test_deepspeed_cp_runs_without_a_pipeline_or_sequence_parallelism_as_the_trainer_builds_it():
    import torch

    from service.catalog import load_model
    from service.train.model import _build_context_parallel

    rule = engine_rules("deepspeed").context_parallel
    assert not rule.with_pipeline and not rule.with_sequence_parallel
    with pytest.raises(ValueError, match=r"cp: .*Ulysses attention without a pipeline.*needs pp = 1"):
        Plan(dp=2, pp=2, cp=2)
    with pytest.raises(ValueError, match=r"cp: .*needs sequence_parallel off"):
        Plan(dp=2, tp=2, cp=2, sequence_parallel=True)
    # What the rule stands for: the trainer (proxies and `service train`) refuses both before building.
    for fields in ({"pp": 2}, {"tp": 2, "sequence_parallel": True}):
        plan = Plan.model_construct(**{**Plan(dp=2, cp=2).model_dump(), **fields})
        with pytest.raises(ValueError, match="context-parallel proxies run with pp = 1"):
            _build_context_parallel(load_model("llama2-7b"), 0, plan, torch.float32)
    for engine in ("megatron", "fsdp"):  # Megatron-Core and torchtitan compose cp with pp and SP
        assert Plan(dp=2, tp=2, pp=2, cp=2, sequence_parallel=True, engine=engine).cp == 2


def test_catalog_holds_exactly_the_engines_the_plan_type_names():
    files = {p.stem for p in (Path(__file__).parents[2] / "service" / "catalog" / "engines").glob("*.yaml")}
    assert files == set(ENGINES)


def test_an_unknown_key_in_an_engine_entry_is_one_line_naming_it():
    from service.spec.engine import _flatten

    message = r"^x\.yaml: offload\.sourc: unknown key; allowed: value, source, why$"
    with pytest.raises(SpecError, match=message):
        _flatten({"offload": {"value": "none", "sourc": "typo"}}, Path("x.yaml"))
    flat = _flatten({"offload": {"value": "none", "source": "s", "why": "w"}}, Path("x.yaml"))
    assert flat == {"offload": "none", "sources": {"offload": "s"}, "why": {"offload": "w"}}
