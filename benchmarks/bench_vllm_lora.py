"""LoRA with `rollout.backend=vllm` in bfloat16: does the engine sample the adapted policy the trainer
computes? The trainer runs each adapted layer unmerged, W x + s B (A x); the engine is given weights.
Merged into one bfloat16 tensor, W + s B A rounds every element whose change is under half a bfloat16
step of W back to W, so small adapters are partly lost. This measures how much, in weights and in the
log-probabilities of sampled tokens, against the engine-trainer gap that bfloat16 leaves without LoRA.
Runs in the vLLM environment (scripts/vllm_env.sh):

    .venv-vllm/bin/python benchmarks/bench_vllm_lora.py

Part 1 (arithmetic, no vLLM): a 2048 x 2048 W ~ N(0, 0.02) in bfloat16, a rank-64 adapter at scale 2
(the README's r = 64, alpha = 128) with A at peft's initialisation and B ~ N(0, b): the share of merged
weights exactly W, and the relative error of the adapter's output contribution x (merged - W)^T.

Part 2 (end to end): the built-in tiny Qwen2.5-VL without vagen's image hooks (a standard checkpoint,
random weights, W ~ N(0, 0.02) like Qwen's initialisation) in bfloat16, r = 64, alpha = 128 on every
language-model projection. So that a B of a given size moves the weights as much as it would at 3B
shape, A is drawn at the scale peft gives a 2048-wide layer (Qwen2.5-VL-3B's hidden size), not the tiny
model's 128. With Adam every step moves each entry of B by about the learning rate, so after k steps
at the README's train.actor_lr=1e-5 B's entries are at most ~k * 1e-5: b = 1e-4 is ~10 steps, 1e-3 ~100.
For each b two engines are synced (`VLLMDecoder.sync_weights`): one given the merged weights (an engine
built without `lora_rank`), one serving the adapters as adapters (`lora_rank=64`, vLLM's LoRA support).
Each plays sokoban_visual, and the engine's log-probability of each sampled token is compared with the
trainer's; `engine - base` is the gap to the trainer with its adapters switched off, the size of what
the engine must carry.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

RANK, ALPHA = 64, 128  # the README's LoRA settings
WIDE = 2048  # Qwen2.5-VL-3B's hidden size: the fan-in A is initialised for


def merge_rounding(b: float, size: int = 2048, rank: int = RANK, scale: float = ALPHA / RANK, seed: int = 0):
    """(share of bfloat16 merged weights exactly W, relative error of the adapter's output contribution)
    for W ~ N(0, 0.02) [size, size], A ~ peft's U(-1/sqrt(size), 1/sqrt(size)), B ~ N(0, b)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(size, size, generator=gen) * 0.02).bfloat16()
    lora_a = (torch.rand(rank, size, generator=gen) * 2 - 1) / size**0.5
    lora_b = torch.randn(size, rank, generator=gen) * b
    delta = scale * lora_b @ lora_a
    merged = (weight.float() + delta).bfloat16()
    x = torch.randn(256, size, generator=gen)
    exact = x @ delta.T
    served = x @ (merged.float() - weight.float()).T
    return (merged == weight).float().mean().item(), ((served - exact).norm() / exact.norm()).item()


def standard_tiny_vl(out: Path, cache: str) -> Path:
    """The built-in tiny Qwen2.5-VL at `out` without vagen's image hooks (stock vLLM runs it)."""
    from vagen.models import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE, resolve_model_path

    shutil.copytree(resolve_model_path("builtin:tiny-vl", cache, seed=0), out)
    config = json.loads((out / "config.json").read_text())
    for key in (CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def with_adapters(model, checkpoint: Path, b: float, seed: int = 0, rank: int = RANK, alpha: int = ALPHA):
    """A copy of `model` with LoRA adapters (rank, alpha) on every language-model projection: A drawn as peft
    draws it for a `WIDE`-wide layer, B ~ N(0, b), both in the model's dtype."""
    from vagen.config import load_config
    from vagen.decoding_vllm import lora_layers
    from vagen.models import add_adapters

    cfg = load_config(None, [f"model.path={checkpoint}", f"model.lora_rank={rank}", f"model.lora_alpha={alpha}"])
    adapted = add_adapters(copy.deepcopy(model), cfg.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(adapted).values():
            lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            lora_a.copy_((torch.rand(lora_a.shape, generator=gen) * 2 - 1) / WIDE**0.5)
            lora_b.copy_(torch.randn(lora_b.shape, generator=gen) * b)
    return adapted.eval()


def merged_share_equal(adapted) -> float:
    """Share of the adapted layers' weights that the merge into the base's dtype leaves exactly W."""
    from vagen.decoding_vllm import lora_layers

    same = total = 0
    for layer in lora_layers(adapted).values():
        weight = layer.base_layer.weight
        merged = (weight.float() + layer.get_delta_weight("default").float()).to(weight.dtype)
        same += int((merged == weight).sum())
        total += weight.numel()
    return same / total


@torch.no_grad()
def sampled_gaps(model, encoder, episodes, temperature: float) -> torch.Tensor:
    """|engine - trainer| log-probability of every sampled token of `episodes` under `model` [N]."""
    from vagen.trajectory import collate, episode_to_sample
    from vagen.update import token_logprobs

    gaps = []
    for episode in episodes:
        batch = collate([episode_to_sample(episode, encoder, model)], encoder.pad_id)
        logprobs, _ = token_logprobs(model, batch, temperature, with_entropy=False, suppress_ids=encoder.suppress_ids)
        for turn in episode.turns:
            start = turn.span[0]
            engine = torch.tensor(turn.sampled_logprobs)
            gaps.append((engine - logprobs[0, start : start + len(engine)].float()).abs())
    return torch.cat(gaps)


def play(model, encoder, decoder, cfg, seeds, group_size: int, sample_seed: int = 0):
    from vagen.rollout import rollout

    decoder.sync_weights(model)
    episodes, _ = rollout(model, encoder, cfg, seeds, group_size, decoder=decoder, sample_seed=sample_seed)
    return episodes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", default="1e-5,1e-4,1e-3,1e-2", help="sizes of B's entries, comma-separated")
    parser.add_argument("--groups", type=int, default=8, help="level groups per rollout")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=2, help="rollouts (sampling seeds) per row")
    parser.add_argument("--cache", default="~/.cache/vagen", help="where the built-in tiny model is built")
    args = parser.parse_args(argv)
    sizes = [float(b) for b in args.b.split(",")]

    print("Part 1: 2048 x 2048 W ~ N(0, 0.02), r = 64, scale 2, merged in bfloat16")
    print("| B entries | merged weights exactly W | adapter output contribution, relative error |")
    print("| --- | --- | --- |")
    for b in sizes:
        share, error = merge_rounding(b)
        print(f"| {b:.0e} | {share:.1%} | {error:.1%} |", flush=True)

    from vagen.config import load_config
    from vagen.decoding_vllm import VLLMDecoder
    from vagen.episode import ChatEncoder, train_seeds
    from vagen.models import load_policy

    work = Path(tempfile.mkdtemp(prefix="vagen_bench_vllm_lora_"))
    path = standard_tiny_vl(work / "tiny-vl", args.cache)
    model, processor = load_policy(path, "bfloat16")
    model.eval()
    encoder = ChatEncoder(processor)
    cfg = load_config("sokoban_visual", [
        f"model.path={path}", "model.dtype=bfloat16", f"rollout.max_turns={args.turns}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0"])
    seeds = train_seeds(0, args.groups)
    engines = {"merged": VLLMDecoder(path, encoder, dtype="bfloat16", seed=0),
               "served": VLLMDecoder(path, encoder, dtype="bfloat16", seed=0, lora_rank=RANK)}

    def gaps_of(policy, decoder, base=None):
        engine, lost = [], []
        for sample_seed in range(args.seeds):
            episodes = play(policy, encoder, decoder, cfg, seeds, args.group_size, sample_seed)
            engine.append(sampled_gaps(policy, encoder, episodes, 1.0))
            if base is not None:
                lost.append(sampled_gaps(base, encoder, episodes, 1.0))
        return torch.cat(engine), (torch.cat(lost) if lost else None)

    reference = {kind: gaps_of(model, decoder)[0] for kind, decoder in engines.items()}
    print(f"\nPart 2: tiny Qwen2.5-VL in bfloat16, sokoban_visual, {args.seeds} x {args.groups} x {args.group_size} "
          f"rollouts of {args.turns} turns; mean engine-trainer |log-prob gap| over sampled tokens")
    for kind, gaps in reference.items():
        print(f"no LoRA, {kind} engine{' (LoRA enabled, no adapter)' if kind == 'served' else ''}: mean "
              f"{gaps.mean():.2e}, max {gaps.max():.2e} over {gaps.numel()} tokens")
    print("| B entries (~Adam steps at lr 1e-5) | merged weights exactly W | gap, merged (x no LoRA) | "
          "gap, served as adapters (x no LoRA) | engine - base (what the adapters change) |")
    print("| --- | --- | --- | --- | --- |")
    for b in sizes:
        adapted = with_adapters(model, path, b)
        merged, _ = gaps_of(adapted, engines["merged"])
        served, lost = gaps_of(adapted, engines["served"], base=model)
        ratio = {kind: gaps.mean() / reference[kind].mean() for kind, gaps in (("merged", merged), ("served", served))}
        print(f"| {b:.0e} (~{b / 1e-5:,.0f}) | {merged_share_equal(adapted):.1%} | {merged.mean():.2e} "
              f"({ratio['merged']:.2f}x) | {served.mean():.2e} ({ratio['served']:.2f}x) | {lost.mean():.2e} |",
              flush=True)
    for decoder in engines.values():
        decoder.close()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
