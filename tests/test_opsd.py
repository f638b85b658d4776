"""algos/opsd.py: the teacher's input (the hint in front of the student's own tokens, positions aligned) on a
hand-built example and on the model, the signal where teacher and student agree, the refusals, the hint-reading
warm start, and a short learning run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import short_rl_run

from algos.opsd import Args, align_to_student, distill_advantages, hint_prompts, main, policy_loss, teacher_episodes
from core import embedded, models, rl
from core.config import ModelConfig
from core.episode import Episode

REPO = Path(__file__).resolve().parent.parent


def episode(prompt_ids, token_ids, example=None, mask=None):
    return Episode(example=example or {}, prompt_ids=list(prompt_ids), token_ids=list(token_ids),
                   logprobs=[-0.5] * len(token_ids), action_mask=mask or [1] * len(token_ids), truncated=False)  # fmt: skip


def test_the_teachers_rows_are_the_hint_then_the_students_tokens_and_align_back():
    """Two episodes by hand: student prompts of 2 and 3 tokens, teacher prompts of 5 and 4, responses of 3 and 2
    tokens (the second with an environment token). The teacher's table holds each response right after its own
    prompt; `align_to_student` puts a value written at teacher position p of a response token back at the student's
    position of that same token, and nothing anywhere else."""
    student = [episode([1, 2], [7, 8, 9]), episode([1, 3, 4], [5, 6], mask=[1, 0])]
    hints = [[1, 40, 41, 42, 2], [1, 40, 43, 3]]
    teacher = teacher_episodes(student, hints)
    assert [e.prompt_ids for e in teacher] == hints and [e.token_ids for e in teacher] == [[7, 8, 9], [5, 6]]
    assert [e.action_mask for e in teacher] == [[1, 1, 1], [1, 0]] and student[0].prompt_ids == [1, 2]  # a copy
    s_tab, t_tab = (rl.sequences(eps, 0, "cpu") for eps in (student, teacher))
    assert t_tab["input_ids"].tolist() == [[1, 40, 41, 42, 2, 7, 8, 9], [1, 40, 43, 3, 5, 6, 0, 0]]
    assert t_tab["loss_mask"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 0, 0, 0]]
    # a "log-prob" that names the token it belongs to: 100 · row + token id, at the teacher's positions
    table = torch.where(t_tab["attention_mask"].bool(), 100 * torch.arange(2)[:, None] + t_tab["input_ids"], 0.0)
    aligned = align_to_student(table.float(), [5, 4], [2, 3], [3, 2])
    assert aligned.shape == s_tab["input_ids"].shape
    response = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(aligned[response], (100 * torch.arange(2)[:, None] + s_tab["input_ids"])[response].float())
    assert not aligned[~response].any()


def test_the_hint_prompt_is_the_template_tokenized_as_the_data_loader_tokenizes_prompts():
    tok = models.load_tokenizer("cleanrlhf/tiny")
    examples = [{"prompt": "37+05=", "label": "042"}, {"prompt": "01+02=", "label": "003"}]
    got = hint_prompts(examples, "answer {answer}; {prompt}", tok, special_tokens=True)
    assert got[0] == [tok.bos_token_id] + tok.encode("answer 042; 37+05=", add_special_tokens=False)
    assert tok.decode(got[1], skip_special_tokens=True) == "answer 003; 01+02="
    assert hint_prompts(examples, "{prompt}{answer}", tok, special_tokens=False)[0] == tok.encode(
        "37+05=042", add_special_tokens=False)  # a chat template writes its own specials  # fmt: skip
    assert Args().algo.hint_template == embedded.HINT_TEMPLATE  # the default is what the embedded student learned


def test_the_teachers_log_probs_are_the_model_reading_the_hint_then_the_students_tokens():
    """On the model, packed and padded: the aligned teacher table at each response token equals one unpadded forward
    of that row's hint prompt + response, computed here token by token."""
    tok = models.load_tokenizer("cleanrlhf/tiny")
    model = models.load_causal_lm(ModelConfig(name_or_path="cleanrlhf/tiny")).eval()
    rows = [("37+05=", "042", [4 + 16, 4 + 20, 4 + 18, 2]), ("9+9=", "018", [4 + 17, 4 + 24]),
            ("12+34=", "046", [4 + 16, 4 + 20, 4 + 22])]  # fmt: skip
    examples = [{"prompt": p, "label": a} for p, a, _ in rows]
    student = [episode(tok(p)["input_ids"], ids, ex) for (p, _, ids), ex in zip(rows, examples)]
    teacher = teacher_episodes(student, hint_prompts(examples, "answer {answer}; {prompt}", tok, True))
    layout = ([len(e.prompt_ids) for e in teacher], [len(e.prompt_ids) for e in student],
              [len(e.token_ids) for e in student])  # fmt: skip
    for packed in (True, False):
        t_tab = rl.sequences(teacher, tok.pad_token_id, "cpu", packed)
        with torch.no_grad():
            aligned = align_to_student(rl.forward_logp(model, t_tab, 1.0)[0], *layout)
        for i, e in enumerate(teacher):
            ids = torch.tensor([e.prompt_ids + e.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            n, s = len(e.prompt_ids), layout[1][i]
            want = torch.stack([logp[n + k - 1, tok_id] for k, tok_id in enumerate(e.token_ids)])
            # fp32 forward vs this fp64 softmax of the same fp32 logits, and packed vs unpadded attention sums
            torch.testing.assert_close(aligned[i, s : s + len(e.token_ids)].double(), want, rtol=0, atol=1e-5)


def test_the_signal_is_zero_where_teacher_and_student_agree():
    student = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.3, 0.3, 0.1]]))
    teacher = student.clone()
    teacher[0, 1] = torch.log(torch.tensor(0.75))  # the hint makes one token likelier
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = distill_advantages(teacher, student, mask)
    assert adv[0, 1].item() == pytest.approx(torch.log(torch.tensor(3.0)).item())
    adv[0, 1] = 0
    assert not adv.any()  # every token they agree on: no pull
    logp = student.clone().requires_grad_(True)
    loss, _, _ = policy_loss(logp, student, distill_advantages(student, student, mask), mask, num_tokens=5, num_seqs=2)
    loss.backward()
    assert loss.item() == 0 and not logp.grad.any()


@pytest.mark.parametrize("flags, message", [
    ({"hint_template": "{prompt}"}, r"--algo.hint-template '\{prompt\}': needs both \{prompt\}"),
    ({"hint_template": "answer {answer}"}, r"--algo.hint-template 'answer \{answer\}': needs both"),
])  # fmt: skip
def test_a_template_without_the_question_or_the_answer_is_refused(nothing_loads, flags, message):
    args = Args()
    for k, v in flags.items():
        setattr(args.algo, k, v)
    with pytest.raises(ValueError, match=message):
        main(args)


def test_pictures_are_refused_naming_the_flag(nothing_loads):
    args = Args()
    args.data.image_key = "image"
    with pytest.raises(ValueError, match=r"--data.image-key 'image': opsd.py splices a text hint"):
        main(args)


def test_a_teacher_prompt_that_leaves_no_room_is_named_by_its_row(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "' + "4" * 600 + '"}\n')
    args = Args()
    args.data.path, args.data.eval_path, args.run_dir = str(rows), str(rows), str(tmp_path / "run")
    with pytest.raises(ValueError, match=r"training row 1 \(prompt '2\+2=', label '4444.*teacher prompt from "
                                         r"--algo.hint-template is 614 tokens, and with --rollout.max-new-tokens 8 "
                                         r"it passes the model's context of 512"):  # fmt: skip
        main(args)


def test_the_embedded_student_reads_the_hint_and_leaves_room_without_it():
    """`cleanrlhf/tiny-sft-hint`, built by sft.py's hint-warm-start preset: the shared warm start is untouched, and
    the student's SFT stopped once it copied the shown answer (eval exact match >= 0.9 on add2-hint's test split)."""
    import json

    summary = json.loads((Path(embedded.resolve_model("cleanrlhf/tiny-sft-hint")) / "sft_summary.json").read_text())
    assert summary["eval_accuracy_last"] >= 0.9 and summary["steps"] < 3000, summary
    rows = [json.loads(line) for line in open(Path(embedded.resolve_data("cleanrlhf/add2-hint")) / "test.jsonl")]
    assert rows[0]["prompt"] == embedded.HINT_TEMPLATE.format(prompt=rows[0]["prompt"][-6:], answer=rows[0]["answer"])


def test_help_lists_the_algo_flags():
    out = subprocess.run([sys.executable, str(REPO / "algos" / "opsd.py"), "--help"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--algo.teacher {frozen,live}", "--algo.hint-template", "--algo.reward-coef", "--ref.zero-stage",
                 "(default: cleanrlhf/tiny-sft-hint)"):  # fmt: skip
        assert flag in out.stdout, flag
    assert "--teacher.model" not in out.stdout


@pytest.mark.slow
def test_opsd_raises_eval_pass_at_1_from_its_warm_start(tmp_path):
    """8 steps of self-distillation (the frozen starting weights reading the answer, λ = 0: no reward trains) with
    `--debug`: the student's greedy pass@1 on the plain prompts rises by 0.1 or more from the hint-reading warm
    start's (0.186; a 16-step run evaluated every 4 steps was at 0.532 after 4 and 0.738 after 8 on the 2-core AMD
    EPYC, 2026-12-05), and the reverse KL to the hinted teacher falls."""
    summary, rows = short_rl_run(main, Args(), tmp_path / "run", steps=8)
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
    kl = [r["opsd/reverse_kl"] for r in rows if "opsd/reverse_kl" in r]
    assert len(kl) == 8 and kl[0] > 0 and sum(kl[-3:]) / 3 < kl[0], kl
