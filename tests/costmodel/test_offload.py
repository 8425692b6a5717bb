"""Host offload (service/costmodel/offload.py): the bytes DeepSpeed 0.19.8 copies over PCIe, how much of
them hides behind compute, and what a step pays for them."""

import numpy as np
import pytest

from service.catalog import load_gpu, load_model
from service.costmodel import estimate, offload
from service.costmodel import memory as mem
from service.costmodel.data_parallel import regathered_fraction
from service.spec import ClusterSpec, Plan, Workload
from service.spec.params import ModelParams
from service.spec.zero import ZeroKnobs

H100 = load_gpu("h100-sxm-80gb")
LLAMA13 = load_model("llama2-13b")
CLUSTER = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, gpus_per_node=8)
WORK = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=2e9)
PSI = 13_015_864_320  # Llama-2-13B's parameters
NORMS = (2 * 40 + 1) * 5120  # the norm weights ZeRO-3 keeps whole on every GPU (under 1e5 elements each)
PCIE = H100.host_to_device_gb_per_s * 1e9


def _est(work=WORK, **kw):
    return estimate(LLAMA13, CLUSTER, Plan(**kw), work, params=ModelParams())


def test_persistent_norms_stay_on_the_gpu():
    assert float(mem.zero3_persistent_params(LLAMA13, 1, 1)) == NORMS


def test_param_fetch_bytes_of_13b_zero3_on_32_gpus_by_hand():
    """dp 32, 4 micro-batches, bf16: each micro-batch gathers every module twice (forward, backward) and
    each gather first copies the rank's 1/32 shard up: 8 × (Ψ − norms)/32 × 2 B = (Ψ − norms)/2 = 6.5 GB.
    With hpZ over a node only the first forward reads the 1/32 shard; the 7 later gathers read the 1/8
    secondary: (Ψ − norms) × 2 × (1/32 + 7/8) = 23.6 GB, 3.6× as much."""
    off = PSI - NORMS
    plain = offload.param_fetch_bytes_per_step(off, 2, 32, 1, 2, 4)
    hpz = offload.param_fetch_bytes_per_step(off, 2, 32, 8, 2, 4)
    assert plain == 6_507_724_800
    assert hpz == 23_590_502_400
    assert offload.hpz_secondary_write_bytes_per_step(off, 2, 8) == off * 2 / 8
    assert offload.hpz_secondary_write_bytes_per_step(off, 2, 1) == 0


def test_full_recompute_copies_up_what_deepspeed_gathers_a_third_time():
    """A fully recomputed 13B block is gathered for the recomputed forward and kept for its backward
    (regathered_fraction 0): the same two copies per micro-batch. A 70B block gathers its attention
    projections a third time, and copies their shards up a third time."""
    reuse = ZeroKnobs.for_model(LLAMA13).stage3_max_reuse_distance
    assert float(regathered_fraction(LLAMA13, 1, reuse)[0]) == 0.0
    llama70 = load_model("llama2-70b")
    third = float(regathered_fraction(llama70, 1, ZeroKnobs.for_model(llama70).stage3_max_reuse_distance)[0])
    none = offload.param_fetch_bytes_per_step(1e9, 2, 64, 1, 2, 8)
    full = offload.param_fetch_bytes_per_step(1e9, 2, 64, 1, 2 + third, 8)
    assert 0.15 < third < 0.2 and full == pytest.approx(none * (2 + third) / 2)


@pytest.mark.parametrize(
    ("stage", "ga", "down", "up"),
    [
        (3, 4, 4 * 2 + 4, 4 * 2),  # down and back up every micro-batch, then fp32 down at the boundary
        (3, 1, 2 + 4, 2),
        (2, 4, 4 * 2 + 4, 3 * 2),  # micro-batch 0 down only; the 3 later ones up, add, down
        (2, 1, 4, 0),  # the lone backward copies the fp32 gradient down, no accumulator
        (1, 4, 2 + 4, 2),  # stage 1 reduces at the boundary only: one accumulate, then fp32 down
        (1, 1, 4, 0),
    ],
)
def test_gradient_copies_per_step_follow_deepspeed(stage, ga, down, up):
    """Bytes per shard element of one step with the optimizer offloaded (bf16 gradients, fp32 master)."""
    d2h, h2d = offload.grad_copy_bytes_per_step(1.0, 2, np.array(stage), np.array(ga))
    assert (float(d2h), float(h2d)) == (down, up)


def test_updated_parameters_cross_pcie_only_where_one_side_is_on_the_gpu():
    both = np.array([True])
    none = ~both
    assert offload.updated_param_copy_bytes_per_step(1.0, 2, both, none) == 2  # 16-bit shard up
    assert offload.updated_param_copy_bytes_per_step(1.0, 2, both, both) == 0  # host-side copy
    assert offload.updated_param_copy_bytes_per_step(1.0, 2, none, both) == 4  # fp32 master down


def test_copies_hide_only_in_the_compute_the_collectives_leave_free():
    """The copy runs in series with the collectives (stream order; the PCIe link each GPU shares with its
    NIC): 1 s of compute behind which 0.8 s of collectives run hides 0.2 s of copies, not 1 s. The hidden
    part pays no SM contention (copy engines)."""
    assert offload.copy_exposed_s(0.1, 0.5, 1.0) == 0.0
    assert offload.copy_exposed_s(0.3, 0.8, 1.0) == pytest.approx(0.1)
    assert offload.copy_exposed_s(0.3, 1.2, 1.0) == pytest.approx(0.3)  # the window is full already
    assert offload.copy_exposed_s(0.3, 0.0, 0.0) == pytest.approx(0.3)  # nothing to hide behind


def test_parameter_offload_is_not_free_on_the_seed_plan():
    """Issue #32: dp32-z3-hpz8-mb1-ga4 with parameters on the CPU. Its 23.6 GB of fetches hide behind
    0.8 s of compute per micro-batch, but two copies hide behind nothing: the fp32 master partition down
    after the step (Ψ/32 × 4 B, blocking) and hpZ's secondary partition written back in the first forward
    ((Ψ − norms)/8 × 2 B, blocking on the compute stream): 30 + 59 ms."""
    base = dict(dp=32, zero_stage=3, micro_batch=1, grad_accum=4, recompute="none", zero_hpz_partition_size=8)
    plain, offpar = _est(**base), _est(**base, offload_params=True)
    expected = (PSI / 32 * 4 + (PSI - NORMS) / 8 * 2) / PCIE
    assert offpar.time_breakdown_s.offload == pytest.approx(expected)
    assert plain.time_breakdown_s.offload == 0
    assert offpar.step_time_s == pytest.approx(plain.step_time_s + expected)
    no_hpz = {**base, "zero_hpz_partition_size": 1}
    assert _est(**no_hpz, offload_params=True).time_breakdown_s.offload == pytest.approx(PSI / 32 * 4 / PCIE)


@pytest.mark.parametrize(
    "plan",
    [
        dict(zero_stage=1, offload_optimizer=True),
        dict(zero_stage=2, offload_optimizer=True),
        dict(zero_stage=3, offload_optimizer=True),
        dict(zero_stage=3, offload_params=True),
        dict(zero_stage=3, offload_params=True, offload_optimizer=True),
        dict(zero_stage=3, offload_params=True, zero_hpz_partition_size=8),
        dict(zero_stage=3, offload_params=True, offload_optimizer=True, zero_hpz_partition_size=8),
    ],
)
def test_a_plan_with_offload_is_strictly_slower_than_the_same_plan_without(plan):
    kw = dict(dp=32, micro_batch=1, grad_accum=4, recompute="full") | plan
    without = {k: v for k, v in kw.items() if not k.startswith("offload")}
    with_offload, plain = _est(**kw), _est(**without)
    assert with_offload.time_breakdown_s.offload > 0
    assert with_offload.step_time_s > plain.step_time_s


def test_offload_grows_with_grad_accum_where_deepspeed_copies_every_micro_batch():
    """Collectives not overlapped (overlap_comm off: DeepSpeed runs gathers, reductions and their copies
    on the compute stream), so every copy is exposed. Going from 4 to 8 micro-batches adds, per extra
    micro-batch: ZeRO-3 two shard fetches (2 × Ψ'/32 × 2 B) with parameters offloaded, or a gradient
    round trip (2 × Ψ/32 × 2 B) with the optimizer offloaded; stage 2 the same round trip; stage 1, which
    reduces and copies once per step, nothing."""
    serial = WORK.model_copy(update={"overlap_comm": False})
    doubled = serial.model_copy(update={"global_batch_sequences": 256})

    def extra(**kw):
        runs = [_est(w, dp=32, micro_batch=1, grad_accum=ga, **kw) for w, ga in ((serial, 4), (doubled, 8))]
        return runs[1].time_breakdown_s.offload - runs[0].time_breakdown_s.offload

    per_micro_batch = 2 * PSI / 32 * 2 / PCIE
    assert extra(zero_stage=3, offload_params=True) == pytest.approx(4 * 2 * (PSI - NORMS) / 32 * 2 / PCIE)
    assert extra(zero_stage=3, offload_optimizer=True) == pytest.approx(4 * per_micro_batch)
    assert extra(zero_stage=2, offload_optimizer=True) == pytest.approx(4 * per_micro_batch)
    assert extra(zero_stage=1, offload_optimizer=True) == pytest.approx(0.0, abs=1e-12)


def test_cpu_adam_and_the_updated_parameters_are_exposed_whole():
    """ZeRO-2 with the optimizer offloaded, gradient copies hidden: CPU Adam over the 1/32 shard at the
    catalog's 1 Gparam/s (0.41 s) plus the 16-bit shard back up (15 ms)."""
    e = _est(dp=32, zero_stage=2, offload_optimizer=True, micro_batch=1, grad_accum=4, recompute="full")
    cpu_adam = PSI / 32 / (H100.cpu_adam_gparams_per_s * 1e9)
    assert e.time_breakdown_s.offload == pytest.approx(cpu_adam + PSI / 32 * 2 / PCIE)
