"""Vision-language models: a row's picture (`--data.image-key`) in front of its prompt, Qwen2-VL style.

    processor = vision.load_image_processor(model_path)                # the model folder's preprocessor_config.json
    make = vision.with_image(make, args.data, tokenizer, processor)    # any row -> example function, now with a picture
    batch = vision.collate(examples, pad_id, device)                   # padded batch + pixel_values, image_grid_thw
    logits = model(**batch_inputs, **vision.model_kwargs(batch))       # the pictures go through the vision tower

A picture is one `<|vision_start|><|image_pad|><|vision_end|>` in the prompt text (put in front of a text prompt, as
Qwen2-VL's chat template renders an image followed by text, unless the text already holds one). After tokenisation the
single `<|image_pad|>` is expanded to one token per merged patch (`image_grid_thw` product / merge_size²), so the
example's token ids are exactly what the model and the rollout engine see; the vision tower's output replaces those
tokens' embeddings inside the model. The example keeps the picture (for the rollout engine) and its processed pixel
values (for every trainer forward, so nothing is processed twice): 75 KB per 56x56 picture.

Why the padded path: Qwen2-VL's multimodal RoPE gives image tokens 3-D (time, row, column) positions, computed by
the model from input_ids, `image_grid_thw` and the attention mask of a padded batch. Packing passes 1-D position ids,
which the model would use for all three axes: its log-probs differed from the padded forward by 3e-3 on the random
tiny-vl. So a batch with pictures always takes the padded forward (`--train.no-packing` behaviour), whatever the flag.

Tested with transformers 5.19 (Qwen2-VL, the PIL image processor: torchvision is not needed on the trainer side).
"""

from __future__ import annotations

import base64
import binascii
import io
from functools import lru_cache
from pathlib import Path

import torch

from core.data import BadRow, _too_long

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"


@lru_cache(maxsize=4)
def load_image_processor(name_or_path: str):
    """The model folder's image processor (Qwen2-VL's PIL backend when torchvision is absent). A folder without a
    `preprocessor_config.json` is a ValueError naming it: `--data.image-key` needs a vision-language model."""
    from transformers import AutoImageProcessor

    from core import embedded

    path = embedded.resolve_model(name_or_path)
    try:
        return AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data.image-key needs a vision-language model with an image processor; {name_or_path!r} "
                         f"has none: {e}") from None  # fmt: skip


def load_image(value, key: str):
    """A PIL RGB image from a row's value: a `data:image/...;base64,` string, bare base64 or a file path. BadRow
    naming `key` when it is none of these or cannot be decoded."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(value, str) or not value.strip():
        raise BadRow(
            key, f"key {key!r} must hold an image (a file path or base64 PNG/JPEG), got {type(value).__name__}"
        )
    try:
        if value.startswith("data:"):
            raw = base64.b64decode(value.split(",", 1)[1], validate=True)
        elif Path(value).expanduser().is_file():
            raw = Path(value).expanduser().read_bytes()
        else:
            raw = base64.b64decode(value, validate=True)
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (binascii.Error, IndexError, UnidentifiedImageError, OSError, ValueError):
        shown = value if len(value) < 60 else value[:57] + "..."
        raise BadRow(key, f"key {key!r}: {shown!r} is neither an image file nor a base64-encoded image") from None
    return image.convert("RGB")


def process(images: list, processor) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision tower's inputs for pictures: pixel_values (sum of patches, C·T·P·P) and image_grid_thw (n, 3)."""
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def image_tokens(grid_thw: torch.Tensor, processor) -> int:
    """How many `<|image_pad|>` tokens one picture of grid (t, h, w) takes: t·h·w / merge_size²."""
    return int(grid_thw.prod()) // processor.merge_size**2


def with_image(make, cfg, tokenizer, processor):
    """Wrap a row -> example function (`data.sft_example`, `data.prompt_example`, ...) for rows with a picture under
    `cfg.image_key`: the placeholder goes in front of the text prompt, the built example's single `<|image_pad|>` is
    expanded to the picture's token count (in `input_ids` + `loss_mask`, or `prompt_ids`), and the example carries the
    picture (`image`, a PIL image), its `pixel_values` (patches, C·T·P·P), its grid (`image_grid_thw`, (1, 3)) and
    the `image_token_id`. The expanded length is checked against `--data.max-len` again."""
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    if pad_id is None or pad_id == tokenizer.unk_token_id:
        raise ValueError(f"--data.image-key: the tokenizer has no {IMAGE_PAD} token (not a Qwen2-VL-style model)")

    def make_with_image(row: dict) -> dict:
        image = load_image(row.get(cfg.image_key), cfg.image_key)
        prompt = row.get(cfg.input_key)
        if isinstance(prompt, str) and IMAGE_PAD not in prompt:
            row = {**row, cfg.input_key: IMAGE_PLACEHOLDER + prompt}
        example = make(row)
        pixels, grid = process([image], processor)
        n = image_tokens(grid[0], processor)
        ids_key = "prompt_ids" if "prompt_ids" in example else "input_ids"
        ids = example[ids_key]
        if ids.count(pad_id) != 1:
            raise BadRow(cfg.input_key, f"the prompt holds {ids.count(pad_id)} {IMAGE_PAD} tokens; one picture per "
                         "row needs exactly one")  # fmt: skip
        at = ids.index(pad_id)
        example[ids_key] = ids[:at] + [pad_id] * n + ids[at + 1 :]
        if "loss_mask" in example:
            example["loss_mask"] = example["loss_mask"][:at] + [0] * n + example["loss_mask"][at + 1 :]
        _too_long(cfg.input_key, len(example[ids_key]), cfg, "tokens with the picture's")
        return {**example, "image": image, "pixel_values": pixels, "image_grid_thw": grid, "image_token_id": pad_id}

    return make_with_image


def collapse_image_tokens(ids: list[int], image_token_id: int) -> list[int]:
    """Each run of image tokens as one: the prompt as vLLM takes it with `multi_modal_data` (its Qwen2-VL processor
    replaces every `<|image_pad|>` it finds by the picture's tokens, so an expanded prompt would be expanded again;
    vllm 0.32 `BaseMultiModalProcessor._apply_prompt_updates`, read, not run)."""
    return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]


def add_pixels(batch: dict, examples: list[dict | None]) -> dict:
    """Give a padded batch (B, L) the pictures of its rows' examples (`with_image`; None or an example without a
    picture: a text row): `pixel_values` and `image_grid_thw`, lists of B per-row tensors (None for text rows), and
    `mm_token_type_ids` (B, L), 1 at image tokens. Lists, so that a subset of rows (`core.rl.rows`) keeps its
    pictures."""
    has = [ex if ex is not None and ex.get("pixel_values") is not None else None for ex in examples]
    batch["pixel_values"] = [None if ex is None else ex["pixel_values"] for ex in has]
    batch["image_grid_thw"] = [None if ex is None else ex["image_grid_thw"] for ex in has]
    token_ids = {ex["image_token_id"] for ex in has if ex is not None}
    mm = torch.zeros_like(batch["input_ids"], dtype=torch.int32)
    for t in token_ids:
        mm = mm | (batch["input_ids"] == t).int()
    batch["mm_token_type_ids"] = mm
    return batch


def collate(examples: list[dict], pad_id: int, device) -> dict:
    """A right-padded batch (`packing.collate_padded`) of examples with pictures (`with_image`), plus `add_pixels`."""
    from core.packing import collate_padded

    return add_pixels(collate_padded(examples, pad_id, device), examples)


def model_kwargs(batch: dict) -> dict:
    """The forward's vision inputs of a batch that has them, {} for a text batch (`core.packing.picture_inputs`: it
    lives there so that `packing.token_logprobs` needs no import of this module)."""
    from core.packing import picture_inputs

    return picture_inputs(batch)


@torch.no_grad()
def greedy_generate(model, tokenizer, examples: list[dict], prompt_key: str, max_new_tokens: int,
                    batch_size: int = 64) -> list[list[int]]:  # fmt: skip
    """Greedy continuations (token ids, the stop token and after removed) of examples with pictures: left-padded
    prompts `examples[i][prompt_key]` with their pictures through `model.generate`, never an image token (it would
    need a picture's features). As `models.greedy_generate`."""
    from core import chat

    model.eval()
    device = next(model.parameters()).device
    pad, stops = tokenizer.pad_token_id, chat.stop_ids(tokenizer)
    image_ids = {ex["image_token_id"] for ex in examples if ex.get("image_token_id") is not None}
    out = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        prompts = [ex[prompt_key] for ex in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        batch = add_pixels({"input_ids": ids}, chunk)
        gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=stops, suppress_tokens=sorted(image_ids),
                             **model_kwargs(batch))  # fmt: skip
        for row in gen[:, width:].tolist():
            out.append(row[: min((row.index(t) for t in stops if t in row), default=len(row))])
    return out
