"""`classify_failure` on what Ray really raised (Ray 2.60, Train V2, CPU proxy on 2 workers): a worker
killed with SIGKILL mid-step is `killed`, not `oom` (Ray's hint for any dead worker names "the OOM
killer"); a plan over the worker's memory cap is still `oom`."""

from __future__ import annotations

import pytest

from service.train.proxy_trial import classify_failure

# `ray.train.WorkerGroupError` of a run whose rank-0 worker was sent SIGKILL at step 2 (paths trimmed).
KILLED = """Training failed due to worker errors:
[Rank 0 Error Snippet]:
A worker health check failed.
Worker info: Worker(
  actor=Actor(RayTrainWorker, 5c8b04a3932a013c37fddd3a01000000),
  metadata=ActorMetadata(
    hostname='vm',
    node_id='678a41c0cbc71e578b9b1807667f3c9c2abf55f27e780a7450d78ae3',
    node_ip='192.0.2.2',
    pid=31684,
  ),
  distributed_context=DistributedContext(world_rank=0, world_size=2, local_rank=0, local_world_size=2, \
node_rank=0),
  log_file_path='/tmp/ray/session_x/logs/train/ray-train-app-worker-84ae.log',
)
The actor died unexpectedly before finishing this task.
\tclass_name: RayTrainWorker
\tactor_id: 5c8b04a3932a013c37fddd3a01000000
\tpid: 31684
\tnamespace: 4a85b1da-e38f-4b4e-ba5f-14fe7ff5641b
\tip: 192.0.2.2
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: \
Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the \
process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the \
worker crashed unexpectedly due to SIGSEGV or another unexpected error. If the process was killed by the \
kernel OOM killer (verifiable by checking for OOM in dmesg of the OOMing node), consider enabling resource \
isolation via --enable-resource-isolation to prevent node deaths by resource contention and significant \
loss of progress by uninformed kernel OOM killing."""

# `ray.train.WorkerGroupError` of a plan over the worker's 0.05 GiB cap (RLIMIT_AS; paths trimmed).
CAPPED = """Training failed due to worker errors:
[Rank 0 Error Snippet]:
Traceback (most recent call last):
  File "service/train/worker.py", line 346, in train_loop_per_worker
    run_worker(config, report)
  File "service/train/worker.py", line 313, in run_worker
    loss = _mean_over_ranks(_train_step(engine, loader, cfg, meter if metered else None))
... (Output truncated. See individual worker logs for full details) ...
  File "transformers/models/llama/modeling_llama.py", line 164, in forward
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: \
you tried to allocate 5636096 bytes. Error code 12 (Cannot allocate memory)"""

CUDA = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
    "of 79.10 GiB of which 3.06 MiB is free."
)


def test_a_killed_worker_is_killed_not_oom() -> None:
    status, reason = classify_failure(KILLED)
    assert status == "killed"
    assert "rank 0" in reason and "pid 31684" in reason and "SYSTEM_ERROR" in reason
    assert "OOM killer" not in reason and "\n" not in reason


def test_a_dead_worker_wins_over_the_timeouts_it_causes() -> None:
    text = KILLED + "\n[Rank 1 Error Snippet]:\nRuntimeError: Timed out waiting 6000ms for recv"
    assert classify_failure(text)[0] == "killed"


@pytest.mark.parametrize("text", [CAPPED, CUDA, "MemoryError", "std::bad_alloc"])
def test_an_allocation_failure_is_oom(text: str) -> None:
    status, reason = classify_failure(text)
    assert status == "oom" and "\n" not in reason


def test_an_allocation_failure_wins_over_the_death_it_causes() -> None:
    # rank 0 ran out of memory and raised; rank 1 was torn down with the group
    assert classify_failure(CAPPED + "\n" + KILLED)[0] == "oom"


def test_an_oom_error_is_found_in_the_causes() -> None:
    class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name, without torch
        pass

    try:
        try:
            raise OutOfMemoryError("Tried to allocate 2.00 GiB")
        except OutOfMemoryError as inner:
            raise RuntimeError("worker group failed") from inner
    except RuntimeError as err:
        assert classify_failure(err)[0] == "oom"


def test_a_worker_that_crashed_by_itself_failed() -> None:
    status, reason = classify_failure("Worker exited unexpectedly: SIGSEGV")
    assert status == "failed" and reason.startswith("crashed: ")
    # Ray's hint names SIGSEGV among its guesses: no evidence of a crash
    assert classify_failure(KILLED)[0] == "killed"
