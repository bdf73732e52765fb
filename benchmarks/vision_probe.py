"""Can the built-in tiny VLM learn to read a frame at all? A one-turn perception probe.

    python benchmarks/vision_probe.py [--env frozenlake|sokoban|navigation|manipulation] [--steps 2000] [--lr 1e-3]
                                      [--model builtin:tiny-vl] [--moves 8] [--position-code] [--size 112]
                                      [--question side|steps] [--train 2000]

FrozenLake 4x4 frames (28-px cells, 16 image tokens) with the player moved to a random cell, or the
first frames of Sokoban 6x6 levels (`--env sokoban`, 36 image tokens, rows 0-5); the
model is fine-tuned through the same tokenisation, masks and DeepSpeed engine as RL to answer
"Which row is the player in?" with `<answer>R</answer>`, and prints held-out exact-answer accuracy
every 100 steps (chance: 0.25). A warm start that acts on frames needs this to be learnable first.

Measured on 2 cores: the built-in model (which centres each image's tokens, see
`vagen.models.center_image_tokens`) stays at chance to step 600 and reaches 0.89 by step 800
(143 s); with `--no-center` it stays at chance for 2,000 steps. On Sokoban (where always answering
the most common row scores 0.355) accuracy is 0.26-0.49 to step 500, 0.99 at step 600 and 1.000 from
step 700 (0.18 s per step on 2 threads). `--position-code` (`model.builtin_position_code`): FrozenLake
1.000 at step 500, Sokoban starts 1.000 at step 500; with `--moves 8` (the frames of `sokoban_visual`'s
perception stage) 1.000 at step 600 without the code and at step 700 with it.

`--moves-question N` asks instead what lies on the cell that N random moves from the player reach
(frozen ice, a hole, the goal, off the map): what a FrozenLake policy must read before the later
moves of a turn. From the built-in model, held-out accuracy stayed at 0.53-0.61 for 1,500 steps for
N = 1 and N = 2, with or without the position code (always answering "frozen" scores 0.530-0.555). From the FrozenLake warm
start (`--model` its directory), N = 2 jumped at step 1,000 and held 0.83-0.85 from step 1,200 to
2,500 (majority 0.530); N = 1 stayed at 0.555 for 1,000 steps. So the tiny VLM can learn to read the
cell two moves away; the demonstrations alone do not teach it.

`--env navigation` asks where the target is ("Where is the red table? 0 = not in view, 1 = on my left,
2 = ahead, 3 = on my right", `--question side`) or how many steps are free ahead (`--question steps`),
on frames of `--size` pixels at the poses a slip-free teacher passes
(`vagen.warmstart.navigation_questions`). At 112 px without the position code (2,000 questions, batch
32, one thread beside about 15 other processes): held-out accuracy 0.675 / 0.665 / 0.685 / 0.690 at steps
100 to 400 against 0.595 for always "not in view" (300 s). `--env manipulation` asks for the action
that picks up a named object after the observation's listing of centres, answered in whole
(`pick (94, 124, 20)`, `vagen.warmstart.manipulation_questions`): with 1,000 questions, whole answers
right on 0.000 / 0.000 / 0.000 / 0.015 / 0.020 / 0.015 / 0.015 / 0.040 of 200 held-out levels at steps 100
to 800 (training loss 0.81 to 0.16).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import envs_visual  # noqa: E402
from vagen.config import load_config  # noqa: E402
from vagen.episode import ChatEncoder  # noqa: E402
from vagen.models import TinySpec, load_policy, resolve_model_path  # noqa: E402
from vagen.trajectory import collate  # noqa: E402
from vagen.warmstart.perception import (  # noqa: E402
    cell_answer,
    cell_question,
    perception_probes,
    question,
    question_sample,
)
from vagen.warmstart.sft import masked_logits, nll_loss, sft_engine  # noqa: E402


def probe_frame(env_name: str, seed: int, rng: np.random.Generator):
    """A frame, the player's row and the number of rows: FrozenLake 4x4 with the player on a random cell, or the start of
    a Sokoban 6x6 level (one box, 28-px cells as in `sokoban_visual`)."""
    if env_name == "sokoban":
        env = envs_visual.make("sokoban", dim_room=[6, 6], num_boxes=1, cell_size=28)
        env.reset(seed=seed)
        return env.render_image(), env.player // env.width, env.level.height
    env = envs_visual.make("frozenlake")
    env.reset(seed=seed)
    env.place_player((int(rng.integers(4)), int(rng.integers(4))))
    return env.render_image(), env.player[0], 4


def moves_probe(seed: int, rng: np.random.Generator, distance: int):
    """A FrozenLake 4x4 frame with the player on a random cell (holes included), a question about the
    cell that `distance` random moves from the player reach (what a policy must read before its later
    moves of a turn), and the answer digit (`vagen.warmstart.perception.CELL_ANSWERS`)."""
    from envs_visual.grid import DIRECTIONS

    env = envs_visual.make("frozenlake")
    env.reset(seed=seed)
    env.place_player((int(rng.integers(4)), int(rng.integers(4))))
    names = [str(n) for n in rng.choice(sorted(DIRECTIONS), size=distance)]
    return env.render_image(), cell_question(names), cell_answer(env.state(), env.player, names)


def probe_sample(env_name: str, seed: int, rng: np.random.Generator, encoder: ChatEncoder, model,
                 distance: int = 0):
    """A one-turn training sample and its answer: the player's row, or with `distance` the content of
    the cell that many random moves away (FrozenLake)."""
    if distance:
        frame, text, answer = moves_probe(seed, rng, distance)
        return question_sample(encoder, model, frame, text, answer, seed), answer

    frame, row, rows = probe_frame(env_name, seed, rng)
    return question_sample(encoder, model, frame, question("the player", "row", rows), row, seed), row


@torch.no_grad()
def accuracy(model, samples, pad_id: int) -> float:
    model.eval()
    hits = 0
    for start in range(0, len(samples), 50):
        logits, targets, mask = masked_logits(model, collate(samples[start:start + 50], pad_id), "cpu")
        hits += int(((logits.argmax(-1) == targets) | (mask == 0)).all(-1).sum())
    model.train()
    return hits / len(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", default="builtin:tiny-vl")
    parser.add_argument("--env", default="frozenlake", choices=["frozenlake", "sokoban", "navigation", "manipulation"],
                        help="frames to read: FrozenLake 4x4 (player moved to a random cell), Sokoban 6x6 starts, "
                             "navigation poses (vagen.warmstart.navigation_questions), or manipulation starts with "
                             "their listing of centres, asked for the pick action of one object "
                             "(vagen.warmstart.manipulation_questions: a copy, answered in whole)")
    parser.add_argument("--size", type=int, default=112,
                        help="navigation: the frame's width and height in pixels (112: 4x4 image tokens, 168: 6x6)")
    parser.add_argument("--question", default="side", choices=["side", "steps"],
                        help="navigation: where the target is (not in view, left, ahead, right) or the free steps "
                             "ahead (0-3)")
    parser.add_argument("--train", type=int, default=2000, help="training questions (distinct levels)")
    parser.add_argument("--vision-init", type=float, default=0.0,
                        help="re-initialise the vision tower's weight matrices with this std (0: keep)")
    parser.add_argument("--no-center", action="store_true",
                        help="remove the built-in model's per-image centring of image tokens")
    parser.add_argument("--moves", type=int, default=0,
                        help="frames of distinct levels after 0 to MOVES of the teacher's moves (as the perception "
                             "stage of a warm start sees them) instead of level starts / a randomly placed player")
    parser.add_argument("--position-code", action="store_true",
                        help="the built-in model with a row and column code on each image token "
                             "(model.builtin_position_code)")
    parser.add_argument("--named", action="store_true",
                        help="manipulation: answer with the object's listing line before the pick action")
    parser.add_argument("--layers", type=int, default=2,
                        help="decoder layers of the built-in model (model.builtin_layers)")
    parser.add_argument("--moves-question", type=int, default=0, metavar="N",
                        help="FrozenLake: ask what is on the cell N random moves from the player (frozen, hole, "
                             "goal, off the map) instead of the player's row")
    args = parser.parse_args()
    if args.moves_question and (args.env != "frozenlake" or args.moves):
        parser.error("--moves-question asks about FrozenLake frames with a randomly placed player: "
                     "use it without --env sokoban and --moves")
    from vagen.distributed import init_distributed

    dist = init_distributed()
    cfg = load_config("frozenlake_visual", [f"sft.lr={args.lr}", f"sft.batch_size={args.batch}",
                                            f"sft.micro_batch_size={args.batch}"])
    spec = TinySpec(num_layers=args.layers, image_position_code=args.position_code)
    model, processor = load_policy(resolve_model_path(args.model, cfg.model.builtin_cache, spec=spec))
    encoder = ChatEncoder(processor)
    if args.vision_init:
        with torch.no_grad():
            for param in model.model.visual.parameters():
                if param.dim() > 1:
                    torch.nn.init.normal_(param, std=args.vision_init)
    if args.no_center:
        model.model.visual._vagen_center = False
    rng = np.random.default_rng(0)
    if args.env == "navigation":
        from vagen.warmstart.navigation_questions import navigation_probes

        env = envs_visual.make("navigation", image_width=args.size, image_height=args.size)
        probes = navigation_probes(env, args.train + 200, questions=(args.question,))
        samples = [question_sample(encoder, model, p.frame, p.question, p.answer, p.seed) for p in probes]
        train, held_out, rows = samples[:args.train], samples[args.train:], [p.answer for p in probes[args.train:]]
    elif args.env == "manipulation":
        from vagen.warmstart.manipulation_questions import copy_probes

        env = envs_visual.make("manipulation", task="place", image_width=args.size, image_height=args.size)
        probes = copy_probes(env, args.train + 200, named=args.named)
        samples = [question_sample(encoder, model, p.frame, p.question, p.answer, p.seed, "Answer with one action.")
                   for p in probes]
        train, held_out, rows = samples[:args.train], samples[args.train:], [p.answer for p in probes[args.train:]]
    elif args.moves:  # the perception stage's frames: distinct levels after 0..moves of the teacher's moves
        cfg_env = load_config(f"{args.env}_visual").env
        probes = perception_probes(cfg_env, args.train + 200, args.moves, objects=("player",), axes=("row",))
        samples = [question_sample(encoder, model, p.frame, p.question, p.answer, p.seed) for p in probes]
        train, held_out, rows = samples[:args.train], samples[args.train:], [p.answer for p in probes[args.train:]]
    else:
        d = args.moves_question
        train = [probe_sample(args.env, seed, rng, encoder, model, d)[0] for seed in range(args.train)]
        held_out, rows = zip(*(probe_sample(args.env, 10**9 + seed, rng, encoder, model, d) for seed in range(200)))
        held_out, rows = list(held_out), list(rows)
    print(f"data: {time.process_time():.0f} CPU-s; held-out levels: {len(held_out)}; always answering the most common digit scores "
          f"{max(rows.count(r) for r in set(rows)) / len(rows):.3f}", flush=True)
    engine = sft_engine(model, cfg, dist)
    generator = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        picked = torch.randint(len(train), (args.batch,), generator=generator).tolist()
        loss = nll_loss(engine, collate([train[i] for i in picked], encoder.pad_id), dist.device)
        engine.backward(loss)
        engine.step()
        if step % 100 == 0:
            print(f"step {step:5d}  loss {loss.item():.3f}  held-out accuracy "
                  f"{accuracy(model, held_out, encoder.pad_id):.3f}  {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
