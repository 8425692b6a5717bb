"""FP8 (Transformer Engine): where it is allowed, what runs faster, what it costs in memory, and its
speed-up against published bf16/FP8 pairs."""

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from service.calibrate.runs import load_dataset
from service.catalog import load_model
from service.costmodel import estimate
from service.spec import ClusterSpec, Plan, Workload, plan_problem
from service.spec.params import ModelParams

LLAMA3_70B = load_model("llama3-70b")
H100 = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)
A100 = ClusterSpec(gpu="a100-sxm-80gb", num_nodes=8)
WORKLOAD = Workload(seq_len=8192, global_batch_sequences=64, tokens_to_train=1e9)
PRIOR = ModelParams()


def _pair(**kw):
    plan = Plan(dp=2, tp=8, pp=4, zero_stage=1, grad_accum=32, recompute="selective", **kw)
    bf16 = estimate(LLAMA3_70B, H100, plan, WORKLOAD, params=PRIOR)
    fp8 = estimate(LLAMA3_70B, H100, plan.model_copy(update={"precision": "fp8"}), WORKLOAD, params=PRIOR)
    return bf16, fp8


def test_fp8_needs_fp8_tensor_cores():
    plan = Plan(dp=64, zero_stage=3, precision="fp8")
    assert plan_problem(plan, LLAMA3_70B, H100) is None
    assert plan_problem(plan, LLAMA3_70B, A100) == (
        "precision",
        "a100-sxm-80gb has no FP8 tensor cores; allowed: bf16, fp16, fp32",
    )
    assert H100.gpu.peak_tflops_fp8 == pytest.approx(2 * H100.gpu.peak_tflops_bf16, rel=1e-3)


def test_fp8_speeds_up_the_block_gemms_only():
    bf16, fp8 = _pair()
    t0, t1 = bf16.time_breakdown_s, fp8.time_breakdown_s
    # Block GEMMs at 1.6× the rate (0.80 of twice: fp8_gemm_efficiency_max); attention core, LM head,
    # norms stay bf16: between 1/1.6 and 1.
    assert 1 / 1.6 < t1.compute / t0.compute < 0.9
    assert t1.tp_comm == t0.tp_comm and t1.pp_comm == t0.pp_comm  # activations stay bf16
    assert fp8.tokens_per_s > 1.1 * bf16.tokens_per_s  # tp and pp traffic stay bf16 and unhidden at the prior
    # MFU is quoted against the bf16 peak, so it rises with the speed-up.
    assert fp8.mfu / bf16.mfu == pytest.approx(fp8.tokens_per_s / bf16.tokens_per_s)


def test_fp8_weight_copies_and_amax_history():
    bf16, fp8 = _pair()
    matmul = (LLAMA3_70B.attention_params_per_layer + LLAMA3_70B.mlp_params_per_layer) / 8 * 20
    amax = 20 * 4 * 3 * 1024 * 4  # 20 layers × 4 GEMMs × 3 FP8 tensors × 1,024 fp32 values
    extra = fp8.memory_per_gpu_bytes.buffers - bf16.memory_per_gpu_bytes.buffers
    assert extra == pytest.approx(2 * matmul + amax)
    assert extra / 2**30 == pytest.approx(4.0, abs=0.1)  # ~2.1 B matmul params per GPU × 2 bytes
    assert fp8.memory_per_gpu_bytes.params == bf16.memory_per_gpu_bytes.params  # bf16 master params


def test_dynamic_scaling_reads_each_cast_input_twice():
    """torchao's tensorwise Float8 (the fsdp engine) reduces a tensor's amax before it casts it; TE's
    delayed scaling (megatron, deepspeed) casts with the scale from its history: 5 bytes per element
    against 3 (read 2, write 1), for Llama 3 70B's QKV and MLP inputs (2h) and the attention output
    and MLP hidden inputs ((h + f)/tp) of a block."""
    from service.costmodel import fp8
    from service.spec.engine import engine_rules

    h, f = LLAMA3_70B.hidden_size, LLAMA3_70B.ffn_hidden_size
    elements = 2 * h + (h + f) / 8
    assert fp8.cast_bytes_per_token_per_layer(LLAMA3_70B, 8, 3) == pytest.approx(3 * elements)
    assert fp8.cast_bytes_per_token_per_layer(LLAMA3_70B, 8, 3, True) == pytest.approx(5 * elements)
    assert fp8.cast_bytes_per_token_per_layer(LLAMA3_70B, 8, 0, True) == 0.0  # bf16 casts nothing
    scaling = {e: engine_rules(e).fp8_scaling for e in ("deepspeed", "megatron", "fsdp")}
    assert scaling == {"deepspeed": "delayed", "megatron": "delayed", "fsdp": "dynamic"}
    plan = Plan(dp=64, zero_stage=3, micro_batch=1, grad_accum=1, recompute="full", precision="fp8")
    ds, fsdp = (
        estimate(LLAMA3_70B, H100, plan.model_copy(update={"engine": e}), WORKLOAD, params=PRIOR)
        for e in ("deepspeed", "fsdp")
    )
    assert fsdp.time_breakdown_s.compute > ds.time_breakdown_s.compute


ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    """benchmarks/fp8_speedup.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("fp8_speedup", ROOT / "benchmarks" / "fp8_speedup.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_speedup_matches_the_published_pairs(tmp_path):
    """benchmarks/fp8_speedup.py: torchtitan's Llama 3.1 8B on 8 and 128 H100 in bf16 and Float8 (same
    torch.compile stack) sped up 1.280× and 1.286×; the shipped model's speed-ups are within 10 %."""
    out = tmp_path / "fp8.json"
    assert _benchmark().main(["--out", str(out)]) == 0
    pairs = json.loads(out.read_text())["pairs"]
    assert [round(p["measured_speedup"], 3) for p in pairs] == [1.280, 1.286]  # 8532/6667, 8380/6514
    for p in pairs:
        assert 1.0 < p["predicted_speedup"] < 2.0  # FP8 helps, and less than its 2× GEMM rate
        assert abs(p["speedup_error"]) <= 0.10, p


def test_a_pair_needs_one_row_of_each_precision(tmp_path):
    data = yaml.safe_load((ROOT / "benchmarks" / "published" / "fp8_pairs.yaml").read_text())
    data["measurements"][1]["precision"] = "bf16"  # two bf16 rows of the 8-GPU setup
    bad = tmp_path / "pairs.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="torchtitan-h100-llama3-8b-n8-compile-bf16: a pair is one bf16"):
        _benchmark().pairs(load_dataset(bad))
