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


def short_rl_run(main, args, run_dir, steps: int = 20) -> tuple[dict, list[dict]]:
    """The learning check every RL script's slow test makes: `steps` steps of the script's defaults (64 prompts x 8
    samples; 12 x 32 was too noisy to test), eval at the start and end, and `--debug` so the engine's log-probs must
    equal the trainer's after every sync. Returns the summary and the metrics.jsonl rows."""
    import json

    args.train.max_steps, args.eval.every = steps, steps
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(run_dir)
    args.debug = True
    summary = main(args)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, rows
