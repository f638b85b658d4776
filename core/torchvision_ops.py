"""Let torchvision's Python code import on the CPU stack, whose torchvision wheel's compiled ops do not load.

vLLM serves Qwen2-VL through transformers' Qwen2-VL processor, which needs torchvision (its video processor, and
`image_utils` imports `torchvision.transforms`). The only torchvision wheel for torch 2.13 the package index has here
(0.28.0) is a CUDA build: its `_C.so` does not load on torch's CPU build, and its import then fails with "operator
torchvision::nms does not exist", because `torchvision/_meta_registrations.py` registers fake kernels for the ops
`nms` and `qnms` unconditionally. Nothing in CleanRLHF calls a torchvision op (resizing and normalising are plain
torch), so defining those two schemas without kernels is enough: torchvision imports, its transforms work, and a call
to `torchvision.ops.nms` fails with "no kernel" instead of the import.

`.ci/setup.sh` copies this file into the virtualenv's site-packages with a `.pth` line that imports it, so every
Python process of the environment (Ray workers, vLLM's model-inspection subprocess) has the hook before anything
imports torchvision. Importing this module costs nothing: torch is imported only when torchvision is. If
torchvision's own ops load (a matching build, e.g. on a GPU machine), nothing is defined.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = None  # the torch.library.Library that holds the schemas: it must outlive the import


def define_missing_ops() -> bool:
    """Load torchvision's compiled ops as torchvision would; where they do not load, define the schemas in `OPS`
    without kernels. Returns True when the schemas were defined here."""
    global _LIBRARY
    import glob
    import os

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for path in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(path)
            return False  # torchvision's own ops are registered
        except (OSError, RuntimeError):
            pass
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for schema in OPS:
        _LIBRARY.define(schema)
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs `define_missing_ops` once, when `import torchvision` starts, then steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_missing_ops()
        return None  # the normal finders import it


def install() -> None:
    if "torchvision" not in sys.modules and not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


install()
