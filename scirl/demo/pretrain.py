"""Build the demo's base model: a small Qwen3 pretrained on "web" pages of open-book science MCQs.

The pages come from ``scirl.demo.world``: fresh questions every step (so the model
must learn to read, not memorise), formatted exactly as scirl's prompt does, with
the unreliable posted answers of ``world.web_answer``. The loss is on the posted
answer, plus a plain next-token loss on the page. The result has the skill (it can find the option the text states)
but answers with a habitual letter on several question types: the starting point
of the demo's runs (every algorithm's, self-distillation's included).

A share of the pages (``--solved-share``) are "solved" pages: the question as a self-teacher sees it
(``scirl.task.prompt.teacher_messages``: the question, "Correct solution:" and a right reply, the
instruction to solve the original question), answered with that reply's letter. They give the small
model what a large one brings to self-distillation by itself: it reads a solution shown in its prompt and answers
with it. Without them the demo base answers worse when shown a right solution than without it (16% vs
42% on held-out questions), and a self-teacher that reads no solutions has nothing to teach.

Rebuild the shipped model (about 10 minutes on one CPU thread; scripts/build_demo_base.sh):

    python -m scirl.demo.pretrain --out scirl/assets/demo-base --steps 1100 --clean-steps 250 \
        --layers 3 --eval-every 100 --val-per-domain 50 --solved-share 0.125

Two phases: ``--clean-steps`` of "textbook" pages (answers always right) teach the
reading skill, then "web" pages (``world.web_answer``) teach the answer habits. Every
``--eval-every`` steps it logs greedy letter accuracy and the skill on a validation
set (never used for anything else) to ``OUT/pretrain_log.jsonl``; the weights
written at the end are the final step's, in bfloat16 to keep the package small.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scirl.demo.world import HABITS, LETTERS, generate_reading_rows, web_answer
from scirl.inference.base import encode_messages
from scirl.synth.questions import RELATIONS
from scirl.synth.tiny_model import build_tiny_model, build_tokenizer
from scirl.task.data import question_from_row
from scirl.task.prompt import build_messages, teacher_messages

VALIDATION_SEED = 1_000_003  # rows for choosing/checking the base; the demo uses other seeds


def encode_prompt(tokenizer, row) -> list[int]:
    return encode_messages(tokenizer, build_messages(question_from_row(row)))


def tokenizer_corpus(seed: int, solved: bool = False) -> list[str]:
    """Text the tokenizer is trained on: rendered demo prompts and the answer forms (and, with ``solved``
    pages, the teacher prompt's wording)."""
    texts = []
    for row in generate_reading_rows(200, seed=seed + 7):
        texts += [m["content"] for m in build_messages(question_from_row(row))]
    texts += [f"Answer: {x}" for x in LETTERS] * 20
    if solved:
        texts += [
            teacher_messages(question_from_row(row), solution="A")[-1]["content"]
            for row in generate_reading_rows(10, seed=seed + 11)
        ]
    texts += ["system\n", "user\n", "assistant\n"] * 200  # the chat template's role names, as whole tokens
    return texts


def right_reply(row, rng: random.Random) -> str:
    """A right answer in one of the forms web pages post (the bare letter, or "Answer: X")."""
    return row["answerKey"] if rng.random() < 0.8 else f"Answer: {row['answerKey']}"


def make_batch(tokenizer, rows, rng, end_id, clean: bool = False, solved_share: float = 0.0, solved_rng=None):
    """Right-padded input ids, attention mask and labels (-100 everywhere but the answer and its end token).
    A ``solved_share`` of the rows (drawn from ``solved_rng``) are solved pages: the teacher's prompt with a
    right reply shown, answered right."""
    seqs, labels = [], []
    for row in rows:
        if solved_share and solved_rng.random() < solved_share:
            shown = right_reply(row, solved_rng)
            prompt = encode_messages(tokenizer, teacher_messages(question_from_row(row), solution=shown))
            text = right_reply(row, solved_rng)
        else:
            prompt = encode_prompt(tokenizer, row)
            text = row["answerKey"] if clean else web_answer(row, rng)
        answer = tokenizer.encode(text, add_special_tokens=False) + [end_id]
        seqs.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lab = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return ids, mask, lab


def letter_scores(model, tokenizer, rows, batch_size: int = 64, solved: bool = False) -> dict:
    """Greedy first-token accuracy and the skill, from the next-token distribution after the prompt.

    ``greedy_acc``: the argmax over the whole vocabulary is the right letter.
    ``skill_acc``: the right letter beats the other three letters once the row's habitual
    letter is set aside (on rows whose answer is not the habit) - what the model knows.
    ``solved_acc`` (with ``solved``): greedy accuracy when the prompt shows the right letter as a self-teacher's
    prompt does - whether the model reads a solution it is shown.
    """
    letter_ids = [tokenizer.convert_tokens_to_ids(x) for x in LETTERS]
    task_habit = {r.task: HABITS[i] for i, r in enumerate(RELATIONS)}
    greedy = skill = skill_n = 0
    per_domain: dict[str, list[int]] = {}
    model.eval()
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            prompts = [encode_prompt(tokenizer, r) for r in chunk]
            width = max(len(p) for p in prompts)
            # left padding so the last position is every row's answer position
            ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -1, :]
            for row, row_logits in zip(chunk, logits):
                gold = LETTERS.index(row["answerKey"])
                ok = int(row_logits.argmax().item() == letter_ids[gold])
                greedy += ok
                per_domain.setdefault(row["domain"], []).append(ok)
                habit = LETTERS.index(task_habit[row["details"]["task"]].letter)
                if habit != gold:
                    others = [i for i in range(4) if i != habit]
                    best = max(others, key=lambda i: row_logits[letter_ids[i]].item())
                    skill += int(best == gold)
                    skill_n += 1
        solved_right = 0
        for row in rows if solved else []:
            ids = encode_messages(tokenizer, teacher_messages(question_from_row(row), solution=row["answerKey"]))
            next_token = model(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item()
            solved_right += int(next_token == letter_ids[LETTERS.index(row["answerKey"])])
    model.train()
    scores = {
        "greedy_acc": greedy / len(rows),
        "skill_acc": skill / max(skill_n, 1),
        "per_domain": {d: sum(v) / len(v) for d, v in sorted(per_domain.items())},
    }
    if solved:
        scores["solved_acc"] = solved_right / len(rows)
    return scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scirl.demo.pretrain", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for the finished HF model")
    parser.add_argument(
        "--init", help="continue from this HF model directory (its tokenizer too) instead of a new model"
    )
    parser.add_argument("--steps", type=int, default=1100)
    parser.add_argument(
        "--clean-steps",
        type=int,
        default=250,
        help="the first N steps read textbook pages (answers always right) before the web pages",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--lm-weight", type=float, default=1.0, help="weight of the next-token loss on the page (0: answer only)"
    )
    parser.add_argument(
        "--solved-share",
        type=float,
        default=0.0,
        help="share of the pages that show a right solution in the self-teacher's prompt, answered with it",
    )
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--val-per-domain", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--snapshots", action="store_true", help="also save the model to OUT/latest at every evaluation"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    if args.init:
        tokenizer = AutoTokenizer.from_pretrained(args.init)
        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        out.mkdir(parents=True, exist_ok=True)
    else:
        tokenizer = build_tokenizer(tokenizer_corpus(args.seed, solved=args.solved_share > 0), args.vocab_size)
        build_tiny_model(
            out,
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.heads,
            vocab_size=args.vocab_size,
            tokenizer=tokenizer,
            seed=args.seed,
        )
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    val_rows = generate_reading_rows(args.val_per_domain, seed=VALIDATION_SEED)
    data_rng = random.Random(f"pretrain-pages-{args.seed}")
    answer_rng = random.Random(f"pretrain-answers-{args.seed}")
    solved_rng = random.Random(f"pretrain-solved-{args.seed}")  # its own stream: --solved-share 0 pages are as before
    log_path = out / "pretrain_log.jsonl"
    log = log_path.open("w")
    t0 = time.time()
    for step in range(1, args.steps + 1):
        # cosine schedule after a linear warmup, down to 10% of the peak
        if step <= args.warmup:
            lr = args.lr * step / args.warmup
        else:
            progress = (step - args.warmup) / max(1, args.steps - args.warmup)
            lr = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        # fresh pages every step: a new seed per batch, drawn from the run's own stream
        rows = generate_reading_rows(math.ceil(args.batch_size / 4), seed=data_rng.randrange(2**31))
        rows = data_rng.sample(rows, args.batch_size) if len(rows) > args.batch_size else rows
        ids, mask, labels = make_batch(
            tokenizer,
            rows,
            answer_rng,
            end_id,
            clean=step <= args.clean_steps,
            solved_share=args.solved_share,
            solved_rng=solved_rng,
        )
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        keep = targets != -100
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]), targets[keep])
        if args.lm_weight > 0:
            # plain next-token loss on the page itself: dense signal that grows the copy/match circuits
            # (names repeated from the text, the text's value among the options) the answer needs
            page = (mask[:, 1:] == 1) & ~keep
            lm_loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[page]), ids[:, 1:][page])
            total = loss + args.lm_weight * lm_loss
        else:
            total = loss
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            scores = letter_scores(model, tokenizer, val_rows, solved=args.solved_share > 0)
            record = {
                "step": step,
                "pages": "textbook" if step <= args.clean_steps else "web",
                "time": round(time.time() - t0, 1),
                "loss": round(loss.item(), 4),
                "lr": lr,
                **scores,
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
            if args.snapshots:  # so a long run can be inspected, or continued with --init
                model.save_pretrained(out / "latest")
                tokenizer.save_pretrained(out / "latest")
    log.close()
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out} after {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
