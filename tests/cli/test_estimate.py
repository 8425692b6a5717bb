"""`python -m service estimate`: one plan's numbers, JSON contract, agreement with the API, bad flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from service.catalog import load_model
from service.cli.main import main
from service.costmodel import estimate
from service.spec import ClusterSpec, Plan, Workload

BASE = ["estimate", "--model", "llama2-13b", "--gpu", "h100-sxm-80gb", "--gpus", "32"]
GIB = 1024**3


def run_json(capsys, *flags: str) -> dict:
    assert main([*BASE, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_json_has_the_contract_fields_and_matches_the_cost_model(capsys):
    flags = ["--tp", "8", "--zero", "1", "--micro-batch", "1", "--grad-accum", "32", "--seq-len", "4096"]
    data = run_json(capsys, *flags, "--recompute", "selective", "--sequence-parallel")
    memory = data["memory_per_gpu_bytes"]
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(memory)
    for key in ("fits", "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu"):
        assert key in data
    assert data["label"] == "dp4-tp8-pp1-z1-mb1-ga32-rc:sele-sp"
    assert data["inputs"]["global_batch_sequences"] == 128  # mb · ga · dp
    assert data["tokens_per_s_per_gpu"] == pytest.approx(data["tokens_per_s"] / 32)
    terms = ("params", "grads", "optimizer", "activations", "logits", "buffers", "overhead")
    assert memory["total"] == pytest.approx(sum(memory[t] for t in terms))
    plan = Plan(
        dp=4, tp=8, zero_stage=1, micro_batch=1, grad_accum=32, recompute="selective", sequence_parallel=True
    )
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, gpus_per_node=8)
    workload = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=1e9)
    direct = estimate(load_model("llama2-13b"), cluster, plan, workload, memory_headroom=0.10)
    assert data["step_time_s"] == pytest.approx(direct.step_time_s)
    assert memory["total"] == pytest.approx(direct.memory_per_gpu_bytes.total)
    assert data["dollars"] == pytest.approx(direct.hours * 32 * 3.0)  # catalog price $3/GPU-hour


def test_estimate_flags_change_the_numbers_the_right_way(capsys):
    z0 = run_json(capsys, "--zero", "0", "--micro-batch", "1")
    z3 = run_json(capsys, "--zero", "3", "--micro-batch", "1")
    assert z3["memory_per_gpu_bytes"]["optimizer"] < z0["memory_per_gpu_bytes"]["optimizer"] / 16
    full = run_json(capsys, "--zero", "3", "--micro-batch", "1", "--recompute", "full")
    assert full["memory_per_gpu_bytes"]["activations"] < z3["memory_per_gpu_bytes"]["activations"] / 4
    assert full["step_time_s"] > z3["step_time_s"]
    tight = run_json(capsys, "--zero", "3", "--micro-batch", "1", "--headroom", "0.5")
    assert tight["memory_limit_bytes"] == pytest.approx(0.5 * 79.6 * GIB)
    priced = run_json(capsys, "--zero", "3", "--price-per-gpu-hour", "1.5", "--tokens-to-train", "2e9")
    assert priced["dollars"] == pytest.approx(priced["hours"] * 32 * 1.5)
    assert priced["hours"] == pytest.approx(2 * z3["hours"])
    # 800 Gb/s per 8-GPU node instead of a 400 Gb/s NIC per GPU: ZeRO-3's gathers cross a slower network.
    cloud = run_json(capsys, "--zero", "3", "--micro-batch", "1", "--inter-node-bandwidth", "12.5")
    assert cloud["time_breakdown_s"]["dp_comm"] > 2 * z3["time_breakdown_s"]["dp_comm"]
    assert cloud["tokens_per_s"] < z3["tokens_per_s"]
    eager = run_json(capsys, "--zero", "3", "--micro-batch", "1", "--no-flash-attention")
    assert eager["inputs"]["flash_attention"] is False
    assert eager["step_time_s"] > z3["step_time_s"]  # unfused attention is slower
    assert not run_json(capsys, "--micro-batch", "16")["fits"]  # ZeRO-0, no recompute, 16 × 4k tokens


def test_estimate_table_output(capsys):
    assert main([*BASE, "--zero", "3", "--offload-optimizer", "--recompute", "full"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dp32-tp1-pp1-z3-offopt-mb1-ga1-rc:full: llama2-13b on 32 × h100-sxm-80gb")
    assert "memory per GPU (GiB): fits" in out and "MFU" in out and "offloaded to host memory" in out
    assert "failure-free (`plan` and `run` add interruptions, checkpoints and restarts)" in out


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--tp", "3"], ["--tp", "allowed tp for this model and cluster: 1, 2, 4, 8"]),
        (["--tp", "16"], ["--tp", "does not divide num_attention_heads 40", "allowed tp for"]),
        (["--pp", "3"], ["--pp", "allowed pp for this model and cluster: 1, 2, 4, 8, 16, 32"]),
        (["--gpus", "12"], ["--gpus", "not a whole number of nodes", "allowed: a multiple of 8"]),
        (["--gpu", "h900"], ["--gpu", "unknown GPU 'h900'", "allowed: a100-sxm-40gb"]),
        (
            ["--model", "llama9"],
            ["--model", "unknown model 'llama9'", "allowed: codellama-34b, deepseek-v2-lite"],
        ),
        (["--zero", "2", "--pp", "2"], ["--zero", "zero_stage 0 or 1 only"]),
        (["--offload-params", "--zero", "2"], ["--offload-params", "needs zero_stage 3"]),
        (["--sequence-parallel"], ["--sequence-parallel", "needs tp > 1"]),
        (["--headroom", "1.5"], ["--headroom", "[0, 1)"]),
        (["--tokens-to-train", "-1"], ["--tokens-to-train", "positive"]),
        # NaN and infinity would reach --json as NaN / Infinity, which is not JSON
        (["--tokens-to-train", "nan"], ["--tokens-to-train", "must be a finite number"]),
        (["--price-per-gpu-hour", "inf"], ["--price-per-gpu-hour", "must be a finite number"]),
        (["--headroom", "abc"], ["--headroom", "not a number"]),
        (["--price-per-gpu-hour", "-2"], ["--price-per-gpu-hour"]),
        (["--inter-node-bandwidth", "0"], ["--inter-node-bandwidth", "greater than or equal to 0.01"]),
        (["--gpus", "0"], ["--gpus", "positive integer"]),
        (["--zero", "4"], ["--zero", "choose from 0, 1, 2, 3"]),
        (["--recompute", "some"], ["--recompute", "'selective'"]),
    ],
)
def test_bad_flags_are_one_line_exit_2(capsys, flags, needles):
    argv = [*BASE, *flags]
    if flags[0] in ("--gpus", "--gpu", "--model"):  # replace the base value instead of repeating the flag
        argv = [
            a for i, a in enumerate(BASE) if a != flags[0] and (i == 0 or BASE[i - 1] != flags[0])
        ] + flags
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        rc = exit_.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_model_yaml_path_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "mymodel.yaml"
    bad.write_text(
        "num_layers: 2\nhidden_size: 100\nnum_attention_heads: 3\nffn_hidden_size: 64\nvocab_size: 10\n"
    )
    assert main(["estimate", "--model", str(bad), "--gpu", "cpu", "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert str(bad) in err and "hidden_size 100 is not divisible by num_attention_heads 3" in err
    good = tmp_path / "ok.yaml"
    good.write_text(
        "num_layers: 2\nhidden_size: 96\nnum_attention_heads: 3\nffn_hidden_size: 64\nvocab_size: 10\n"
    )
    assert (
        main(["estimate", "--model", str(good), "--gpu", "cpu", "--gpus", "2", "--seq-len", "32", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["inputs"]["model"] == "ok"


def test_estimate_subprocess_is_light_and_fast():
    """No torch/ray/deepspeed in a fresh interpreter (torch alone takes seconds to import)."""
    code = (
        "import time; t0 = time.perf_counter()\n"
        "import sys, io, json, contextlib\n"
        "import service.cli.main, service.planner, service.costmodel\n"
        "start_s = time.perf_counter() - t0\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rc = service.cli.main.main({[*BASE, '--zero', '3', '--json']!r})\n"
        "heavy = [m for m in ('torch', 'ray', 'deepspeed') if m in sys.modules]\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy, 'start_s': start_s}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    seen = json.loads(proc.stdout)
    # The heavy modules are what would make it slow; its start time is a benchmark's business
    # (benchmarks/plan_speed.py), not a test's on 2 shared cores.
    assert seen["rc"] == 0 and seen["heavy"] == []


def test_engine_and_virtual_stages_flags(capsys):
    flags = ["--model", "gpt3-175b", "--gpu", "a100-sxm-80gb", "--gpus", "64", "--tp", "8", "--pp", "8"]
    flags += ["--zero", "1", "--grad-accum", "64", "--seq-len", "2048", "--recompute", "full"]
    plain = run_json(capsys, *flags, "--engine", "megatron")
    inter = run_json(capsys, *flags, "--engine", "megatron", "--virtual-stages", "3")
    assert inter["plan"]["engine"] == "megatron" and inter["label"].startswith("megatron:dp1-tp8-pp8v3")
    assert inter["time_breakdown_s"]["bubble"] < plain["time_breakdown_s"]["bubble"] / 2
    # DeepSpeed (the default engine) runs the layout with plain 1F1B, not the interleaved schedule; its
    # stage hops send the whole hidden state where Megatron's scatter/gather sends 1/tp of it. (Given
    # fused element-wise kernels, as Megatron's TE layers have, so the slots match.)
    deepspeed = run_json(capsys, *flags, "--fused-elementwise")["time_breakdown_s"]
    assert deepspeed["bubble"] == pytest.approx(plain["time_breakdown_s"]["bubble"], rel=0.1)
    assert deepspeed["pp_comm"] > 4 * plain["time_breakdown_s"]["pp_comm"]
    assert main(["estimate", *flags, "--virtual-stages", "3"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--virtual-stages" in err and "interleaved" in err


def test_cp_flag_splits_the_sequence(capsys):
    flags = ["--model", "llama3-70b", "--gpu", "h100-sxm-80gb", "--gpus", "64", "--tp", "8", "--pp", "1"]
    flags += ["--zero", "1", "--grad-accum", "16", "--seq-len", "32768", "--recompute", "full"]
    one, two = run_json(capsys, *flags), run_json(capsys, *flags, "--cp", "2")
    assert two["label"] == "dp4-tp8-pp1-cp2-z1-mb1-ga16-rc:full" and two["plan"]["cp"] == 2
    assert two["inputs"]["global_batch_sequences"] == 64 == one["inputs"]["global_batch_sequences"] // 2
    activations = two["memory_per_gpu_bytes"]["activations"] / one["memory_per_gpu_bytes"]["activations"]
    assert activations == pytest.approx(0.5)
    assert two["time_breakdown_s"]["cp_comm"] > 0 == one["time_breakdown_s"]["cp_comm"]
    # Ulysses needs whole heads per rank: 64 heads / tp 8 = 8, so cp 16 is refused, naming the flag.
    assert main(["estimate", *flags, "--gpus", "128", "--cp", "16", "--grad-accum", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--cp" in err and "8 attention heads per TP rank" in err
    # The service's DeepSpeed runs Ulysses without a pipeline: --cp 2 with --pp 2 names --cp.
    assert main(["estimate", *flags, "--pp", "2", "--cp", "2", "--grad-accum", "16"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--cp" in err and "needs pp = 1" in err


def test_zero_plus_plus_and_shard_group_flags(capsys):
    flags = ["--model", "llama2-70b", "--gpus", "1024", "--zero", "3", "--recompute", "full"]
    plain = run_json(capsys, *flags)
    zero_plus_plus = ["--zero-hpz", "8", "--zero-quantized-weights", "--zero-quantized-gradients"]
    plus = run_json(capsys, *flags, *zero_plus_plus)
    assert plus["label"] == "dp1024-tp1-pp1-z3-hpz8-qw-qg-mb1-ga1-rc:full"
    assert plus["time_breakdown_s"]["dp_comm"] < plain["time_breakdown_s"]["dp_comm"]
    hsdp = run_json(capsys, *flags, "--engine", "fsdp", "--shard-group-size", "16")
    assert hsdp["plan"]["shard_group_size"] == 16 and hsdp["label"].startswith("fsdp:dp1024-tp1-pp1-z3-sg16")
    assert hsdp["memory_per_gpu_bytes"]["optimizer"] > 60 * plain["memory_per_gpu_bytes"]["optimizer"]
    assert main(["estimate", *BASE[1:], "--zero", "2", "--zero-hpz", "8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--zero:" in err and "needs zero_stage 3" in err
    assert main([*BASE, *flags, "--shard-group-size", "16"]) == 2  # deepspeed: MiCS is gone
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--shard-group-size:" in err and "removed MiCS" in err


def test_fp8_precision_flag(capsys):
    flags = ["--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--zero", "1"]
    flags += ["--grad-accum", "32", "--seq-len", "8192", "--recompute", "selective"]
    bf16, fp8 = run_json(capsys, *flags), run_json(capsys, *flags, "--precision", "fp8")
    assert fp8["plan"]["precision"] == "fp8" and fp8["tokens_per_s"] > 1.1 * bf16["tokens_per_s"]
    assert main(["estimate", *flags, "--gpu", "a100-sxm-80gb", "--precision", "fp8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--precision" in err and "no FP8 tensor cores" in err


def test_fused_elementwise_flag(capsys):
    flags = ["--zero", "1", "--micro-batch", "1", "--grad-accum", "4", "--seq-len", "4096"]
    eager, fused = run_json(capsys, *flags), run_json(capsys, *flags, "--fused-elementwise")
    assert eager["inputs"]["fused_elementwise"] is False and fused["inputs"]["fused_elementwise"] is True
    assert fused["time_breakdown_s"]["compute"] < eager["time_breakdown_s"]["compute"]


def test_fused_cross_entropy_flag(capsys):
    """Llama 3 8B at 32K tokens: Liger's fused loss keeps no logits; the time is the same."""
    flags = ["--model", "llama3-8b", "--gpu", "h200-sxm-141gb", "--gpus", "8", "--zero", "3"]
    flags += ["--micro-batch", "1", "--grad-accum", "1", "--seq-len", "32768", "--recompute", "full"]
    whole, fused = run_json(capsys, *flags), run_json(capsys, *flags, "--fused-cross-entropy")
    assert whole["inputs"]["fused_cross_entropy"] is False and fused["inputs"]["fused_cross_entropy"] is True
    assert fused["memory_per_gpu_bytes"]["logits"] < whole["memory_per_gpu_bytes"]["logits"] / 10
    assert fused["step_time_s"] == whole["step_time_s"]


def test_cudnn_attention_flag(capsys):
    """Torch 2.13's SDPA runs cuDNN's attention on H100 by default; the flag prices FlashAttention-2."""
    flags = ["--zero", "3", "--micro-batch", "1", "--grad-accum", "4", "--seq-len", "4096"]
    cudnn, flash2 = run_json(capsys, *flags), run_json(capsys, *flags, "--no-cudnn-attention")
    assert cudnn["inputs"]["cudnn_attention"] is True and flash2["inputs"]["cudnn_attention"] is False
    assert cudnn["time_breakdown_s"]["compute"] < flash2["time_breakdown_s"]["compute"]


def test_selective_recompute_flag(capsys):
    """torchtitan's op policy re-runs every element-wise op and three of seven matmuls: on Llama 3 8B it
    costs more recompute than the attention sub-block and keeps fewer bytes."""
    flags = ["--model", "llama3-8b", "--zero", "3", "--micro-batch", "1", "--seq-len", "8192"]
    flags += ["--recompute", "selective"]
    block, op = (
        run_json(capsys, *flags),
        run_json(capsys, *flags, "--selective-recompute", "every_other_matmul"),
    )
    assert block["inputs"]["selective_recompute"] == "attention_block"
    assert op["inputs"]["selective_recompute"] == "every_other_matmul"
    assert op["memory_per_gpu_bytes"]["activations"] < block["memory_per_gpu_bytes"]["activations"]
    assert op["time_breakdown_s"]["recompute"] != block["time_breakdown_s"]["recompute"]


MIXTRAL_CONFIG = {  # mistralai/Mixtral-8x7B-v0.1 config.json, the fields a ModelSpec reads
    "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
    "num_experts_per_tok": 2, "tie_word_embeddings": False,
}  # fmt: skip


def test_estimate_a_mixtral_config_with_expert_parallelism(capsys, tmp_path):
    config = tmp_path / "mixtral" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(MIXTRAL_CONFIG))
    flags = ["--model", str(config), "--gpu", "h100-sxm-80gb", "--gpus", "64", "--engine", "megatron"]
    flags += ["--ep", "8", "--zero", "1", "--grad-accum", "4", "--recompute", "full", "--json"]
    assert main(["estimate", *flags]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["label"] == "megatron:dp64-tp1-pp1-ep8-z1-mb1-ga4-rc:full"
    memory = data["memory_per_gpu_bytes"]
    # The routed experts apart: 45.1B expert parameters over 8 EP ranks, ZeRO-1 over the 8 expert replicas.
    psi = 32 * 8 * 3 * 4096 * 14336 / 8
    assert memory["experts"] == pytest.approx(4 * psi + 12 * psi / 8)
    assert data["inputs"]["active_params"] / 1e9 == pytest.approx(12.88, abs=0.01)
    low, high = data["tokens_per_s_interval"]
    assert low < data["tokens_per_s"] < high
    assert 0.2 < data["mfu"] < 0.7  # on active FLOPs
    assert data["time_breakdown_s"]["ep_comm"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ep", "3"], "--ep: ep 3 does not divide num_experts 8"),
        (["--ep", "8", "--zero", "3"], "--zero: "),
        (["--expert-tp", "2"], "--expert-tp: "),
    ],
)
def test_bad_expert_flags_name_the_flag(capsys, tmp_path, flags, message):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MIXTRAL_CONFIG))
    base = ["estimate", "--model", str(config), "--gpu", "h100-sxm-80gb", "--gpus", "8"]
    assert main([*base, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_recompute_modules_flag_is_megatrons(capsys):
    flags = ["--model", "mixtral-8x7b", "--gpu", "h100-sxm-80gb", "--gpus", "64", "--ep", "8", "--zero", "1"]
    flags += ["--grad-accum", "4", "--seq-len", "4096", "--recompute", "selective"]
    default = run_json(capsys, *flags, "--engine", "megatron")
    moe = run_json(capsys, *flags, "--engine", "megatron", "--recompute-modules", "core_attn", "moe")
    assert default["inputs"]["recompute_modules"] == ["core_attn"]
    assert moe["inputs"]["recompute_modules"] == ["core_attn", "moe"]
    assert moe["memory_per_gpu_bytes"]["activations"] < default["memory_per_gpu_bytes"]["activations"]
    assert main(["estimate", *flags, "--recompute-modules", "moe"]) == 2  # the default engine: deepspeed
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--recompute-modules" in err and "engine megatron" in err
