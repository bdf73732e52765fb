"""Rewards for describing the state: the agent's `<observation>` is graded against the true state
before its actions and its `<prediction>` against the state after them, and the turn's reward gains
`algo.grounding_coef` x the first score and `algo.worldmodeling_coef` x the second.

The environment grades (`envs_visual.state_grader`, rules over the true relations) and reports in
each turn's info: `grounding_score` / `worldmodel_score` (None where the format has no such field or
the response did not parse) and `state_before` / `state_after` (the true relations). This module
adds what needs the whole run: the coefficients, a repetition check across episodes, and the
optional judge (`algo.state_reward=judge`), a local causal LM that scores a description against the
true state written out in the environment's words.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from pathlib import Path

# (response field, info key of its score, info key of the true relations, coefficient in algo)
GRADED = (
    ("observation", "grounding_score", "state_before", "grounding_coef"),
    ("prediction", "worldmodel_score", "state_after", "worldmodeling_coef"),
)
METRIC = {"grounding_score": "rollout/grounding_score", "worldmodel_score": "rollout/worldmodel_score"}


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


class RepetitionTracker:
    """The descriptions graded last (at most `window`) with the true state each was written for. A
    text written verbatim (case and spacing aside) for more than `max_states` different states in
    the window is a template, not a description: it scores 0."""

    def __init__(self, window: int, max_states: int):
        self.window, self.max_states = int(window), int(max_states)
        self.recent: deque[tuple[str, str]] = deque()
        self.states_of: dict[str, Counter[str]] = {}

    def add(self, text: str, state) -> bool:
        """Record `text` written for `state`; True when it is now a repeat (scores 0)."""
        key = normalized(text)
        self._record(key, json.dumps(state, sort_keys=True))
        return len(self.states_of[key]) > self.max_states

    def _record(self, key: str, state_key: str) -> None:
        self.recent.append((key, state_key))
        self.states_of.setdefault(key, Counter())[state_key] += 1
        if len(self.recent) > self.window:
            old_key, old_state = self.recent.popleft()
            states = self.states_of[old_key]
            states[old_state] -= 1
            if not states[old_state]:
                del states[old_state]
            if not states:
                del self.states_of[old_key]

    def state_dict(self) -> dict:
        return {"window": self.window, "max_states": self.max_states, "recent": [list(x) for x in self.recent]}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(state["window"], state["max_states"])
        for key, state_key in state["recent"]:
            self._record(key, state_key)


class StateJudge:
    """Scores descriptions with a local Hugging Face causal LM: after a prompt giving the true state
    and the description, the score is P(" yes") / (P(" yes") + P(" no")), each answer's probability
    that of its whole token sequence. Batched, deterministic; nothing is downloaded."""

    PROMPT = ("True state: {truth}\nDescription: {description}\n"
              "Does the description state the true state correctly? Answer yes or no.\nAnswer:")
    ANSWERS = (" yes", " no")

    def __init__(self, path: str, device=None, batch_size: int = 16, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        local = Path(path).expanduser()
        if not (local / "config.json").exists():
            raise FileNotFoundError(f"state judge {path!r}: no config.json in {local}; pass the directory of a "
                                    f"Hugging Face causal LM (algo.state_judge_path)")
        self.tokenizer = AutoTokenizer.from_pretrained(local, local_files_only=True)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_id = int(pad or 0)
        # in the run's dtype (model.dtype): a float32 judge beside a bfloat16 policy would double its memory
        self.model = AutoModelForCausalLM.from_pretrained(local, local_files_only=True,
                                                          dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
        self.device = torch.device(device or "cpu")
        self.model.to(self.device).eval().requires_grad_(False)
        self.batch_size = int(batch_size)
        self.answers = [self.tokenizer.encode(a, add_special_tokens=False) for a in self.ANSWERS]

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Scores in [0, 1] of (true state text, description) pairs; a pair scores the same in any batch."""
        import torch

        scores = []
        for start in range(0, len(pairs), self.batch_size):
            prompts = [self.tokenizer.encode(self.PROMPT.format(truth=truth, description=description),
                                             add_special_tokens=False)
                       for truth, description in pairs[start:start + self.batch_size]]
            rows = [(prompt, answer) for prompt in prompts for answer in self.answers]
            width = max(len(p) + len(a) for p, a in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (prompt, answer) in enumerate(rows):  # right-padded: positions start at 0 in every row
                ids[i, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
                mask[i, :len(prompt) + len(answer)] = 1
            # Only the positions that predict an answer token go through the head, and only their
            # log-softmax is taken: the whole [rows, width, vocab] would be 3.9 GB at 32 x 200 x 151,936.
            rows_at = torch.tensor([i for i, (p, a) in enumerate(rows) for _ in a])
            positions = torch.tensor([k for p, a in rows for k in range(len(p) - 1, len(p) + len(a) - 1)])
            targets = torch.tensor([t for _, a in rows for t in a])
            with torch.no_grad():
                hidden = self.model.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
                logits = self.model.get_output_embeddings()(hidden[rows_at.to(self.device), positions.to(self.device)])
                logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.to(self.device)[:, None])[:, 0]
            totals = torch.zeros(len(rows), dtype=torch.float64).index_add_(0, rows_at, logprobs.double().cpu())
            pairs_lp = totals.float().view(-1, len(self.answers))
            scores += torch.softmax(pairs_lp, dim=-1)[:, 0].tolist()
        return scores


class StateRewarder:
    """Adds the state rewards to the turns of a rollout (`algo.state_reward` rules or judge). With a
    process group (`dist`), every rank's descriptions go through the repetition check in rank order,
    so each rank's tracker holds the same history whatever the number of ranks."""

    def __init__(self, algo, judge: StateJudge | None = None, dist=None):
        if algo.state_reward == "judge" and judge is None:
            raise ValueError("algo.state_reward=judge needs a StateJudge (built from algo.state_judge_path)")
        self.algo = algo
        self.judge = judge
        self.dist = dist
        self.tracker = RepetitionTracker(algo.state_repeat_window, algo.state_repeat_states)

    def _all_ranks(self, items: list) -> tuple[list[list], int]:
        if self.dist is None or not self.dist.active:
            return [items], 0
        import torch

        gathered: list = [None] * self.dist.world_size
        torch.distributed.all_gather_object(gathered, items)
        return gathered, self.dist.rank

    def __call__(self, episodes) -> dict[str, float]:
        """Grade every turn that has a score, zero repeats, add the rewards; return the metrics:
        rollout/grounding_score and rollout/worldmodel_score (means over graded turns, after the
        repetition check), the same before it (`_raw`), and rollout/state_repeats (the share of graded
        descriptions zeroed)."""
        graded = []  # (turn, field, score key, state key, coefficient)
        for ep in episodes:
            for turn in ep.turns:
                for name, score_key, state_key, coef in GRADED:
                    if turn.info.get(score_key) is not None:
                        graded.append((turn, name, score_key, state_key, getattr(self.algo, coef)))
        if self.judge is not None and graded:
            from envs_visual.state_grader import describe_relations

            judged = self.judge.score([(describe_relations(turn.info[state_key]), turn.info["parsed"][name])
                                       for turn, name, _, state_key, _ in graded])
            for (turn, _, score_key, _, _), score in zip(graded, judged):
                turn.info[score_key] = float(score)
        every_rank, mine = self._all_ranks([(turn.info["parsed"][name], turn.info[state_key])
                                            for turn, name, _, state_key, _ in graded])
        repeated = []
        for rank, items in enumerate(every_rank):
            flags = [self.tracker.add(text, state) for text, state in items]
            if rank == mine:
                repeated = flags
        sums, raw, counts, repeats = Counter(), Counter(), Counter(), 0
        for (turn, _, score_key, _, coef), repeat in zip(graded, repeated):
            raw[score_key] += float(turn.info[score_key])
            if repeat:
                turn.info[score_key] = 0.0
                repeats += 1
            score = float(turn.info[score_key])
            turn.reward += coef * score
            sums[score_key] += score
            counts[score_key] += 1
        stats = {METRIC[k]: sums[k] / counts[k] for k in counts}
        # the grades before the repetition check: comparable with a run without the state reward
        stats.update({METRIC[k] + "_raw": raw[k] / counts[k] for k in counts})
        if graded:
            stats["rollout/state_repeats"] = repeats / len(graded)
        return stats


def state_rewarder(cfg, dist=None) -> StateRewarder | None:
    """The rewarder `cfg.algo.state_reward` asks for (None for none); the judge runs on `dist.device`."""
    if cfg.algo.state_reward == "none":
        return None
    judge = None
    if cfg.algo.state_reward == "judge":
        judge = StateJudge(cfg.algo.state_judge_path, dist.device if dist is not None else None, dtype=cfg.model.dtype)
    return StateRewarder(cfg.algo, judge, dist)
