"""HTTP reward server: scores batches of texts with a reward model trained by `algos/rm.py` (or any
`AutoModelForSequenceClassification` with one label), for the RL scripts' `--reward.remote-url`.

    POST /get_reward   {"query": ["37+45=82", ...], "prompts": [...], "labels": [...]}
                    -> {"rewards": [1.7, ...], "scores": [1.7, ...]}
    GET  /health    -> {"status": "ok", "model": ..., "normalize": ...}

The request and response follow OpenRLHF's remote reward-model contract: `query` holds the full texts (prompt +
response, as the policy saw them); `prompts` and `labels` are optional and, when given, must have one entry per
query (a rule or hybrid server could use them; this one scores `query` alone). Each text is tokenized in one piece
with an eos appended (`core.data.reward_ids`, exactly as `algos/rm.py` trained) and scored at its last token. With
`--normalize` a score is (r − reward_mean) / reward_std, the held-out statistics `algos/rm.py` saved in config.json.

Errors: a body that is not JSON or has the wrong shape -> 422 with pydantic's description of the offending field;
mismatched list lengths, too many texts or an over-long text -> 400 naming the field and index. A bad request never
stops the server.

Run:
    python -m rewards.server --model runs/rm__1__<time>/hf --normalize --port 5000
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import tyro
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from core import data, models


@dataclass
class ServerArgs:
    model: str
    """reward model folder (an `algos/rm.py` export) or hub id."""
    host: str = "127.0.0.1"
    """interface to bind; 0.0.0.0 serves other machines."""
    port: int = 5000
    """TCP port."""
    normalize: bool = False
    """serve (r − reward_mean) / reward_std with the statistics saved in the model's config.json."""
    batch_size: int = 64
    """texts per forward pass."""
    max_len: int = 2048
    """reject texts longer than this many tokens (400), rather than truncate them silently."""
    max_texts: int = 4096
    """reject requests with more texts than this (400)."""
    dtype: str = "auto"
    """`auto` (bf16 on GPU, fp32 on CPU), `bf16` or `fp32`."""


class RewardRequest(BaseModel):
    query: list[str]
    prompts: list[str] | None = None
    labels: list | None = None


class RewardScorer:
    """The model, tokenizer and normalization; `scorer(texts)` returns one float per text (thread-safe)."""

    def __init__(self, path: str, normalize: bool = False, batch_size: int = 64, max_len: int = 2048,
                 dtype: str = "auto", device: str | None = None):  # fmt: skip
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = models.load_scalar_model(path, dtype).to(self.device).eval()
        self.tokenizer = models.load_tokenizer(path)
        config = self.model.config
        self.add_special_tokens = getattr(config, "reward_add_special_tokens", True)
        self.mean, self.std = 0.0, 1.0
        if normalize:
            if getattr(config, "reward_mean", None) is None or getattr(config, "reward_std", None) is None:
                raise ValueError(f"{path}: --normalize needs reward_mean / reward_std in config.json (algos/rm.py "
                                 "writes them); serve without --normalize")  # fmt: skip
            self.mean, self.std = float(config.reward_mean), max(float(config.reward_std), 1e-8)
        self.path, self.normalize, self.batch_size, self.max_len = path, normalize, batch_size, max_len
        self.lock = threading.Lock()

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Tokenize; ValueError naming the index of the first over-long text."""
        ids = [data.reward_ids(self.tokenizer, t, self.add_special_tokens) for t in texts]
        for i, x in enumerate(ids):
            if len(x) > self.max_len:
                raise ValueError(f"query[{i}]: {len(x)} tokens > max_len {self.max_len}")
        return ids

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> list[float]:
        ids, out = self.token_ids(texts), []
        pad = self.tokenizer.pad_token_id
        with self.lock:  # one forward at a time: requests run in a thread pool
            for i in range(0, len(ids), self.batch_size):
                chunk = ids[i : i + self.batch_size]
                width = max(len(x) for x in chunk)
                input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in chunk], device=self.device)
                mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in chunk], device=self.device)
                scores = models.sequence_scores(self.model, input_ids, mask)
                out += ((scores - self.mean) / self.std).tolist()
        return out


def create_app(scorer: RewardScorer, max_texts: int = 4096) -> FastAPI:
    app = FastAPI(title="CleanRLHF reward server")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": scorer.path, "normalize": scorer.normalize}

    @app.post("/get_reward")
    def get_reward(req: RewardRequest) -> dict:
        n = len(req.query)
        for name, values in (("prompts", req.prompts), ("labels", req.labels)):
            if values is not None and len(values) != n:
                raise HTTPException(400, f"{name!r} has {len(values)} entries but 'query' has {n}: one per query")
        if n > max_texts:
            raise HTTPException(400, f"{n} texts in one request > max_texts {max_texts}: split the batch")
        if n == 0:
            return {"rewards": [], "scores": []}
        try:
            rewards = scorer(req.query)
        except ValueError as e:  # an over-long text: the client's mistake
            raise HTTPException(400, str(e)) from None
        return {"rewards": rewards, "scores": rewards}

    return app


def main(args: ServerArgs) -> None:
    import uvicorn

    scorer = RewardScorer(args.model, args.normalize, args.batch_size, args.max_len, args.dtype)
    uvicorn.run(create_app(scorer, args.max_texts), host=args.host, port=args.port)


if __name__ == "__main__":
    main(tyro.cli(ServerArgs))
