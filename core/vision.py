"""Vision-language models: a row's picture (`--data.image-key`) in front of its prompt, Qwen2-VL style.

    processor = vision.load_image_processor(model_path)                # the model folder's preprocessor_config.json
    make = vision.with_image(make, args.data, tokenizer, processor)    # any row -> example function, now with a picture
    batch = vision.collate(examples, pad_id, device)                   # padded batch + pixel_values, image_grid_thw
    logits = model(**batch_inputs, **vision.model_kwargs(batch))       # the pictures go through the vision tower

A picture is one `<|vision_start|><|image_pad|><|vision_end|>` in the prompt text (put in front of a text prompt, as
Qwen2-VL's chat template renders an image followed by text, unless the text already holds one; a row may hold several
pictures, `--data.max-images-per-prompt`, each where the row places it). After tokenisation the
single `<|image_pad|>` is expanded to one token per merged patch (`image_grid_thw` product / merge_size²), so the
example's token ids are exactly what the model and the rollout engine see; the vision tower's output replaces those
tokens' embeddings inside the model. The example keeps the pictures (for the rollout engine) and their processed pixel
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


PIXEL_BOMB = "pictures over PIL's decompression-bomb limit"
REFUSED = "pictures the image processor refuses"


def load_image(value, key: str):
    """A PIL RGB image from a row's value: a `data:image/...;base64,` string, bare base64 or a file path. BadRow
    naming `key` when it is none of these, cannot be decoded, or claims more pixels than PIL opens (its
    decompression-bomb guard, 2 x `PIL.Image.MAX_IMAGE_PIXELS`: PIL raises at `Image.open`, from the header, before
    decoding anything)."""
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
    except Image.DecompressionBombError as e:  # not an OSError: it would end the run with PIL's bare error
        raise BadRow(key, f"PIL refuses to open the picture: {e}", PIXEL_BOMB) from None
    return image.convert("RGB")


def process(images: list, processor) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision tower's inputs for pictures: pixel_values (sum of patches, C·T·P·P) and image_grid_thw (n, 3). A
    picture the processor refuses (Qwen2-VL's `smart_resize`: an aspect ratio over 200) is a ValueError naming the
    pictures' sizes and the processor's reason."""
    try:
        out = processor(images=images, return_tensors="pt")
    except ValueError as e:
        sizes = ", ".join(f"{w}x{h}" for w, h in (im.size for im in images))
        raise ValueError(f"the image processor refuses the picture(s) of {sizes} pixels (width x height): "
                         f"{e}") from None  # fmt: skip
    return out["pixel_values"], out["image_grid_thw"]


def image_tokens(grid_thw: torch.Tensor, processor) -> int:
    """How many `<|image_pad|>` tokens one picture of grid (t, h, w) takes: t·h·w / merge_size²."""
    return int(grid_thw.prod()) // processor.merge_size**2


def row_images(row: dict, cfg) -> list:
    """A row's pictures under `cfg.image_key`: one value (a path or base64 string) or a list of them, loaded
    (`load_image`). BadRow naming the key for an empty list or more than `--data.max-images-per-prompt`."""
    value = row.get(cfg.image_key)
    values = value if isinstance(value, list) else [value]
    limit = getattr(cfg, "max_images_per_prompt", 1)
    if not values:
        raise BadRow(cfg.image_key, "an empty list of pictures")
    if len(values) > limit:
        raise BadRow(cfg.image_key, f"{len(values)} pictures, more than --data.max-images-per-prompt {limit}")
    return [load_image(v, cfg.image_key) for v in values]


def expand_image_tokens(part: dict, ids_key: str, pad_id: int, counts: list[int], key: str) -> dict:
    """`part[ids_key]` with its k-th `<|image_pad|>` repeated `counts[k]` times (the k-th picture's tokens), and its
    `loss_mask` (if any) 0 there. BadRow naming `key` when the ids hold another number of image tokens than there are
    pictures."""
    ids, mask = part[ids_key], part.get("loss_mask")
    found = ids.count(pad_id)
    if found != len(counts):
        raise BadRow(key, f"the prompt holds {found} {IMAGE_PAD} tokens for {len(counts)} picture(s); each picture "
                     "needs one, where the row places it (or none: the pictures then go in front of the text)")  # fmt: skip
    out_ids, out_mask, k = [], [], 0
    for i, t in enumerate(ids):
        n = counts[k] if t == pad_id else 1
        k += t == pad_id
        out_ids += [t] * n
        out_mask += [0] * n if t == pad_id else ([mask[i]] if mask is not None else [])
    return {**part, ids_key: out_ids, **({"loss_mask": out_mask} if mask is not None else {})}


def with_image(make, cfg, tokenizer, processor):
    """Wrap a row -> example function (`data.sft_example`, `data.prompt_example`, `data.preference_example`, ...) for
    rows with pictures under `cfg.image_key` (one, or a list of at most `--data.max-images-per-prompt`): each picture
    sits where the row's prompt holds a `<|image_pad|>` (a text prompt with Qwen2-VL's placeholder, or a chat prompt
    whose message content lists `{"type": "image"}` items, which the chat template renders so); a text prompt without
    one gets them all in front. In the built example each picture's single `<|image_pad|>` is expanded to its token
    count (in `input_ids` + `loss_mask`, or `prompt_ids`; in both `chosen` and `rejected` of a pair, which share the
    prompt's pictures), and the example (or each side of a pair) carries the pictures (`images`, PIL images), their
    `pixel_values` (all patches, C·T·P·P), their grids (`image_grid_thw`, (n, 3)) and the `image_token_id`. The
    expanded length is checked against `--data.max-len` again."""
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    if pad_id is None or pad_id == tokenizer.unk_token_id:
        raise ValueError(f"--data.image-key: the tokenizer has no {IMAGE_PAD} token (not a Qwen2-VL-style model)")

    def picture_part(part: dict, images: list, pixels, grid, counts: list[int]) -> dict:
        ids_key = "prompt_ids" if "prompt_ids" in part else "input_ids"
        part = expand_image_tokens(part, ids_key, pad_id, counts, cfg.input_key)
        _too_long(cfg.input_key, len(part[ids_key]), cfg, "tokens with the pictures'")
        return {**part, "images": images, "pixel_values": pixels, "image_grid_thw": grid, "image_token_id": pad_id}

    def make_with_image(row: dict) -> dict:
        images = row_images(row, cfg)
        prompt = row.get(cfg.input_key)
        if isinstance(prompt, str) and IMAGE_PAD not in prompt:
            row = {**row, cfg.input_key: IMAGE_PLACEHOLDER * len(images) + prompt}
        example = make(row)
        try:  # here, at load, so that such a row is skipped and counted (or named) before the run starts
            pixels, grid = process(images, processor)
        except ValueError as e:
            raise BadRow(cfg.image_key, str(e), REFUSED) from None
        counts = [image_tokens(g, processor) for g in grid]
        if "chosen" in example and "rejected" in example:  # a preference pair: both sides see the prompt's pictures
            return {**example, **{side: picture_part(example[side], images, pixels, grid, counts)
                                  for side in ("chosen", "rejected")}}  # fmt: skip
        return picture_part(example, images, pixels, grid, counts)

    return make_with_image


def picture_messages(messages: list[dict]) -> tuple[list[dict], list]:
    """Chat messages whose `content` may be a list of parts (`{"type": "text", "text": ...}`, `{"type": "image",
    "image": a PIL image, a path or base64}`), as text messages with Qwen2-VL's placeholder where each picture was,
    and the pictures in order (an environment's feedback with pictures, `agents.executor.MultiTurnExecutor`)."""
    out, images = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        text = ""
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                images.append(part.get("image"))
                text += IMAGE_PLACEHOLDER
            elif kind == "text":
                text += str(part.get("text", ""))
            else:
                raise ValueError(f"a message part must be {{'type': 'text' | 'image', ...}}, got {part!r}")
        out.append({**m, "content": text})
    return out, images


def as_image(value, what: str):
    """A PIL image as it is (RGB), or one loaded from a path or base64 string (`load_image`); ValueError naming `what`."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    try:
        return load_image(value, what)
    except BadRow as e:
        raise ValueError(f"{what}: {e.reason}") from None


def with_more_pictures(example: dict, images: list, processor, image_token_id: int) -> dict:
    """A copy of `example` whose pictures (`images`, `pixel_values`, `image_grid_thw`: `with_image`'s keys) are its
    own followed by `images` (PIL), for an episode whose environment answered with pictures: what the engine and the
    trainer's forward then see for the whole conversation, in order."""
    pixels, grid = process(images, processor)
    if example.get("pixel_values") is not None:
        pixels, grid = torch.cat([example["pixel_values"], pixels]), torch.cat([example["image_grid_thw"], grid])
    return {**example, "images": list(example.get("images") or []) + list(images), "pixel_values": pixels,
            "image_grid_thw": grid, "image_token_id": image_token_id}  # fmt: skip


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
