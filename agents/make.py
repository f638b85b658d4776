"""The episodes of an RL run, wired by the script: which executor its `--rollout.*` flags ask for and the reward it
scores with. The RL scripts call these by name and hand the executor to core (`core.rl.start`), which runs it and
never imports agents/ or rewards/:

    check_episode_files(args.rollout, args.reward)             # the driver, before anything loads
    reward = load_reward(args.rollout, args.reward, group)       # None when the environment or the agent rewards
    episodes = partial(make_executor, args.rollout, reward, model_path, max_model_len)
    run = rl.start(..., episodes, ...)                           # core calls episodes(engines, tokenizer)

Three executors, one interface (`run(batch, n, seed, step) -> Rollout`): the single-turn one (prompt tokens, one
generation, the reward function), the multi-turn one (`--rollout.env-file`: an environment's turns) and the agent one
(`--rollout.agent-file`: an agent's OpenAI API calls to a server over the engines).
"""

from __future__ import annotations

from functools import partial

from agents.executor import MultiTurnExecutor, SingleTurnExecutor, load_env_factory
from agents.openai_agent import OpenAIAgentExecutor, check_agent_file
from core import models
from rewards.loader import check_reward_source, load_reward_func, score


def agentic(rollout_cfg) -> bool:
    """Whether the episodes reward themselves: an environment (`--rollout.env-file`) or an agent
    (`--rollout.agent-file`) gives the reward, not `--reward.*`."""
    return bool(rollout_cfg.env_file or rollout_cfg.agent_file)


def check_episode_files(rollout_cfg, reward_cfg) -> None:
    """What the run reads from files the user wrote, checked before anything loads (DeepSpeed, Ray, vLLM): one of
    an environment and an agent file, an agent file that imports and whose `agent` is `async def`, a judge that
    answers. Each stops the run in one error naming the flag and the file."""
    if rollout_cfg.env_file and rollout_cfg.agent_file:
        raise ValueError(f"--rollout.env-file {rollout_cfg.env_file} and --rollout.agent-file "
                         f"{rollout_cfg.agent_file}: give one (both define the episodes and their rewards)")  # fmt: skip
    if rollout_cfg.agent_file:
        check_agent_file(rollout_cfg.agent_file)
    if not agentic(rollout_cfg):
        check_reward_source(reward_cfg)


def load_reward(rollout_cfg, reward_cfg, group=None) -> tuple | None:
    """(reward_func, its name) from `--reward.*` (`rewards.loader.load_reward_func`; `group`: the reward model's Ray
    replicas of `--reward.ranks`), or None when the environment or the agent rewards."""
    return None if agentic(rollout_cfg) else load_reward_func(reward_cfg, group)


def make_executor(rollout_cfg, reward: tuple | None, model_path: str, max_model_len: int | None, engines, tokenizer):
    """The executor `--rollout.*` asks for, over `engines`: the agent's (an OpenAI-compatible server over the
    engines, contexts up to `max_model_len` or the model's own), the environment's, or the single-turn one scoring
    with `reward` (`load_reward`)."""
    c = rollout_cfg
    if c.agent_file:
        max_context = max_model_len or models.max_positions(model_path, "--actor.model.name-or-path")
        return OpenAIAgentExecutor(engines, tokenizer, c.agent_file, model_path, c.max_new_tokens, max_context,
                                   c.temperature, c.top_p, c.agent_concurrency, c.agent_timeout_s, c.agent_tool_parser,
                                   c.agent_max_request_bytes)  # fmt: skip
    if c.env_file:
        return MultiTurnExecutor(engines, tokenizer, load_env_factory(c.env_file), c.max_new_tokens, c.max_turns,
                                 c.max_total_tokens, c.temperature, c.top_p, model_path)  # fmt: skip
    return SingleTurnExecutor(engines, tokenizer, partial(score, *reward), c.max_new_tokens, c.temperature, c.top_p)
