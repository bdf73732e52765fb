"""A `vagen.decoding.Decoder` that answers from a script instead of a model, for rollout tests."""

from vagen.decoding import Generated


class ScriptedDecoder:
    """Answers row r's k-th turn with `script[r][k]` (text, then <|im_end|>) and records the prompt
    ids each turn was generated from in `prompts[r]`."""

    def __init__(self, encoder, script):
        self.encoder, self.script, self.turn, self.prompts = encoder, script, {}, {}

    def start_rollout(self):
        self.turn = {}

    def any_rank(self, flag):
        return flag

    def generate(self, episodes, rows, sampling):
        out = []
        for row, episode in zip(rows, episodes):
            k = self.turn.get(row, 0)
            self.turn[row] = k + 1
            self.prompts.setdefault(row, []).append(list(episode.input_ids))
            out.append(Generated(self.encoder.encode_text(self.script[row][k]) + [self.encoder.im_end_id]))
        return out
