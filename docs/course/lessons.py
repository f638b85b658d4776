"""The course's lessons: for each, its page, the real source file and function its exercise leaves blank, and the
short learning run that grades an exercise (docs/course/check.py). make_exercises.py writes the exercise files from
this table; tests/test_course.py checks that the pages, the functions they link and the exercises agree with it.

An exercise is a copy of a real file of the project with one function's body removed: a script in algos/, the
calculator agent, or core/rl_math.py where the math lives there (the KL estimators, which every RL script
calls). A script exercise runs as the script it is copied from; an rl_math exercise runs inside the script named by
`runs` (docs/course/run_with.py puts it in place of core.rl_math).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

COURSE = Path(__file__).resolve().parent
REPO = COURSE.parent.parent
EXERCISES = COURSE / "exercises"


@dataclass(frozen=True)
class Lesson:
    number: int
    slug: str
    title: str
    source: str | None
    """the real file the exercise copies (repo-relative), None for a lesson without an exercise"""
    function: str | None
    """the function whose body the student writes"""
    runs: str | None = None
    """for a core/ exercise: the script its learning run trains with it"""
    run_flags: tuple[str, ...] = field(default=())
    """the learning run's flags (after the script)"""

    @property
    def page(self) -> Path:
        return COURSE / f"{self.number:02d}_{self.slug}.md"

    @property
    def exercise(self) -> Path | None:
        return None if self.function is None else EXERCISES / f"{self.number:02d}_{self.slug}.py"


# The RL learning run: 20 steps of the script's defaults (64 prompts x 8 samples on the embedded add-2 task, from the
# embedded SFT warm start), greedy pass@1 on 500 held-out prompts before the first step and after the last.
RL_RUN = ("--train.max-steps", "20", "--eval.every", "20", "--eval.k", "1")  # judged on greedy pass@1 alone

LESSONS: dict[int, Lesson] = {
    lesson.number: lesson
    for lesson in (
        Lesson(1, "baseline", "Policy gradient with a baseline (RLOO)", "algos/rloo.py", "rloo_advantages",
               run_flags=RL_RUN),
        Lesson(2, "group_advantage", "GRPO's group advantage, and Dr.GRPO", "algos/grpo.py", "group_advantages",
               run_flags=RL_RUN),
        Lesson(3, "ppo_clip", "The PPO clip", "algos/grpo.py", "policy_loss", run_flags=RL_RUN),
        Lesson(4, "kl", "KL regularisation and its estimators", "core/rl_math.py", "approx_kl", runs="algos/grpo.py",
               run_flags=(*RL_RUN, "--algo.kl-coef", "0.05", "--algo.kl-estimator", "k3")),
        Lesson(5, "gae", "A critic and GAE (PPO)", "algos/ppo.py", "gae", run_flags=RL_RUN),
        Lesson(6, "reward_model", "Reward models (Bradley-Terry)", "algos/rm.py", "reward_loss",
               run_flags=("--train.max-steps", "60", "--eval.every", "60", "--eval.max-samples", "300")),
        Lesson(7, "dpo", "Direct preference optimisation (DPO)", "algos/dpo.py", "dpo_loss",
               run_flags=("--train.max-steps", "40", "--eval.every", "40", "--eval.max-samples", "300")),
        Lesson(8, "agents", "Agents and tools", "agents/examples/calculator_agent.py", "agent"),
        Lesson(9, "scaling_out", "Scaling out: ranks, engines, ZeRO-3", None, None),
        Lesson(10, "reward_parts", "Rewards with several parts (GDPO)", "algos/gdpo.py", "gdpo_advantages",
               run_flags=RL_RUN),
    )
}  # fmt: skip
