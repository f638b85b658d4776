"""A real chat tokenizer end to end: the Qwen2.5-style BPE of `cleanrlhf/tiny-chat` (core/embedded.py: eos
`<|im_end|>`, pad `<|endoftext|>`, no BOS, a default system prompt) on its tiny random Qwen2.

What is checked: the tokenizer's layout; SFT's multi-turn loss mask (every assistant turn through its `<|im_end|>`,
nothing else); chat prompts, pairs and bad rows in core/data.py; a multi-turn environment whose turns are appended
exactly as tokenizing the whole templated conversation gives them; and, on the real engines, that vLLM stops at
`<|im_end|>`, that sft.py, grpo.py (single and multi-turn), dpo.py and rm.py run on chat data and train on the ids
the engine generated, with the pad id nowhere inside a trained sequence.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from agents.executor import MultiTurnExecutor
from core import chat, data, embedded, models
from core.config import DataConfig, ModelConfig
from core.rollout import Sample

CFG = DataConfig(apply_chat_template=True, max_len=512)
MESSAGES = [
    {"role": "system", "content": "Add numbers."},
    {"role": "user", "content": "What is 1+2?"},
    {"role": "assistant", "content": "3, easy"},
    {"role": "user", "content": "And 10+20?"},
    {"role": "assistant", "content": "30"},
]


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory):
    """A folder holding `cleanrlhf/tiny-chat` (the tokenizer and a random model), built for this module."""
    return embedded.save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def tok(chat_path):
    return models.load_tokenizer(str(chat_path))


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every run of 1s in `mask`."""
    out, start = [], None
    for t, m in enumerate([*mask, 0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            out.append((start, t))
            start = None
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ the tokenizer
def test_tokenizer_layout_is_qwen_style(tok, chat_path):
    from transformers import AutoTokenizer

    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.eos_token_id != tok.pad_token_id
    assert tok.bos_token is None and tok("12+30")["input_ids"] == ids_of(tok, "12+30")  # nothing prepended
    text = tok.apply_chat_template(MESSAGES[1:2], tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_start|>system\n{embedded.DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nWhat is 1+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(MESSAGES[:2], tokenize=False).startswith(
        "<|im_start|>system\nAdd numbers.<|im_end|>"
    )
    # the specials are single tokens; the tokenizer as built and as transformers loads it cut text alike
    built = embedded.build_chat_tokenizer()
    specials = ids_of(tok, "<|im_start|>user\n<|im_end|><|endoftext|>")
    assert [specials[0], *specials[-2:]] == [tok.convert_tokens_to_ids("<|im_start|>"), 2, 0]
    for s in (text, "Hello  world!\n\n  x y's 42 café\t\n", "😀 ünï"):
        assert ids_of(tok, s) == ids_of(built, s) == ids_of(AutoTokenizer.from_pretrained(chat_path), s)
        assert tok.decode(ids_of(tok, s)) == s
    assert chat.end_of_turn_id(tok) == tok.eos_token_id and chat.stop_ids(tok) == [tok.eos_token_id]


def test_embedded_name_builds_once_under_the_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEANRLHF_HOME", str(tmp_path))
    path = embedded.resolve_model("cleanrlhf/tiny-chat")
    assert path == str(tmp_path / "models" / "tiny-chat") and (Path(path) / ".complete").exists()
    assert models.max_positions("cleanrlhf/tiny-chat") == 1024
    assert models.load_tokenizer("cleanrlhf/tiny-chat").eos_token == "<|im_end|>"


def test_end_of_turn_is_read_off_the_template(tok, tokenizer):
    """A base model's layout (eos <|endoftext|>, turns ending with <|im_end|>) stops at both; the embedded character
    tokenizer's plain-text template has no end-of-turn token."""
    base = embedded.build_chat_tokenizer()
    base.eos_token = "<|endoftext|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.end_of_turn_id(base) == im_end and chat.stop_ids(base) == [base.eos_token_id, im_end]
    assert chat.turn_end_ids(base) == [im_end]
    assert chat.end_of_turn_id(tokenizer) is None and chat.stop_ids(tokenizer) == [tokenizer.eos_token_id]


# ------------------------------------------------------------------------------------------------ data
def test_sft_multiturn_mask_is_every_assistant_turn_through_im_end(tok):
    ex = data.sft_example({"prompt": MESSAGES}, tok, CFG, mode="multiturn")
    assert ex["input_ids"] == ids_of(tok, tok.apply_chat_template(MESSAGES, tokenize=False))
    targets = [ex["input_ids"][a:b] for a, b in spans(ex["loss_mask"])]
    assert targets == [ids_of(tok, "3, easy") + [tok.eos_token_id], ids_of(tok, "30") + [tok.eos_token_id]]
    # not targets: the headers `<|im_start|>assistant\n` before, and the template's `\n` after each turn
    assert ex["loss_mask"][-1] == 0 and ex["input_ids"][-1] == ids_of(tok, "\n")[0]
    assert tok.pad_token_id not in ex["input_ids"]


def test_sft_single_chat_response_ends_with_im_end(tok):
    ex = data.sft_example({"prompt": "What is 1+2?", "answer": "3"}, tok, CFG)
    prompt = ids_of(tok, tok.apply_chat_template(MESSAGES[1:2], tokenize=False, add_generation_prompt=True))
    assert ex["input_ids"] == prompt + ids_of(tok, "3") + [tok.eos_token_id]
    assert ex["loss_mask"] == [0] * len(prompt) + [1, 1]
    # a base model's layout: the response ends its turn with <|im_end|>, not with the tokenizer's eos
    base = embedded.build_chat_tokenizer()
    base.eos_token = "<|endoftext|>"
    assert data.sft_example({"prompt": "x", "answer": "3"}, base, CFG)["input_ids"][-1] == tok.eos_token_id


def test_chat_pairs_share_the_templated_prompt(tok):
    row = {"prompt": MESSAGES[:4], "chosen": "30", "rejected": "31"}
    prompt = ids_of(tok, tok.apply_chat_template(MESSAGES[:4], tokenize=False, add_generation_prompt=True))
    pair = data.preference_example(row, tok, CFG)
    for name, answer in (("chosen", "30"), ("rejected", "31")):
        assert pair[name]["input_ids"] == prompt + ids_of(tok, answer) + [tok.eos_token_id]
        assert pair[name]["loss_mask"] == [0] * len(prompt) + [1] * (len(pair[name]["input_ids"]) - len(prompt))
    rm = data.reward_pair_example(row, tok, CFG)
    assert rm["chosen"][: len(prompt)] == rm["rejected"][: len(prompt)] == prompt
    assert rm["chosen"][-1] == rm["rejected"][-1] == tok.eos_token_id  # scored at the turn's <|im_end|>


def test_chat_pairs_as_whole_conversations_equal_prompt_plus_answer(tok):
    """The hub format: chosen/rejected are conversations that share every message but the last assistant answer."""
    as_text = {"prompt": MESSAGES[:4], "chosen": "30", "rejected": "31"}
    whole = {"chosen": [*MESSAGES[:4], {"role": "assistant", "content": "30"}],
             "rejected": [*MESSAGES[:4], {"role": "assistant", "content": "31"}]}  # fmt: skip
    answers_only = {"prompt": MESSAGES[:4], "chosen": [{"role": "assistant", "content": "30"}],
                    "rejected": [{"role": "assistant", "content": "31"}]}  # fmt: skip
    for row in (whole, answers_only):
        assert data.preference_example(row, tok, CFG) == data.preference_example(as_text, tok, CFG)
        assert data.reward_pair_example(row, tok, CFG) == data.reward_pair_example(as_text, tok, CFG)
    other = {**whole, "rejected": [*MESSAGES[:2], {"role": "assistant", "content": "31"}]}
    with pytest.raises(data.BadRow, match="share every message"):
        data.preference_example(other, tok, CFG)
    with pytest.raises(data.BadRow, match="end with the assistant"):
        data.preference_example({**whole, "chosen": MESSAGES[:4]}, tok, CFG)
    with pytest.raises(data.BadRow, match="need --data.apply-chat-template"):
        data.preference_example(whole, tok, DataConfig(max_len=512))


def test_prompt_example_with_messages(tok):
    ex = data.prompt_example({"prompt": MESSAGES[:2], "answer": 3}, tok, CFG)
    assert ex["prompt"] == tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert ex["prompt_ids"] == ids_of(tok, ex["prompt"]) and ex["label"] == "3"


@pytest.mark.parametrize(
    "value, words",
    [
        ([], "non-empty list"),
        ([{"role": "user"}], "message 0 must be a {role, content} dict"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "3"}], "last message is an assistant"),
    ],
)
def test_bad_chat_prompt_names_file_row_and_key(tmp_path, tok, value, words):
    f = write_jsonl(
        tmp_path / "train.jsonl", [{"messages": MESSAGES[1:2], "answer": "3"}, {"messages": value, "answer": "3"}]
    )
    cfg = replace(CFG, input_key="messages", on_bad_row="raise")
    make = lambda row: data.prompt_example(row, tok, cfg)  # noqa: E731
    with pytest.raises(ValueError, match=rf"train.jsonl: row 1: key 'messages': .*{_re(words)}"):
        data.build_examples(data.load_sources(str(f), "train"), make, cfg)


def _re(words: str) -> str:
    import re

    return re.escape(words)


def test_no_chat_template_or_a_refusing_one_is_a_clear_error():
    plain = embedded.build_chat_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="apply-chat-template: the tokenizer has no chat template"):
        data.prompt_example({"prompt": "x", "answer": "1"}, plain, CFG)
    plain.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(data.BadRow, match="the chat template refused the messages: roles must alternate"):
        data.sft_example({"prompt": MESSAGES}, plain, CFG, mode="multiturn")


# ------------------------------------------------------------------------------------------------ multi-turn
class CannedEngines:
    """Stands for `RolloutEngines`: each turn answers with the next canned reply's ids, + <|im_end|> unless the reply
    is marked cut (a turn that hit max-new-tokens); records what it generated."""

    def __init__(self, tok, replies: list[str], cut: bool = False):
        self.tok, self.replies, self.cut, self.generated, self.prompts = tok, replies, cut, [], []

    def generate(self, prompt_token_ids, n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=None):
        out = []
        for p in prompt_token_ids:
            self.prompts.append(list(p))
            ids = ids_of(self.tok, self.replies[len(self.generated) % len(self.replies)])
            ids = ids if self.cut else ids + [self.tok.eos_token_id]
            self.generated.append(ids)
            out.append([Sample(ids, [-0.5] * len(ids), "length" if self.cut else "stop", self.cut)])
        return out


class ChatRetry:
    """Answer the sum; a wrong answer gets a user turn "Wrong, try again." and one more try."""

    def __init__(self, example):
        self.label = example["label"]

    def reset(self, example):
        return ""

    def step(self, response):
        if response.strip() == self.label:
            return "", 1.0, True
        return {"role": "user", "content": "Wrong, try again."}, 0.0, False


def test_environment_turns_are_the_templated_conversation_tokens(tok):
    example = data.prompt_example({"prompt": "What is 1+2?", "answer": "3"}, tok, CFG)
    engines = CannedEngines(tok, ["4", "3"])
    ro = MultiTurnExecutor(engines, tok, ChatRetry, max_new_tokens=8, max_turns=3).run([example], 1, 0, 0)
    ep = ro.episodes[0]
    conversation = [*MESSAGES[1:2], {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "Wrong, try again."}, {"role": "assistant", "content": "3"}]  # fmt: skip
    whole = ids_of(tok, tok.apply_chat_template(conversation, tokenize=False))
    # the episode is the templated conversation token for token, up to the model's last <|im_end|>
    assert ep.prompt_ids + ep.token_ids == whole[:-1] and whole[-1] == ids_of(tok, "\n")[0]
    # the tokens the policy is trained on are exactly the ones generated, turn by turn
    assert [ep.token_ids[a:b] for a, b in spans(ep.action_mask)] == engines.generated
    assert ro.rewards.tolist() == [1.0] and ro.logs["rollout/turns_mean"] == 2
    # the second turn was generated after the conversation's own tokens, generation prompt included
    assert engines.prompts[1] == ep.prompt_ids + ep.token_ids[: len(ep.token_ids) - len(engines.generated[1])]


def test_a_turn_cut_before_im_end_ends_the_chat_episode(tok):
    example = data.prompt_example({"prompt": "What is 1+2?", "answer": "3"}, tok, CFG)
    engines = CannedEngines(tok, ["4 4 4"], cut=True)
    ro = MultiTurnExecutor(engines, tok, ChatRetry, max_new_tokens=8, max_turns=3).run([example], 1, 0, 0)
    ep = ro.episodes[0]
    assert len(engines.generated) == 1 and ep.token_ids == engines.generated[0] and ep.truncated


# ------------------------------------------------------------------------------------------------ the scripts
# One SFT run on chat messages makes a model that ends its turns (the random one almost never samples <|im_end|>);
# the RL runs start from it. The model is so small that the whole section takes ~20 s on a 2-core CPU (plus the
# one-time build of DeepSpeed's shm op, ~30 s, when no earlier test built it).
def sum_chat(rng, turns: int) -> list[dict]:
    messages = []
    for _ in range(turns):
        a, b = rng.randrange(50), rng.randrange(50)
        messages += [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]
    return messages


def quiet(args, run_dir: Path):
    args.logger.quiet, args.logger.tensorboard, args.run_dir = True, False, str(run_dir)
    return args


@pytest.fixture(scope="module")
def chat_sft(chat_path, tmp_path_factory, one_thread):
    """sft.py --train.mode multiturn on `messages` rows of 1-2 turns: (summary, metrics rows, export folder)."""
    import random

    from algos import sft

    rng, root = random.Random(0), tmp_path_factory.mktemp("chat-sft")
    for split, n in (("train", 256), ("test", 32)):
        write_jsonl(root / f"{split}.jsonl", [{"messages": sum_chat(rng, 1 + i % 2)} for i in range(n)])
    args = quiet(sft.Args(), root / "run")
    args.model.name_or_path, args.data.path, args.data.input_key = str(chat_path), str(root), "messages"
    args.data.apply_chat_template, args.train.mode, args.eval.generate = True, "multiturn", False
    args.train.max_steps, args.train.batch_size, args.eval.every = 40, 32, 40
    summary = sft.main(args)
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, Path(summary["export_dir"])


def test_sft_on_chat_messages_learns_the_turns(chat_sft):
    summary, rows, export = chat_sft
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 2, summary  # ~6.1 -> ~1.6
    assert all(r["train/tokens"] > 0 for r in rows if "train/tokens" in r)
    tok = models.load_tokenizer(str(export))  # exported with its template, eos and pad
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    prompt = ids_of(tok, tok.apply_chat_template(MESSAGES[1:2], tokenize=False, add_generation_prompt=True))
    model = models.load_causal_lm(ModelConfig(name_or_path=str(export), dtype="fp32"))
    (out,) = models.greedy_generate(model, tok, [prompt], max_new_tokens=8)
    assert 0 < len(out) < 8 and tok.decode(out).isdigit()  # a number, then it stopped at <|im_end|>


def test_vllm_stops_at_im_end_when_eos_is_another_token(chat_sft, tmp_path):
    """A base model's layout: eos <|endoftext|> in tokenizer and config, turns ending with <|im_end|>. vLLM alone would
    run past <|im_end|> into a made-up next turn; the engine stops there, the stop token last in `token_ids`."""
    import shutil

    from conftest import in_process_engines

    folder = tmp_path / "base-layout"
    shutil.copytree(chat_sft[2], folder)
    for name, key, value in (("tokenizer_config.json", "eos_token", "<|endoftext|>"), ("config.json", "eos_token_id", 0),
                             ("generation_config.json", "eos_token_id", 0)):  # fmt: skip
        cfg = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**cfg, key: value}))
    tok = models.load_tokenizer(str(folder))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == 0 and chat.stop_ids(tok) == [0, im_end]
    prompts = [
        data.prompt_example({"prompt": f"What is {a}+{a}?", "answer": 1}, tok, CFG)["prompt_ids"] for a in range(8)
    ]
    engines = in_process_engines(str(folder), "float32")
    try:
        samples = [s for g in next(engines).generate(prompts, n=4, max_new_tokens=12, seed=3) for s in g]
    finally:
        next(engines, None)
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert len(stopped) >= 24, [s.token_ids for s in samples]  # measured: 32 of 32
    for s in stopped:
        assert s.token_ids[-1] == im_end and s.token_ids.count(im_end) == 1 and not s.truncated


def test_vllm_stops_where_a_separate_tokenizer_says(chat_sft, tmp_path):
    """`--actor.model.tokenizer`: a base model folder whose own tokenizer has no chat template (eos <|endoftext|>)
    and the chat tokenizer given apart. The engines take their stop tokens from the given tokenizer and stop at
    <|im_end|>; started on the model folder's own tokenizer they would not."""
    import shutil

    from core import rollout

    folder = tmp_path / "no-template"
    shutil.copytree(chat_sft[2], folder)
    for extra in ("chat_template.jinja", "chat_template.json"):
        (folder / extra).unlink(missing_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|endoftext|>"}))
    for name in ("config.json", "generation_config.json"):
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), "eos_token_id": 0}))
    assert chat.stop_ids(models.load_tokenizer(str(folder))) == [0]
    tok = models.load_tokenizer(str(chat_sft[2]))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [data.prompt_example({"prompt": f"What is {a}+{a}?", "answer": 1}, tok, CFG)["prompt_ids"]
               for a in range(8)]  # fmt: skip
    ended = {}
    for given in (str(chat_sft[2]), None):
        vcfg = rollout.VLLMConfig(in_process=True, dtype="float32", kv_cache_gib=0.5, timeout_s=120)
        engines = rollout.create_engines(str(folder), vcfg, seed=0, tokenizer=given)
        try:
            samples = [s for g in engines.generate(prompts, n=4, max_new_tokens=12, seed=3) for s in g]
        finally:
            engines.shutdown()
        ended[given] = sum(s.finish_reason == "stop" and s.token_ids[-1] == im_end for s in samples)
        if given:
            assert all(s.token_ids.count(im_end) <= 1 for s in samples)
    assert ended[str(chat_sft[2])] >= 24 and ended[None] == 0, ended


PARITY_REWARD = '''
import torch


def reward_func(queries, prompts, labels):
    """1 when the response starts with an even digit: any policy gets groups with both rewards."""
    r = torch.tensor([float(q[len(p):].strip()[:1] in "02468") for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r}
'''

CHAT_ENV = '''
class ChatRetry:
    """A wrong sum gets a user turn (chat messages) and one more try."""

    def __init__(self, example):
        self.label = example["label"]

    def reset(self, example):
        return ""

    def step(self, response):
        if response.strip() == self.label:
            return "", 1.0, True
        return [{"role": "user", "content": "Wrong, try again."}], 0.0, False


def make_env(example):
    return ChatRetry(example)
'''


def chat_grpo(chat_sft, tmp_path, monkeypatch, env: bool):
    """2 steps of grpo.py on chat prompts from the SFT model; returns (the batches trained on as (episodes, batch),
    every engine call as (prompts, samples), the tokenizer, and the prompt messages by templated prompt text)."""
    import random

    from algos import grpo
    from core import rl, rollout

    tok, rng, messages = models.load_tokenizer(str(chat_sft[2])), random.Random(1), {}
    for split, n in (("train", 64), ("test", 8)):
        rows = [dict(zip(("prompt", "answer"), sum_chat(rng, 1))) for _ in range(n)]
        for r in rows:
            r["prompt"], r["answer"] = [r["prompt"]], int(r["answer"]["content"])
            messages[tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)] = r["prompt"]
        write_jsonl(tmp_path / f"{split}.jsonl", rows)
    trained, calls = [], []
    sequences, generate = rl.sequences, rollout.RolloutEngines.generate

    def spy_sequences(episodes, pad_id, device, *rest):
        batch = sequences(episodes, pad_id, device, *rest)
        trained.append((episodes, batch))
        return batch

    def spy_generate(self, prompt_token_ids, *a, **kw):
        out = generate(self, prompt_token_ids, *a, **kw)
        calls.append(([list(p) for p in prompt_token_ids], out))
        return out

    monkeypatch.setattr(rl, "sequences", spy_sequences)
    monkeypatch.setattr(rollout.RolloutEngines, "generate", spy_generate)
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    (tmp_path / "env.py").write_text(CHAT_ENV)
    args = quiet(grpo.Args(), tmp_path / "run")
    args.actor.model.name_or_path, args.data.path, args.data.apply_chat_template = str(chat_sft[2]), str(tmp_path), True
    args.reward.func = str(tmp_path / "reward.py")
    args.rollout.env_file = str(tmp_path / "env.py") if env else None
    args.rollout.batch_size, args.rollout.n_samples, args.rollout.max_new_tokens = 8, 4, 8
    args.train.max_steps, args.eval.every, args.eval.k, args.vllm.kv_cache_gib = 2, 0, 2, 0.5
    args.algo.filter_zero_variance = False  # train on every episode, the all-wrong groups of the environment too
    summary = grpo.main(args)
    assert summary["steps"] == 2 and trained
    return trained, calls, tok, messages


def assert_trained_ids_were_generated(trained, calls, tok):
    """Every span the loss covers is the engine's output for exactly the tokens before it; pad only as padding."""
    outputs = {}
    for prompts, groups in calls:
        for p, g in zip(prompts, groups):
            outputs.setdefault(tuple(p), []).extend(tuple(s.token_ids) for s in g)
    n_spans = 0
    for episodes, batch in trained:
        for row, ep in enumerate(episodes):
            ids = batch["input_ids"][row].tolist()
            mask = batch["loss_mask"][row].int().tolist()
            length = len(ep.prompt_ids) + len(ep.token_ids)
            assert ids[:length] == ep.prompt_ids + ep.token_ids and tok.pad_token_id not in ids[:length]
            assert set(ids[length:]) <= {tok.pad_token_id} and not any(mask[length:])
            for a, b in spans(mask):
                assert tuple(ids[a:b]) in outputs[tuple(ids[:a])]
                n_spans += 1
    assert n_spans > 0
    return n_spans


def test_grpo_on_chat_prompts_stops_at_im_end_and_trains_on_generated_ids(chat_sft, tmp_path, monkeypatch):
    trained, calls, tok, _ = chat_grpo(chat_sft, tmp_path, monkeypatch, env=False)
    assert_trained_ids_were_generated(trained, calls, tok)
    for episodes, _ in trained:
        for ep in episodes:
            assert ep.prompt_ids[-3:] == ids_of(tok, "<|im_start|>assistant\n")  # the generation prompt
            assert ep.action_mask == [1] * len(ep.token_ids)
            if ep.finish_reason == "stop":  # <|im_end|> once, last, in the action mask; nothing after it
                assert ep.token_ids[-1] == tok.eos_token_id and ep.token_ids.count(tok.eos_token_id) == 1
            else:
                assert ep.truncated and tok.eos_token_id not in ep.token_ids
    assert sum(ep.finish_reason == "stop" for eps, _ in trained for ep in eps) > 0


def test_grpo_multi_turn_chat_environment_appends_templated_turns(chat_sft, tmp_path, monkeypatch):
    trained, calls, tok, messages = chat_grpo(chat_sft, tmp_path, monkeypatch, env=True)
    n_spans = assert_trained_ids_were_generated(trained, calls, tok)
    assert n_spans > sum(len(eps) for eps, _ in trained)  # some episodes had a second turn
    retry = chat.continuation_ids(tok, [{"role": "user", "content": "Wrong, try again."}])
    for episodes, _ in trained:
        for ep in episodes:
            turns = [ep.token_ids[a:b] for a, b in spans(ep.action_mask)]
            feedback = [ep.token_ids[a:b] for a, b in spans([1 - m for m in ep.action_mask])]
            assert feedback == [retry] * (len(turns) - 1)
            assert all(t[-1] == tok.eos_token_id for t in turns[:-1])  # only a finished turn gets an answer
            # the episode's text is the templated conversation of its turns, up to where it ended
            conv = list(messages[ep.example["prompt"]])
            for k, t in enumerate(turns):
                conv += [{"role": "assistant", "content": tok.decode(t, skip_special_tokens=True)}]
                conv += [{"role": "user", "content": "Wrong, try again."}] if k < len(turns) - 1 else []
            assert tok.apply_chat_template(conv, tokenize=False).startswith(tok.decode(ep.prompt_ids + ep.token_ids))


def pair_rows(n: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "chosen": str(a + b),
                     "rejected": str(a + b + 10)})  # fmt: skip
    return rows


@pytest.mark.parametrize("script", ["dpo", "rm"])
def test_preference_scripts_on_chat_pairs(chat_sft, tmp_path, script):
    import importlib
    import math

    mod = importlib.import_module(f"algos.{script}")
    write_jsonl(tmp_path / "train.jsonl", pair_rows(64, 0))
    write_jsonl(tmp_path / "test.jsonl", pair_rows(16, 1))
    args = quiet(mod.Args(), tmp_path / "run")
    args.model.name_or_path, args.data.path, args.data.apply_chat_template = str(chat_sft[2]), str(tmp_path), True
    args.train.max_steps, args.train.batch_size, args.eval.every = 3, 16, 3
    summary = mod.main(args)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    loss = [r[f"loss/{script}"] for r in rows if f"loss/{script}" in r]
    assert summary["steps"] == 3 and len(loss) == 3 and all(math.isfinite(v) for v in loss)
