"""Micro-batches by tokens (`train.micro_batch_tokens`) and packed sequences (`train.pack_sequences`).

A packed micro-batch runs its samples back to back in one row: attention stays within each sample (the text
positions restart at each one), each keeps its M-RoPE positions and its frames, so log-probs and values equal
the padded batch's; the update's gradient is the count-based one's, whatever the cut."""

import copy
import json
from pathlib import Path

import pytest
import torch
from update_fixtures import answer_samples

from vagen.batch_plan import micro_batch_tokens, micro_batches
from vagen.config import ChecksFailed, check_config, load_config, machine_problems
from vagen.episode import ChatEncoder
from vagen.models.families import FAMILIES
from vagen.models.forward import forward_packed, pack_inputs
from vagen.preflight import UNPACKED_MODEL_TYPES
from vagen.trajectory import collate, model_inputs
from vagen.update import token_logprobs


@pytest.fixture
def text_policy(tiny_text):
    _, model, tokenizer = tiny_text
    return copy.deepcopy(model), ChatEncoder(tokenizer)


def test_a_padded_batch_packs_into_one_row_with_positions_that_restart_at_each_sample():
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
              "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
              # M-RoPE positions [3, B, L]: the second sample's image shifts its height and width rows
              "position_ids": torch.tensor([[[0, 1, 2], [0, 1, 0]], [[0, 1, 2], [0, 3, 0]], [[0, 1, 2], [0, 4, 0]]]),
              "pixel_values": torch.ones(4, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    packed, (rows, columns) = pack_inputs(inputs)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    # a first row of text positions (where samples start), then the three M-RoPE rows
    assert packed["position_ids"].tolist() == [[[0, 1, 2, 0, 1]], [[0, 1, 2, 0, 1]], [[0, 1, 2, 0, 3]],
                                               [[0, 1, 2, 0, 4]]]
    assert packed["pixel_values"] is inputs["pixel_values"] and "attention_mask" not in packed
    assert rows.tolist() == [0, 0, 0, 1, 1] and columns.tolist() == [0, 1, 2, 0, 1]
    text = dict(inputs, position_ids=torch.tensor([[0, 1, 2], [0, 1, 0]]))
    assert pack_inputs(text)[0]["position_ids"].tolist() == [[0, 1, 2, 0, 1]]


class Sized:
    def __init__(self, length):
        self.length = length


def test_micro_batches_are_cut_by_count_or_by_a_token_budget():
    samples = [Sized(n) for n in (100, 300, 50, 700, 200, 200)]
    indices = list(range(6))
    train = load_config("sokoban_visual", ["train.micro_batch_size=4"]).train
    assert micro_batches(indices, samples, train) == [[0, 1, 2, 3], [4, 5]]
    # padded: rows x the widest row; [0, 1] costs 600, adding 2 costs 900
    train = load_config("sokoban_visual", ["train.micro_batch_tokens=900"]).train
    assert micro_batches(indices, samples, train) == [[0, 1, 2], [3], [4, 5]]
    assert micro_batch_tokens([100, 300, 50], packed=False) == 900
    # packed: the sum of lengths; 700 > 600 runs alone, longer than the budget
    train = load_config("sokoban_visual", ["train.micro_batch_tokens=600", "train.pack_sequences=true"]).train
    assert micro_batches(indices, samples, train) == [[0, 1, 2], [3], [4, 5]]
    assert micro_batch_tokens([100, 300, 50], packed=True) == 450
    assert micro_batches([], samples, train) == []
    with pytest.raises(ValueError, match=r"train.micro_batch_tokens=-1 must be >= 0"):
        load_config("sokoban_visual", ["train.micro_batch_tokens=-1"])


def test_packed_forward_gives_the_padded_log_probs_and_values_with_frames():
    from vagen.models import load_policy, resolve_model_path
    from vagen.models.critic import ValueModel
    from vagen.rollout import rollout
    from vagen.trajectory import episode_to_sample

    # the shipped warm start ends episodes at different turns and answers at different lengths
    model, processor = load_policy(resolve_model_path("assets:frozenlake_visual"))
    cfg = load_config("frozenlake_visual", ["rollout.max_turns=2"])
    encoder = ChatEncoder(processor)
    torch.manual_seed(3)
    with torch.no_grad():
        episodes, _ = rollout(model, encoder, cfg, [0, 1, 2], group_size=1)
        samples = [episode_to_sample(ep, encoder, model) for ep in episodes]
        assert len({s.length for s in samples}) > 1 and all(s.pixel_values is not None for s in samples)
        batch = collate(samples, encoder.pad_id)
        padded, _ = token_logprobs(model, batch, 1.0, with_entropy=False)
        packed, _ = token_logprobs(model, batch, 1.0, with_entropy=False, packed=True)
        assert int(batch["loss_mask"].sum()) > 20
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
        critic = ValueModel(model)
        torch.nn.init.normal_(critic.value_head.weight)
        mask = batch["attention_mask"].bool()
        padded_values, packed_values = critic(**model_inputs(batch)), critic(**model_inputs(batch), packed=True)
        torch.testing.assert_close(packed_values[mask], padded_values[mask], atol=1e-4, rtol=1e-4)
        assert packed_values.abs().max() > 0.1
        hidden = forward_packed(model, model_inputs(batch), final_hidden=True)
        assert hidden[~mask].abs().max() == 0  # padding positions are zeros


@pytest.mark.parametrize("extra", [["train.micro_batch_tokens=155"],
                                   ["train.micro_batch_tokens=160", "train.pack_sequences=true"]])
def test_token_budgeted_and_packed_updates_equal_a_plain_update_of_whole_minibatches(text_policy, distributed,
                                                                                     extra):
    from ppo_reference import ADVANTAGES, ANSWERS, assert_update_equals_plain, overrides

    model, encoder = text_policy
    cfg = load_config("bandit_text", overrides(mini=8, micro=4) + extra)
    reference = copy.deepcopy(model)
    samples = answer_samples(encoder, ANSWERS, ADVANTAGES)
    cuts = [micro_batches(list(range(8)), samples, cfg.train), micro_batches(list(range(8, 12)), samples, cfg.train)]
    # the budget cuts the mini-batches into micro-batches of unequal counts, none of them the whole
    assert len({len(m) for part in cuts for m in part}) > 1 and all(len(part) > 1 for part in cuts), cuts
    assert_update_equals_plain(model, reference, samples, cfg, encoder.pad_id, distributed)


# Sokoban trajectories of 1-3 turns with a frame each (`update_fixtures.visual_samples`): 271 to 495 tokens.
# Mini-batches 0-7 and 8-11 cut by count, by a padded budget (3, 3, 2 | 3, 1) and by a packed one.
VISUAL_CUTS = {"count 4": ["train.micro_batch_size=4"], "tokens 1500": ["train.micro_batch_tokens=1500"],
               "packed 1200": ["train.micro_batch_tokens=1200", "train.pack_sequences=true"]}


@pytest.fixture(scope="module")
def frame_samples(tiny_vl):
    from ppo_reference import ADVANTAGES, ANSWERS
    from update_fixtures import visual_samples

    _, model, processor = tiny_vl
    return visual_samples(ChatEncoder(processor), model, ANSWERS, ADVANTAGES)


@pytest.mark.parametrize("cut", VISUAL_CUTS)
def test_updates_with_frames_equal_a_plain_update_whatever_the_micro_batches(tiny_vl, frame_samples, distributed,
                                                                             cut):
    """Trajectories of unequal lengths and frame counts through the built-in Qwen2.5-VL: count-based, token-
    budgeted and packed micro-batches all move the weights where a plain-torch step per whole mini-batch does
    (whose forward takes the frames and derives its own M-RoPE positions), to float32 tolerance (the largest
    difference was 6e-8 of a 5e-3 move)."""
    from ppo_reference import assert_update_equals_plain, overrides

    _, model, processor = tiny_vl
    model, reference, encoder = copy.deepcopy(model), copy.deepcopy(model), ChatEncoder(processor)
    cfg = load_config("bandit_text", overrides(mini=8, micro=4) + VISUAL_CUTS[cut])
    samples = copy.deepcopy(frame_samples)  # the update stores its log-probs and advantages on them
    assert len({s.length for s in samples}) > 3 and {len(s.image_grid_thw) for s in samples} == {1, 2, 3}
    cuts = [micro_batches(list(range(8)), samples, cfg.train), micro_batches(list(range(8, 12)), samples, cfg.train)]
    expected = {"count 4": [[4, 4], [4]], "tokens 1500": [[3, 3, 2], [3, 1]], "packed 1200": [[3, 3, 2], [3, 1]]}
    assert [[len(m) for m in part] for part in cuts] == expected[cut]
    assert_update_equals_plain(model, reference, samples, cfg, encoder.pad_id, distributed)


@pytest.mark.slow
def test_two_zero3_ranks_with_frames_match_a_plain_update_whatever_the_micro_batches(tmp_path, tiny_vl, model_cache):
    """Two gloo ranks under ZeRO-3, every parameter partitioned, holding unequal shares of the Sokoban
    trajectories (tests/packing_worker.py): micro-batches by count, by tokens and packed give the plain-torch
    update of whole mini-batches, though the ranks run unequal numbers of micro-batches (padding passes)."""
    from packing_worker import CUTS
    from ppo_reference import ADVANTAGES, ANSWERS, overrides, reference_update
    from test_distributed import _launch
    from update_fixtures import visual_samples

    results = _launch(2, tmp_path / "two.pt", model_cache, worker=Path(__file__).parent / "packing_worker.py")
    _, model, processor = tiny_vl
    reference, encoder = copy.deepcopy(model), ChatEncoder(processor)
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    samples = visual_samples(encoder, reference, ANSWERS, ADVANTAGES)
    cfg = load_config("bandit_text", overrides(mini=8, micro=2))
    reference_update(reference, samples, [list(range(8)), list(range(8, 12))], cfg, encoder.pad_id)
    # each rank's micro-batches per mini-batch (0: a pass of loss 0 that pairs with the other rank's)
    assert {case: results[case]["micro"] for case in CUTS} == {
        "count 2": [[[2, 2], [2, 1]], [[2, 2], [1, 0]]],
        "tokens 800": [[[2, 1, 1], [1, 2]], [[1, 1, 2], [1, 0]]],
        "packed 700": [[[2, 1, 1], [1, 2]], [[1, 1, 2], [1, 0]]]}
    assert set(results) == set(CUTS)
    for case, result in results.items():
        assert result["steps"] == 2, case  # one optimizer step per mini-batch
        moved = 0.0
        for name, expected in reference.named_parameters():
            torch.testing.assert_close(result["params"][name], expected.detach(), atol=1e-6, rtol=0,
                                       msg=f"{case}: {name}")
            moved = max(moved, float((expected - initial[name]).abs().max()))
        assert moved > 1e-3


def test_packing_is_refused_by_name_for_qwen3_5_when_the_config_loads(tmp_path):
    assert sorted(UNPACKED_MODEL_TYPES) == sorted(t for f in FAMILIES if not f.packs for t in f.model_types)
    cfg = load_config("sokoban_visual", ["model.path=builtin:tiny-qwen3.5", "train.pack_sequences=true"])
    [problem] = machine_problems(cfg)
    assert problem.startswith("train.pack_sequences=true with model.path=builtin:tiny-qwen3.5, whose the built-in "
                              "builtin:tiny-qwen3.5 says model_type 'qwen3_5'")
    assert "set train.pack_sequences=false" in problem
    checkpoint = tmp_path / "qwen35"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    with pytest.raises(ChecksFailed, match="train.pack_sequences=true with model.path=.*qwen35"):
        check_config("sokoban_visual", [f"model.path={checkpoint}", "train.pack_sequences=true"], ranks=1)
    assert machine_problems(load_config("sokoban_visual", ["train.pack_sequences=true"])) == []
    assert machine_problems(load_config("sokoban_visual", ["model.path=builtin:tiny-qwen3.5"])) == []


def test_navigation_visual_trains_an_iteration_with_token_budgeted_packed_micro_batches(tmp_path, model_cache,
                                                                                       distributed):
    from vagen.train import main

    overrides = ["train.iterations=1", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_turns=2",
                 "train.mini_batch_size=4", "train.micro_batch_tokens=4096", "train.pack_sequences=true",
                 "log.progress=false", f"train.run_dir={tmp_path}", f"model.builtin_cache={model_cache}"]
    assert main(["--config", "navigation_visual", *overrides]) == 0
    [run] = [p for p in tmp_path.iterdir() if p.is_dir()]
    [record] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert record["iteration"] == 0 and record["update/micro_batches"] >= 1
    assert all(key in record for key in ("actor/pg_loss", "critic/vf_loss", "rollout/success"))


def test_the_memory_estimate_counts_a_token_budget_as_the_trajectories_it_holds():
    from vagen.memory import KNOWN_SHAPES, update_activations

    shape = KNOWN_SHAPES["Qwen2.5-VL-3B-Instruct"]

    def activations(*extra):
        cfg = load_config("navigation_visual", ["model.path=builtin:tiny-vl", *extra])
        return cfg, update_activations(cfg, shape["text"], shape["vision"], width=4).total

    cfg, one = activations("train.micro_batch_size=1")
    length = cfg.rollout.max_trajectory_length
    assert activations(f"train.micro_batch_tokens={length}")[1] == one  # one trajectory's worth
    assert activations(f"train.micro_batch_tokens={length // 2}")[1] == one  # a longer one runs alone
    assert activations(f"train.micro_batch_tokens={3 * length - 1}")[1] == activations("train.micro_batch_size=3")[1]
