"""Datasets: load local json/jsonl/parquet files, folders or hub datasets with HF `datasets`, turn rows into token
examples, mix several sources, and cut deterministic batches.

Every user mistake becomes one `ValueError` naming the file, the row and the key. Bad rows (missing key, empty text,
too long after tokenization) are skipped and counted, or raise, as `--data.on-bad-row` says.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from core import embedded
from core.config import DataConfig

DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class BadRow(Exception):
    """A row that cannot become an example; `key` names the offending field."""

    def __init__(self, key: str, reason: str):
        super().__init__(reason)
        self.key, self.reason = key, reason


@dataclass
class Source:
    """One loaded data file (or hub split): `name` is what error messages cite."""

    name: str
    rows: object  # datasets.Dataset


def _check_json_file(path: Path) -> None:
    """Parse every line of a .jsonl (or the whole .json) so a malformed line is reported by file and line."""
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {lineno}: malformed JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: line {lineno}: expected a JSON object, got {type(obj).__name__}")


def _files_for(path: Path, split: str) -> list[Path]:
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise ValueError(f"{path}: unsupported data file type {path.suffix!r} (use .json, .jsonl or .parquet)")
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix in DATA_SUFFIXES)
    split_files = [p for p in files if p.stem == split]
    if split_files:
        return split_files
    if not files:
        raise ValueError(f"{path}: folder holds no .json, .jsonl or .parquet files")
    return files


def load_sources(paths: str, split: str, max_samples: int = 100_000_000) -> list[Source]:
    """Load comma-separated datasets; returns one `Source` per file (or per hub dataset)."""
    import datasets

    datasets.disable_progress_bars()
    sources = []
    for raw in [p.strip() for p in paths.split(",") if p.strip()]:
        resolved = Path(embedded.resolve_data(raw)).expanduser()
        if resolved.exists():
            for f in _files_for(resolved, split):
                if DATA_SUFFIXES[f.suffix] == "json":
                    _check_json_file(f)
                try:
                    ds = datasets.load_dataset(DATA_SUFFIXES[f.suffix], data_files=str(f), split="train")
                except Exception as e:  # arrow schema errors etc.: name the file, keep the cause
                    raise ValueError(f"{f}: could not be read as a dataset: {e}") from e
                sources.append(Source(str(f), ds.select(range(min(max_samples, len(ds))))))
        elif raw.startswith((".", "/", "~")) or Path(raw).suffix in DATA_SUFFIXES:
            raise ValueError(f"{raw}: no such data file or folder")
        else:
            try:
                ds = datasets.load_dataset(raw, split=split)
            except Exception as e:
                raise ValueError(
                    f"{raw}: not a local file or folder, and not loadable as a hub dataset (split {split!r}): {e}"
                ) from e
            sources.append(Source(f"{raw}[{split}]", ds.select(range(min(max_samples, len(ds))))))
    if not sources:
        raise ValueError(f"no datasets given (got {paths!r})")
    return sources


def _text(row: dict, key: str) -> str:
    if key not in row or row[key] is None:
        raise BadRow(key, f"missing key {key!r}")
    value = row[key]
    if isinstance(value, str) and not value.strip():
        raise BadRow(key, f"empty text in key {key!r}")
    return value


def format_prompt(prompt, tokenizer, cfg: DataConfig) -> str:
    """Prompt text as the model sees it: chat template (a string becomes one user turn) or `input_template`."""
    if cfg.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise BadRow(cfg.input_key, "a list of messages needs --data.apply-chat-template")
    return cfg.input_template.format(prompt) if cfg.input_template else prompt


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def sft_example(row: dict, tokenizer, cfg: DataConfig, mode: str = "single") -> dict:
    """One training example: `input_ids` and `loss_mask` (1 where the token is a target), both lists of length L.

    mode `single`: loss on the response + eos; `multiturn`: `input_key` holds chat messages, loss on every
    assistant turn; `pretrain`: `input_key` holds plain text, loss on every token after the first.
    """
    if mode == "pretrain":
        ids = _ids(tokenizer, _text(row, cfg.input_key), True) + [tokenizer.eos_token_id]
        example = {"input_ids": ids, "loss_mask": [0] + [1] * (len(ids) - 1)}
    elif mode == "multiturn":
        messages = _text(row, cfg.input_key)
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise BadRow(cfg.input_key, f"key {cfg.input_key!r} must hold a list of {{role, content}} messages")
        ids, mask = [], []
        for k, m in enumerate(messages):
            full = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
            new = _ids(tokenizer, full, False)[len(ids) :]
            ids += new
            mask += [int(m["role"] == "assistant")] * len(new)
        if not any(mask):
            raise BadRow(cfg.input_key, "no assistant turn to learn from")
        example = {"input_ids": ids, "loss_mask": mask}
    elif mode == "single":
        prompt_ids = _ids(
            tokenizer, format_prompt(_text(row, cfg.input_key), tokenizer, cfg), not cfg.apply_chat_template
        )
        response = _text(row, cfg.output_key)
        if not isinstance(response, str):
            raise BadRow(cfg.output_key, f"key {cfg.output_key!r} must hold text")
        response_ids = _ids(tokenizer, response, False) + [tokenizer.eos_token_id]
        example = {"input_ids": prompt_ids + response_ids, "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids)}
    else:
        raise ValueError(f"unknown SFT mode {mode!r}: expected single, multiturn or pretrain")
    if len(example["input_ids"]) > cfg.max_len:
        raise BadRow(cfg.input_key, f"{len(example['input_ids'])} tokens > --data.max-len {cfg.max_len}")
    return example


def prompt_example(row: dict, tokenizer, cfg: DataConfig) -> dict:
    """One RL prompt: token ids, text, label for the reward function and the data source (for per-source eval)."""
    text = format_prompt(_text(row, cfg.input_key), tokenizer, cfg)
    ids = _ids(tokenizer, text, not cfg.apply_chat_template)
    if len(ids) > cfg.max_len:
        raise BadRow(cfg.input_key, f"{len(ids)} prompt tokens > --data.max-len {cfg.max_len}")
    return {
        "prompt_ids": ids,
        "prompt": text,
        "label": _text(row, cfg.label_key),
        "datasource": row.get("datasource", "default"),
    }


def build_examples(sources: list[Source], make, cfg: DataConfig, log=print) -> list[list[dict]]:
    """Apply `make(row)` to every row of every source; bad rows are skipped and counted or raise (file, row, key)."""
    out = []
    for src in sources:
        examples, skipped, first = [], Counter(), None
        for i, row in enumerate(src.rows):
            try:
                examples.append(make(row))
            except BadRow as e:
                msg = f"{src.name}: row {i}: key {e.key!r}: {e.reason}"
                if cfg.on_bad_row == "raise":
                    raise ValueError(msg) from None
                skipped[e.reason] += 1
                first = first or msg
        if skipped:
            log(f"[data] skipped {sum(skipped.values())} of {len(src.rows)} rows in {src.name} "
                f"({dict(skipped)}); first: {first}")  # fmt: skip
        if not examples:
            raise ValueError(f"{src.name}: no usable rows (the dataset is empty or every row was bad)")
        out.append(examples)
    return out


def mix(groups: list[list[dict]], probs: str | None, seed: int) -> list[dict]:
    """Concatenate the per-source example lists, or, with probabilities, draw sum(len) examples where each slot
    comes from source i with probability p_i (a source is cycled in a fixed shuffled order when exhausted)."""
    if probs is None:
        return [e for g in groups for e in g]
    p = torch.tensor([float(x) for x in probs.split(",")])
    if len(p) != len(groups) or (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"--data.probs {probs!r}: need {len(groups)} non-negative numbers, one per dataset")
    gen = torch.Generator().manual_seed(seed)
    picks = torch.multinomial(p / p.sum(), sum(len(g) for g in groups), replacement=True, generator=gen)
    orders = [torch.randperm(len(g), generator=gen).tolist() for g in groups]
    cursor = [0] * len(groups)
    out = []
    for src in picks.tolist():
        out.append(groups[src][orders[src][cursor[src] % len(groups[src])]])
        cursor[src] += 1
    return out


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of global batch `step`: the data stream is epoch-wise `randperm(n)` seeded by (seed, epoch), so any
    step's batch is a pure function of (n, batch_size, step, seed) and resuming at a step continues exactly."""
    start, out = step * batch_size, []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out += perm[offset : offset + batch_size - len(out)].tolist()
    return out
