"""Peak host memory of annotation's forward: the hidden states the language-model head reads, taken as
`vagen.models.forward_shared_prefix(..., final_hidden=True)` takes them (the backbone's last hidden
state caught on its way to the head), against asking the model for `output_hidden_states=True` (every
layer's hidden states kept until the call returns). Each way runs in a fresh process, under
`torch.no_grad()` as annotation runs; the figure is the growth of the process's peak resident memory
(VmHWM) over a forward, with the model loaded and one forward already run (the first call's own
allocations are printed apart).

    python benchmarks/bench_annotate.py                       # bench_memory's 0.5 B checkpoint, 4 x 1024 tokens
    python benchmarks/bench_annotate.py --layers 8 --rows 8 --tokens 512

The model is `benchmarks/bench_memory.py`'s (Qwen2.5-VL-shaped, hidden 896, the real vocabulary), built
once under its cache; the input is random token ids, one shared 156-token prefix as a system prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 2**20
WAYS = ("last_hidden_state", "output_hidden_states")


def peak() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:  # 5: resets VmHWM to the current resident size
        handle.write("5")


def measure(way: str, model_path: str, rows: int, tokens: int) -> dict:
    import torch

    from vagen.models import forward_shared_prefix, load_policy

    torch.set_num_threads(1)
    model, _ = load_policy(Path(model_path))
    model.eval()
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, tokens), generator=generator)
    ids[:, :156] = ids[0, :156]  # the shared system prompt
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    def forward():
        if way == "last_hidden_state":
            return forward_shared_prefix(model, inputs, final_hidden=True)
        out = model(**inputs, output_hidden_states=True, use_cache=False, logits_to_keep=torch.zeros(0, dtype=torch.long))
        return out.hidden_states[-1]

    with torch.no_grad():
        first = peak()
        forward()  # the first call's one-time allocations (kernels' workspaces, caches) are not the forward's
        warm_up = peak() - first
        reset_peak()
        before = peak()
        hidden = forward()
        grown = peak() - before
    return {"way": way, "grown": grown, "warm_up": warm_up, "hidden": hidden.numel() * hidden.element_size(),
            "layers": model.config.get_text_config().num_hidden_layers}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--cache", default="~/.cache/vagen/bench_memory")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.way:
        print(json.dumps(measure(args.way, args.model, args.rows, args.tokens)))
        return 0

    from benchmarks.bench_memory import build_checkpoint

    model, count = build_checkpoint(args.layers, args.cache)
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    rows = []
    for way in WAYS:
        done = subprocess.run([sys.executable, __file__, "--way", way, "--model", str(model), "--rows", str(args.rows),
                               "--tokens", str(args.tokens)], env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{way} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\n{count / 1e9:.3f} B parameters, {rows[0]['layers']} layers, {args.rows} rows x {args.tokens} tokens, "
          f"float32, no_grad; one [rows, tokens, hidden] tensor is {rows[0]['hidden'] / MIB:,.0f} MiB\n")
    print("| hidden states taken as | peak growth over a forward (MiB) | over the first forward (MiB) |")
    print("| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['way']} | {r['grown'] / MIB:,.0f} | {r['warm_up'] / MIB:,.0f} |")
    print(f"\nratio: {rows[1]['grown'] / max(rows[0]['grown'], 1):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
