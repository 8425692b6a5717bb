"""The same worker loop without Ray: `torchrun --nproc_per_node N -m service.train.torchrun_entry CFG.json`.

CONFIG.json is a `WorkerConfig` dump (see `service.train.worker`). Rank 0 writes one JSON line of
metrics per step to `<run_dir>/torchrun_metrics.jsonl`. Used by the overhead benchmark (Ray vs torchrun)
and by anyone who wants to run a proxy plan on a machine without Ray.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from service.train.worker import run_worker


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[0]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    out = Path(config["run_dir"]) / "torchrun_metrics.jsonl"

    def report(metrics: dict[str, float], directory: str | None) -> None:
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps(metrics) + "\n")

    try:
        run_worker(config, report)
    finally:
        # torchrun leaves the process group to the program; one left alive at interpreter exit can
        # abort there ("terminate called without an active exception", SIGABRT, seen once in the
        # overhead benchmark) as gloo's threads are torn down unjoined.
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
