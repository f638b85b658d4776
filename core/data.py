"""Datasets: load local json/jsonl/parquet files, folders or hub datasets with HF `datasets`, turn rows into token
examples, mix several sources, and cut deterministic batches.

Every user mistake becomes one `ValueError` naming the file, the row and the key. Bad rows (missing key, empty text,
too long after tokenization, a JSONL line that is not UTF-8 text) are skipped and counted, or raise naming the file
and row (or line), as `--data.on-bad-row` says. "Too long" is measured against `--data.max-len`, which the scripts
first resolve against the model's context (`resolve_max_len`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core import chat, embedded, preference
from core.config import DataConfig

DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
KNOWN_SPLITS = {"train", "test", "validation", "valid", "val", "dev", "eval"}


class BadRow(Exception):
    """A row that cannot become an example; `key` names the offending field. `kind` (default: the reason) is what
    the skipped rows are counted by, so rows too long by different amounts are one count."""

    def __init__(self, key: str, reason: str, kind: str | None = None):
        super().__init__(reason)
        self.key, self.reason, self.kind = key, reason, kind or reason


def resolve_max_len(max_len: int | None, limits: dict[str, int | None], reserve: int = 0,
                    reserve_flag: str = "") -> int:  # fmt: skip
    """The sequence limit rows are checked against: `--data.max-len` (`max_len`), by default the smallest of the
    context `limits` ({what it is: tokens}, e.g. {"max_position_embeddings of --model.name-or-path": 512}; None:
    unknown). An explicit `max_len` above a limit is a ValueError naming both numbers. `reserve` tokens (RL: the
    response budget, from the flag(s) `reserve_flag`) must leave room for a prompt of at least one token."""
    known = {what: n for what, n in limits.items() if n is not None}
    if max_len is None:
        if not known:
            raise ValueError(f"--data.max-len: the model's config names no context length ({', '.join(limits)}); "
                             "set --data.max-len")  # fmt: skip
        max_len = min(known.values())
    for what, n in known.items():
        if max_len > n:
            raise ValueError(f"--data.max-len {max_len} exceeds the {what}, {n}: sequences that long cannot fit")
    if reserve >= max_len:
        raise ValueError(f"{reserve_flag} {reserve} leaves no room for a prompt within {max_len} tokens "
                         "(--data.max-len, default the model's max_position_embeddings)")  # fmt: skip
    return max_len


def _too_long(key: str, n: int, cfg: DataConfig, what: str = "tokens", reserve: int = 0) -> None:
    if cfg.max_len is not None and n + reserve > cfg.max_len:
        budget = f" + {reserve} response tokens" if reserve else ""
        raise BadRow(key, f"{n} {what}{budget} > --data.max-len {cfg.max_len}", f"longer than {cfg.max_len} tokens")


@dataclass
class Source:
    """One loaded data file (or hub split): `name` is what error messages cite. `bad_lines`: the lines of a JSONL
    file that were not UTF-8 text, left out of `rows` ("<file>: line <n>: ..."); `build_examples` skips and counts
    them, or raises, as `--data.on-bad-row` says."""

    name: str
    rows: object  # datasets.Dataset
    bad_lines: list[str] = field(default_factory=list)


NOT_UTF8 = "not UTF-8 text"


def _read_json_text(path: Path) -> tuple[str, list[tuple[int, str]]]:
    """The file's text and its lines that are not UTF-8, as (line number, "<file>: line <n>: not UTF-8 text (...)"),
    each replaced by an empty line so that the line numbers stay and JSONL readers see no row there. A JSON array
    file cannot lose a line: any such byte in it is a ValueError naming the file and line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8"), []
    except UnicodeDecodeError:
        pass
    lines, bad = [], []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            lines.append("")
            bad.append((lineno, f"{path}: line {lineno}: {NOT_UTF8} (byte 0x{line[e.start]:02x} at column "
                                f"{e.start + 1}: {e.reason})"))  # fmt: skip
    text = "\n".join(lines)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        raise ValueError(f"{bad[0][1]}; a JSON array file cannot skip a line: fix or re-encode the file as UTF-8")
    if not text.strip():
        raise ValueError(f"{path}: no line is UTF-8 text ({len(bad)} lines; first: {bad[0][1]})")
    return text, bad


def _check_json_file(path: Path, text: str) -> None:
    """Parse every line of a .jsonl (or the whole .json, `text`) so a malformed line is reported by file and line."""
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
        if not rows:
            raise ValueError(f"{path}: empty dataset file (no rows)")
        return
    if not text.strip():
        raise ValueError(f"{path}: empty dataset file (no rows)")
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
    split_of = {p: p.stem.split("-")[0] for p in files}  # `train.jsonl`, `train-00000-of-00002.parquet`
    split_files = [p for p in files if split_of[p] == split]
    if split_files:
        return split_files
    if not files:
        raise ValueError(f"{path}: folder holds no .json, .jsonl or .parquet files")
    if {split_of[p] for p in files} & KNOWN_SPLITS:  # e.g. train.jsonl only, asked for test: don't eval on train
        raise ValueError(f"{path}: no file for split {split!r} (files: {', '.join(p.name for p in files)})")
    return files


def resolve_data(path: str) -> str:
    """An embedded dataset name -> its built folder: `cleanrlhf/addN` (core/embedded.py), `cleanrlhf/addN-pref` and
    `cleanrlhf/addN-kto` (core/preference.py). A local folder of the same name wins; anything else passes through."""
    if path.startswith(embedded.PREFIX) and path.endswith(("-pref", "-kto")) and not Path(path).exists():
        return str(preference.ensure_preference_data(path[len(embedded.PREFIX) :]))
    return embedded.resolve_data(path)


def _load_file(datasets, f: Path, text: str | None):
    """`datasets.load_dataset` of one local file; given `text` (the file with its non-UTF-8 lines blanked), loaded from
    a cleaned copy instead, kept in memory, with nothing left in the datasets cache."""
    if text is None:
        return datasets.load_dataset(DATA_SUFFIXES[f.suffix], data_files=str(f), split="train")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        clean = Path(tmp) / f.name
        clean.write_text(text, encoding="utf-8")
        return datasets.load_dataset(DATA_SUFFIXES[f.suffix], data_files=str(clean), split="train",
                                     cache_dir=str(Path(tmp) / "cache"), keep_in_memory=True)  # fmt: skip


def load_sources(paths: str, split: str, max_samples: int = 100_000_000) -> list[Source]:
    """Load comma-separated datasets; returns one `Source` per file (or per hub dataset)."""
    import datasets

    datasets.disable_progress_bars()
    sources = []
    for raw in [p.strip() for p in paths.split(",") if p.strip()]:
        resolved = Path(resolve_data(raw)).expanduser()
        if resolved.exists():
            for f in _files_for(resolved, split):
                text, bad = None, []
                if DATA_SUFFIXES[f.suffix] == "json":
                    text, bad = _read_json_text(f)
                    _check_json_file(f, text)
                try:
                    ds = _load_file(datasets, f, text if bad else None)
                except Exception as e:  # arrow schema errors etc.: name the file, keep the cause
                    raise ValueError(f"{f}: could not be read as a dataset: {e}") from e
                if bad and len(ds) > max_samples:  # only the bad lines among the rows kept count
                    rows = [n for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
                    bad = [(n, msg) for n, msg in bad if n < rows[max_samples]]
                sources.append(Source(str(f), ds.select(range(min(max_samples, len(ds)))), [msg for _, msg in bad]))
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


def _messages(value, key: str, prompt: bool = False) -> list[dict]:
    """Chat messages of column `key`: a non-empty list of {role, content} dicts with text values (a prompt's must not
    end with an assistant turn: the generation prompt opens the turn the model answers). BadRow otherwise."""
    try:
        messages = chat.check_messages(value, "the messages")
    except ValueError as e:
        raise BadRow(key, str(e)) from None
    if prompt and messages[-1]["role"] == "assistant":
        raise BadRow(key, "the prompt's last message is an assistant turn (the model answers the last user turn)")
    return messages


def _render(tokenizer, messages: list[dict], key: str, add_generation_prompt: bool) -> str:
    """The chat template's text; a template error (e.g. roles that must alternate) is a BadRow of column `key`."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--data.apply-chat-template: the tokenizer has no chat template (--model.tokenizer, or a "
                         "chat_template.jinja in the model folder)")  # fmt: skip
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        raise BadRow(key, f"the chat template refused the messages: {e}") from None


def format_prompt(prompt, tokenizer, cfg: DataConfig) -> str:
    """Prompt text as the model sees it: chat template (a string becomes one user turn) with the generation prompt,
    or `input_template`."""
    if cfg.apply_chat_template:
        raw = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return _render(tokenizer, _messages(raw, cfg.input_key, prompt=True), cfg.input_key, True)
    if not isinstance(prompt, str):
        raise BadRow(cfg.input_key, "a list of messages needs --data.apply-chat-template")
    return cfg.input_template.format(prompt) if cfg.input_template else prompt


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    """`tokenizer(text, add_special_tokens=special)["input_ids"]`. A fast tokenizer's Rust backend is called directly
    (what transformers' call runs for one plain text, without its per-call Python around it): 10,000 prompts took
    2.3 s through the call and ~0.3 s through the backend on a 2-core Xeon, paid by every RL run at start."""
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return tokenizer(text, add_special_tokens=special)["input_ids"]
    return backend.encode(text, add_special_tokens=special).ids


def sft_example(row: dict, tokenizer, cfg: DataConfig, mode: str = "single") -> dict:
    """One training example: `input_ids` and `loss_mask` (1 where the token is a target), both lists of length L.

    mode `single`: loss on the response + eos (with `--data.apply-chat-template`: + the template's end-of-turn token);
    `multiturn`: `input_key` holds chat messages, loss on every assistant turn's tokens through its end-of-turn token
    (the role header and the template's separator after the turn are not targets); `pretrain`: `input_key` holds
    plain text, loss on every token after the first.
    """
    if mode == "pretrain":
        text = _text(row, cfg.input_key)
        if not isinstance(text, str):
            raise BadRow(cfg.input_key, f"key {cfg.input_key!r} must hold text")
        ids = _ids(tokenizer, text, True) + [tokenizer.eos_token_id]
        example = {"input_ids": ids, "loss_mask": [0] + [1] * (len(ids) - 1)}
    elif mode == "multiturn":
        messages = _messages(_text(row, cfg.input_key), cfg.input_key)
        # An assistant turn is learned up to and including the template's end-of-turn token; what the template
        # writes after it (Qwen: "\n") is a separator the model never generates, so it is not a target.
        eot = chat.end_of_turn_id(tokenizer)
        ids, mask = [], []
        for k, m in enumerate(messages):
            if m["role"] == "assistant":  # the role header comes from the generation prompt: not a target
                head = _render(tokenizer, messages[:k], cfg.input_key, True)
                new = _ids(tokenizer, head, False)[len(ids) :]
                ids, mask = ids + new, mask + [0] * len(new)
            full = _ids(tokenizer, _render(tokenizer, messages[: k + 1], cfg.input_key, False), False)
            if full[: len(ids)] != ids:
                raise BadRow(cfg.input_key, f"chat template output of turn {k} does not extend turns < {k}")
            new = full[len(ids) :]
            target = len(new) if m["role"] == "assistant" else 0
            if target and eot in new:
                target = len(new) - new[::-1].index(eot)
            ids += new
            mask += [1] * target + [0] * (len(new) - target)
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
        # a chat response ends its turn as the template does (Qwen: <|im_end|>, whatever the tokenizer's eos)
        end = chat.turn_end_ids(tokenizer) if cfg.apply_chat_template else [tokenizer.eos_token_id]
        response_ids = _ids(tokenizer, response, False) + end
        example = {"input_ids": prompt_ids + response_ids, "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids)}
    else:
        raise ValueError(f"unknown SFT mode {mode!r}: expected single, multiturn or pretrain")
    _too_long(cfg.input_key, len(example["input_ids"]), cfg)
    return example


def _label(value):
    """A JSON number's text (see `prompt_example`); an integral float loses its `.0`, since `datasets` loads a JSON
    column mixing 42 and 3.5 as float64, 42 as 42.0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def prompt_example(row: dict, tokenizer, cfg: DataConfig, reserve: int = 0) -> dict:
    """One RL prompt: token ids, text, label for the reward function and the data source (for per-source eval).

    `reserve`: response tokens the prompt must leave room for (the RL scripts pass `--rollout.max-new-tokens`, plus
    `--rollout.max-total-tokens` in multi-turn): a prompt of more than `cfg.max_len - reserve` tokens is a BadRow,
    so a row that cannot fit in the model's context is skipped and counted at load time instead of failing in the
    rollout engine.

    Labels: a JSON number (int or float, not bool) becomes its text, `42` -> "42", `42.0` -> "42", `2.5` -> "2.5",
    so rule rewards comparing text see what the file says (rewards/arithmetic.py compares integers as numbers, so a
    zero-padded "042" and 42 are one answer). Any other label (text, a list, a
    dict, a bool) is passed through unchanged, for custom reward functions that want structure; rewards/arithmetic.py
    raises naming the type when it gets a label that is neither text nor an int."""
    text = format_prompt(_text(row, cfg.input_key), tokenizer, cfg)
    ids = _ids(tokenizer, text, not cfg.apply_chat_template)
    _too_long(cfg.input_key, len(ids), cfg, "prompt tokens", reserve)
    return {
        "prompt_ids": ids,
        "prompt": text,
        "label": _label(_text(row, cfg.label_key)),
        "datasource": row.get("datasource", "default"),
    }


def build_examples(sources: list[Source], make, cfg: DataConfig, log=print) -> list[list[dict]]:
    """Apply `make(row)` to every row of every source; bad rows are skipped and counted or raise (file, row, key)."""
    out = []
    for src in sources:
        examples, skipped, first = [], Counter(), None
        if src.bad_lines:  # lines of the file that were not UTF-8 text: bad rows read before the dataset
            if cfg.on_bad_row == "raise":
                raise ValueError(src.bad_lines[0])
            skipped[NOT_UTF8], first = len(src.bad_lines), src.bad_lines[0]
        rows = src.rows.to_list() if hasattr(src.rows, "to_list") else src.rows  # one bulk read, not a row at a time
        for i, row in enumerate(rows):
            try:
                examples.append(make(row))
            except BadRow as e:
                msg = f"{src.name}: row {i}: key {e.key!r}: {e.reason}"
                if cfg.on_bad_row == "raise":
                    raise ValueError(msg) from None
                skipped[e.kind] += 1
                first = first or msg
        if skipped:
            log(f"[data] skipped {sum(skipped.values())} of {len(src.rows) + len(src.bad_lines)} rows in {src.name} "
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


def _conversation_pair(row: dict, cfg: DataConfig, chosen_key: str, rejected_key: str) -> dict:
    """The row with chosen/rejected given as whole conversations (the common hub format: lists of messages whose last
    one is the assistant's answer) rewritten as prompt + response text: the prompt is the shared messages before the
    answer (or `input_key` when the conversations hold only the answer), the responses the answers' text. Rows whose
    responses are text come back unchanged."""
    def conversation(value) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)

    if not conversation(row.get(chosen_key)) and not conversation(row.get(rejected_key)):
        return row  # text responses (anything else is refused as "must hold text" by sft_example)
    if not cfg.apply_chat_template:
        raise BadRow(chosen_key, "chosen/rejected conversations (lists of messages) need --data.apply-chat-template")
    prefixes, out = [], dict(row)
    for key in (chosen_key, rejected_key):
        messages = _messages(_text(row, key), key)
        if messages[-1]["role"] != "assistant":
            raise BadRow(key, f"the conversation in key {key!r} must end with the assistant's answer")
        prefixes.append(messages[:-1])
        out[key] = messages[-1]["content"]
    if prefixes[0] != prefixes[1]:
        raise BadRow(rejected_key, f"keys {chosen_key!r} and {rejected_key!r} must share every message before the "
                     "last assistant answer")  # fmt: skip
    if prefixes[0]:
        out[cfg.input_key] = prefixes[0]
    return out


def preference_example(row: dict, tokenizer, cfg: DataConfig, chosen_key: str = "chosen",
                       rejected_key: str = "rejected") -> dict:  # fmt: skip
    """A preference pair (DPO, and KTO's paired eval): `{"chosen": ex, "rejected": ex}`, each an `sft_example` of
    prompt `cfg.input_key` with that response (`loss_mask` on the response + eos); responses are text, or whole
    conversations ending with the assistant's answer (`_conversation_pair`). BadRow when a response is missing,
    empty or not text, or when both responses tokenize identically (the pair would carry no preference)."""
    from dataclasses import replace

    row = _conversation_pair(row, cfg, chosen_key, rejected_key)
    chosen = sft_example(row, tokenizer, replace(cfg, output_key=chosen_key))
    rejected = sft_example(row, tokenizer, replace(cfg, output_key=rejected_key))
    if chosen["input_ids"] == rejected["input_ids"]:
        raise BadRow(rejected_key, f"keys {chosen_key!r} and {rejected_key!r} hold identical responses")
    return {"chosen": chosen, "rejected": rejected}


def reward_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids a reward model scores: the whole text (prompt + response) tokenized in one piece, plus eos unless it
    already ends with one; the score is read at that last token. Shared by algos/rm.py (training) and
    rewards/server.py (serving) so both see exactly the same tokens."""
    ids = _ids(tokenizer, text, add_special_tokens)
    return ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


def reward_pair_example(row: dict, tokenizer, cfg: DataConfig, chosen_key: str = "chosen",
                        rejected_key: str = "rejected", margin_key: str | None = None) -> dict:  # fmt: skip
    """A reward-model pair: `{"chosen": ids, "rejected": ids, "margin": float}` where ids = `reward_ids` of the
    formatted prompt + response. Same BadRow rules as `preference_example`; `margin_key` (optional) must hold a number."""
    row = _conversation_pair(row, cfg, chosen_key, rejected_key)
    prompt = format_prompt(_text(row, cfg.input_key), tokenizer, cfg)
    special = not cfg.apply_chat_template
    out: dict = {"margin": 0.0}
    for name, key in (("chosen", chosen_key), ("rejected", rejected_key)):
        response = _text(row, key)
        if not isinstance(response, str):
            raise BadRow(key, f"key {key!r} must hold text")
        out[name] = reward_ids(tokenizer, prompt + response, special)
        _too_long(key, len(out[name]), cfg)
    if out["chosen"] == out["rejected"]:
        raise BadRow(rejected_key, f"keys {chosen_key!r} and {rejected_key!r} hold identical responses")
    if margin_key is not None:
        margin = _text(row, margin_key)
        if isinstance(margin, bool) or not isinstance(margin, int | float):
            raise BadRow(margin_key, f"key {margin_key!r} must hold a number, got {margin!r}")
        out["margin"] = float(margin)
    return out
