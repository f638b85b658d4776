"""A two-turn picture task whose second picture is the environment's feedback, for a vision-language policy on the
embedded `cleanrlhf/shapes` rows (`--rollout.env-file`):

    python algos/grpo.py --actor.model.name-or-path my-vl-sft --data.path cleanrlhf/shapes --data.image-key image \
        --rollout.env-file agents/examples/shapes_env.py --rollout.max-turns 2 --rollout.max-new-tokens 3

Turn 1: the row's picture and "How many squares?"; the answer earns 0.5 when it is the count. The environment then
answers with a new picture (1-5 squares drawn for this episode from the row's picture, so a row always gets the same
one) and the same question, as `{"text": ..., "images": [picture]}`: its tokens join the episode (masked out of the
loss) and the engine and the trainer see the picture there. Turn 2's answer earns 0.5 when it is the new count.
"""

from __future__ import annotations

import random
import zlib

from core import embedded
from rewards.shapes import score

QUESTION = "How many squares?"


def second_picture(example: dict):
    """(picture, count): 1-5 squares of random colours in random cells, drawn with a seed taken from the row's own
    picture (its pixel values), so an episode of the same row always gets the same feedback."""
    pixels = example.get("pixel_values")
    key = pixels.numpy().tobytes() if pixels is not None else str(example.get("prompt", "")).encode()
    rng = random.Random(zlib.crc32(key))
    cells = rng.sample(range(16), rng.randint(1, 5))
    picture = embedded.draw_shapes({i: rng.choice(list(embedded.SHAPE_COLOURS)) for i in cells})
    return picture, str(len(cells))


class ShapesTwoTurns:
    """`agents.executor.Environment`: turn 1 scores the row's count, turn 2 the count of the picture sent back."""

    def __init__(self, example: dict):
        self.label = str(example["label"])
        self.picture, self.count = second_picture(example)
        self.turn = 0

    def reset(self, example: dict) -> str:
        return ""  # the row's picture and question are already the prompt

    def step(self, response: str):
        self.turn += 1
        if self.turn == 1:
            return {"text": QUESTION, "images": [self.picture]}, 0.5 * score(response, self.label), False
        return "", 0.5 * score(response, self.count), True


def make_env(example: dict) -> ShapesTwoTurns:
    return ShapesTwoTurns(example)
