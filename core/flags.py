"""The flag rules a config field carries in its type: `batch_size: PosInt = 64` is an int flag for tyro and a size
that must be > 0 for `core.config.check_args`, which reads the rules from the annotations. A new or renamed field is
checked by what its type says, with no list of names to keep; a fork's own field picks a type from here.
"""

from __future__ import annotations

from typing import Annotated


class Rule(str):
    """A flag rule in a field's `Annotated` type: "positive", "non-negative", "at-most-one", "above-one",
    "interval:weight", "interval:open", "model-path" or "cuda-only:<why>" (a switch that cannot be on without a CUDA
    GPU, and why). None always passes (it means "off" or "the default")."""


POSITIVE, NON_NEGATIVE, AT_MOST_ONE, ABOVE_ONE = Rule("positive"), Rule("non-negative"), Rule("at-most-one"), Rule("above-one")
PosInt = Annotated[int, POSITIVE]
"""a size or a count: 0 trains nothing, divides by zero or gives NaN metrics."""
PosFloat = Annotated[float, POSITIVE]
"""a rate, scale or limit that has no "off" at 0."""
NonNegInt = Annotated[int, NON_NEGATIVE]
"""0 means off, none or "from the start"."""
NonNegFloat = Annotated[float, NON_NEGATIVE]
"""0 means off."""
Fraction = Annotated[float, NON_NEGATIVE, AT_MOST_ONE]
"""a fraction or probability in [0, 1]."""
PosFraction = Annotated[float, POSITIVE, AT_MOST_ONE]
"""a fraction in (0, 1]."""
AboveOne = Annotated[float, ABOVE_ONE]
"""a constant > 1 (the dual clip bounds a loss at c·|A| > |A|)."""
WeightBounds = Annotated[tuple[float, float], Rule("interval:weight")]
"""(low, high) bounds of a weight that multiplies a gradient: 0 <= low <= high and high > 0 (a negative bound turns
the gradient's sign: `clamp(w, -1, -2)` is -2 everywhere)."""
OpenInterval = Annotated[tuple[float, float], Rule("interval:open")]
"""(low, high) keeping what lies strictly inside: low < high (an empty one keeps nothing)."""
CUDA_ONLY = "cuda-only:"


def CudaOnly(why: str):  # noqa: N802 - a type, as the others here
    """A switch that needs a CUDA GPU: on without one it is refused before anything loads, with `why`."""
    return Annotated[bool, Rule(CUDA_ONLY + why)]


ModelPath = Annotated[str, Rule("model-path")]
"""a model (HF id, embedded name or local folder); a local folder must exist (with config.json, but a tokenizer's)."""
