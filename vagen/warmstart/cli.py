"""The command line of `python -m vagen.sft` (its help is `vagen.warmstart.sft`'s): one task's warm start
(`vagen.warmstart.sft`) or, for a config that lists `rollout.tasks`, one model on every task's demonstrations
(`vagen.warmstart.mix`). It sits above both, so neither imports the other's caller."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vagen.warmstart import mix, sft


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vagen.sft", description=sft.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="name in configs/ or path of a YAML file")
    parser.add_argument("--policy", default="teacher", help="whose demonstrations: teacher | solver")
    parser.add_argument("--base", default=None, help="checkpoint to fine-tune (default: sft.base, else the built-in "
                                                     "model of env.render_mode)")
    parser.add_argument("--out", default=None, help="output directory (default: runs/warm_starts/<config>-<policy>-<time>)")
    parser.add_argument("--eval", type=int, default=0, help="then evaluate on N distinct held-out levels and write "
                                                             "card.json into the output directory")
    parser.add_argument("--evaluate", default=None, metavar="DIR",
                        help="no training: evaluate the warm start in DIR on --eval levels (256 if unset) and write "
                             "its card.json")
    parser.add_argument("--cells-only", action="store_true",
                        help="--base is a warm start: run only the cell-question stage on it (sft.cell_*)")
    parser.add_argument("--on-policy-only", action="store_true",
                        help="--base is a warm start: run only the on-policy stage on it (sft.on_policy_*)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    for flag, given in (("--cells-only", args.cells_only), ("--on-policy-only", args.on_policy_only)):
        if given and not (args.base and args.out):
            parser.error(f"{flag} continues an existing warm start: name it with --base and the result with --out")
    if args.cells_only and args.on_policy_only:
        parser.error("--cells-only and --on-policy-only each run one stage alone: choose one")
    if args.policy not in ("teacher", "solver"):
        parser.error(f"--policy {args.policy!r}: choose teacher or solver")
    from vagen.config import load_config_or_exit

    cfg = load_config_or_exit(args.config, args.overrides)
    tasks = None
    if cfg.rollout.tasks:  # one model on every task's demonstrations (vagen.warmstart.mix)
        if args.cells_only or args.on_policy_only:
            parser.error(f"config {cfg.name} lists rollout.tasks: its warm start is one schedule on every task's "
                         f"demonstrations, without a cell-question or on-policy stage; drop "
                         f"{'--cells-only' if args.cells_only else '--on-policy-only'}, or continue one task's warm "
                         f"start with its own config (python -m vagen.sft --config {cfg.rollout.tasks[0].config})")
        try:
            tasks = mix.mixed_tasks(cfg, args.overrides)
        except ValueError as err:
            parser.error(str(err))
    if not args.evaluate and sft.zero_stage(cfg) == 3:
        # Its stages hand one model from engine to engine and save it with save_pretrained: under ZeRO-3
        # the module holds only this rank's shards, and the saved weights were empty.
        parser.error(f"train.deepspeed_config={cfg.train.deepspeed_config} partitions the parameters (ZeRO stage 3), "
                     f"which a warm-start build does not support; build it with train.deepspeed_config="
                     f"deepspeed/zero2_bf16.json (model.dtype=bfloat16) or deepspeed/zero0_fp32.json, then train "
                     f"from it with ZeRO-3")
    if args.on_policy_only and not cfg.sft.on_policy_levels:
        parser.error("--on-policy-only runs the on-policy stage, but sft.on_policy_levels=0; add e.g. "
                     "sft.on_policy_levels=1000")
    if args.evaluate:
        checkpoint = Path(args.evaluate)
        n = args.eval or 256
        write_any_card(cfg, tasks, checkpoint, n)
        print(f"card written to {checkpoint / sft.CARD_FILE}", flush=True)
        return 0
    from vagen.distributed import init_distributed
    from vagen.models import base_checkpoint

    dist = init_distributed(timeout_minutes=cfg.train.dist_timeout_minutes)
    base = Path(args.base) if args.base else base_checkpoint(cfg.model, sft.base_path_of(cfg))
    out = Path(args.out) if args.out else sft.default_out(cfg, args.policy)
    command = " ".join(["python -m vagen.sft", *(argv if argv is not None else sys.argv[1:])])
    what = ", ".join(name for name, _, _ in tasks) if tasks else cfg.env.name
    print(f"warm start of {base} on {args.policy} demonstrations ({what}, config {cfg.name}) -> {out}", flush=True)
    if tasks:
        mix.build_mixed_warm_start(cfg, tasks, base, out, args.policy, dist, command=command,
                                   from_builtin=not args.base and sft.base_path_of(cfg).startswith("builtin:"))
    else:
        sft.build_warm_start(cfg, base, out, args.policy, dist, cells_only=args.cells_only, command=command,
                             on_policy_only=args.on_policy_only)
    if args.eval:
        write_any_card(cfg, tasks, out, args.eval)
        print(f"card written to {out / sft.CARD_FILE}", flush=True)
    print(f"train from it: deepspeed vagen/train.py --config {args.config} model.path={out}", flush=True)
    return 0


def write_any_card(cfg, tasks, checkpoint: Path, n: int) -> None:
    """`sft.write_card` with `sft.report`'s rows, or for a warm start of several tasks (`tasks` from
    `mix.mixed_tasks`) `vagen.warmstart.mix.write_mixed_card`."""
    if tasks:
        mix.write_mixed_card(cfg, tasks, checkpoint, n)
    else:
        sft.write_card(cfg, checkpoint, sft.report(cfg, checkpoint, n), n)
