"""Shared test setup: quiet tokenizers, one torch thread (CI is a shared 2-core machine), and the embedded tiny model.

The embedded artifacts are built in the user's normal cache ($CLEANRLHF_HOME, default ~/.cache/cleanrlhf), so CI
and repeated runs build them once.
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # OpenMP threads oversubscribe a busy 2-core machine badly; the models are tiny


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a whole module, restored after it: an earlier module (vLLM's CPU worker binds threads)
    may have changed the count, and two spinning OpenMP threads on a busy 2-core machine make every op slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_path():
    """Folder of the randomly initialised embedded model + tokenizer (`cleanrlhf/tiny`), built on first use."""
    from core import embedded

    return embedded.ensure_tiny_base()


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from core import models

    return models.load_tokenizer(str(tiny_path))


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    """The tiny causal LM in fp32, eval mode (no dropout), shared read-only by tests that do not train it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
