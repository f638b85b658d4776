"""Vision-language models: the embedded `cleanrlhf/tiny-vl` (a random Qwen2-VL) and its picture task
`cleanrlhf/shapes`, a row's picture through `--data.image-key` (core/vision.py), SFT on pictures, the transformers
rollout engine (`--vllm.engine hf`) and vLLM with pictures and their weight syncs (vision tower included), and GRPO
after SFT.

vLLM serves the tiny-vl too (an in-process engine: pictures as `multi_modal_data`, its weight sync and debug check);
its Qwen2-VL processor needs torchvision, whose CPU-stack import `core/torchvision_ops.py` makes work."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import short_rl_run

from core import data, embedded, hf_engine, models, packing, rl, rollout, vision
from core.config import DataConfig, ModelConfig
from rewards import shapes

VL = "cleanrlhf/tiny-vl"
SHAPES = "cleanrlhf/shapes"


@pytest.fixture(scope="module")
def vl(one_thread):
    """(model fp32 eval, tokenizer, image processor) of the random tiny-vl."""
    path = embedded.resolve_model(VL)
    model = models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32")).eval()
    return model, models.load_tokenizer(path), vision.load_image_processor(path)


def picture_rows(n: int, seed: int = 0) -> list[dict]:
    return embedded.shapes_rows(n, seed)


def examples(tokenizer, processor, rows, cfg: DataConfig | None = None) -> list[dict]:
    cfg = cfg or DataConfig(path=SHAPES, image_key="image")
    make = vision.with_image(lambda r: data.sft_example(r, tokenizer, cfg), cfg, tokenizer, processor)
    return [make(r) for r in rows]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_vl_and_the_picture_task_are_built_and_load_offline(vl):
    model, tokenizer, processor = vl
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 300_000
    assert any(n.startswith("model.visual.") for n, _ in model.named_parameters())  # the vision tower
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    parts = [{"type": "image"}, {"type": "text", "text": "Hi"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>" in text
    folder = Path(data.resolve_data(SHAPES))
    train = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()]
    assert len(train) == embedded.SHAPES_TRAIN and len(test) == embedded.SHAPES_TEST
    # the answer is the number of squares drawn: count the coloured 14-pixel cells of the decoded picture
    for row in test[:20]:
        image = vision.load_image(row["image"], "image")
        assert image.size == (embedded.IMAGE_SIZE, embedded.IMAGE_SIZE)
        centres = [image.getpixel((x * 14 + 7, y * 14 + 7)) for y in range(4) for x in range(4)]
        assert str(sum(c != (255, 255, 255) for c in centres)) == row["answer"]
    assert {r["answer"] for r in test} == {"1", "2", "3", "4", "5"}


def test_with_image_expands_the_picture_tokens_and_checks_rows(vl, tmp_path):
    _, tokenizer, processor = vl
    rows = picture_rows(3)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ex = examples(tokenizer, processor, rows)[0]
    assert ex["input_ids"].count(pad) == 4 and ex["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert ex["pixel_values"].shape == (16, 3 * 2 * 14 * 14)
    assert len(ex["loss_mask"]) == len(ex["input_ids"]) and sum(ex["loss_mask"]) == 2  # the digit and eos
    # a picture file path works as well as inline base64, and gives the same pixels
    path = tmp_path / "p.png"
    vision.load_image(rows[0]["image"], "image").save(path)
    same = examples(tokenizer, processor, [{**rows[0], "image": str(path)}])[0]
    assert torch.equal(same["pixel_values"], ex["pixel_values"]) and same["input_ids"] == ex["input_ids"]
    # RL prompts: the prompt ids are expanded the same way
    cfg = DataConfig(path=SHAPES, image_key="image")
    make = vision.with_image(lambda r: data.prompt_example(r, tokenizer, cfg), cfg, tokenizer, processor)
    prompt = make(rows[0])
    assert prompt["prompt_ids"] == ex["input_ids"][: len(prompt["prompt_ids"])] and prompt["images"] is not None
    # bad pictures and bad keys are BadRows naming the key; through build_examples they name file and row
    for bad in ({**rows[0], "image": "not an image"}, {**rows[0], "image": 3}, {"prompt": "x", "answer": "1"}):
        with pytest.raises(data.BadRow) as e:
            examples(tokenizer, processor, [bad])
        assert e.value.key == "image"
    two = {**rows[0], "prompt": "<|image_pad|> and <|image_pad|>"}
    with pytest.raises(data.BadRow, match="2 <\\|image_pad\\|> tokens"):
        examples(tokenizer, processor, [two])
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[1], "image": "nope"}) + "\n")
    src = data.load_sources(str(bad_file), "train")
    make = vision.with_image(lambda r: data.sft_example(r, tokenizer, cfg), replace(cfg, on_bad_row="raise"),
                             tokenizer, processor)  # fmt: skip
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: key 'image'"):
        data.build_examples(src, make, replace(cfg, on_bad_row="raise"))
    with pytest.raises(ValueError, match="image processor"):
        vision.load_image_processor(str(embedded.resolve_model("cleanrlhf/tiny-chat")))


def test_picture_batches_take_the_padded_forward_because_packed_positions_differ(vl):
    """The documented decision: multimodal RoPE needs the padded batch. Per-row log-probs of a padded batch equal
    one-row forwards; the same tokens with packed 1-D position ids do not (so packing is never used with pictures)."""
    model, tokenizer, processor = vl
    exs = examples(tokenizer, processor, picture_rows(4))
    batch = vision.collate(exs, tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        padded = packing.token_logprobs(model, batch)
        for i, ex in enumerate(exs):
            alone = packing.token_logprobs(model, vision.collate([ex], tokenizer.pad_token_id, "cpu"))
            assert torch.allclose(alone[0], padded[i, : len(ex["input_ids"])], atol=1e-5)
        one = vision.collate(exs[:1], tokenizer.pad_token_id, "cpu")
        flat = model(input_ids=one["input_ids"], position_ids=torch.arange(one["input_ids"].shape[1])[None],
                     **vision.model_kwargs(one)).logits  # fmt: skip
        mrope = model(
            input_ids=one["input_ids"], attention_mask=one["attention_mask"], **vision.model_kwargs(one)
        ).logits
    assert (flat - mrope).abs().max() > 1e-4
    # the RL table: rows keep their own pictures, and forward_logp (padded) equals the SFT-side log-probs
    episodes = [rl.Episode(ex, ex["input_ids"][:-2], ex["input_ids"][-2:], [0.0, 0.0], [1, 1], False) for ex in exs]
    seqs = rl.sequences(episodes, tokenizer.pad_token_id, "cpu", packed=True)
    sub = rl.rows(seqs, [2, 0])
    assert sub["pixel_values"][0] is exs[2]["pixel_values"]
    with torch.no_grad():
        logp, _ = rl.forward_logp(model, sub, 1.0)
    for j, i in enumerate([2, 0]):
        n = len(exs[i]["input_ids"])
        assert torch.allclose(logp[j, n - 2 : n], padded[i, n - 2 : n], atol=1e-5)


def change_then_sync(engines, changed, prefix: str, seqs, sample_examples) -> dict:
    """Move every weight of `changed` whose name starts with `prefix` (all: ""): the debug check must fail on the
    engine, then pass within 1e-4 after a sync. Returns the sync's stats."""
    with torch.no_grad():
        for n, p in changed.named_parameters():
            if n.startswith(prefix):
                p.add_(0.05 * torch.randn_like(p))
    with pytest.raises(rollout.EngineError, match="disagrees"):
        rollout.check_weights(engines, changed, seqs, examples=sample_examples)
    stats = engines.update_weights(changed.named_parameters())
    assert rollout.check_weights(engines, changed, seqs, examples=sample_examples) < 1e-4
    return stats


def test_the_transformers_engine_samples_with_pictures_and_syncs_the_vision_tower(vl):
    model, tokenizer, processor = vl
    path = embedded.resolve_model(VL)
    cfg = rollout.VLLMConfig(engine="hf")
    engines = rollout.create_engines(path, cfg, seed=0)
    exs = examples(tokenizer, processor, picture_rows(3))
    prompts = [ex["input_ids"][: ex["loss_mask"].index(1)] for ex in exs]
    images = [ex["images"] for ex in exs]
    groups = engines.generate(prompts, n=2, max_new_tokens=3, temperature=1.0, seed=7, images=images)
    again = engines.generate(prompts, n=2, max_new_tokens=3, temperature=1.0, seed=7, images=images)
    assert [[s.token_ids for s in g] for g in groups] == [[s.token_ids for s in g] for g in again]  # seeded
    # the engine's sampled log-probs are the trainer's (temperature 1) log-probs of the same tokens and picture, over
    # the vocabulary without the image token (never sampled, below): the distribution the engine sampled from
    seqs = [p + s.token_ids for p, g in zip(prompts, groups) for s in g]
    sample_examples = [ex for ex in exs for _ in range(2)]
    batch = vision.add_pixels(packing.collate_padded([{"input_ids": t, "loss_mask": [0] * len(t)} for t in seqs], 0,
                                                     "cpu"), sample_examples)  # fmt: skip
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        logits = model(**inputs, **vision.model_kwargs(batch)).logits
        logits[..., model.config.image_token_id] = -torch.inf
        trainer = torch.log_softmax(logits, -1)
    for k, (p, s) in enumerate([(p, s) for p, g in zip(prompts, groups) for s in g]):
        want = trainer[k, len(p) - 1 : len(p) - 1 + len(s.token_ids)].gather(-1, torch.tensor(s.token_ids)[:, None])
        assert torch.allclose(torch.tensor(s.logprobs), want[:, 0], atol=1e-4)
        plain = packing.token_logprobs(model, rl.rows(batch, [k]))[0, len(p) : len(p) + len(s.token_ids)]
        assert 0 < (plain - want[:, 0]).abs().max() < 0.01  # the random model gives the image token ~1/468
    assert rollout.check_weights(engines, model, seqs, examples=sample_examples) < 1e-4
    # a response never holds the image token (the trainer's forward would look for a picture's features for it): 1,536
    # hot samples of the random model would hold ~3 of them if it were not suppressed
    hot = engines.generate(prompts, n=64, max_new_tokens=8, temperature=3.0, seed=1, images=images, ignore_eos=True)
    sampled = [t for g in hot for s in g for t in s.token_ids]
    assert len(sampled) == 3 * 64 * 8 and model.config.image_token_id not in sampled
    # change every weight (vision tower included), sync, and the check passes again; an unsynced engine fails it
    changed = models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32")).eval()
    stats = change_then_sync(engines, changed, "", seqs, sample_examples)
    assert stats["sync/mb"] > 0
    visual = [n for n, _ in changed.named_parameters() if n.startswith("model.visual.")]
    hf = engines.engines[0].model
    assert visual and all(
        torch.equal(dict(hf.named_parameters())[n], dict(changed.named_parameters())[n]) for n in visual
    )
    engines.shutdown()


def test_vllm_serves_pictures_and_syncs_the_vision_tower(vl):
    """An in-process vLLM engine on the tiny-vl: pictures go as `multi_modal_data`, seeded samples repeat, the
    engine's prompt log-probs with the pictures equal the trainer's, a response never holds the image token, and after
    every weight changed (vision tower included) the debug check fails until a sync, then passes."""
    model, tokenizer, processor = vl
    path = embedded.resolve_model(VL)
    cfg = rollout.VLLMConfig(in_process=True, dtype="float32", kv_cache_gib=0.25, max_model_len=256, timeout_s=300)
    engines = rollout.create_engines(path, cfg, seed=0)
    try:
        exs = examples(tokenizer, processor, picture_rows(3))
        prompts = [ex["input_ids"][: ex["loss_mask"].index(1)] for ex in exs]
        images = [ex["images"] for ex in exs]
        groups = engines.generate(prompts, n=2, max_new_tokens=3, temperature=1.0, seed=7, images=images)
        again = engines.generate(prompts, n=2, max_new_tokens=3, temperature=1.0, seed=7, images=images)
        assert [[s.token_ids for s in g] for g in groups] == [[s.token_ids for s in g] for g in again]
        seqs = [p + s.token_ids for p, g in zip(prompts, groups) for s in g]
        sample_examples = [ex for ex in exs for _ in range(2)]
        assert rollout.check_weights(engines, model, seqs, examples=sample_examples) < 1e-4
        hot = engines.generate(prompts, n=64, max_new_tokens=8, temperature=2.0, seed=1, images=images,
                               ignore_eos=True)  # vLLM's highest temperature  # fmt: skip
        sampled = [t for g in hot for s in g for t in s.token_ids]
        assert len(sampled) == 3 * 64 * 8 and model.config.image_token_id not in sampled
        changed = models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32")).eval()
        change_then_sync(engines, changed, "", seqs, sample_examples)  # the cached picture encodings go with the KV
        change_then_sync(engines, changed, "model.visual.", seqs, sample_examples)  # the vision tower alone
    finally:
        engines.shutdown()


def two_picture_rows(n: int) -> list[dict]:
    """Rows asking about two pictures, each placed where the prompt says: "<pic> squares, then <pic> squares?"."""
    rows = picture_rows(2 * n, seed=3)
    slot = vision.IMAGE_PLACEHOLDER
    return [{"prompt": f"Left {slot} right {slot} total?", "image": [a["image"], b["image"]],
             "answer": str(int(a["answer"]) + int(b["answer"]))} for a, b in zip(rows[::2], rows[1::2])]  # fmt: skip


def test_several_pictures_per_prompt_sit_where_the_row_places_them(vl, tmp_path):
    """`--data.max-images-per-prompt 2`: a row's list of pictures, each expanded at its own placeholder; the trainer
    and the vLLM engine (`multi_modal_data` with both) compute the same log-probs; swapping the two pictures changes
    them (each is read where it sits); a row with more pictures than the flag allows is skipped and counted, or
    refused naming the file, row and count."""
    model, tokenizer, processor = vl
    cfg = DataConfig(path=SHAPES, image_key="image", max_images_per_prompt=2)
    rows = two_picture_rows(3)
    exs = examples(tokenizer, processor, rows, cfg)
    pad = exs[0]["image_token_id"]
    per_picture = vision.image_tokens(exs[0]["image_grid_thw"][0], processor)
    for ex in exs:
        assert len(ex["images"]) == 2 and ex["image_grid_thw"].shape == (2, 3)
        ids = ex["input_ids"]
        assert ids.count(pad) == 2 * per_picture and ex["loss_mask"][ids.index(pad)] == 0
        first, last = ids.index(pad), len(ids) - ids[::-1].index(pad) - 1
        assert pad not in ids[first + per_picture : last - per_picture + 1]  # two runs, text between them
    swapped = examples(tokenizer, processor, [{**rows[0], "image": rows[0]["image"][::-1]}], cfg)[0]
    batch = vision.collate([exs[0], swapped], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logp = packing.token_logprobs(model, batch)
    assert not torch.allclose(logp[0], logp[1], atol=1e-4)

    path = embedded.resolve_model(VL)
    engine_cfg = rollout.VLLMConfig(in_process=True, dtype="float32", kv_cache_gib=0.25, max_model_len=256,
                                    timeout_s=300)  # fmt: skip
    engines = rollout.create_engines(path, engine_cfg, seed=0)
    try:
        seqs = [ex["input_ids"] for ex in exs]
        assert rollout.check_weights(engines, model, seqs, examples=exs) < 1e-4
        prompts = [ex["input_ids"][: ex["loss_mask"].index(1)] for ex in exs]
        groups = engines.generate(prompts, n=2, max_new_tokens=3, seed=7, images=[ex["images"] for ex in exs])
        assert all(len(s.token_ids) > 0 and pad not in s.token_ids for g in groups for s in g)
    finally:
        engines.shutdown()

    three = {**rows[0], "image": rows[0]["image"] + rows[1]["image"][:1]}
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text("\n".join(json.dumps(r) for r in (rows[0], three, rows[1])) + "\n")
    make = vision.with_image(lambda r: data.sft_example(r, tokenizer, cfg), cfg, tokenizer, processor)
    kept = data.build_examples(data.load_sources(str(bad_file), "train"), make, cfg)
    assert sum(len(g) for g in kept) == 2  # the three-picture row skipped
    strict = replace(cfg, on_bad_row="raise")
    make = vision.with_image(lambda r: data.sft_example(r, tokenizer, strict), strict, tokenizer, processor)
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: key 'image': 3 pictures, more than "
                                         r"--data.max-images-per-prompt 2"):  # fmt: skip
        data.build_examples(data.load_sources(str(bad_file), "train"), make, strict)


def test_an_environment_answering_with_a_picture_reaches_the_engine_and_the_trainer(vl):
    """agents/examples/shapes_env.py answers turn 1 with a new picture: the episode's example holds both pictures,
    the feedback's image tokens sit in the response (masked out of the loss), the in-process vLLM engine sampled turn
    2 seeing them (its sampled log-probs are the trainer's, whose padded forward gets both pictures, over the
    vocabulary without the image token), and the debug check agrees on the whole conversation."""
    from agents.examples import shapes_env
    from agents.executor import MultiTurnExecutor

    model, tokenizer, processor = vl
    path = embedded.resolve_model(VL)
    cfg = DataConfig(path=SHAPES, image_key="image")
    make = vision.with_image(lambda r: data.prompt_example(r, tokenizer, cfg), cfg, tokenizer, processor)
    prompts = [make(r) for r in picture_rows(3)]
    engine_cfg = rollout.VLLMConfig(in_process=True, dtype="float32", kv_cache_gib=0.25, max_model_len=256,
                                    timeout_s=300)  # fmt: skip
    engines = rollout.create_engines(path, engine_cfg, seed=0)
    try:
        executor = MultiTurnExecutor(engines, tokenizer, shapes_env.make_env, max_new_tokens=3, max_turns=2,
                                     max_total_tokens=256, model_path=path)  # fmt: skip
        ro = executor.run(prompts, n=2, seed=5, step=0)
        pad = prompts[0]["image_token_id"]
        per_picture = vision.image_tokens(prompts[0]["image_grid_thw"][0], processor)
        for ep, row in zip(ro.episodes, [p for p in prompts for _ in range(2)]):
            assert len(ep.example["images"]) == 2 and ep.example["image_grid_thw"].shape == (2, 3)
            assert ep.example["images"][0] is row["images"][0] and len(row["images"]) == 1  # the row is untouched
            fed = [i for i, t in enumerate(ep.token_ids) if t == pad]
            assert len(fed) == per_picture and all(ep.action_mask[i] == 0 for i in fed)
            assert sum(ep.action_mask[fed[-1] :]) > 0  # turn 2 came after the picture
        seqs = rl.sequences(ro.episodes, tokenizer.pad_token_id, "cpu")
        with torch.no_grad():
            logits = model(**rl.model_inputs(model, seqs)[0]).logits
            logits[..., model.config.image_token_id] = -torch.inf
            trainer = torch.log_softmax(logits, -1)
        for k, ep in enumerate(ro.episodes):
            start = len(ep.prompt_ids)
            for j, (lp, m) in enumerate(zip(ep.logprobs, ep.action_mask)):
                if m:
                    want = trainer[k, start + j - 1, seqs["input_ids"][k, start + j]].item()
                    assert abs(lp - want) < 1e-4, (k, j, lp, want)
        full = [ep.prompt_ids + ep.token_ids for ep in ro.episodes]
        assert rollout.check_weights(engines, model, full, examples=[ep.example for ep in ro.episodes]) < 1e-4
    finally:
        engines.shutdown()


def test_vllm_gets_the_picture_tokens_collapsed_to_one():
    """vLLM's processor expands each `<|image_pad|>` of a prompt with `multi_modal_data` itself."""
    assert vision.collapse_image_tokens([1, 9, 9, 9, 9, 2, 3], 9) == [1, 9, 2, 3]
    assert vision.collapse_image_tokens([9, 9, 5, 9], 9) == [9, 5, 9]
    assert vision.collapse_image_tokens([1, 2], 9) == [1, 2]


def test_shapes_reward_hand_cases():
    out = shapes.reward_func(["Q 3", "Q three", "Q 4", "Q x", "Q  2 squares"], ["Q"] * 5, ["3", "3", "3", "3", "2"])
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert out["extra_logs"]["format_ok"].tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="label 2.5 is a float"):
        shapes.score("2", 2.5)


def test_sft_on_pictures_lowers_the_loss_and_trains_the_vision_tower(tmp_path, one_thread):
    from algos.sft import Args, main

    args = Args()
    args.model.name_or_path, args.data.path, args.data.image_key = VL, SHAPES, "image"
    args.data.max_samples, args.eval.max_samples, args.eval.max_new_tokens = 640, 64, 3
    args.train.max_steps, args.train.warmup_steps, args.train.batch_size, args.eval.every = 15, 2, 32, 15
    args.ckpt.every, args.logger.quiet, args.logger.tensorboard = 0, True, False
    args.run_dir = str(tmp_path / "run")
    summary = main(args)
    assert summary["eval_loss_last"] < 0.5 * summary["eval_loss_first"]
    before = models.load_causal_lm(ModelConfig(name_or_path=embedded.resolve_model(VL), dtype="fp32"))
    after = models.load_causal_lm(ModelConfig(name_or_path=summary["export_dir"], dtype="fp32"))
    moved = {n for n, p in after.named_parameters() if not torch.equal(p, dict(before.named_parameters())[n])}
    assert any(n.startswith("model.visual.patch_embed") for n in moved)
    assert any(n.startswith("model.visual.merger") for n in moved)
    rows = metrics(tmp_path / "run")
    assert all(r["train/tokens"] == 64 for r in rows if "train/tokens" in r)  # 32 answers: digit + eos each


def sampled_accuracy(model_dir: str, n: int = 4) -> float:
    """Mean reward of `n` seeded samples (temperature 1, what GRPO maximises) per held-out picture of
    `cleanrlhf/shapes` (300), from `model_dir` through the transformers engine: the same prompts and seeds for every
    model, so two models compare pair by pair."""
    tokenizer, processor = models.load_tokenizer(model_dir), vision.load_image_processor(model_dir)
    cfg = DataConfig(path=SHAPES, image_key="image")
    make = vision.with_image(lambda r: data.prompt_example(r, tokenizer, cfg), cfg, tokenizer, processor)
    prompts = [make(r) for r in data.load_sources(SHAPES, "test")[0].rows]
    engine = hf_engine.HFEngine(model_dir, rollout.VLLMConfig(engine="hf"))
    groups = engine.generate([p["prompt_ids"] for p in prompts], n=n, max_new_tokens=3, temperature=1.0, seed=4242,
                             images=[p["images"] for p in prompts])  # fmt: skip
    scores = [shapes.score(tokenizer.decode(s.token_ids, skip_special_tokens=True), p["label"])
              for p, g in zip(prompts, groups) for s in g]  # fmt: skip
    return sum(scores) / len(scores)


@pytest.fixture(scope="module")
def vl_sft(tmp_path_factory, one_thread) -> dict:
    """SFT of the random tiny-vl on the picture task until greedy accuracy on held-out pictures reaches 60 % (chance:
    20 %): the warm start of the RL tests on pictures (its summary; `export_dir` is the model)."""
    from algos import sft

    args = sft.Args()
    args.model.name_or_path, args.data.path, args.data.image_key = VL, SHAPES, "image"
    args.data.max_samples, args.eval.max_samples, args.eval.max_new_tokens = 3000, 200, 3
    args.train.max_steps, args.eval.every, args.eval.stop_at_accuracy = 800, 20, 0.6
    args.ckpt.every, args.logger.quiet, args.logger.tensorboard = 0, True, False
    args.run_dir = str(tmp_path_factory.mktemp("vl") / "sft")
    summary = sft.main(args)
    assert summary["eval_accuracy_last"] >= 0.6
    return summary


def second_turn_accuracy(model_dir: str, n: int = 4) -> float:
    """Mean turn-2 score of agents/examples/shapes_env.py (the count of the picture the environment answered with)
    over `n` seeded two-turn episodes per held-out picture (300), from `model_dir` through the transformers engine:
    the same prompts, seeds and feedback pictures for every model."""
    from agents.examples import shapes_env
    from agents.executor import MultiTurnExecutor

    tokenizer, processor = models.load_tokenizer(model_dir), vision.load_image_processor(model_dir)
    cfg = DataConfig(path=SHAPES, image_key="image")
    make = vision.with_image(lambda r: data.prompt_example(r, tokenizer, cfg), cfg, tokenizer, processor)
    prompts = [make(r) for r in data.load_sources(SHAPES, "test")[0].rows]
    scores: list[float] = []

    class Recorded(shapes_env.ShapesTwoTurns):
        def step(self, response: str):
            feedback, reward, done = super().step(response)
            if self.turn == 2:
                scores.append(reward / 0.5)
            return feedback, reward, done

    engine = hf_engine.HFEngine(model_dir, rollout.VLLMConfig(engine="hf"))
    executor = MultiTurnExecutor(engine, tokenizer, Recorded, max_new_tokens=3, max_turns=2, max_total_tokens=256,
                                 model_path=model_dir)  # fmt: skip
    executor.run(prompts, n=n, seed=4242, step=0)
    return sum(scores) / len(scores)


@pytest.mark.slow
def test_grpo_on_pictures_with_a_picture_as_feedback_raises_both_turns_rewards(vl_sft, tmp_path, one_thread):
    """From the SFT warm start (`vl_sft`), GRPO with vLLM rollouts through agents/examples/shapes_env.py: turn 1
    answers about the row's picture (the single-turn task), turn 2 about the picture the environment sent back, and
    `--debug` checks the engine against the trainer, both pictures included, after every sync. On held-out pictures
    (4 seeded samples each, the same for both models) GRPO must raise the single-turn sampled accuracy and the turn-2
    accuracy by MARGIN each: the policy learned from the feedback's picture too, which only the engine's and the
    trainer's forwards of the whole conversation show it."""
    from algos import grpo

    g = grpo.Args()  # the defaults: 64 prompts x 8 samples, lr 3e-4
    g.actor.model.name_or_path, g.data.path, g.data.image_key = vl_sft["export_dir"], SHAPES, "image"
    g.rollout.env_file, g.rollout.max_turns, g.rollout.max_new_tokens = "agents/examples/shapes_env.py", 2, 3
    g.data.max_samples, g.eval.max_samples = 3000, 200  # short_rl_run: greedy pass@1 only
    out, rows = short_rl_run(grpo.main, g, tmp_path / "grpo", steps=STEPS)
    assert sum("perf/debug_check_s" in r for r in rows) == STEPS  # the engine was checked after every sync
    trained = str(tmp_path / "grpo" / "hf")
    first = (sampled_accuracy(vl_sft["export_dir"]), sampled_accuracy(trained))
    second = (second_turn_accuracy(vl_sft["export_dir"]), second_turn_accuracy(trained))
    reward = [round(r["rollout/reward_mean"], 3) for r in rows if "rollout/reward_mean" in r]
    print(f"\nsft {vl_sft}\ngrpo {out}\nrollout reward by step {reward}\nheld-out single-turn sampled accuracy "
          f"{first[0]:.3f} -> {first[1]:.3f}, turn-2 accuracy {second[0]:.3f} -> {second[1]:.3f}")  # fmt: skip
    assert first[1] >= first[0] + MARGIN, first
    assert second[1] >= second[0] + MARGIN, second


# measured 2026-11-29 (vLLM rollouts): SFT stopped at 0.65 after 320 steps; GRPO 24 steps, rollout reward 0.307 ->
# 0.36-0.42; held-out single-turn sampled accuracy 0.437 -> 0.531, turn-2 accuracy 0.223 -> 0.275.
STEPS, MARGIN = 24, 0.03


@pytest.mark.slow
def test_dpo_on_picture_pairs_raises_the_held_out_preference_accuracy(tmp_path):
    """dpo.py with `--data.image-key image` on `cleanrlhf/shapes-pref` (a picture, "How many squares?", chosen the
    count, rejected another count from 1-5) from the random tiny-vl: both sides see the picture through the padded
    forward. Ranking the answers by any fixed order of the digits scores 0.5 on these pairs (chosen and rejected are
    exchangeable across the count's values), so accuracy above it needs the picture. Measured 0.5 -> 0.765 after 10
    steps, 0.935 after 30 (2026-11-29)."""
    from algos.dpo import Args, main

    args = Args()
    args.model.name_or_path, args.data.path, args.data.image_key = VL, "cleanrlhf/shapes-pref", "image"
    args.train.max_steps, args.eval.every, args.eval.max_samples = 10, 10, 200
    args.logger.quiet, args.logger.tensorboard, args.run_dir = True, False, str(tmp_path / "run")
    summary = main(args)
    rows = metrics(tmp_path / "run")
    first, last = rows[0]["eval/pref_accuracy"], rows[-1]["eval/pref_accuracy"]
    assert first == 0.5 and last >= 0.65, (first, last, summary)  # ties (policy = reference) count half at step 0
    exported = models.load_causal_lm(ModelConfig(name_or_path=summary["export_dir"]))
    assert exported.config.vision_config is not None  # the export is the vision-language model, tower included


@pytest.mark.slow
def test_reward_model_on_picture_pairs_learns_and_its_export_scores_them_the_same(vl_sft, tmp_path):
    """rm.py with `--data.image-key image` on `cleanrlhf/shapes-pref` from the picture SFT warm start: the scalar head
    sits on the vision-language body (`models.vl_scalar_class`), chosen and rejected both see the picture. A fixed
    ranking of the answers scores 0.5 on these pairs (see the DPO test above), so accuracy above it needs the picture;
    measured from two SFT warm starts (2026-11-29): 0.2 -> 0.81 and 0.64 -> 0.785 after 20 steps. The export loads back through `load_scalar_model` as the same
    class, tower included, and ranks the held-out pairs exactly as the run's last eval did."""
    from functools import partial

    from algos.rm import Args, main, padded_scores, with_pictures
    from rewards.server import RewardScorer

    args = Args()
    args.model.name_or_path, args.data.path, args.data.image_key = vl_sft["export_dir"], "cleanrlhf/shapes-pref", "image"
    args.train.max_steps, args.train.warmup_steps, args.eval.every, args.eval.max_samples = 20, 3, 10, 200
    args.logger.quiet, args.logger.tensorboard, args.run_dir = True, False, str(tmp_path / "run")
    summary = main(args)
    first, last = summary["eval_accuracy_first"], summary["eval_accuracy_last"]
    assert last >= 0.7 and last >= first + 0.1, summary
    export = summary["export_dir"]
    model = models.load_scalar_model(export, "fp32").eval()
    assert type(model).__name__ == "Qwen2VLForSequenceClassification" and model.config.vision_config is not None
    tokenizer = models.load_tokenizer(export)
    make = with_pictures(partial(data.reward_pair_example, tokenizer=tokenizer, cfg=args.data), args.data, tokenizer,
                         vision.load_image_processor(export))  # fmt: skip
    sources = data.load_sources(args.data.path, args.data.eval_split, args.eval.max_samples)
    pairs = [ex for g in data.build_examples(sources, make, args.data, print) for ex in g]
    scores = padded_scores(model, [p[k] for p in pairs for k in ("chosen", "rejected")], tokenizer.pad_token_id,
                           "cpu", [p["pictures"] for p in pairs for _ in range(2)])  # fmt: skip
    assert (scores[0::2] > scores[1::2]).double().mean().item() == pytest.approx(last, abs=1e-9)
    with pytest.raises(ValueError, match="vision-language reward model.*without their pictures"):
        RewardScorer(export)  # the reward server (and --reward.model) scores texts only: refused, not scored blind
    # the picture matters to the reward: another picture changes the chosen side's score
    other = padded_scores(model, [pairs[0]["chosen"]], 0, "cpu", [pairs[1]["pictures"]])
    assert pairs[0]["pictures"]["pixel_values"].shape != pairs[1]["pictures"]["pixel_values"].shape or \
        not torch.allclose(other, scores[:1])  # fmt: skip


def png_claiming(width: int, height: int) -> bytes:
    """A PNG of a signature, a header chunk claiming `width` x `height` RGB pixels and an end chunk: no pixel data, so
    only what PIL reads from the header (its decompression-bomb check at `Image.open`) can decide."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_pictures_a_library_refuses_are_bad_rows_skipped_and_counted_or_named(vl, tmp_path):
    """A picture over PIL's decompression-bomb limit (its real one: 15000 x 15000 = 225 M pixels against 2 x
    `Image.MAX_IMAGE_PIXELS`, read from a header that claims it) and one whose 300:1 aspect ratio Qwen2-VL's processor
    refuses (over 200) are bad rows at load: skipped and counted by what is wrong with `--data.on-bad-row skip`,
    named by file, row and key with `raise`, never the library's bare error."""
    import base64

    from PIL import Image

    _, tokenizer, processor = vl
    assert 15000 * 15000 > 2 * Image.MAX_IMAGE_PIXELS  # PIL's default limit, not one lowered for the test
    wide = tmp_path / "wide.png"
    Image.new("RGB", (300, 1), "red").save(wide)
    good = picture_rows(1)[0]
    bomb = {**good, "image": "data:image/png;base64," + base64.b64encode(png_claiming(15000, 15000)).decode()}
    files = {"bomb": [good, bomb], "wide": [good, {**good, "image": str(wide)}]}
    for name, rows in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    both = f"{tmp_path / 'bomb.jsonl'},{tmp_path / 'wide.jsonl'}"
    for mode in ("skip", "raise"):
        cfg = DataConfig(path=both, image_key="image", on_bad_row=mode)
        make = vision.with_image(lambda r, cfg=cfg: data.sft_example(r, tokenizer, cfg), cfg, tokenizer, processor)
        if mode == "skip":
            lines = []
            groups = data.build_examples(data.load_sources(both, "train"), make, cfg, lines.append)
            assert [len(g) for g in groups] == [1, 1]  # the good row of each file, processed as before
            assert torch.equal(groups[0][0]["pixel_values"], examples(tokenizer, processor, [good])[0]["pixel_values"])
            assert "skipped 1 of 2 rows" in lines[0] and f"{{{vision.PIXEL_BOMB!r}: 1}}" in lines[0]
            assert "skipped 1 of 2 rows" in lines[1] and f"{{{vision.REFUSED!r}: 1}}" in lines[1]
            continue
        for name, what in (("bomb", r"PIL refuses to open the picture: Image size \(225000000 pixels\)"),
                           ("wide", r"the image processor refuses the picture\(s\) of 300x1 pixels .*aspect ratio")):  # fmt: skip
            path = str(tmp_path / f"{name}.jsonl")
            with pytest.raises(ValueError, match=rf"{name}.jsonl: row 1: key 'image': {what}") as e:
                data.build_examples(data.load_sources(path, "train"), make, cfg)
            assert e.type is ValueError and e.value.__cause__ is None
