"""Per-turn samples with a history window (`rollout.context=window`) against one sequence per trajectory
(`rollout.context=full`) as episodes grow: the update's speed and peak memory at 3, 10 and 30 turns.

    python benchmarks/bench_window.py                          # 3, 10, 30 turns; window of 2 turns
    python benchmarks/bench_window.py --turns 3 10 --window-turns 1 --episodes 4

Each (turns, mode) runs in a process of its own on the built-in VLM (`sokoban_visual`): the same scripted
play (a fixed well-formed answer that moves nothing, so every episode lasts exactly the given number of
turns), its samples annotated, then one `vagen.update.ppo_update` of the actor (GRPO, one epoch) in a real
DeepSpeed engine, timed, with the process's anonymous resident memory sampled during the update. The table
gives the longest sequence, the tokens of all samples (windows repeat earlier turns), the generated tokens
trained, generated tokens trained per second of update, and the update's peak memory above what the
process held before it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))

ANSWER = "<think>The box has not moved; I look at the board again before I push.</think><answer>Wait</answer>"


class ScriptedDecoder:
    """Answers every turn with `ANSWER`: a response of fixed length that the environment executes as no move."""

    def __init__(self, encoder):
        self.ids = encoder.encode_text(ANSWER) + [encoder.im_end_id]

    def start_rollout(self):
        pass

    def any_rank(self, flag):
        return flag

    def generate(self, episodes, rows, sampling):
        from vagen.decoding import Generated

        return [Generated(list(self.ids)) for _ in rows]


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from bench_memory import Sampler

    from vagen.config import load_config
    from vagen.distributed import init_distributed
    from vagen.episode import ChatEncoder
    from vagen.models import base_checkpoint, load_policy
    from vagen.rollout import rollout
    from vagen.train import make_engine
    from vagen.trajectory import episode_samples
    from vagen.update import annotate, compute_advantages, ppo_update

    dist = init_distributed()
    torch.set_num_threads(args.threads)
    cfg = load_config("sokoban_visual", [
        f"rollout.max_turns={args.turns}", f"rollout.context={args.mode}", f"rollout.window_turns={args.window_turns}",
        "rollout.env_groups=1", f"rollout.group_size={args.episodes}", "rollout.max_trajectory_length=100000",
        "algo.adv_estimator=grpo", f"train.mini_batch_size={args.episodes}",
        f"train.micro_batch_size={args.micro_batch_size}", "train.ppo_epochs=1"])
    model, processor = load_policy(base_checkpoint(cfg.model))
    encoder = ChatEncoder(processor)
    episodes, _ = rollout(model, encoder, cfg, [7], args.episodes, decoder=ScriptedDecoder(encoder))
    assert all(len(ep.turns) == args.turns for ep in episodes), [len(ep.turns) for ep in episodes]
    samples = [s for index, ep in enumerate(episodes) for s in episode_samples(ep, encoder, model, index)]
    engine = make_engine(model.train(), cfg, cfg.train.actor_lr, dist)
    annotate(samples, engine, None, None, cfg, encoder.pad_id, dist.device)
    compute_advantages(samples, cfg)
    sampler = Sampler()
    sampler.reset()
    before = sampler.anon
    sampler.start()
    t0 = time.perf_counter()
    ppo_update(engine, None, samples, cfg, encoder.pad_id, dist.device, shuffle=False)
    elapsed = time.perf_counter() - t0
    peak = sampler.anon
    result = {
        "turns": args.turns, "mode": args.mode, "samples": len(samples),
        "longest": max(s.length for s in samples), "tokens": sum(s.length for s in samples),
        "generated": int(sum(float(s.loss_mask.sum()) for s in samples)), "seconds": elapsed,
        "peak_mib": (peak - before) / 2**20,
    }
    Path(args.out).write_text(json.dumps(result))


def table(results: list[dict], window_turns: int) -> str:
    lines = ["| turns | context | samples | longest sequence | sequence tokens | generated tokens | update s | "
             "generated tokens/s | update peak above start (MiB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        mode = "full" if r["mode"] == "full" else f"window, {window_turns} turns"
        lines.append(f"| {r['turns']} | {mode} | {r['samples']} | {r['longest']:,} | {r['tokens']:,} | {r['generated']:,} | "
                     f"{r['seconds']:.1f} | {r['generated'] / r['seconds']:.0f} | {r['peak_mib']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[3, 10, 30])
    parser.add_argument("--window-turns", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=4, help="episodes per setting (one level group)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per forward/backward")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(argparse.Namespace(**{**vars(args), "turns": args.turns[0]}))
        return 0
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as work:
        for turns in args.turns:
            for mode in ("full", "window"):
                out = Path(work) / f"{turns}_{mode}.json"
                cmd = [sys.executable, __file__, "--worker", "--turns", str(turns), "--mode", mode, "--out", str(out),
                       "--window-turns", str(args.window_turns), "--episodes", str(args.episodes),
                       "--micro-batch-size", str(args.micro_batch_size), "--threads", str(args.threads)]
                env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
                done = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": str(args.threads)}, capture_output=True,
                                      text=True)
                if done.returncode != 0:
                    print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
                    return 1
                results.append(json.loads(out.read_text()))
                print(f"{turns} turns, {mode}: done", file=sys.stderr, flush=True)
    import torch

    print(f"sokoban_visual, built-in VLM, {args.episodes} episodes per setting, micro-batches of "
          f"{args.micro_batch_size} sequences, {args.threads} thread(s), torch {torch.__version__}")
    print(table(results, args.window_turns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
