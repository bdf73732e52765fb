"""Throughput of the training loop's two halves against bare Hugging Face / torch baselines,
measured in one process on the same model and batches.

    python benchmarks/bench_train.py [--config sokoban_visual] [--groups 4] [--group-size 4] [key=value ...]

- rollout: `vagen.rollout.rollout` (batched multi-turn generation + environment steps + image
  processing + bookkeeping), generated tokens per second, against bare `model.generate` on exactly
  the batches the rollout generated from (same sampling settings, same number of new tokens, no
  stop strings or token suppression). Measured twice: with the key/value cache kept across turns
  (`rollout.reuse_cache=true`, the default) and with the cache dropped every turn (the whole history
  runs again); both play the same episodes token for token.
- update: `vagen.update.ppo_update` (actor only, GRPO advantages) in a real DeepSpeed engine, tokens
  per second, against a bare loop of forward + backward + AdamW step over the same micro-batches.
- vision tower: forward + backward over the update's frames, frames per second, with the patch
  embedding as one matrix product (`vagen.models.matmul_patch_embedding`, what `load_policy` gives)
  against transformers' Conv3d.

Targets: rollout >= 80% of bare generate (both ways), update >= 70% of bare forward+backward, vision
tower at least as fast as with the convolution.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the left-padded batch of whole histories that bare `generate` takes, as the tests build it
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402
from hf_generate import batch_generation_inputs  # noqa: E402

from vagen import core  # noqa: E402
from vagen.batch_plan import chunks  # noqa: E402
from vagen.config import load_config  # noqa: E402
from vagen.episode import ChatEncoder, train_seeds  # noqa: E402
from vagen.models import base_checkpoint, load_policy  # noqa: E402
from vagen.rollout import make_decoder, rollout  # noqa: E402
from vagen.trajectory import collate, episode_to_sample, model_inputs  # noqa: E402
from vagen.update import annotate, compute_advantages, ppo_update  # noqa: E402


def measure_rollout(model, encoder, cfg, seeds, group_size):
    """Our rollout, recording every batch its decoder was given (the episodes' whole histories, as bare
    `generate` would need them) and how many tokens it produced."""
    captured = []
    decoder = make_decoder(cfg, model, encoder)
    decode = decoder.generate

    def recording(episodes, rows, sampling):
        new = decode(episodes, rows, sampling)
        ids = [encoder.finish_response(g.ids)[0] for g in new]
        captured.append((batch_generation_inputs(encoder, episodes), max(1, max(len(i) - 1 for i in ids)),
                         sum(len(i) for i in ids)))
        return new

    decoder.generate = recording
    torch.manual_seed(0)
    t0 = time.perf_counter()
    episodes, _ = rollout(model, encoder, cfg, seeds, group_size, decoder=decoder)
    elapsed = time.perf_counter() - t0
    tokens = sum(t.response_length for ep in episodes for t in ep.turns)
    return episodes, tokens, elapsed, captured


@torch.no_grad()
def measure_bare_generate(model, encoder, cfg, captured):
    """Plain `generate` on the captured batches: every row produces the turn's longest length."""
    ro = cfg.rollout
    tokens, elapsed = 0, 0.0
    for batch, new_tokens, _ in captured:
        t0 = time.perf_counter()
        out = model.generate(**batch, do_sample=True, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=encoder.pad_id)
        elapsed += time.perf_counter() - t0
        tokens += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return tokens, elapsed


def measure_update(engine, samples, cfg, encoder, device):
    t0 = time.perf_counter()
    ppo_update(engine, None, samples, cfg, encoder.pad_id, device, shuffle=False)
    elapsed = time.perf_counter() - t0
    return sum(s.length for s in samples) * cfg.train.ppo_epochs, elapsed


def measure_bare_update(model, samples, cfg, encoder):
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.actor_lr)
    per_step = cfg.train.mini_batch_size
    t0 = time.perf_counter()
    for _ in range(cfg.train.ppo_epochs):
        for mini in chunks(samples, per_step):
            micro = chunks(mini, cfg.train.micro_batch_size)
            for group in micro:
                batch = collate(group, encoder.pad_id)
                logits = model(**model_inputs(batch), use_cache=False).logits[:, :-1]
                logprobs = core.logprobs_from_logits(logits.float(), batch["input_ids"][:, 1:])
                mask = batch["loss_mask"][:, 1:]
                loss = -(logprobs * mask).sum() / mask.sum() / len(micro)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    return sum(s.length for s in samples) * cfg.train.ppo_epochs, elapsed


def measure_vision(model, samples, encoder, repeats: int = 3):
    """Frames per second of the vision tower's forward + backward over the samples' frames, with our
    patch embedding and with transformers' own (alternated, best of two each)."""
    visual = model.model.visual
    embed = visual.patch_embed
    ours_class, conv_class = type(embed), type(embed).__bases__[1]  # (_MatmulPatchEmbed, upstream)
    batch = collate(samples, encoder.pad_id)
    pixels, grids = batch["pixel_values"], batch["image_grid_thw"]
    best = {ours_class: float("inf"), conv_class: float("inf")}
    try:
        for _ in range(2):
            for cls in best:
                embed.__class__ = cls
                t0 = time.perf_counter()
                for _ in range(repeats):
                    visual(pixels, grid_thw=grids).pooler_output.square().sum().backward()
                best[cls] = min(best[cls], time.perf_counter() - t0)
    finally:
        embed.__class__ = ours_class
        model.zero_grad(set_to_none=True)
    frames = grids.shape[0] * repeats
    return frames / best[ours_class], frames / best[conv_class]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="sokoban_visual")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a shared machine's noise low)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. model.builtin_layers=4)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from vagen.distributed import init_distributed
    from vagen.train import make_engine

    dist = init_distributed()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [f"rollout.env_groups={args.groups}", f"rollout.group_size={args.group_size}",
                                    f"rollout.max_new_tokens={args.max_new_tokens}", "algo.adv_estimator=grpo",
                                    "train.mini_batch_size=8", "train.micro_batch_size=4", *args.overrides])
    model, processor = load_policy(base_checkpoint(cfg.model))
    encoder = ChatEncoder(processor)
    seeds = train_seeds(0, args.groups)
    model.eval()
    whole = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, reuse_cache=False))
    measure_rollout(model, encoder, cfg, seeds[:1], 1)  # warm-up
    episodes, ours_tokens, ours_time, _ = measure_rollout(model, encoder, cfg, seeds, args.group_size)
    replayed, whole_tokens, whole_time, captured = measure_rollout(model, encoder, whole, seeds, args.group_size)
    same = [ep.input_ids for ep in episodes] == [ep.input_ids for ep in replayed]
    bare_tokens, bare_time = measure_bare_generate(model, encoder, cfg, captured)

    samples = [episode_to_sample(ep, encoder, model) for ep in episodes]
    bare_model = copy.deepcopy(model).train()
    engine = make_engine(model.train(), cfg, cfg.train.actor_lr, dist)
    annotate(samples, engine, None, None, cfg, encoder.pad_id, dist.device)
    compute_advantages(samples, cfg)
    measure_bare_update(copy.deepcopy(bare_model), samples[:4], cfg, encoder)  # warm-up
    upd_tokens, upd_time = measure_update(engine, samples, cfg, encoder, dist.device)
    bare_upd_tokens, bare_upd_time = measure_bare_update(bare_model, samples, cfg, encoder)

    vision_ours, vision_conv = measure_vision(copy.deepcopy(bare_model), samples, encoder)

    rows = [
        ("rollout, cache across turns", ours_tokens / ours_time, bare_tokens / bare_time, 0.80),
        ("rollout, whole history", whole_tokens / whole_time, bare_tokens / bare_time, 0.80),
        ("update, trajectory tokens/s", upd_tokens / upd_time, bare_upd_tokens / bare_upd_time, 0.70),
        ("vision tower, frames/s", vision_ours, vision_conv, 1.00),
    ]
    print(f"config {args.config}: {args.groups}x{args.group_size} episodes, {len(captured)} generation batches, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; the two rollouts played "
          f"{'the same' if same else 'DIFFERENT'} episodes")
    print(f"{'measure':<30} {'vagen':>10} {'bare':>10} {'ratio':>7} {'target':>7}  met")
    ok = True
    for name, ours, bare, target in rows:
        ratio = ours / bare
        ok &= ratio >= target
        print(f"{name:<30} {ours:>10.1f} {bare:>10.1f} {ratio:>7.2f} {target:>7.2f}  {'yes' if ratio >= target else 'no'}")
    return 0 if ok and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
