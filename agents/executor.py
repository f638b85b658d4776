"""Agent executors: how a batch of prompts becomes scored, token-level trajectories for the RL scripts.

Every RL script gets its training data from one call,

    rollout = executor.run(batch, n=G, seed=s, step=step)      # batch: dataset rows with prompt_ids, prompt, label

and trains on `rollout.episodes` (prompt-major: the G episodes of prompt i are i·G .. i·G+G−1), `rollout.rewards`
and `rollout.scores`. What happens inside `run` is the executor's business:

- `SingleTurnExecutor` (the default): prompt tokens → one generation by the vLLM engines → the reward function on
  the decoded text. Token-in-token-out: the tokens trained on are exactly the tokens the engine sampled, never a
  re-tokenisation of decoded text.
- `MultiTurnExecutor`: the same API for an environment with `reset` / `step`; the environment's replies are appended
  as tokens between the model's turns and masked out of the loss (`Episode.action_mask` 0), and the environment's
  rewards are summed. A reply given as chat messages is appended as the chat template renders it (`core.chat`), so
  the episode's tokens are those of the whole templated conversation, and the model's own turns stay the tokens it
  sampled. A script switches executor without touching its loop.
- `OpenAIAgentExecutor` (agents/openai_agent.py, `--rollout.agent-file`): each episode is the user's
  `async def agent(client, example) -> reward` talking to an OpenAI-compatible server over the engines
  (agents/openai_server.py), which records the calls as token ids.

An `Episode` is everything a trainer needs for one trajectory: prompt tokens, response tokens (model and environment
tokens interleaved), the engine's log-probs of them (for importance-sampling corrections), the action mask, and how
the generation ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from core import chat, moe
from core.episode import Episode, Rollout  # what an executor returns: defined in core, which reads them

RewardFn = Callable[..., tuple[torch.Tensor, dict, torch.Tensor, list[dict]]]
"""`reward_fn(queries, prompts, labels, step) -> (rewards (B,), logs, scores (B,), extras)`, checked (the RL scripts' `score`
wrapped around the user's `reward_func`)."""


class SingleTurnExecutor:
    """One generation per episode, scored by a batch reward function on prompt + decoded response."""

    def __init__(self, engines, tokenizer, reward_fn: RewardFn, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0):  # fmt: skip
        self.engines, self.tokenizer, self.reward_fn = engines, tokenizer, reward_fn
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p

    def run(self, batch: list[dict], n: int, seed: int | list[int] | None, step: int,
            temperature: float | None = None) -> Rollout:  # fmt: skip
        """n episodes per row of `batch`; sampling seeds derive from `seed`, an int or one per row (see
        `RolloutEngines.generate`);
        `temperature` overrides the executor's (0: greedy, for evaluation)."""
        temperature = self.temperature if temperature is None else temperature
        images = [e.get("images") for e in batch]  # a vision-language prompt's pictures (core/vision.py), else None
        pictures = {"images": images} if any(i is not None for i in images) else {}
        groups = self.engines.generate([e["prompt_ids"] for e in batch], n=n, max_new_tokens=self.max_new_tokens,
                                       temperature=temperature, top_p=self.top_p, seed=seed, **pictures)  # fmt: skip
        episodes = [Episode(e, list(e["prompt_ids"]), s.token_ids, s.logprobs, [1] * len(s.token_ids), s.truncated,
                            s.finish_reason, routed_experts=s.routed_experts)
                    for e, g in zip(batch, groups) for s in g]  # fmt: skip
        texts = [self.tokenizer.decode(ep.token_ids, skip_special_tokens=True) for ep in episodes]
        prompts = [ep.example["prompt"] for ep in episodes]
        rewards, logs, scores, extras = self.reward_fn([p + t for p, t in zip(prompts, texts)], prompts,
                                                       [ep.example["label"] for ep in episodes], step)  # fmt: skip
        for ep, extra in zip(episodes, extras):
            ep.extra = extra
        return Rollout(episodes, rewards, scores, logs)

    def close(self) -> None:
        """Nothing to release (the agent executor stops its server here)."""


class Environment(Protocol):
    """One episode's environment for `MultiTurnExecutor`; a fresh instance per episode (`env_factory(example)`)."""

    def reset(self, example: dict) -> str:
        """Text appended to the prompt before the first turn ("" for none)."""
        ...

    def step(self, response: str) -> tuple[str | dict | list[dict], float, bool]:
        """The model's latest turn (decoded, special tokens removed) -> (feedback, reward of this turn, done).

        Feedback text is appended as its tokens. Feedback as chat messages (a {role, content} dict or a list of them,
        e.g. `{"role": "user", "content": "Wrong, try again."}`) is appended as the chat template continues the
        conversation: the separator after the model's end-of-turn token, the messages and the next assistant header
        (`core.chat.continuation_ids`); with a chat prompt (`--data.apply-chat-template`) that is what keeps the
        episode a well-formed conversation.

        Pictures (a vision-language model): text feedback as `{"text": str, "images": [picture, ...]}`, each picture
        where the text holds Qwen2-VL's placeholder `<|vision_start|><|image_pad|><|vision_end|>` (or all in front of
        a text without one), or chat messages whose `content` is a list of parts, `{"type": "image", "image":
        picture}` among `{"type": "text", "text": ...}`. A picture is a PIL image, a file path or base64 PNG/JPEG. Its
        tokens join the episode as the model's processor counts them, and the engine and the trainer see it there."""
        ...


class MultiTurnExecutor:
    """Turns of generation and environment feedback until the environment says done or `max_turns` is reached.

    All episodes of a batch advance turn by turn together (one engine call per turn for the still-running ones).
    The response grows by the model's tokens (action_mask 1) and the feedback's tokens (action_mask 0); the episode's
    reward is the sum of its turns' rewards (its score: that reward clipped to [0, 1]). An episode whose response
    plus the next feedback would reach `max_total_tokens` stops there and is marked truncated. Feedback as chat
    messages continues only a turn that ended with the template's end-of-turn token: after a turn cut off at
    max-new-tokens (truncated) or ended by another stop token (eos), the episode ends."""

    def __init__(self, engines, tokenizer, env_factory: Callable[[dict], Environment], max_new_tokens: int,
                 max_turns: int = 4, max_total_tokens: int = 1024, temperature: float = 1.0,
                 top_p: float = 1.0, model_path: str | None = None):  # fmt: skip
        self.engines, self.tokenizer, self.env_factory = engines, tokenizer, env_factory
        self.max_new_tokens, self.max_turns, self.max_total_tokens = max_new_tokens, max_turns, max_total_tokens
        self.temperature, self.top_p = temperature, top_p
        self.model_path = model_path  # the policy's folder: its image processor, for feedback with pictures

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _feedback_ids(self, feedback: str | dict | list[dict], turn: list[int]) -> tuple[list[int], list] | None:
        """The tokens appended after the model's `turn` for the environment's `feedback`, and the pictures it holds
        (their image tokens not yet expanded: one `<|image_pad|>` each); None when chat messages cannot follow that
        turn (it did not end with the template's end-of-turn token)."""
        from core import vision

        if isinstance(feedback, str):
            return self._tokens(feedback), []
        if isinstance(feedback, dict) and "role" not in feedback:  # {"text", "images"}: text with pictures
            images, text = list(feedback.get("images") or []), str(feedback.get("text", ""))
            if images and vision.IMAGE_PAD not in text:
                text = vision.IMAGE_PLACEHOLDER * len(images) + text
            return self._tokens(text), images
        if not turn or turn[-1] != chat.end_of_turn_id(self.tokenizer):
            return None
        messages, images = vision.picture_messages([feedback] if isinstance(feedback, dict) else feedback)
        return chat.continuation_ids(self.tokenizer, messages), images

    def _with_pictures(self, example: dict, ids: list[int], images: list) -> tuple[list[int], dict]:
        """`ids` (feedback tokens) with each picture's `<|image_pad|>` expanded to its token count, and the episode's
        example with the pictures added (`core.vision.with_more_pictures`: the engine and the trainer read them
        there)."""
        from core import vision

        where = "the environment's feedback (--rollout.env-file)"
        if self.model_path is None:
            raise ValueError(f"{where} holds pictures, and this executor was given no vision-language model")
        processor = vision.load_image_processor(self.model_path)
        pad_id = self.tokenizer.convert_tokens_to_ids(vision.IMAGE_PAD)
        pictures = [vision.as_image(p, where) for p in images]
        example = vision.with_more_pictures(example, pictures, processor, pad_id)
        counts = [vision.image_tokens(g, processor) for g in example["image_grid_thw"][-len(pictures) :]]
        try:
            ids = vision.expand_image_tokens({"input_ids": ids}, "input_ids", pad_id, counts, "feedback")["input_ids"]
        except vision.BadRow as e:
            raise ValueError(f"{where}: {e.reason}") from None
        return ids, example

    def run(self, batch: list[dict], n: int, seed: int | list[int] | None, step: int,
            temperature: float | None = None) -> Rollout:  # fmt: skip
        temperature = self.temperature if temperature is None else temperature
        rows = [e for e in batch for _ in range(n)]
        envs = [self.env_factory(e) for e in rows]
        episodes = []
        for e, env in zip(rows, envs):
            first = self._tokens(env.reset(e))
            episodes.append(Episode(e, list(e["prompt_ids"]), first, [0.0] * len(first), [0] * len(first), False))
        rewards = [0.0] * len(rows)
        tables: list[list] = [[] for _ in rows]  # --actor.routing-replay: per turn, its table and the rows kept
        active = list(range(len(rows)))
        for turn in range(self.max_turns):
            if not active:
                break
            seeds = None if seed is None else [(seed[i // n] + i % n if isinstance(seed, list) else seed + i)
                                               + 7_919 * turn for i in active]  # fmt: skip
            images = [episodes[i].example.get("images") for i in active]  # the prompt's and the feedback's pictures
            pictures = {"images": images} if any(i is not None for i in images) else {}
            outs = self.engines.generate([episodes[i].prompt_ids + episodes[i].token_ids for i in active], n=1,
                                         max_new_tokens=self.max_new_tokens, temperature=temperature,
                                         top_p=self.top_p, seed=seeds, **pictures)  # fmt: skip
            still = []
            for i, (s,) in zip(active, outs):
                ep = episodes[i]
                ep.token_ids += s.token_ids
                ep.logprobs += s.logprobs
                ep.action_mask += [1] * len(s.token_ids)
                ep.truncated, ep.finish_reason = s.truncated, s.finish_reason
                tables[i].append((s.routed_experts, len(ep.prompt_ids) + len(ep.token_ids) - 1))
                feedback, r, done = envs[i].step(self.tokenizer.decode(s.token_ids, skip_special_tokens=True))
                rewards[i] += float(r)
                done = done or turn == self.max_turns - 1  # no feedback after the last turn: nothing would read it
                got = self._feedback_ids(feedback, s.token_ids) if not done else ([], [])
                if got is None:  # a chat turn that did not end its turn: the conversation cannot go on
                    got, done = ([], []), True
                fb, shown = got
                example = ep.example
                if shown and not done:  # pictures: their tokens expanded, the episode's example to hold them
                    fb, example = self._with_pictures(ep.example, fb, shown)
                if len(ep.token_ids) + len(fb) >= self.max_total_tokens:
                    ep.truncated, done = True, True
                if not done:
                    ep.example = example  # the row's pictures, then the feedback's (a copy: the row is shared)
                    ep.token_ids += fb
                    ep.logprobs += [0.0] * len(fb)
                    ep.action_mask += [0] * len(fb)
                    still.append(i)
            active = still
        for ep, turned in zip(episodes, tables):  # one table per episode, joined across its turns
            ep.routed_experts = moe.joined_tables([t for t, _ in turned], [n for _, n in turned]) if turned else None
        r = torch.tensor(rewards, dtype=torch.float32)
        turns = [sum(1 for a, b in zip([0] + ep.action_mask, ep.action_mask) if b and not a) for ep in episodes]
        return Rollout(episodes, r, r.clamp(0, 1), {"rollout/turns_mean": sum(turns) / max(len(turns), 1)})

    def close(self) -> None:
        """Nothing to release."""


def load_env_factory(path: str) -> Callable[[dict], Environment]:
    """`make_env` from a Python file (`--rollout.env-file`): `make_env(example) -> Environment`, called once per
    episode with the dataset row. Errors name the file."""
    import importlib.util
    from pathlib import Path

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"--rollout.env-file {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"cleanrlhf_env_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    make_env = getattr(module, "make_env", None)
    if not callable(make_env):
        raise AttributeError(f"--rollout.env-file {path}: defines no function `make_env(example) -> Environment`")
    return make_env
