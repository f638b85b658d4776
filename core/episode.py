"""What an episode executor (agents/executor.py, agents/openai_agent.py) returns and core's RL loop reads: the
episodes of a rollout, token ids in and out, with the engine's log-probs, the action mask and the rewards. Defined
here, below both, so that the loop takes executors from the scripts without importing agents/."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Episode:
    example: dict
    """the dataset row the episode answers (prompt, prompt_ids, label, datasource, ...). Its pictures (`images`,
    `pixel_values`, `image_grid_thw`; core/vision.py) are the whole episode's: when an environment answers with
    pictures, a copy of the row holding the row's pictures and then the feedback's, in order."""
    prompt_ids: list[int]
    token_ids: list[int]
    """the response: everything after the prompt, model and environment tokens interleaved."""
    logprobs: list[float]
    """one per `token_ids` entry: the engine's log-prob of the sampled token (0.0 on environment tokens)."""
    action_mask: list[int]
    """1 on tokens the policy generated (trained on), 0 on tokens the environment inserted."""
    truncated: bool
    """the last generation hit max-new-tokens (or the context) without an eos."""
    finish_reason: str = "stop"
    extra: dict = field(default_factory=dict)
    """the reward function's per-sample `extra_logs` entries (kept with the samples, core/samples.py)."""
    routed_experts: torch.Tensor | None = None
    """`--actor.routing-replay`: the engine's routing table of prompt + response (`Sample.routed_experts`), which the
    trainer's forwards replay (`core.rl.sequences`' `routing`); None otherwise."""


@dataclass
class Rollout:
    episodes: list[Episode]
    """prompt-major: episode j of prompt i at i·G + j."""
    rewards: torch.Tensor
    """(B,) float32, one reward per episode."""
    scores: torch.Tensor
    """(B,) float32 0-1 scores for dynamic filtering (the rewards when the reward function gives none)."""
    logs: dict[str, float] = field(default_factory=dict)
    """`rollout/*` extras from the reward function or environment, batch means."""

    def take_groups(self, keep: torch.Tensor, group_size: int) -> Rollout:
        """The groups where `keep` (B / G,) bool is True, in order."""
        idx = [g * group_size + j for g in keep.nonzero().flatten().tolist() for j in range(group_size)]
        return Rollout([self.episodes[i] for i in idx], self.rewards[idx], self.scores[idx], dict(self.logs))

    @staticmethod
    def cat(parts: list[Rollout]) -> Rollout:
        """Concatenate rollouts (logs of the first)."""
        return Rollout([e for p in parts for e in p.episodes], torch.cat([p.rewards for p in parts]),
                       torch.cat([p.scores for p in parts]), dict(parts[0].logs) if parts else {})  # fmt: skip
