import numpy as np
import pytest
import torch
from PIL import Image

from vagen.episode import ChatEncoder, Episode, Turn
from vagen.models import forward_shared_prefix, generated_positions, shared_prefix_length
from vagen.trajectory import collate, episode_to_sample, model_inputs


def _frame(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8))


def _two_turn_episode(encoder):
    """System + observation with an image, two answers, built the way the rollout builds them."""
    episode = Episode("sokoban", seed=3, group_id=0, system_prompt="Push the box.")
    responses = ["<think>box left</think><answer>Left</answer>", "<think>done</think><answer>Up, Up</answer>"]
    rewards = [0.4, 10.5]
    frames = [_frame(0), _frame(1)]
    for response, reward, frame in zip(responses, rewards, frames):
        append_turn(encoder, episode, frame, response, reward)
    return episode, responses, rewards, frames


def append_turn(encoder, episode, frame, response: str, reward: float = 0.0) -> None:
    """One turn appended to `episode` the way the rollout builds it: an observation with `frame`, then the
    response's ids with the end of the turn."""
    ids, pixel_values, grids = encoder.user_segment("Observation:\n<image>", [frame], first=not episode.turns,
                                                    system=episode.system_prompt)
    episode.input_ids += ids
    episode.pixel_values += pixel_values
    episode.image_grid_thw += grids
    generated, text = encoder.finish_response(encoder.encode_text(response))
    start = len(episode.input_ids)
    episode.input_ids += generated
    episode.turns.append(Turn("Observation:\n<image>", [frame], text, reward, {}, (start, len(episode.input_ids)),
                              len(generated)))


def test_sequence_equals_the_chat_template_over_all_turns_with_expanded_images(tiny_vl):
    _, model, processor = tiny_vl
    encoder = ChatEncoder(processor)
    episode, responses, _, frames = _two_turn_episode(encoder)
    messages = [{"role": "system", "content": "Push the box."}]
    for response in responses:
        messages.append({"role": "user", "content": [{"type": "text", "text": "Observation:\n"}, {"type": "image"}]})
        messages.append({"role": "assistant", "content": response})
    text = processor.apply_chat_template(messages, tokenize=False).rstrip("\n")
    reference = processor(text=[text], images=frames, return_tensors="pt")
    assert episode.input_ids == reference["input_ids"][0].tolist()
    assert torch.equal(torch.cat(episode.pixel_values), reference["pixel_values"])
    # 56x84 pixels -> 2x3 merged patches = 6 image tokens per frame
    assert episode.input_ids.count(encoder.image_pad_id) == 12


def test_masks_at_exact_positions(tiny_vl):
    _, model, processor = tiny_vl
    encoder = ChatEncoder(processor)
    tok = processor.tokenizer
    episode, responses, rewards, _ = _two_turn_episode(encoder)
    sample = episode_to_sample(episode, encoder, model)
    ids = sample.input_ids.tolist()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    # the assistant turns start after "<|im_start|>assistant\n" and end at their <|im_end|>
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    starts = [i + len(header) for i in range(len(ids)) if ids[i : i + len(header)] == header]
    ends = [ids.index(im_end, s) for s in starts]
    expected_loss = torch.zeros(len(ids))
    expected_turn_end = torch.zeros(len(ids))
    expected_rewards = torch.zeros(len(ids))
    for s, e, r in zip(starts, ends, rewards):
        expected_loss[s : e + 1] = 1
        expected_turn_end[e] = 1
        expected_rewards[e] = r
    assert len(starts) == 2
    assert torch.equal(sample.loss_mask, expected_loss)
    assert torch.equal(sample.turn_end_mask, expected_turn_end)
    assert torch.equal(sample.token_rewards, expected_rewards)
    assert ids[ends[0] + 2] == im_start  # "\n" then the next user turn: not trained on
    for (s, e), response in zip(zip(starts, ends), responses):
        answer_ids = [ids[i] for i in range(s, e) if sample.answer_mask[i]]
        think_ids = [ids[i] for i in range(s, e) if sample.think_mask[i]]
        answer = response[response.index("<answer>"):]
        think = response[: response.index("</think>") + len("</think>")]
        # a token overlapping a span belongs to it; with byte-level BPE "><" straddles both tags
        decoded_answer, decoded_think = tok.decode(answer_ids), tok.decode(think_ids)
        assert decoded_answer.endswith(answer) and len(decoded_answer) - len(answer) <= 1, decoded_answer
        assert decoded_think.startswith(think) and len(decoded_think) - len(think) <= 1, decoded_think
    covered = (sample.answer_mask + sample.think_mask) > 0
    assert int(covered.sum()) == int(sample.loss_mask.sum()) - 2  # every generated token but the <|im_end|>s


def test_position_ids_come_from_the_models_rope_index(tiny_vl):
    _, model, processor = tiny_vl
    encoder = ChatEncoder(processor)
    episode, *_ = _two_turn_episode(encoder)
    sample = episode_to_sample(episode, encoder, model)
    ids = sample.input_ids[None]
    expected, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == encoder.image_pad_id).int(),
                                             image_grid_thw=sample.image_grid_thw)
    assert torch.equal(sample.position_ids, expected[:, 0])
    image_positions = sample.position_ids[:, sample.input_ids == encoder.image_pad_id]
    assert image_positions.shape == (3, 12)
    # a 2x3 grid: height index in {0, 1}, width index in {0, 1, 2} relative to the image start
    first = image_positions[:, :6] - image_positions[0, 0]
    assert first[1].tolist() == [0, 0, 0, 1, 1, 1] and first[2].tolist() == [0, 1, 2, 0, 1, 2]


def test_training_forward_matches_sampling_logprobs(tiny_vl):
    """The padded training batch gives the same log-probabilities as the unpadded sequence."""
    _, model, processor = tiny_vl
    encoder = ChatEncoder(processor)
    episode, *_ = _two_turn_episode(encoder)
    short = Episode("sokoban", 4, 1, "Push the box.")
    ids, pv, grids = encoder.user_segment("Observation:\n<image>", [_frame(5)], True, "Push the box.")
    short.input_ids, short.pixel_values, short.image_grid_thw = ids + [1, 2, 3], pv, grids
    short.turns.append(Turn("", [], "", 0.0, {}, (len(ids), len(ids) + 3), 3))
    samples = [episode_to_sample(ep, encoder, model) for ep in (episode, short)]
    batch = collate(samples, encoder.pad_id)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw")}
    with torch.no_grad():
        padded = model(**inputs, use_cache=False).logits
        alone = model(input_ids=samples[0].input_ids[None], position_ids=samples[0].position_ids[:, None],
                      pixel_values=samples[0].pixel_values, image_grid_thw=samples[0].image_grid_thw).logits
    n = samples[0].length
    assert torch.allclose(padded[0, :n], alone[0], atol=1e-4)


def test_user_segment_rejects_images_for_a_text_model(tiny_text):
    _, _, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    with pytest.raises(ValueError, match="no vision tower.*set env.render_mode=text"):
        encoder.user_segment("<image>", [_frame(0)], True, "sys")


def _demo_batch(config, model, processor, episodes=3):
    from vagen.config import load_config
    from vagen.warmstart.sft import demo_samples, demo_sets

    cfg = load_config(config, [f"sft.demos={episodes}", "sft.val_demos=1", "sft.exclude_eval=4"])
    encoder = ChatEncoder(processor)
    samples = demo_samples(demo_sets(cfg, "teacher")[0], cfg, encoder, model)
    return collate(samples, encoder.pad_id)


def test_shared_prefix_length_stops_where_rows_differ_and_before_images():
    ids = torch.tensor([[5, 6, 7, 8, 9, 1], [5, 6, 7, 8, 2, 0], [5, 6, 7, 8, 9, 3]])
    lengths = torch.tensor([6, 5, 6])
    assert shared_prefix_length(ids, lengths) == 4
    assert shared_prefix_length(ids, lengths, stop_ids=(7,)) == 2  # the image token stays with its row
    assert shared_prefix_length(ids, lengths, limit=3) == 3  # ends before the first kept logit
    assert shared_prefix_length(ids, torch.tensor([6, 4, 6])) == 3  # every row keeps a token of its own
    assert shared_prefix_length(ids.flip(1), lengths) == 0


@pytest.mark.parametrize("config", ["frozenlake_visual", "sokoban_text"])
def test_shared_prefix_forward_equals_the_padded_forward(config, tiny_vl, tiny_text):
    """Logits, critic hidden states and gradients with the prompt prefix computed once equal those of
    one plain forward over the right-padded batch with its attention mask."""
    _, model, processor = tiny_vl if config.endswith("visual") else tiny_text
    batch = _demo_batch(config, model, processor)
    inputs = model_inputs(batch)
    positions = generated_positions(batch["loss_mask"])
    shapes = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        shared = forward_shared_prefix(model, inputs, logits_to_keep=positions)
    finally:
        hook.remove()
    rows, width = batch["input_ids"].shape
    prefix = shapes[0][1]
    assert shapes == [(1, prefix), (rows, width - prefix)] and prefix >= 30  # the system prompt at least
    generated = batch["loss_mask"][:, positions + 1].bool()  # elsewhere in `positions` a row is padding
    plain = model(**inputs, use_cache=False).logits[:, positions]
    assert torch.allclose(shared[generated], plain[generated], atol=1e-5)

    assert_equal_gradients(model, shared[generated], plain[generated])

    real = batch["attention_mask"].bool()
    with torch.no_grad():
        hidden = forward_shared_prefix(model.model, inputs)
        plain_hidden = model.model(**inputs, use_cache=False).last_hidden_state
    assert torch.allclose(hidden[real], plain_hidden[real], atol=1e-5)


def test_one_row_or_no_common_prefix_runs_a_single_forward(tiny_text):
    _, model, processor = tiny_text
    batch = _demo_batch("sokoban_text", model, processor, episodes=1)
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        forward_shared_prefix(model, model_inputs(batch), logits_to_keep=generated_positions(batch["loss_mask"]))
    finally:
        hook.remove()
    assert len(calls) == 1


def test_an_appended_im_end_is_a_turn_end_but_not_sampled(tiny_text):
    """Turn 1 stopped at `</answer>` (the rollout appended <|im_end|>); turn 2 sampled <|im_end|> itself."""
    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    im_end, eot = encoder.im_end_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")
    first = encoder.encode_text("<answer>Left</answer>")
    second = encoder.encode_text("<answer>Up</answer>") + [im_end]
    assert not encoder.sampled_end(first) and encoder.sampled_end(second)
    assert not encoder.sampled_end(encoder.encode_text("<answer>Up</answer>") + [eot, im_end])  # <|endoftext|> replaced
    episode = Episode("bandit", seed=0, group_id=0, system_prompt="Choose.")
    spans = []
    for turn, generated in enumerate((first, second)):
        ids, _, _ = encoder.user_segment("Which way?", [], first=turn == 0, system="Choose.")
        episode.input_ids += ids
        closed, text = encoder.finish_response(generated)
        start = len(episode.input_ids)
        episode.input_ids += closed
        spans.append((start, len(episode.input_ids)))
        episode.turns.append(Turn("Which way?", [], text, 1.0, {}, spans[-1], len(closed),
                                  end_sampled=encoder.sampled_end(generated)))
    sample = episode_to_sample(episode, encoder)
    (s1, e1), (s2, e2) = spans
    expected_loss = torch.zeros(sample.length)
    expected_loss[s1:e1] = 1
    expected_loss[s2:e2] = 1
    expected_sampled = expected_loss.clone()
    expected_sampled[e1 - 1] = 0  # the appended <|im_end|> of turn 1
    assert sample.input_ids[e1 - 1] == im_end and sample.input_ids[e2 - 1] == im_end
    assert torch.equal(sample.loss_mask, expected_loss)
    assert torch.equal(sample.sampled_mask, expected_sampled)
    assert sample.turn_end_mask[e1 - 1] == 1 and sample.token_rewards[e1 - 1] == 1.0  # still the turn's end


def assert_equal_gradients(model, first: torch.Tensor, second: torch.Tensor) -> None:
    """The gradients of the same loss (mean log-sum-exp of the logits) through two forwards of `model` agree."""
    first.logsumexp(-1).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    second.logsumexp(-1).mean().backward()
    for grad, parameter in zip(grads, model.parameters()):
        assert torch.allclose(grad, parameter.grad, atol=1e-6)
    model.zero_grad()
