"""Playing episodes on a rank's vLLM engine: the `vagen.decoding.Decoder` protocol, per-turn `generate` and
the agent loop `play`, which carries unfinished episodes over an update where rollout.max_staleness > 0. The
engine is built in `engine.py`; its weights arrive through `weights.py`.

What the engine is given and what comes back are exactly the tokens training uses:
- a turn's prompt is the episode's own `input_ids` (a `TokensPrompt`, never re-rendered text) with its
  frames (`Episode.images`, resized once by `ChatEncoder.resize`, so vLLM's processor leaves them as
  they are); the prompt vLLM ran is checked to be those ids, position for position;
- generated ids are kept as sampled, and with each the engine's log-probability of it under the
  distribution it was drawn from (`logprobs_mode="processed_logprobs"`: after the suppress mask and the
  temperature, which is what `vagen.update` computes);
- the rules of `vagen.decoding` hold: stop at `<|im_end|>`/`<|endoftext|>` (kept), at `</answer>` (the
  token that completes it kept), or after `max_new_tokens`; `ChatEncoder.suppress_ids` get -inf
  logits (`SuppressTokens`, an exact mask, greedy included); no nucleus, no top-k unless asked; each request
  seeded from the turn's seed and the episode's row (`request_seed`); greedy when `do_sample` is false. The
  checkpoint's own generation config (repetition penalty and the like) is never read.
"""

from __future__ import annotations

import time

from vagen import vllm_compat as compat
from vagen.decoding import STOP_STRING, Generated, Sampling, request_seed
from vagen.episode import Episode
from vagen.vllm_compat import SUPPRESS_ARG


class AgentLoop:
    """The decoding half of `VLLMDecoder` (engine.py). It reads what the engine's constructor sets: `llm` (the
    `vllm.LLM`), `encoder` (the `ChatEncoder`), `settings`, `lora_request` (the adapter requests run, or None),
    and `asleep` (`WeightSync`)."""

    def start_rollout(self) -> None:
        """Nothing to drop: requests carry whole histories, and the prefix cache serves the next turn."""

    def any_rank(self, flag: bool) -> bool:
        """Each rank's engine decodes alone: no rank waits for another's."""
        return flag

    def sampling_params(self, sampling: Sampling, row: int):
        from vllm import SamplingParams

        options = dict(
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=sorted(self.encoder.stop_ids),
            ignore_eos=True,  # only the stop ids above end a turn, as in the hf backend
            stop=[STOP_STRING],
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's own log-probability
            skip_special_tokens=True,
            extra_args={SUPPRESS_ARG: list(self.encoder.suppress_ids)},  # masked by `SuppressTokens`
        )
        if sampling.do_sample:
            options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0))
            if self.settings["seeded_requests"]:
                # Each request draws from a generator of its own: what an episode samples does not depend on
                # which requests share its batch. vLLM then draws each seeded row's noise in a loop of its own.
                options["seed"] = request_seed(sampling.seed, row)
        else:
            options.update(temperature=0.0)
        return SamplingParams(**options)

    def prompt(self, episode: Episode) -> dict:
        """The episode's ids and frames as a vLLM `TokensPrompt`. vLLM expands each image's placeholder
        itself (its processor counts the image's tokens), so each image's run of `<|image_pad|>` goes in
        as one; `generate` checks that the expanded prompt is the episode's ids again."""
        if not episode.images:
            return {"prompt_token_ids": list(episode.input_ids)}
        pad = self.encoder.image_pad_id
        ids = [t for k, t in enumerate(episode.input_ids) if t != pad or k == 0 or episode.input_ids[k - 1] != pad]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": list(episode.images)}}

    def _refuse_asleep(self) -> None:
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: it dropped its weights and KV cache for the update; "
                               "call sync_weights(model), which wakes it with the updated weights, before generating")

    def generate(self, episodes: list[Episode], rows: list[int], sampling: Sampling) -> list[Generated]:
        assert len(episodes) == len(rows), f"{len(episodes)=} {len(rows)=}"
        self._refuse_asleep()
        if not episodes:
            return []
        outputs = self.llm.generate([self.prompt(ep) for ep in episodes],
                                    [self.sampling_params(sampling, row) for row in rows], use_tqdm=False,
                                    lora_request=self.lora_request)
        return [self.completion(row, episode, output) for row, episode, output in zip(rows, episodes, outputs)]

    def completion(self, row: int, episode: Episode, output) -> Generated:
        """The ids and log-probabilities of a finished vLLM request for `episode`, once the prompt vLLM ran is
        checked to be the episode's ids."""
        if list(output.prompt_token_ids) != list(episode.input_ids):
            first = next((k for k, (a, b) in enumerate(zip(output.prompt_token_ids, episode.input_ids)) if a != b),
                         min(len(output.prompt_token_ids), len(episode.input_ids)))
            raise RuntimeError(
                f"vLLM ran a different prompt from episode {row}'s token ids (first difference at position "
                f"{first} of {len(episode.input_ids)}; vLLM's has {len(output.prompt_token_ids)}): its image "
                f"processor expanded the frames to other token counts than the encoder's; check that "
                f"Episode.images were resized by ChatEncoder.resize")
        completion = output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, ids)]
        return Generated(ids, logprobs)

    @staticmethod
    def take_answers(games, decoding: bool) -> None:
        """The environment answers that join the next pass (`rollout.env_wait_ms`), of every game: every one due
        (null), or those that arrive within the wait; where the engine has nothing to decode (`decoding`
        false, no episode ready in any game), the first answer of any game, and those that follow it within
        the wait."""
        wait_ms = games[0].ro.env_wait_ms  # the run's (a task cannot set it)
        if wait_ms is None:
            for game in games:
                game.take_answers(block=True, all_of_them=True)
            return

        def within_wait():
            until = time.perf_counter() + wait_ms / 1000
            for game in games:
                game.take_answers(block=True, all_of_them=True, until=until)

        within_wait()
        while not decoding and not any(game.ready for game in games):
            busy = [game for game in games if game.pool.busy()]
            if not busy:
                return
            if len(busy) == 1:
                busy[0].take_answers(block=True)
            else:  # whichever game's environments answer first: each asked in turn, briefly
                while not any(game.take_answers(block=True, until=time.perf_counter() + 0.002) for game in busy):
                    pass
            within_wait()

    def play(self, *games) -> None:
        """The agent loop over one or more games (`vagen.rollout.Game`; with rollout.tasks each task's, so that
        one engine pass decodes turns of several tasks): each episode's next request joins the engine's
        running batch as soon as its observation is ready, and the engine steps (one forward pass over every
        running request) while the environments answer, so no episode waits for a turn boundary. Before each
        pass the engine waits for the environment answers due (`take_answers`) for rollout.env_wait_ms (10 ms
        by default): the pass runs with the answers that came, so that environments (in worker processes or
        actors) step while the engine decodes, and later answers join a later pass. With null it waits for
        every one, so an episode's next turn joins the pass right after its response, as when its
        environment steps in this process, and workers add no forward pass (docs/benchmarks.md has both).
        A request is seeded by its episode's row and turn exactly as in
        the per-turn schedule (`request_seed` of `turn_seed`), and takes its own game's turn budget
        (`Game.request`), so what an episode samples depends on neither its batch, nor the order in which
        requests finish, nor the other games played beside it. Request ids name the game, episode and turn;
        the prefix cache serves each turn's history whatever request brought it. With rollout.max_staleness > 0
        a game closes once enough of its groups have ended: the requests running then finish, the episodes it
        holds wait between turns (`Game.waiting`), and the loop returns once nothing runs in any game; the next
        rollout sends them on with the synced weights. `engine_steps` and `engine_sequences` count the forward
        passes and the requests they ran; a pass's time goes to the first game's `timing/generate`."""
        from vllm.sampling_params import RequestOutputKind

        assert games, "play needs at least one game"
        self._refuse_asleep()
        engine, clock, timing = self.llm.llm_engine, time.perf_counter, games[0].timing
        running: dict[str, tuple] = {}  # request id -> (game, episode row)
        self.engine_steps = self.engine_sequences = 0
        try:
            while True:
                self.take_answers(games, bool(running))
                for number, game in enumerate(games):
                    game.ended.count()
                    for row in game.ready:
                        episode = game.episodes[row]
                        params = self.sampling_params(*game.request(row))  # seeded by its group's rollout and row
                        params.output_kind = RequestOutputKind.FINAL_ONLY
                        request_id = f"game-{number}-episode-{row}-turn-{len(episode.turns)}"
                        # What `LLM.generate` does to a prompt before `add_request`: the frames through vLLM's
                        # processor.
                        engine.add_request(request_id, compat.preprocess_prompt(self.llm, self.prompt(episode)),
                                           params, lora_request=self.lora_request)
                        running[request_id] = (game, row)
                    game.ready.clear()
                if not running:
                    if all(game.finished() for game in games):
                        return
                    continue
                t0 = clock()
                self.engine_sequences += engine.get_num_unfinished_requests()
                outputs = engine.step()
                self.engine_steps += 1
                timing["timing/generate"] += clock() - t0
                for output in outputs:
                    if output.finished:
                        game, row = running.pop(output.request_id)
                        game.respond(row, self.completion(row, game.episodes[row], output))
        finally:
            # Requests of an agent loop stopped by an error would otherwise stay in the engine and be stepped
            # with the next rollout's (whose loop knows nothing of them).
            if running:
                engine.abort_request(list(running))
