"""Tests for core/data.py: loading (jsonl, json, parquet, folders, lists), bad inputs (one clear ValueError naming the
file, row/line and key), mixing, the deterministic batch stream and the SFT example modes on the embedded tokenizer."""

import json
from collections import Counter
from dataclasses import replace
from functools import partial

import pytest

from core import data
from core.config import DataConfig

CFG = DataConfig(max_len=64)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path, tokenizer, cfg=CFG, mode="single", split="train", log=print):
    """Files -> per-source example lists, as algos/sft.py does it."""
    sources = data.load_sources(str(path), split, cfg.max_samples)
    return data.build_examples(sources, partial(data.sft_example, tokenizer=tokenizer, cfg=cfg, mode=mode), cfg, log)


def masked_text(tokenizer, ex, target=1):
    return tokenizer.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m == target])


GOOD = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+20=", "answer": "30"}]


# ----------------------------------------------------------------------------------------------- bad rows and files
def test_missing_key_raises_naming_file_row_and_key(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "d.jsonl", [GOOD[0], {"prompt": "2+2="}, GOOD[1]])
    with pytest.raises(ValueError) as err:
        load(f, tokenizer, replace(CFG, on_bad_row="raise"))
    msg = str(err.value)
    assert msg.startswith(f"{f}: ")
    assert "row 1" in msg and "key 'answer'" in msg and "missing" in msg.removeprefix(str(f))
    assert err.value.__suppress_context__  # one error, not a chained traceback


def test_bad_rows_are_skipped_and_counted(tmp_path, tokenizer):
    rows = [
        GOOD[0],
        {"prompt": "2+2="},  # missing answer
        {"prompt": "   ", "answer": "1"},  # empty prompt
        GOOD[1],
        {"prompt": "9" * 100 + "+1=", "answer": "1"},  # too long for max_len 64
    ]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    logs = []
    (examples,) = load(f, tokenizer, replace(CFG, on_bad_row="skip"), log=logs.append)
    assert len(logs) == 1
    assert "skipped 3 of 5 rows" in logs[0] and str(f) in logs[0] and "row 1" in logs[0] and "'answer'" in logs[0]
    assert [tokenizer.decode(ex["input_ids"], skip_special_tokens=True) for ex in examples] == ["1+2=3", "10+20=30"]


@pytest.mark.parametrize(
    "row, key, words",
    [
        ({"prompt": "", "answer": "3"}, "prompt", "empty"),
        ({"prompt": "1+2=", "answer": "  \n"}, "answer", "empty"),
        ({"prompt": "1+2=", "answer": None}, "answer", "missing"),
        ({"prompt": "9" * 70, "answer": "3"}, "prompt", "max-len 64"),
    ],
)
def test_each_bad_row_kind_raises_with_file_row_key(tmp_path, tokenizer, row, key, words):
    f = write_jsonl(tmp_path / "d.jsonl", [GOOD[0], GOOD[1], row])
    with pytest.raises(ValueError) as err:
        load(f, tokenizer, replace(CFG, on_bad_row="raise"))
    msg = str(err.value)
    assert msg.startswith(f"{f}: row 2: key '{key}': ") and words in msg.removeprefix(str(f))


def test_response_must_be_text(tokenizer):
    with pytest.raises(data.BadRow, match="'answer' must hold text"):
        data.sft_example({"prompt": "1+2=", "answer": ["3"]}, tokenizer, CFG)


def test_every_row_bad_is_an_error_even_when_skipping(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+2=", "answer": "3"}])
    with pytest.raises(ValueError, match="no usable rows"):
        load(f, tokenizer, log=lambda *_: None)


@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.json", "[]")])
def test_empty_dataset_file(tmp_path, tokenizer, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError) as err:
        load(tmp_path / name, tokenizer)
    assert str(err.value) == f"{tmp_path / name}: empty dataset file (no rows)"


def test_malformed_jsonl_line_names_file_and_line(tmp_path, tokenizer):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(GOOD[0]) + "\n" + json.dumps(GOOD[1]) + '\n{"prompt": "3+4=", "answer": \n')
    with pytest.raises(ValueError) as err:
        load(f, tokenizer)
    assert str(err.value).startswith(f"{f}: line 3: malformed JSON (")
    f.write_text(json.dumps(GOOD[0]) + "\n[1, 2]\n")  # valid JSON, but not a row
    with pytest.raises(ValueError, match="line 2: expected a JSON object"):
        load(f, tokenizer)


def test_malformed_json_array_file(tmp_path, tokenizer):
    f = tmp_path / "d.json"
    f.write_text('[\n  {"prompt": "1+2=", "answer": "3"},\n  {"prompt": "1+2=" "answer": "3"}\n]\n')
    with pytest.raises(ValueError, match=r"d\.json: malformed JSON at line 3"):
        load(f, tokenizer)


def write_latin1_line(path, at: int):
    """GOOD's rows as JSONL with a Latin-1 row ("café": byte 0xe9, not UTF-8) inserted as line `at`."""
    lines = [json.dumps(r).encode() for r in GOOD]
    lines.insert(at - 1, '{"prompt": "caf\u00e9=", "answer": "1"}'.encode("latin-1"))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_a_line_that_is_not_utf8_names_file_and_line_or_is_skipped_and_counted(tmp_path, tokenizer):
    f = write_latin1_line(tmp_path / "d.jsonl", at=2)
    with pytest.raises(ValueError) as err:
        load(f, tokenizer, replace(CFG, on_bad_row="raise"))
    assert str(err.value).startswith(f"{f}: line 2: not UTF-8 text (byte 0xe9 at column 16")
    logs = []
    (examples,) = load(f, tokenizer, replace(CFG, on_bad_row="skip"), log=logs.append)
    assert [tokenizer.decode(ex["input_ids"], skip_special_tokens=True) for ex in examples] == ["1+2=3", "10+20=30"]
    assert len(logs) == 1 and "skipped 1 of 3 rows" in logs[0] and "'not UTF-8 text': 1" in logs[0]
    assert f"{f}: line 2: not UTF-8 text" in logs[0]
    # --data.max-samples: a bad line past the rows kept is not counted
    (src,) = data.load_sources(str(write_latin1_line(tmp_path / "e.jsonl", at=3)), "train", max_samples=1)
    assert len(src.rows) == 1 and src.bad_lines == []
    (src,) = data.load_sources(str(write_latin1_line(tmp_path / "e.jsonl", at=3)), "train", max_samples=2)
    assert len(src.rows) == 2 and len(src.bad_lines) == 1


def test_a_json_array_file_that_is_not_utf8_names_file_and_line(tmp_path, tokenizer):
    f = tmp_path / "d.json"
    f.write_bytes(b'[\n  {"prompt": "1+2=", "answer": "3"},\n  {"prompt": "caf\xe9=", "answer": "1"}\n]\n')
    with pytest.raises(ValueError, match=rf"^{f}: line 3: not UTF-8 text .*cannot skip a line"):
        load(f, tokenizer, replace(CFG, on_bad_row="skip"))
    f = tmp_path / "utf16.jsonl"  # every line bad: an error either way
    f.write_bytes(json.dumps(GOOD[0]).encode("utf-16"))
    with pytest.raises(ValueError, match=rf"^{f}: no line is UTF-8 text"):
        load(f, tokenizer, replace(CFG, on_bad_row="skip"))


def test_nonexistent_path(tmp_path, tokenizer, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in ["./nope.jsonl", "nope.jsonl", str(tmp_path / "nope")]:
        with pytest.raises(ValueError) as err:
            load(path, tokenizer)
        assert path in str(err.value) and "no such data file or folder" in str(err.value)


def test_unsupported_file_type(tmp_path, tokenizer):
    (tmp_path / "d.csv").write_text("prompt,answer\n1+2=,3\n")
    with pytest.raises(ValueError, match=r"d\.csv: unsupported data file type"):
        load(tmp_path / "d.csv", tokenizer)


def test_folder_without_data_files(tmp_path, tokenizer):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError) as err:
        load(tmp_path, tokenizer)
    assert str(tmp_path) in str(err.value) and "no .json, .jsonl or .parquet" in str(err.value)


def test_no_datasets_given(tokenizer):
    with pytest.raises(ValueError, match="no datasets given"):
        load(" , ", tokenizer)


# ------------------------------------------------------------------------------------------------- formats, folders
def test_folder_picks_the_split_file(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(7)])
    write_jsonl(tmp_path / "test.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)])
    (train,) = data.load_sources(str(tmp_path), "train")
    (test,) = data.load_sources(str(tmp_path), "test")
    assert train.name == str(tmp_path / "train.jsonl") and len(train.rows) == 7
    assert test.name == str(tmp_path / "test.jsonl") and list(test.rows) == [
        {"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)
    ]
    # a split the folder does not have is an error, never silently the other splits' rows
    with pytest.raises(ValueError, match="no file for split 'validation'"):
        data.load_sources(str(tmp_path), "validation")


def test_folder_of_unsplit_files_loads_them_all(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", GOOD)
    write_jsonl(tmp_path / "b.jsonl", GOOD[:1])
    sources = data.load_sources(str(tmp_path), "train")
    assert [(s.name, len(s.rows)) for s in sources] == [(str(tmp_path / "a.jsonl"), 2), (str(tmp_path / "b.jsonl"), 1)]


def test_parquet_and_json_files_load(tmp_path, tokenizer):
    import datasets

    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(5)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=2))
    for name in ["d.parquet", "d.json"]:
        (src,) = data.load_sources(str(tmp_path / name), "train")
        assert list(src.rows) == rows
        (examples,) = load(tmp_path / name, tokenizer)
        assert tokenizer.decode(examples[3]["input_ids"], skip_special_tokens=True) == "3+3=6"


def test_comma_separated_files_and_max_samples(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "answer": "x"} for i in range(5)])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "answer": "y"} for i in range(3)])
    monkeypatch.chdir(tmp_path)
    a, b = data.load_sources("a.jsonl, b.jsonl", "train")
    assert (a.name, len(a.rows), b.name, len(b.rows)) == ("a.jsonl", 5, "b.jsonl", 3)
    a, b = data.load_sources("a.jsonl,b.jsonl", "train", max_samples=2)
    assert [r["prompt"] for r in a.rows] == ["a0", "a1"] and [r["prompt"] for r in b.rows] == ["b0", "b1"]


# ------------------------------------------------------------------------------------------------------------- mix
def test_mix_without_probs_concatenates():
    assert data.mix([[1, 2], [3]], None, seed=0) == [1, 2, 3]


def test_mix_with_probs_proportions_and_determinism():
    groups = [[("a", i) for i in range(1000)], [("b", i) for i in range(200)]]
    out = data.mix(groups, "0.75,0.25", seed=3)
    assert len(out) == 1200
    frac_a = sum(src == "a" for src, _ in out) / len(out)
    assert abs(frac_a - 0.75) < 0.04  # 3+ sigma of a binomial(1200, 0.75) fraction is ~0.037
    # b (200 rows, ~300 draws) is cycled: every row at least once, none more than twice
    counts = Counter(i for src, i in out if src == "b")
    assert set(counts) == set(range(200)) and max(counts.values()) <= 2
    assert data.mix(groups, "0.75,0.25", seed=3) == out
    assert data.mix(groups, "0.75,0.25", seed=4) != out
    assert data.mix(groups, "3,1", seed=3) == out  # probabilities are normalised
    only_b = data.mix(groups, "0,1", seed=0)
    assert all(src == "b" for src, _ in only_b)


@pytest.mark.parametrize("probs", ["1", "0.5,0.3,0.2", "-1,2", "0,0"])
def test_mix_rejects_bad_probs(probs):
    with pytest.raises(ValueError, match="--data.probs"):
        data.mix([[1], [2]], probs, seed=0)


# --------------------------------------------------------------------------------------------------- batch stream
@pytest.mark.parametrize("n, bs", [(10, 4), (10, 25), (7, 7)])
def test_batch_indices_epochs_are_permutations_and_resume_is_exact(n, bs):
    steps = 6
    stream = [i for step in range(steps) for i in data.batch_indices(n, bs, step, seed=5)]
    assert len(stream) == steps * bs
    full_epochs = len(stream) // n
    assert full_epochs >= 2
    for e in range(full_epochs):  # each epoch visits every index exactly once
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
    assert stream[:n] != stream[n : 2 * n] or n < 3  # epochs are reshuffled
    for k in range(steps):  # the batch of step k, computed alone (as after a resume), is the k-th slice of the run
        assert data.batch_indices(n, bs, k, seed=5) == stream[k * bs : (k + 1) * bs]
    assert data.batch_indices(n, bs, 0, seed=6) != data.batch_indices(n, bs, 0, seed=5)


# ------------------------------------------------------------------------------------------------ SFT example modes
def test_sft_single_loss_on_response_and_eos(tokenizer):
    ex = data.sft_example({"prompt": "12+34=", "answer": "46"}, tokenizer, CFG)
    prompt = tokenizer("12+34=")["input_ids"]
    assert prompt[0] == tokenizer.bos_token_id
    assert ex["input_ids"] == prompt + tokenizer("46", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ex["loss_mask"] == [0] * len(prompt) + [1, 1, 1]
    assert masked_text(tokenizer, ex) == "46</s>"


def test_sft_input_template(tokenizer):
    cfg = replace(CFG, input_template="Question: {}\nAnswer: ")
    ex = data.sft_example({"prompt": "12+34=", "answer": "46"}, tokenizer, cfg)
    assert masked_text(tokenizer, ex, target=0) == "<s>Question: 12+34=\nAnswer: "
    assert masked_text(tokenizer, ex) == "46</s>"


def test_sft_apply_chat_template(tokenizer):
    cfg = replace(CFG, apply_chat_template=True)
    for prompt in ["12+34=", [{"role": "user", "content": "12+34="}]]:
        ex = data.sft_example({"prompt": prompt, "answer": "46"}, tokenizer, cfg)
        assert masked_text(tokenizer, ex, target=0) == "user: 12+34=\nassistant: "  # the template owns specials
        assert masked_text(tokenizer, ex) == "46</s>"
    with pytest.raises(data.BadRow, match="apply-chat-template"):  # messages without the template
        data.sft_example({"prompt": [{"role": "user", "content": "x"}], "answer": "1"}, tokenizer, CFG)


def test_sft_multiturn_masks_only_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Add numbers."},
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3, easy"},
        {"role": "user", "content": "And 10+20?"},
        {"role": "assistant", "content": "30"},
    ]
    ex = data.sft_example({"prompt": messages}, tokenizer, replace(CFG, max_len=256), mode="multiturn")
    assert tokenizer.decode(ex["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)
    # targets: each assistant turn's content and its end-of-turn newline; the `assistant: ` header is prompt
    assert masked_text(tokenizer, ex) == "3, easy\n30\n"
    assert (
        masked_text(tokenizer, ex, target=0)
        == "system: Add numbers.\nuser: 1+2=\nassistant: user: And 10+20?\nassistant: "
    )
    with pytest.raises(data.BadRow, match="no assistant turn"):
        data.sft_example({"prompt": messages[:2]}, tokenizer, CFG, mode="multiturn")
    with pytest.raises(data.BadRow, match="list of"):
        data.sft_example({"prompt": "just text"}, tokenizer, CFG, mode="multiturn")


def test_sft_pretrain_all_but_first(tokenizer):
    ex = data.sft_example({"prompt": "hello world"}, tokenizer, CFG, mode="pretrain")
    assert ex["input_ids"] == tokenizer("hello world")["input_ids"] + [tokenizer.eos_token_id]
    assert ex["loss_mask"] == [0] + [1] * 12
    assert masked_text(tokenizer, ex) == "hello world</s>"
    with pytest.raises(ValueError, match="unknown SFT mode"):
        data.sft_example({"prompt": "x"}, tokenizer, CFG, mode="dpo")


def test_prompt_example(tokenizer):
    cfg = replace(CFG, input_template="Q: {} A:")
    ex = data.prompt_example({"prompt": "1+2=", "answer": "3", "datasource": "add1"}, tokenizer, cfg)
    assert ex == {"prompt_ids": tokenizer("Q: 1+2= A:")["input_ids"], "prompt": "Q: 1+2= A:", "label": "3",
                  "datasource": "add1"}  # fmt: skip
    assert data.prompt_example({"prompt": "1", "answer": "1"}, tokenizer, CFG)["datasource"] == "default"
    with pytest.raises(data.BadRow, match="missing key 'answer'"):
        data.prompt_example({"prompt": "1"}, tokenizer, CFG)


@pytest.mark.parametrize("name", ["cleanrlhf/tiny", "cleanrlhf/tiny-chat"])
def test_prompt_ids_through_the_tokenizer_backend_equal_the_tokenizers_own_call(name):
    """`data._ids` calls a fast tokenizer's Rust backend directly (a tenth of the time per prompt): the ids equal
    transformers' call for every embedded task prompt, and for chat-templated text with and without special tokens."""
    from core import models

    tok = models.load_tokenizer(name)
    (src,) = data.load_sources("cleanrlhf/add2", "test")
    texts = [row["prompt"] for row in src.rows.to_list()]
    texts.append(tok.apply_chat_template([{"role": "user", "content": texts[0]}], tokenize=False,
                                         add_generation_prompt=True) if tok.chat_template else texts[0] + "\n")  # fmt: skip
    for special in (True, False):
        assert [data._ids(tok, t, special) for t in texts] == tok(texts, add_special_tokens=special)["input_ids"]
