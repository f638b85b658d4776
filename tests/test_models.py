"""Tests for core/models.py and the embedded tiny model/tokenizer: clear load errors, the scalar head's save/load
round trip, LoRA, batched greedy generation against HF generate, and the character tokenizer."""

import copy

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from core import embedded, models
from core.config import ModelConfig


# --------------------------------------------------------------------------------------------------- load errors
@pytest.mark.parametrize("path", ["./nope_model", "/nonexistent/nope_model", "~/nope_model_cleanrlhf"])
def test_nonexistent_model_path_is_one_clear_error(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    loaders = {
        "causal_lm": lambda: models.load_causal_lm(ModelConfig(name_or_path=path)),
        "tokenizer": lambda: models.load_tokenizer(path),
        "scalar": lambda: models.load_scalar_model(path),
    }
    for name, load in loaders.items():
        with pytest.raises(ValueError) as err:
            load()
        assert repr(path) in str(err.value) and "no such" in str(err.value), name


def test_folder_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        models.load_causal_lm(ModelConfig(name_or_path=str(tmp_path)))


# ---------------------------------------------------------------------------------------------------- scalar head
def right_padded(tokenizer, texts):
    rows = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, attn


def test_scalar_model_save_load_round_trip(tiny_path, tokenizer, tmp_path):
    torch.manual_seed(0)
    model = models.load_scalar_model(str(tiny_path), dtype="fp32").eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    ids, attn = right_padded(tokenizer, ["1+2=3", "12+34=46", "7"])
    with torch.no_grad():
        values = models.token_values(model, ids, attention_mask=attn)
        scores = models.sequence_scores(model, ids, attn)
    assert values.shape == ids.shape and values.dtype == torch.float32
    assert torch.equal(scores, values[torch.arange(3), attn.sum(-1) - 1])  # the head at the last real token
    assert scores.std() > 0  # a real (random) head, not zeros
    # padding does not change a sequence's score
    with torch.no_grad():
        alone = models.sequence_scores(model, ids[1:2, : attn[1].sum()], attn[1:2, : attn[1].sum()])
    torch.testing.assert_close(alone, scores[1:2], rtol=1e-5, atol=1e-5)

    model.save_pretrained(tmp_path / "rm")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(models.sequence_scores(loaded, ids, attn), scores)
    # and through the project's own loader (the critic / reward-model path)
    with torch.no_grad():
        again = models.sequence_scores(models.load_scalar_model(str(tmp_path / "rm"), dtype="fp32").eval(), ids, attn)
    assert torch.equal(again, scores)


# ----------------------------------------------------------------------------------------------------------- LoRA
def test_lora_trains_only_adapters(tiny_path, tiny_model):
    model = models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), dtype="fp32", lora_rank=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert frozen and not any("lora_" in n for n in frozen)
    # every linear layer of every block got an adapter (all-linear: q, k, v, o, gate, up, down per layer)
    assert len([n for n in trainable if n.endswith("lora_A.default.weight")]) == 4 * 7
    # lora_B starts at zero: the adapted model computes the base model's function
    ids = torch.tensor([[1, 21, 22, 15, 23, 24, 33]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, tiny_model(input_ids=ids).logits)


def test_gradient_checkpointing_flag(tiny_path):
    model = models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), dtype="fp32", gradient_checkpointing=True))
    assert model.is_gradient_checkpointing and model.config.use_cache is False


def test_auto_attention_is_eager_for_bf16_without_cuda_else_sdpa(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.attn_implementation("auto", torch.bfloat16) == "eager"
    assert models.attn_implementation("auto", torch.float32) == "sdpa"
    assert models.attn_implementation("sdpa", torch.bfloat16) == "sdpa"  # a name given is kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.attn_implementation("auto", torch.bfloat16) == "sdpa"
    assert models.attn_implementation("flash_attention_2", torch.bfloat16) == "flash_attention_2"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the auto choice differs on CUDA")
def test_both_loaders_honour_the_attention_flag(tiny_path):
    """`--model.attn-implementation` reaches the causal LM and the scalar-head model (rm.py, the PPO critic)."""
    path = str(tiny_path)
    lm = models.load_causal_lm(ModelConfig(name_or_path=path, dtype="bf16"))
    assert lm.config._attn_implementation == "eager" and lm.dtype == torch.bfloat16
    lm = models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32"))
    assert lm.config._attn_implementation == "sdpa"
    assert models.load_scalar_model(path, "fp32", "eager").config._attn_implementation == "eager"
    assert models.load_scalar_model(path, "bf16").config._attn_implementation == "eager"
    assert models.load_scalar_model(path, "fp32").config._attn_implementation == "sdpa"


# ----------------------------------------------------------------------------------------------------- generation
def test_greedy_generate_matches_hf_generate_per_prompt(tiny_model, tokenizer):
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():  # sharper than the random init (which repeats one token), so every step is a real check
        for p in model.parameters():
            p.mul_(4.0)
    texts = ["1+2=", "12+34=", "123+4567=", "hello world, 5+5="]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    batched = models.greedy_generate(model, tokenizer, prompts, max_new_tokens=8)
    small_batches = models.greedy_generate(model, tokenizer, prompts, max_new_tokens=8, batch_size=2)
    reference = []
    for p in prompts:  # one prompt at a time: no padding at all
        out = model.generate(
            input_ids=torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )[0, len(p) :].tolist()  # fmt: skip
        reference.append(out[: out.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in out else out)
    assert batched == reference and small_batches == reference
    assert len({t for r in reference for t in r}) > 8  # varied continuations: a padding leak would show
    assert all(tokenizer.eos_token_id not in r for r in batched)


def test_greedy_generate_cuts_at_eos(tokenizer):
    model = embedded.build_tiny_model(tokenizer)
    with torch.no_grad():  # a head that prefers token 5 first, then eos: the eos and what follows are removed
        model.lm_head = torch.nn.Linear(128, len(tokenizer), bias=True)
        model.lm_head.weight.zero_()
        model.lm_head.bias.zero_()
        model.lm_head.bias[tokenizer.eos_token_id] = 1.0
    assert models.greedy_generate(model, tokenizer, [[1, 5], [1, 6, 7, 8]], max_new_tokens=4) == [[], []]


# ------------------------------------------------------------------------------------------------------ tokenizer
def test_embedded_tokenizer_round_trip(tiny_path, tokenizer):
    ids = tokenizer("12+34=46")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len("12+34=46")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34=46"
    assert tokenizer.decode(ids) == "<s>12+34=46"
    # every printable ASCII character and newline is its own token, and nothing is lost (spaces included)
    text = "".join(embedded.CHARS)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and len(set(ids)) == len(text) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer("  a  b\n\nc ")["input_ids"], skip_special_tokens=True) == "  a  b\n\nc "
    assert len(tokenizer) == len(embedded.SPECIALS) + len(embedded.CHARS) == 100
    specials = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    assert specials == {0, 1, 2, 3}
    # the freshly built tokenizer and the one AutoTokenizer loads from disk agree
    fresh = embedded.build_tokenizer()
    loaded = AutoTokenizer.from_pretrained(tiny_path)
    assert fresh(text)["input_ids"] == loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    messages = [{"role": "user", "content": "1 + 2 ="}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "user: 1 + 2 =\nassistant: "
    assert tokenizer.decode(tokenizer(rendered, add_special_tokens=False)["input_ids"]) == rendered


def test_embedded_model_size_and_from_pretrained(tiny_path, tiny_model):
    built = embedded.build_tiny_model(embedded.build_tokenizer())
    n_params = sum(p.numel() for p in built.parameters())
    assert 0.95e6 < n_params < 1.1e6
    assert type(tiny_model).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in tiny_model.parameters()) == n_params
    assert tiny_model.config.tie_word_embeddings and tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight
    loaded = tiny_model.state_dict()
    for name, tensor in built.state_dict().items():  # the saved model is exactly the seeded build
        assert torch.equal(loaded[name], tensor), name
    through_core = models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), dtype="fp32"))
    assert torch.equal(through_core.model.embed_tokens.weight, built.model.embed_tokens.weight)


def test_default_zero_stage_fits_the_world(monkeypatch):
    """`--ds.zero-stage` unset: 0 for one process, 2 for several or to offload the optimizer or move the states (hybrid
    engine), 3 to offload parameters; a stage given is kept."""
    import torch.distributed as dist

    from core.config import DSConfig
    from core.engine import zero_stage

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert zero_stage(DSConfig()) == 0
    assert zero_stage(DSConfig(), hybrid=True) == 2
    assert zero_stage(DSConfig(offload_optimizer=True)) == 2
    assert zero_stage(DSConfig(offload_params=True)) == 3
    assert zero_stage(DSConfig(zero_stage=3)) == 3 and zero_stage(DSConfig(zero_stage=1), hybrid=True) == 1
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert zero_stage(DSConfig()) == 2 and zero_stage(DSConfig(zero_stage=0)) == 0


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_stage0_engine_reports_the_gradient_norm_of_zero2(tiny_path, grad_clip):
    """A stage-0 fp32 engine (the one-process default) logs the same gradient norm as ZeRO-2 (DeepSpeed itself keeps
    none at stage 0), with and without clipping, and takes the same step."""
    from core import engine as ds_engine
    from core.config import DSConfig

    ds_engine.init_distributed("gloo")
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25], [1, 40, 41, 42, 43, 44, 45]])
    out = {}
    for stage in (0, 2):
        torch.manual_seed(0)
        model = models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path)))
        engine = ds_engine.make_engine(model, DSConfig(zero_stage=stage, grad_clip=grad_clip), 1e-2)
        engine.backward(engine(input_ids=ids, labels=ids).loss * 50)  # × 50: a norm well above the clip
        engine.step()
        out[stage] = (float(engine.get_global_grad_norm()), [p.detach().clone() for p in engine.module.parameters()])
    assert out[0][0] > 5 and out[0][0] == pytest.approx(out[2][0], rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out[0][1], out[2][1]))


@pytest.mark.parametrize("stage", [None, 2, 3])
def test_scalar_head_engine_accumulates_micro_batches_like_one_batch(tiny_path, stage):
    """The critic / reward model as trained: `TokenValues` in a DeepSpeed engine, called through the engine. Two
    micro-batches with the accumulation boundary on the second give the gradient of one batch of both, also under
    ZeRO-3, where calling the model around the engine's forward had kept only part of it."""
    from core import engine as ds_engine
    from core.config import DSConfig
    from core.packing import collate_padded

    ds_engine.init_distributed("gloo")
    seqs = [[1, 5, 9, 13, 17, 21, 25], [1, 40, 41, 42], [1, 7, 3, 8, 9], [1, 30, 31, 32, 33, 34]]
    targets = torch.linspace(-1, 1, 4)

    def grad_norm(parts):
        torch.manual_seed(0)
        model = models.TokenValues(models.load_scalar_model(str(tiny_path), "fp32"))
        engine = ds_engine.make_engine(model, DSConfig(zero_stage=stage), 1e-3)
        assert engine.zero_optimization_stage() == (stage or 0)  # None: the default for one process
        for j, rows in enumerate(parts):
            b = collate_padded([{"input_ids": seqs[i], "loss_mask": [1] * len(seqs[i])} for i in rows], pad_id=0)
            values = engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"])  # (B, T)
            last = b["attention_mask"].sum(-1) - 1
            loss = ((values[torch.arange(len(rows)), last] - targets[rows]) ** 2).sum() / len(seqs)
            engine.set_gradient_accumulation_boundary(j == len(parts) - 1)
            engine.backward(loss)
        engine.step()
        return float(engine.get_global_grad_norm())

    # (the updated parameters are not compared: Adam's first step is ~lr·sign(g), so gradients at rounding level
    # move parameters by up to 2·lr depending on the order of the sums)
    norm_whole = grad_norm([[0, 1, 2, 3]])
    assert norm_whole > 0 and grad_norm([[0, 1], [2, 3]]) == pytest.approx(norm_whole, rel=1e-5)


def test_hf_export_draws_no_progress_bar_and_restores_the_setting(tiny_path, tokenizer, tmp_path, capsys):
    """export_hf runs inside a training loop's rich progress bar (the "best" export at an eval, the final one): it
    must not draw transformers' "Writing model shards" bar through it, and leaves the global bar setting as found."""
    from transformers.utils import logging as hf_logging

    from core import engine as ds_engine
    from core.config import DSConfig

    ds_engine.init_distributed("gloo")
    engine = ds_engine.make_engine(
        models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path))), DSConfig(), 1e-3
    )
    capsys.readouterr()
    for shown in (True, False):
        (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
        ds_engine.export_hf(engine, tokenizer, tmp_path / f"hf-{shown}")
        out, err = capsys.readouterr()
        assert "Writing model shards" not in out + err and hf_logging.is_progress_bar_enabled() == shown
        assert (tmp_path / f"hf-{shown}" / "model.safetensors").exists()
    hf_logging.enable_progress_bar()


@pytest.mark.parametrize("loader", ["causal", "scalar"])
def test_a_truncated_weights_file_is_named_with_the_flag(tmp_path, tiny_path, loader):
    """A `model.safetensors` cut short (a full disk, an interrupted copy): the error names the file and the flag
    that pointed to it, not safetensors' bare `invalid header length`."""
    import shutil

    from core.config import ModelConfig
    from core.models import load_causal_lm, load_scalar_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_path, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5])
    with pytest.raises(ValueError, match=r"--actor\.model\.name-or-path .*damaged weights file: .*model\.safetensors"):
        if loader == "causal":
            load_causal_lm(ModelConfig(name_or_path=str(folder)), "--actor.model.name-or-path")
        else:
            load_scalar_model(str(folder), flag="--actor.model.name-or-path")
