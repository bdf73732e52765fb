"""Run by the tests in a process of its own, at the real vocabulary (151,936 entries) and a tiny hidden
size; prints JSON with the rise of resident memory above where it stood before the measured work.

    memory_worker.py [update]      one actor forward and backward through `vagen.update.token_logprobs`
                                   on a Qwen2.5-VL-shaped bf16 model; also the size of one bf16
                                   [positions, vocab] logits tensor
    memory_worker.py judge PATH    `vagen.state_reward.StateJudge` scoring 8 pairs (16 rows of ~120 tokens)
                                   with a bf16 causal LM and the tokenizer at PATH; also the size of the
                                   whole float32 [rows, width, vocab] log-softmax
"""

import json
import sys

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from vagen.update import token_logprobs

VOCAB = 151_936
ROWS, LENGTH, GENERATED = 2, 320, 256


def status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def judge(tokenizer_path: str) -> None:
    from pathlib import Path

    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from vagen.state_reward import StateJudge

    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = Path("judge")
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)
    scorer = StateJudge(str(out), batch_size=8, dtype="bfloat16")
    truth = "The player is at row 2, column 3. " * 8
    pairs = [(truth, f"The player is at row {i}, column 1. " * 6) for i in range(8)]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    scores = scorer.score(pairs)
    peak = status("VmHWM")
    width = max(len(scorer.tokenizer.encode(scorer.PROMPT.format(truth=t, description=d))) for t, d in pairs) + 2
    json.dump({"rise": peak - before, "full_logits": 16 * width * VOCAB * 4, "width": width,
               "dtype": str(next(scorer.model.parameters()).dtype),
               "scores_in_range": all(0.0 <= x <= 1.0 for x in scores)}, sys.stdout)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "judge":
        return judge(sys.argv[2])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
                              vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=True)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).train()
    input_ids = torch.randint(0, VOCAB, (ROWS, LENGTH))
    loss_mask = torch.zeros(ROWS, LENGTH)
    loss_mask[:, LENGTH - GENERATED :] = 1
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "loss_mask": loss_mask,
             "position_ids": torch.arange(LENGTH).expand(3, ROWS, -1).clone()}
    positions = int(loss_mask[:, 1:].sum())
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current resident size
        f.write("5")
    before = status("VmRSS")
    logprobs, entropies = token_logprobs(model, batch, temperature=1.0, with_entropy=True)
    loss = -(logprobs * loss_mask).sum() / loss_mask.sum() - 0.01 * (entropies * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    peak = status("VmHWM")
    json.dump({"rise": peak - before, "bf16_logits": positions * VOCAB * 2, "positions": positions,
               "finite": bool(torch.isfinite(loss))}, sys.stdout)


if __name__ == "__main__":
    main()
