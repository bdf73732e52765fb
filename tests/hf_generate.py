"""transformers' own `generate` over an episode's whole history: the reference the decoders are checked
against (the same draws from the same seed), and a `Decoder` that plays rollouts with it."""

from __future__ import annotations

import contextlib

import torch

from vagen.decoding import Generated, Sampling, sampling_from


def batch_generation_inputs(encoder, episodes) -> dict[str, torch.Tensor]:
    """Left-padded batch of the episodes' histories, with their images in order."""
    width = max(len(ep.input_ids) for ep in episodes)
    input_ids = torch.full((len(episodes), width), encoder.pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(episodes), width), dtype=torch.long)
    for row, ep in enumerate(episodes):
        input_ids[row, width - len(ep.input_ids):] = torch.tensor(ep.input_ids)
        attention_mask[row, width - len(ep.input_ids):] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    pixel_values = [p for ep in episodes for p in ep.pixel_values]
    if pixel_values:
        batch["pixel_values"] = torch.cat(pixel_values)
        batch["image_grid_thw"] = torch.stack([g for ep in episodes for g in ep.image_grid_thw])
        batch["mm_token_type_ids"] = (input_ids == encoder.image_pad_id).long() * attention_mask
    return batch


@contextlib.contextmanager
def neutral_generation_config(model):
    """Inside, `model.generate` applies only the options it is given, none of the checkpoint's own."""
    from transformers import GenerationConfig

    own = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = own


@torch.no_grad()
def generate(model, encoder, episodes, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
             do_sample: bool | None = None) -> list[list[int]]:
    """One batched `model.generate` over the episodes' histories; the new ids of each row."""
    batch = batch_generation_inputs(encoder, episodes)
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    sample = temperature > 0 if do_sample is None else do_sample
    options = dict(do_sample=sample, max_new_tokens=max_new_tokens, pad_token_id=encoder.pad_id,
                   eos_token_id=sorted(encoder.stop_ids), suppress_tokens=encoder.suppress_ids,
                   stop_strings=["</answer>"], tokenizer=encoder.tokenizer, use_cache=True)
    if sample:
        options.update(temperature=max(temperature, 1e-5), top_p=top_p, top_k=top_k)
    else:
        options.update(temperature=None, top_p=None, top_k=None)
    with neutral_generation_config(model):
        out = model.generate(**batch, **options)
    return out[:, batch["input_ids"].shape[1]:].cpu().tolist()


class GenerateDecoder:
    """A `vagen.decoding.Decoder` that runs transformers' `generate` over each whole history."""

    def __init__(self, model, encoder):
        self.model, self.encoder = model, encoder

    def start_rollout(self) -> None:
        pass

    def any_rank(self, flag: bool) -> bool:
        return flag

    def generate(self, episodes, rows, sampling: Sampling) -> list[Generated]:
        out = generate(self.model, self.encoder, episodes, sampling.max_new_tokens, sampling.temperature,
                       sampling.top_p, sampling.top_k, sampling.do_sample)
        return [Generated(ids) for ids in out]


def decode(decoder, episodes, rows, max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
           do_sample: bool | None = None) -> list[list[int]]:
    """The new ids `decoder` generates for the episodes (a test's shorthand for one turn)."""
    cfg = type("Rollout", (), dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k))
    return [g.ids for g in decoder.generate(episodes, rows, sampling_from(cfg, do_sample))]
