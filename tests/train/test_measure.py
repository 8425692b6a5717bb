"""Measurement: model-state bytes from the tensors an optimizer holds, saved activations from autograd."""

from __future__ import annotations

import pytest
import torch

from service.spec import ModelSpec
from service.train.measure import ActivationMeter, model_state_bytes, peak_memory_bytes, reset_peak_memory
from service.train.model import apply_recompute, build_causal_lm, forward_loss

TINY = ModelSpec(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=172,
    vocab_size=128,
)


def test_model_state_of_plain_adamw_is_params_grads_and_two_moments():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    got = model_state_bytes(model, opt)
    assert got["params"] == 4 * n_params
    assert got["grads"] == 4 * n_params
    assert got["optimizer"] == 8 * n_params + 4 * 4  # exp_avg, exp_avg_sq, and a 4-byte step per tensor
    assert got["master"] == 0  # AdamW updates the parameters themselves
    assert got["model_state"] == got["params"] + got["grads"] + got["optimizer"]


def test_zero_offload_scratch_buffers_are_not_gradients():
    """ZeRO-1/2 offload's `temp_grad_buffer_for_*_offload` (largest-parameter-sized staging copies) are
    buffers; a real gradient attribute (`averaged_gradients`) stays a gradient."""
    model = torch.nn.Linear(8, 8, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    wrapper = type("ZeroLike", (), {})()
    wrapper.optimizer = opt
    wrapper.temp_grad_buffer_for_cpu_offload = torch.zeros(64)
    wrapper.temp_grad_buffer_for_gpu_offload = torch.zeros(64)
    wrapper.averaged_gradients = {0: [torch.zeros(32)]}
    got = model_state_bytes(model, wrapper)
    assert got["grads"] == 32 * 4
    assert got["buffers"] == 2 * 64 * 4
    assert got["model_state"] == got["params"] + got["grads"] + got["optimizer"] + got["master"]


def test_views_of_one_buffer_count_once():
    flat = torch.zeros(100)
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(flat[:40])
    module.b = torch.nn.Parameter(flat[40:])
    assert model_state_bytes(module, None)["params"] == 400


def test_activation_meter_counts_saved_tensors_once_and_not_parameters():
    lin = torch.nn.Linear(4, 8)
    x = torch.randn(5, 4)
    with ActivationMeter(lin) as meter:
        y = torch.relu(lin(x))
        z = (y * y).sum()  # y saved twice by mul: one storage
        assert meter.live_bytes == 5 * 4 * 4 + 5 * 8 * 4  # linear's input + relu's output, weight excluded
        z.backward()
    assert meter.peak_bytes == 5 * 4 * 4 + 5 * 8 * 4
    del y, z
    assert meter.live_bytes == 0  # backward released them


def test_recompute_modes_trade_saved_activations_and_keep_gradients():
    ids = torch.randint(0, TINY.vocab_size, (2, 32))
    peaks, grads = {}, {}
    for mode in ("none", "selective", "full"):
        model = build_causal_lm(TINY, seed=0)
        assert sum(p.numel() for p in model.parameters()) == TINY.num_params
        apply_recompute(model, mode)
        model.train()
        with ActivationMeter(model) as meter:
            forward_loss(model, ids).backward()
        peaks[mode] = meter.peak_bytes
        grads[mode] = model.lm_head.weight.grad.clone()
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    assert torch.allclose(grads["full"], grads["none"], atol=1e-6)
    assert torch.allclose(grads["selective"], grads["none"], atol=1e-6)
    with pytest.raises(ValueError, match="recompute"):
        apply_recompute(build_causal_lm(TINY, seed=0), "sometimes")


def test_cpu_peak_memory_is_the_process_high_water_mark():
    reset_peak_memory(torch.device("cpu"))
    before = peak_memory_bytes(torch.device("cpu"))
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = peak_memory_bytes(torch.device("cpu"))
    assert after - before >= 60 * 2**20
    del block


def test_busiest_rank_memory_takes_the_rank_that_holds_the_most():
    from service.train.rank_memory import busiest_rank_memory

    # [model_state, params, grads, optimizer, master, buffers, expert_state, activations, peak] per rank:
    # rank 0 is a first pipeline stage (more state), rank 1 the last (logits: more activations).
    rows = [
        [100.0, 40.0, 20.0, 30.0, 10.0, 5.0, 60.0, 700.0, 9000.0],
        [90.0, 36.0, 18.0, 27.0, 9.0, 50.0, 70.0, 900.0, 8000.0],
    ]
    got = busiest_rank_memory(rows)
    assert got["measured_model_state_bytes_per_rank"] == 100.0
    assert got["measured_buffers_bytes_per_rank"] == 5.0  # the breakdown of the same rank's state
    assert got["measured_expert_state_bytes_per_rank"] == 60.0
    assert got["measured_activation_bytes_per_rank"] == 900.0
    assert got["measured_peak_memory_bytes_per_rank"] == 9000.0


def test_activation_meter_cost_per_save_does_not_grow_with_depth(monkeypatch):
    """A save is checked against the running modules' parameters only: storage reads per save stay
    flat as layers are added (reading every parameter per save made a step O(layers²))."""
    from service.train import measure

    reads = {"n": 0}
    original = measure._storage_key

    def counting(t):
        reads["n"] += 1
        return original(t)

    monkeypatch.setattr(measure, "_storage_key", counting)
    per_save = {}
    for layers in (2, 16):
        model = build_causal_lm(TINY.model_copy(update={"num_layers": layers}), seed=0)
        model.train()
        saves = {"n": 0}
        meter = ActivationMeter(model)
        pack = meter._pack

        def counted_pack(t, pack=pack, saves=saves):
            saves["n"] += 1
            return pack(t)

        meter._hooks = torch.autograd.graph.saved_tensors_hooks(counted_pack, meter._unpack)
        reads["n"] = 0
        with meter:
            forward_loss(model, torch.randint(0, TINY.vocab_size, (1, 8))).backward()
        per_save[layers] = reads["n"] / saves["n"]
    assert per_save[16] < 1.5 * per_save[2]  # was 6.7x: every parameter of the model, at every save
