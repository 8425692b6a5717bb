"""The production path on one lent GPU (issue #31): `preflight`, then a short real fine-tune of a
1B-width Llama created here, its measured tokens/s and peak memory against the cost model's prediction.

Nothing is downloaded: the checkpoint is a random-weight Llama at Llama-3.2-1B's width (hidden 2048, 32
heads, 8 KV heads, MLP 8192; fewer layers, `--layers`) saved with `save_pretrained`, with a WordLevel
tokenizer trained here on the synthetic text it then fine-tunes on. The experiment describes this
machine (one GPU of `--gpu`'s catalog type); the plan is `--zero` on that GPU. Steps:

1. `python -m service preflight EXP --plan LABEL --json`: the plan's steps timed, collectives,
   checkpoint write, and the GO / NO-GO verdict against the thresholds it states first;
2. `ProductionRun(..., weights=CKPT, data=JSONL)`: the fine-tune under Ray Train, loss, evaluation loss,
   the exported Hugging Face folder;
3. the cost model's estimate of the same plan (the shipped parameter set), beside what was measured.

    python benchmarks/gpu_finetune_check.py --gpu h100-sxm-80gb   # ≤ 5 min on one GPU
    python benchmarks/gpu_finetune_check.py --gpu cpu --hidden 64 --heads 4 --kv-heads 2 --ffn 128 \\
        --layers 2 --seq-len 64 --steps 3 --out /tmp/check.json   # the same path on a CPU, in miniature

Writes `--out` (default benchmarks/results/gpu_finetune_check.json). Exit 0 when both ran, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS_PATH = HERE / "results" / "gpu_finetune_check.json"
WORDS = [f"w{i}" for i in range(2000)]


def texts(rows: int, seed: int = 0) -> list[str]:
    """Learnable rows: runs of consecutive words, so the loss has something to go down on."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        start, length = int(rng.integers(0, len(WORDS))), int(rng.integers(200, 600))
        out.append(" ".join(WORDS[(start + k) % len(WORDS)] for k in range(length)))
    return out


def save_checkpoint(folder: Path, args: argparse.Namespace, corpus: list[str]) -> int:
    """A random-weight Llama of the asked width and its tokenizer in `folder`; returns the vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        [*corpus, " ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    vocab = len(fast)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_len, 128),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return vocab


def experiment(path: Path, args: argparse.Namespace, vocab: int) -> Path:
    """This machine as the experiment's cluster: one GPU (or CPU worker) of `--gpu`'s type."""
    data = {
        "name": "gpu-finetune-check",
        "model": {
            "name": "llama-1b-width",
            "num_layers": args.layers,
            "hidden_size": args.hidden,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
            "ffn_hidden_size": args.ffn,
            "vocab_size": vocab,
            "mlp": "swiglu",
            "tie_word_embeddings": False,
        },
        "cluster": {"gpu": args.gpu, "num_nodes": 1, "gpus_per_node": 1},
        "workload": {
            "seq_len": args.seq_len,
            "global_batch_sequences": args.micro_batch,
            "tokens_to_train": 1.0e9,
        },
        "budget": {"objective": "throughput"},
        "proxy": {
            "num_layers": args.layers,
            "num_workers": 1,
            "device": "cpu" if args.gpu == "cpu" else "cuda",
            "precision": "fp32" if args.gpu == "cpu" else "bf16",
            "steps": args.steps,
            "warmup_steps": 1,
        },
        "tracking": {"experiment_name": "gpu-finetune-check"},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def predicted(exp_path: Path, plan: Any) -> dict[str, float]:
    from service.costmodel import estimate
    from service.spec import load_experiment

    spec = load_experiment(exp_path)
    e = estimate(spec.model, spec.cluster, plan, spec.workload)
    return {
        "tokens_per_s": float(e.tokens_per_s),
        "tokens_per_s_low": float(e.tokens_per_s_interval[0]),
        "tokens_per_s_high": float(e.tokens_per_s_interval[1]),
        "memory_per_gpu_bytes": float(e.memory_per_gpu_bytes.total),
        "step_time_s": float(e.step_time_s),
    }


def run_preflight(exp_path: Path, label: str, work: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "service", "preflight", str(exp_path), "--plan", label, "--steps", "4",
           "--out", str(work / "preflight"), "--storage-path", str(work / "storage"),
           "--no-track", "--json"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    try:
        doc: dict[str, Any] = json.loads(proc.stdout)
    except ValueError:
        return {"exit": proc.returncode, "error": proc.stderr[-2000:]}
    production = doc.get("production", {})
    return {
        "exit": proc.returncode,
        "verdict": doc.get("verdict"),
        "go": doc.get("go"),
        "tokens_per_s": production.get("tokens_per_s"),
        "step_time_s": production.get("step_time_s"),
        "peak_memory_bytes": production.get("peak_memory_bytes"),
        "checkpoint": doc.get("checkpoint"),
    }


def run_finetune(exp_path: Path, plan: Any, ckpt: Path, data: str, work: Path, steps: int) -> dict[str, Any]:
    from service.train.production import ProductionRun

    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{work / 'mlflow.db'}")
    result = ProductionRun(
        exp_path, plan, steps=steps, storage_path=work / "runs", run_name="ft", weights=ckpt, data=data,
        eval_every=max(1, steps // 2),
    ).fit()  # fmt: skip
    metrics = result.last_metrics
    return {
        "status": result.status,
        "reason": result.reason,
        "losses": result.losses,
        "eval_losses": {str(k): v for k, v in result.eval_losses.items()},
        "tokens_per_s": metrics.get("tokens_per_s"),
        "step_time_s": metrics.get("step_time_s"),
        "peak_memory_bytes": metrics.get("measured_peak_memory_bytes_per_rank"),
        "model_state_bytes": metrics.get("measured_model_state_bytes_per_rank"),
        "activation_bytes": metrics.get("measured_activation_bytes_per_rank"),
        "metrics": metrics,
        "exported": bool(result.hf_model_dir and Path(result.hf_model_dir).is_dir()),
        "wall_s": result.wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100-sxm-80gb", help="catalog GPU of this machine (cpu: a CPU worker)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=400, help="JSON-lines rows of synthetic text")
    ap.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = ap.parse_args(argv)

    from service.spec import Plan

    precision = "fp32" if args.gpu == "cpu" else "bf16"
    plan = Plan(dp=1, zero_stage=args.zero, micro_batch=args.micro_batch, grad_accum=1, precision=precision)
    with tempfile.TemporaryDirectory(prefix="gpu-finetune-") as tmp:
        work = Path(tmp)
        corpus = texts(args.rows)
        vocab = save_checkpoint(work / "ckpt", args, corpus)
        data = work / "train.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus))
        exp_path = experiment(work / "experiment.yaml", args, vocab)
        result: dict[str, Any] = {
            "gpu": args.gpu,
            "model": {k: getattr(args, k) for k in ("hidden", "heads", "kv_heads", "ffn", "layers")},
            "vocab": vocab,
            "seq_len": args.seq_len,
            "plan": plan.short(),
            "predicted": predicted(exp_path, plan),
        }
        result["preflight"] = run_preflight(exp_path, plan.short(), work)
        result["finetune"] = run_finetune(exp_path, plan, work / "ckpt", str(data), work, args.steps)
    for stage in ("preflight", "finetune"):
        measured = result[stage].get("tokens_per_s")
        if measured:
            result[stage]["predicted_over_measured"] = result["predicted"]["tokens_per_s"] / measured
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({k: result[k] for k in ("plan", "predicted")}, indent=1))
    for stage in ("preflight", "finetune"):
        print(stage, {k: v for k, v in result[stage].items() if k not in ("metrics", "checkpoint", "losses")})
    print(f"wrote {args.out}")
    ok = result["finetune"]["status"] == "ok" and result["preflight"].get("tokens_per_s") is not None
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
