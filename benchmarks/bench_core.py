"""Time vagen.core's gae and turn_level_gae against the naive per-sequence loops of the tests.

Batch: B=256 sequences of L=4096 tokens, each a prompt followed by 8 turns of 50-150
generated tokens separated by observation gaps (image + text tokens); about a quarter of the
sequences have their last turn cut by the length limit (no turn end). Times are medians;
"max rel. error" is max |fast - naive| / max(|naive|, 1) over advantages and returns.

    PYTHONPATH=. python benchmarks/bench_core.py [--batch 256] [--length 4096] [--turns 8]
"""

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.core_reference import gae_ref, turn_level_gae_ref  # noqa: E402
from vagen.core import gae, turn_level_gae  # noqa: E402


def make_batch(batch: int, length: int, turns: int, seed: int = 0):
    """Random multi-turn layout: returns token_rewards, values, loss_mask, turn_end_mask [B, L]."""
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(batch, length, dtype=torch.bool)
    turn_end_mask = torch.zeros(batch, length, dtype=torch.bool)
    token_rewards = torch.randn(batch, length, generator=g) * 0.01  # per-token KL-like noise
    for b in range(batch):
        gen_lens = torch.randint(50, 151, (turns,), generator=g).tolist()
        room = length - sum(gen_lens) - 64
        gaps = torch.randint(100, max(101, room // turns), (turns,), generator=g).tolist()
        pos = int(gaps[0])  # prompt
        for k in range(turns):
            end = min(pos + gen_lens[k], length)
            loss_mask[b, pos:end] = True
            if end - 1 < length and pos < end:
                turn_end_mask[b, end - 1] = True
                token_rewards[b, end - 1] += float(torch.randn((), generator=g))
            pos = end + (gaps[k + 1] if k + 1 < turns else 0)
            if pos >= length:
                break
        if b % 4 == 3:  # truncated last turn
            last = int(loss_mask[b].nonzero().max())
            turn_end_mask[b, last] = False
    values = torch.randn(batch, length, generator=g)
    return token_rewards, values, loss_mask, turn_end_mask


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def max_rel_err(got: tuple, want: tuple) -> float:
    err = 0.0
    for x, y in zip(got, want, strict=True):
        err = max(err, float(((x - y).abs() / y.abs().clamp(min=1.0)).max()))
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20, help="vectorised runs (median taken)")
    parser.add_argument("--ref-repeats", type=int, default=3, help="naive-loop runs (median taken)")
    args = parser.parse_args()

    token_rewards, values, loss_mask, turn_end_mask = make_batch(args.batch, args.length, args.turns)
    n_gen = loss_mask.sum(1).float()
    gamma, lam = 0.99, 0.95
    turn_args = (0.95, 0.95, 1.0, 0.95)
    cases = [
        (
            "gae",
            lambda: gae(token_rewards, values, loss_mask, gamma, lam),
            lambda: gae_ref(token_rewards, values, loss_mask, gamma, lam),
        ),
        (
            "turn_level_gae",
            lambda: turn_level_gae(token_rewards, values, loss_mask, turn_end_mask, *turn_args),
            lambda: turn_level_gae_ref(token_rewards, values, loss_mask, turn_end_mask, *turn_args),
        ),
    ]
    print(
        f"B={args.batch} L={args.length} turns={args.turns} generated tokens/seq: mean {n_gen.mean():.0f}, "
        f"max {n_gen.max():.0f}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    )
    print()
    print("| function | naive loop (ms) | vectorised (ms) | speed-up | max rel. error |")
    print("|---|---:|---:|---:|---:|")
    for name, fast, naive in cases:
        fast()  # warm-up
        t_fast, got = timed(fast, args.repeats)
        t_naive, want = timed(naive, args.ref_repeats)
        print(
            f"| {name} | {t_naive * 1e3:.1f} | {t_fast * 1e3:.1f} | {t_naive / t_fast:.1f}x "
            f"| {max_rel_err(got, want):.1e} |"
        )


if __name__ == "__main__":
    main()
