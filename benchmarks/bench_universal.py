"""How long converting a checkpoint's engine states to DeepSpeed's universal form takes (`vagen.run.to_universal`,
what a run resumed on another rank count does first, on rank 0, while the other ranks wait), against the
bytes converted; prints a Markdown table row per setting.

    python benchmarks/bench_universal.py                          # 8 layers of 4096 x 4096: 134 M parameters
    python benchmarks/bench_universal.py --layers 2 --stage 2     # ZeRO-2

The model is a stack of `--layers` float32 Linear(`--width`, `--width`) layers (no bias) in a DeepSpeed engine
of one gloo rank with AdamW (torch's), `--stage` 2 or 3 in float32, after one optimizer step, so that the
engine states hold the fp32 weights and both AdamW moments (12 bytes a parameter). The states are saved as
vagen saves them (`checkpoints/step_1/deepspeed/actor`) and converted as vagen converts them at resume; the
save, the conversion and the bytes before and after are recorded, with the machine's 1-minute load average.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--stage", type=int, default=3, choices=(2, 3))
    parser.add_argument("--workers", type=int, nargs=2, default=None,
                        help="ds_to_universal's extract and merge processes (default: vagen's choice, 1 1 here)")
    args = parser.parse_args()
    import deepspeed
    import torch

    from vagen.config import load_config
    from vagen.distributed import init_distributed
    from vagen.run import to_universal

    init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
              "zero_optimization": {"stage": args.stage}, "bf16": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(1, args.width)).square().mean()
    engine.backward(loss)
    engine.step()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        ckpt = Path(tmp) / "step_1"
        t0 = time.perf_counter()
        engine.save_checkpoint(str(ckpt / "deepspeed"), tag="actor")
        saved_s = time.perf_counter() - t0
        states = folder_bytes(ckpt / "deepspeed")
        (ckpt / "trainer_state.json").write_text(json.dumps({"iteration": 0, "ranks": 1, "zero_stage": args.stage}))
        del engine, model
        cfg = load_config("bandit_text")
        t0 = time.perf_counter()
        out = to_universal(ckpt, cfg, 2, args.workers and tuple(args.workers))
        converted_s = time.perf_counter() - t0
        universal = folder_bytes(out)
    workers = "x".join(map(str, args.workers or (1, 1)))
    print(f"| ZeRO-{args.stage} | {workers} | {params / 1e6:.0f} M | {states / 1e9:.2f} GB | {saved_s:.1f} s | "
          f"{universal / 1e9:.2f} GB | {converted_s:.1f} s | {states / 1e6 / converted_s:.0f} MB/s | "
          f"{os.getloadavg()[0]:.1f} |")


if __name__ == "__main__":
    main()
