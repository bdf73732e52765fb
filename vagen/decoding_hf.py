"""The `transformers` decoder: multi-turn generation that keeps every episode's keys and values from one
turn to the next.

`transformers`' `generate` starts from an empty cache, so each turn of a rollout would run the whole
conversation again (system prompt, every earlier frame through the vision tower, every earlier
answer) before it samples the first new token. `TurnGenerator` keeps one key/value cache for the
rollout's episodes instead: a turn feeds only the tokens that are not in it yet (the end of the
previous answer, the new observation and its frames), then decodes.

Rows of the cache are episodes. Their histories have different lengths, so each turn's new tokens are
left-padded to a common width and each decoding step feeds a padding token to rows that have stopped;
those slots are masked out for every later query, and positions are always the ones the model's
own rope-index function gives the unpadded sequence, so a token's keys and values are exactly those
that the training forward pass computes for it. Episodes that end are dropped from the cache.

Tokens are drawn on the model's device: the last position's logits never leave it, and only the drawn
ids (one per row) come back to decide which rows stop.

Under DeepSpeed ZeRO-3 every forward pass is collective (each layer gathers its parameters from all
ranks), while how many passes a rank needs depends on its data: how many tokens its rows decode before
they stop, how many turns its episodes last. `Lockstep` keeps the ranks together, as transformers'
`synced_gpus` does: a rank that is done keeps running idle forward passes, with the same modules in the
same order as the others' (the vision tower included when another rank feeds frames), until every rank
is done.

With `keep_cache=False` (`rollout.reuse_cache=false`) the cache is dropped before every turn, so each
turn runs the whole history again: the same numbers, for models or setups without a usable cache. A model
family whose padding is not inert (`Family.inert_padding`: Qwen3.5, whose linear-attention layers keep a
convolution window and a recurrent state that every fed token moves) always runs so: padding between
turns and the padding tokens fed to stopped rows would move those states. Within a turn the cache is
exact for them too: left padding before any real token leaves a zero state zero, and a stopped row's
state is never read again before the cache goes.
"""

from __future__ import annotations

import torch
from PIL import Image

from vagen.decoding import Generated, Sampling, draw, ends_turn
from vagen.distributed import Lockstep
from vagen.models import cache_argument, family_of, rope_positions, select_rows, without_wrapper


def idle_inputs(encoder, with_image: bool) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Token ids, pixel values and grids of a stand-in input for a rank's idle forward pass: one padding
    token, or one small frame when the other ranks run the vision tower."""
    if not with_image:
        return [encoder.pad_id], [], []
    pixel_values, grids = encoder.images_to_inputs([Image.new("RGB", (56, 56))])
    n = int(grids[0].prod()) // encoder.merge**2
    ids = encoder.encode_text("<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>")
    return ids, pixel_values, grids


class HFDecoder:
    """Generates the responses of a rollout's episodes turn after turn, with one cache across turns
    (see the module docstring). Implements `vagen.decoding.Decoder`."""

    def __init__(self, model, encoder, keep_cache: bool = True):
        self.model, self.encoder = model, encoder
        self.keep_cache = keep_cache and family_of(model).inert_padding
        self.lockstep = Lockstep(model)
        self.device = self.lockstep.device
        self.cache_arg = cache_argument(type(without_wrapper(model)))  # a LoRA policy's wrapper passes it on
        self.suppress = torch.tensor(encoder.suppress_ids, dtype=torch.long, device=self.device)
        self.token_text: dict[int, str] = {}
        self.start_rollout()

    def start_rollout(self) -> None:
        self.cache = None
        self.rows: list[int] = []  # rollout index of the episode in each cache row
        self.mask: torch.Tensor | None = None  # [rows, slots]: 1 where a slot holds one of the row's tokens
        self.fed: dict[int, list[int]] = {}  # per episode: the ids whose keys and values are in the cache
        self.fed_images: dict[int, int] = {}  # per episode: how many of its images are in the cache

    def any_rank(self, flag: bool) -> bool:
        return self.lockstep.any(flag)[0]

    def _text(self, token: int) -> str:
        if token not in self.token_text:
            self.token_text[token] = self.encoder.tokenizer.decode([token], skip_special_tokens=True)
        return self.token_text[token]

    def _positions(self, input_ids: list[int], image_grid_thw: list[torch.Tensor]) -> torch.Tensor:
        """Positions of a whole history [3, L] (vision) or [L] (text), as training computes them."""
        ids = torch.tensor(input_ids, dtype=torch.long)
        if not self.encoder.is_vision:
            return torch.arange(ids.shape[0])
        grids = torch.stack(image_grid_thw) if image_grid_thw else None
        return rope_positions(self.model, ids, grids, self.encoder.image_pad_id)

    def _forward(self, input_ids, positions, new_mask, images, grids):
        """One forward pass of `input_ids` [R, W] after the cache; returns the last position's logits
        [R, vocab] in float32, on the model's device."""
        device = self.device
        new_mask = new_mask.to(device)
        self.mask = new_mask if self.mask is None else torch.cat([self.mask, new_mask], dim=1)
        kwargs = dict(input_ids=input_ids.to(device), position_ids=positions.to(device),
                      attention_mask=self.mask, use_cache=True, logits_to_keep=1)
        if images:
            kwargs["pixel_values"] = torch.cat(images).to(device)
            kwargs["image_grid_thw"] = torch.stack(grids).to(device)
        if self.cache is not None:
            kwargs[self.cache_arg] = self.cache
        out = self.model(**kwargs)
        cache = getattr(out, "cache", None)
        self.cache = cache if cache is not None else getattr(out, "past_key_values", None)
        if self.cache is None:
            raise RuntimeError(f"{type(self.model).__name__} returned no key/value cache, which decoding needs even "
                               f"within one turn; use a transformers causal LM or image-text-to-text model")
        return out.logits[:, -1].float()

    def _idle_forward(self, with_image: bool) -> None:
        """A forward pass whose output is thrown away, run by a rank that has nothing to feed while others
        do (see `Lockstep`): the modules the others run, in the same order, outside the cache."""
        ids, pixel_values, grids = idle_inputs(self.encoder, with_image)
        positions = self._positions(ids, grids)
        kwargs = dict(input_ids=torch.tensor([ids], device=self.device), position_ids=positions[..., None, :].to(self.device),
                      attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=self.device),
                      use_cache=False, logits_to_keep=1)
        if pixel_values:
            kwargs["pixel_values"] = torch.cat(pixel_values).to(self.device)
            kwargs["image_grid_thw"] = torch.stack(grids).to(self.device)
        self.model(**kwargs)

    def _keep_rows(self, rows: list[int]) -> None:
        if rows == self.rows or self.cache is None:
            self.rows = list(rows)
            return
        where = {episode: k for k, episode in enumerate(self.rows)}
        missing = [r for r in rows if r not in where]
        if missing:
            raise ValueError(f"episodes {missing} are not in the cache (rows {self.rows}): an episode that "
                             f"left the generation cannot come back")
        keep = torch.tensor([where[r] for r in rows], dtype=torch.long)
        keep = keep.to(self.device)
        select_rows(self.cache, keep)
        self.mask = self.mask[keep]
        for r in set(self.rows) - set(rows):
            self.fed.pop(r, None)
            self.fed_images.pop(r, None)
        self.rows = list(rows)

    @torch.no_grad()
    def generate(self, episodes, rows: list[int], sampling: Sampling) -> list[Generated]:
        assert len(episodes) == len(rows), f"{len(episodes)=} {len(rows)=}"
        if not self.keep_cache:
            self.start_rollout()
        was_training = self.model.training
        self.model.eval()  # a training-mode model with gradient checkpointing would drop the cache
        try:
            images_here = any(len(ep.pixel_values) > self.fed_images.get(row, 0) for row, ep in zip(rows, episodes))
            rows_anywhere, images_anywhere = self.lockstep.any(bool(rows), images_here)
            if not rows_anywhere:
                return []
            if not rows:  # nothing of this rank's is left; the others still need this rank's passes
                self.start_rollout()
                self._idle_forward(with_image=images_anywhere)
                while self.lockstep.any(False)[0]:
                    self._idle_forward(with_image=False)
                return []
            if images_anywhere and not images_here:
                raise RuntimeError("under ZeRO-3 every rank's turn runs the same modules, but this rank's episodes "
                                   "brought no new frame while another rank's did; an environment in vision mode "
                                   "must return a frame with every observation")
            self._keep_rows(rows)
            logits, next_position = self._feed(episodes, rows)
            return [Generated(ids) for ids in self._decode(logits, next_position, rows, sampling)]
        finally:
            self.model.train(was_training)

    def _feed(self, episodes, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed what the cache does not hold yet of each episode's history (left-padded to one width);
        returns the logits of each row's last position and the position each row's next token takes."""
        chunks, chunk_positions, images, grids, next_position = [], [], [], [], []
        for row, episode in zip(rows, episodes):
            fed = self.fed.setdefault(row, [])
            if episode.input_ids[: len(fed)] != fed:
                raise RuntimeError(f"episode {row}'s history no longer starts with the tokens in the cache; "
                                   f"histories may only grow between turns")
            positions = self._positions(episode.input_ids, episode.image_grid_thw)
            chunks.append(episode.input_ids[len(fed):])
            chunk_positions.append(positions[..., len(fed):])
            next_position.append(int(positions.max()) + 1)
            first_image = self.fed_images.get(row, 0)
            images += episode.pixel_values[first_image:]
            grids += episode.image_grid_thw[first_image:]
            self.fed_images[row] = len(episode.pixel_values)
            fed += chunks[-1]
        n, width = len(rows), max(len(chunk) for chunk in chunks)
        input_ids = torch.full((n, width), self.encoder.pad_id, dtype=torch.long)
        positions = torch.zeros((3, n, width) if self.encoder.is_vision else (n, width), dtype=torch.long)
        new_mask = torch.zeros((n, width), dtype=torch.long)
        for k, (chunk, pos) in enumerate(zip(chunks, chunk_positions)):
            if chunk:
                input_ids[k, width - len(chunk):] = torch.tensor(chunk)
                positions[..., k, width - len(chunk):] = pos
                new_mask[k, width - len(chunk):] = 1
        logits = self._forward(input_ids, positions, new_mask, images, grids)
        return logits, torch.tensor(next_position, device=self.device)

    def _decode(self, logits, next_position, rows, sampling: Sampling) -> list[list[int]]:
        """Draw tokens until every row has ended its turn (and, under ZeRO-3, every rank its rows)."""
        n = len(rows)
        generated: list[list[int]] = [[] for _ in rows]
        texts = [""] * n
        running = [True] * n
        pad_ids = torch.full((n,), self.encoder.pad_id, dtype=torch.long, device=self.device)
        step = 0
        while True:
            decoding = any(running)
            if decoding:
                drawn = draw(logits, self.suppress, sampling)  # every row draws, as in generate
                tokens = drawn.tolist()
                feed = []
                for k, token in enumerate(tokens):
                    if running[k]:
                        generated[k].append(token)
                        piece = self._text(token)
                        texts[k] += piece
                        running[k] = not ends_turn(texts[k], piece, token, self.encoder.stop_ids)
                    feed.append(running[k])
                decoding = any(running) and step < sampling.max_new_tokens - 1
            # A rank whose rows are done keeps passing while another rank's still decode (ZeRO-3).
            if not self.lockstep.any(decoding)[0]:
                return generated
            step += 1
            if not decoding:
                running = [False] * n
                self._idle_forward(with_image=False)
                continue
            keep = torch.tensor(feed, device=self.device)
            step_ids = torch.where(keep, drawn, pad_ids)[:, None]
            step_positions = next_position[:, None]
            if self.encoder.is_vision:
                step_positions = step_positions[None].expand(3, -1, -1)
            logits = self._forward(step_ids, step_positions, keep.long()[:, None], [], [])
            for k, row in enumerate(rows):
                if feed[k]:
                    self.fed[row].append(tokens[k])
            next_position += keep.long()
