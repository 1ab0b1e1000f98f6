"""The trainer's packed rows (each group's prompt once, completions attending to it, no padding) compute what
whole sequences compute: per-token logprobs, entropies, the loss and every parameter's gradient, for every
algorithm, with LoRA, tied and untied heads, at a temperature and a nucleus; on one process and under FSDP2 on
2 gloo ranks; and the micro-batch's forward and backward never wait for the device to tell the host a number.

The reference (``per_sequence_hidden``) runs every completion as its own sequence, prompt and completion, through
the model with transformers' own attention, and takes the hidden states that predict its tokens: what the trainer
computed before packing. Both sides run the same head and loss on those hidden states, so a difference can only
come from the layout and the attention; both run here, in one process, so the tolerance is float32 round-off.
"""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.train_runs import torchrun
from scirl import algorithms
from scirl.distributed import Dist
from scirl.rollouts.contract import Sample
from scirl.run.config import TrainConfig
from scirl.trainer import Trainer, attention, packing
from scirl.trainer.batching import Batching
from scirl.trainer.head import hidden_states_out
from scirl.trainer.model import load_model
from scirl.trainer.packing import completion_grids, make_micro_batches, pack

CPU = torch.device("cpu")


DEFAULT_GRID_OVERHEAD = packing.GRID_OVERHEAD_PAIRS


@pytest.fixture(autouse=True)
def grids_of_every_length(monkeypatch):
    """The SDPA path's completions in as many grids of similar lengths as the lengths allow: at these tests' few
    tokens a grid's fixed cost would keep one grid, and the split into grids is what these tests must cover."""
    monkeypatch.setattr(packing, "GRID_OVERHEAD_PAIRS", 0)


def grouped_samples(seed: int = 0, teachers: bool = False) -> list[Sample]:
    """Three groups of prompts of different lengths and completions of 1-6 tokens; group 1's completions each saw
    their own prompt (options shuffled per completion: one group, four prompts). With ``teachers``, a self-teacher's
    prompts: one per group shared by most completions, another for one of them, none for group 2's first."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group, (n_prompt, lengths) in enumerate(((9, (4, 1, 6, 2)), (5, (3, 2, 5, 1)), (12, (6, 3)))):
        prompt = torch.randint(10, 500, (n_prompt,), generator=g).tolist()
        shown = torch.randint(10, 500, (n_prompt + 4,), generator=g).tolist()
        for k, n in enumerate(lengths):
            if group == 1:
                prompt = torch.randint(10, 500, (n_prompt,), generator=g).tolist()
            teacher = None
            if teachers and (group, k) != (2, 0):
                teacher = shown if k else torch.randint(10, 500, (n_prompt + 2,), generator=g).tolist()
            samples.append(
                Sample(
                    prompt,
                    torch.randint(10, 500, (n,), generator=g).tolist(),
                    (-torch.rand(n, generator=g) * 3).tolist(),
                    float(torch.randn(1, generator=g)),
                    group,
                    teacher,
                )
            )
    return samples


def per_sequence_hidden(trainer, packed):
    """The reference forward: every completion row of ``packed`` as its own whole sequence."""
    model, layout, ids = trainer.compute_model, packed.layout, packed.input_ids[0]
    packed_attention, model.config._attn_implementation = model.config._attn_implementation, "sdpa"
    hidden = []
    try:
        for r in range(packed.loss_mask.shape[0]):
            grid = next(grid for grid in layout.grids if r in grid.rows.tolist())
            i = grid.rows.tolist().index(r)
            g = grid.prompts[i]
            prompt = ids[layout.prompt_index[g, : layout.prompt_lengths[g]]]
            completion = ids[grid.query_index[i, : int(packed.loss_mask[r].sum())]]
            with hidden_states_out(model) as seen:
                states = model(input_ids=torch.cat([prompt, completion])[None], use_cache=False).logits[0]
            hidden.append(states[len(prompt) - 1 : len(prompt) + len(completion) - 1])
    finally:
        model.config._attn_implementation = packed_attention  # the trainer's step holds its own setting
    return torch.cat(hidden), seen["weight"]


def trainer_for(
    model_dir,
    algorithm: str,
    *,
    lora: bool = False,
    batching: Batching = Batching(),
    reference: bool = False,
    dtype=torch.float32,
) -> Trainer:
    extra = {"sdpo": {"teacher": "ema", "top_k": 5, "ema_rate": 0.5}} if algorithm == "sdpo" else {}
    cfg = TrainConfig(
        algorithm=algorithm, **extra, **({"lora": {"enabled": True, "rank": 4, "alpha": 8}} if lora else {})
    )
    if lora:
        from scirl.trainer.lora import load_model as load_lora

        torch.manual_seed(0)  # the adapter's random init, the same on both sides
        model = load_lora(str(model_dir), cfg.lora, CPU, dtype)
    else:
        model = load_model(str(model_dir), CPU, Dist(), dtype)
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=0.7,
        top_p=0.9,
        device=CPU,
        dist=Dist(),
        dtype=dtype,
        head_block_tokens=5,
        batching=batching,
    )
    trainer.optimizer = torch.optim.SGD(trainer.trainable, lr=1.0)  # new weights = old - gradient
    trainer.max_norm = 1e9  # no clipping: the gradient itself is compared
    if reference:
        trainer.packed_hidden = types.MethodType(per_sequence_hidden, trainer)
    return trainer


def run_step(trainer: Trainer, samples: list[Sample]) -> tuple[dict, list, dict]:
    """One step: its stats, every micro-batch's per-token (logprobs, entropies), and the weights after it."""
    seen = []
    token_logprobs = trainer.head.token_logprobs

    def recording(*args):
        logprobs, entropy = token_logprobs(*args)
        seen.append((logprobs.detach().clone(), entropy.detach().clone()))
        return logprobs, entropy

    trainer.head.token_logprobs = recording
    stats = trainer.train_step(trainer.batches(samples))
    return stats, seen, {name: t.detach().clone() for name, t in trainer.model.state_dict().items()}


def assert_same_step(got, want) -> None:
    (stats, tokens, weights), (want_stats, want_tokens, want_weights) = got, want
    assert stats["loss_tokens"] == want_stats["loss_tokens"]
    for key in ("loss", "entropy", "mismatch_kl", "masked_fraction", "grad_norm"):
        assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-6), key
    assert len(tokens) == len(want_tokens)
    for (logprobs, entropy), (want_logprobs, want_entropy) in zip(tokens, want_tokens):
        torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=2e-5)
        torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=2e-5)
    for name, value in want_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    from scirl.synth.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("untied"), tie_word_embeddings=False)


@pytest.mark.parametrize("algorithm", sorted(algorithms.names()))
def test_packed_rows_equal_whole_sequences_for_every_algorithm(tiny_model_dir, algorithm):
    """Every algorithm (SDPO: its student and its EMA teacher's top-k targets, whose sequences are packed too) on
    micro-batches of whole groups and of groups split between micro-batches (their prompt in each)."""
    samples = grouped_samples(teachers=algorithm == "sdpo")
    for batching in (Batching(), Batching(micro_batch_tokens=30)):
        want = run_step(trainer_for(tiny_model_dir, algorithm, batching=batching, reference=True), samples)
        trainer = trainer_for(tiny_model_dir, algorithm, batching=batching)
        assert max(len(mb.packed.layout.grids) for mb in trainer.batches(samples)) > 1
        assert_same_step(run_step(trainer, samples), want)


@pytest.mark.parametrize("case", ["untied", "lora", "unshared"])
def test_packed_rows_equal_whole_sequences_untied_lora_and_unshared(tiny_model_dir, untied_model_dir, case):
    model_dir = untied_model_dir if case == "untied" else tiny_model_dir
    batching = Batching(share_prompts=case != "unshared", micro_batch_size=5)
    samples = grouped_samples()
    want = run_step(trainer_for(model_dir, "grpo", lora=case == "lora", batching=batching, reference=True), samples)
    assert_same_step(run_step(trainer_for(model_dir, "grpo", lora=case == "lora", batching=batching), samples), want)


def test_micro_batches_pack_whole_groups_within_the_token_budget():
    samples = grouped_samples()
    unique = sum(len(s.completion_ids) for s in samples) + 9 + 4 * 5 + 12  # group 1's four prompts each once
    (one,) = make_micro_batches(samples, max_tokens=10_000)
    assert one.packed.forward_tokens == one.unique_tokens == unique and one.packed.padding_tokens == 0
    assert one.loss_tokens == sum(len(s.completion_ids) for s in samples)
    several = make_micro_batches(samples, max_tokens=30)
    # within budget, except a completion that with its prompt alone exceeds it
    assert all(mb.packed.forward_tokens <= 30 or mb.sequences == 1 for mb in several)
    assert sum(mb.unique_tokens for mb in several) == unique  # a split group's prompt is useful work once
    assert sum(mb.sequences for mb in several) == len(samples)
    assert [mb.sequences for mb in make_micro_batches(samples, max_rows=4)] == [4, 4, 2]
    unshared = make_micro_batches(samples, max_tokens=10_000, share_prompts=False)[0]
    assert unshared.packed.forward_tokens == sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    padded = make_micro_batches(samples, max_tokens=10_000, pad_to=128)[0].packed
    assert padded.forward_tokens == 128 and padded.padding_tokens == 128 - unique


def test_the_flex_layout_gives_the_sdpa_paths_attention():
    """flex attention (CUDA's default) compiled once per process, as eager layers call it, by inductor and without
    gradients (torch has no CPU backward for it): over 20 packed lengths, padded to flex's few row lengths (2 up to
    a budget of 256 tokens), it attends as the SDPA path's gathers do, padding included, in one graph a row length."""
    from torch._dynamo.utils import counters

    rows = [((s.group, tuple(s.prompt_ids)), s.prompt_ids, s.completion_ids) for s in grouped_samples()]
    layouts = [pack(rows, pad_to=attention.FLEX_BLOCK, max_grids=packing.MAX_GRIDS)]
    assert len(layouts[0].layout.grids) == packing.MAX_GRIDS
    for seed in range(19):
        samples = grouped_samples(seed)[: 3 + seed % 8]
        layouts.append(
            pack(
                [((s.group, tuple(s.prompt_ids)), s.prompt_ids, s.completion_ids * (1 + seed % 5)) for s in samples],
                pad_to=lambda n: attention.row_length(n, "flex", 256),
            )
        )
    assert len({p.forward_tokens - p.padding_tokens for p in layouts}) > 10
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    for packed in layouts:
        n = packed.forward_tokens
        query, key, value = (torch.randn(1, heads, n, 8, generator=g) for heads in (4, 2, 2))
        flex = attention.prepare(packed.layout, "flex", n, torch.float32)
        sdpa = attention.prepare(packed.layout, "sdpa", n, torch.float32)
        with torch.no_grad():
            got, _ = attention.packed_attention(None, query, key, value, None, scaling=0.3, scirl_layout=flex)
            want, _ = attention.packed_attention(None, query, key, value, None, scaling=0.3, scirl_layout=sdpa)
        real = n - packed.padding_tokens  # the SDPA path gives padding a copy of another token's output
        torch.testing.assert_close(got[:, :real], want[:, :real], rtol=0, atol=1e-5)
    assert {p.forward_tokens for p in layouts} == {128, 256}
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


def pack_token_by_token(rows, pad_to: int, max_grids: int) -> dict[str, torch.Tensor]:
    """``pack``'s tensors by its rule written out a token at a time (how it built them before it built them a
    tensor op at a time), keyed by where they sit in the ``Packed``."""
    prompt_of, prompts, members = {}, [], []
    for r, (key, prompt, _) in enumerate(rows):
        if key not in prompt_of:
            prompt_of[key] = len(prompts)
            prompts.append(prompt)
            members.append([])
        members[prompt_of[key]].append(r)
    lengths = [len(c) for _, _, c in rows]
    longest_prompt, longest_completion = max(map(len, prompts)), max(lengths)
    grid_rows = completion_grids(lengths, longest_prompt, max_grids)
    want = {"prompt_index": torch.zeros((len(prompts), longest_prompt), dtype=torch.long)}
    out_start, grid_of, offset = {}, {}, len(prompts) * longest_prompt
    for k, members_k in enumerate(grid_rows):
        width = max(lengths[r] for r in members_k)
        want[f"grid{k}.rows"] = torch.tensor(members_k)
        want[f"grid{k}.prompts"] = torch.tensor([prompt_of[rows[r][0]] for r in members_k])
        want[f"grid{k}.query_index"] = torch.zeros((len(members_k), width), dtype=torch.long)
        for i, r in enumerate(members_k):
            out_start[r], grid_of[r] = offset + i * width, (k, i)
        offset += len(members_k) * width
    tokens, positions, group, branch, unpack = [], [], [], [], []
    predictor, targets, slot = {}, {}, {}
    first = [sum(lengths[:r]) for r in range(len(rows))]
    for g, prompt in enumerate(prompts):
        for j, token in enumerate(prompt):
            want["prompt_index"][g, j] = len(tokens)
            tokens.append(token), positions.append(j), group.append(g), branch.append(0)
            unpack.append(g * longest_prompt + j)
        last_prompt_position = len(tokens) - 1
        for r in members[g]:
            k_grid, i = grid_of[r]
            for k, token in enumerate(rows[r][2]):
                t = first[r] + k
                predictor[t] = last_prompt_position if k == 0 else len(tokens) - 1
                targets[t], slot[t] = token, r * longest_completion + k
                want[f"grid{k_grid}.query_index"][i, k] = len(tokens)
                tokens.append(token), positions.append(len(prompt) + k), group.append(g), branch.append(r + 1)
                unpack.append(out_start[r] + k)
    padding = -len(tokens) % pad_to
    long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    want.update(
        input_ids=long([tokens + [0] * padding]),
        position_ids=long([positions + [0] * padding]),
        group=torch.tensor(group + [-1] * padding, dtype=torch.int32),
        branch=torch.tensor(branch + [-1] * padding, dtype=torch.int32),
        unpack=long(unpack + [0] * padding),
        prompt_lengths=long([len(p) for p in prompts]),
        **{
            name: long([values[t] for t in sorted(values)])
            for name, values in (("predictor", predictor), ("targets", targets), ("slot", slot))
        },
        loss_mask=torch.arange(longest_completion)[None] < long(lengths)[:, None],
    )
    return want


@pytest.mark.parametrize("pad_to, max_grids", [(1, packing.MAX_GRIDS), (attention.FLEX_BLOCK, 1)])
def test_pack_builds_every_tensor_by_the_token_by_token_rule(pad_to, max_grids):
    """Random layouts (groups of 1-6 completions of 1-40 tokens after prompts of 1-30, a group's completions
    sharing its prompt or each seeing its own): every tensor of the packed row, its layout and its grids."""
    g = torch.Generator().manual_seed(0)
    draw = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=g))  # noqa: E731
    for trial in range(40):
        rows = []
        for group in range(draw(1, 5)):
            shared = draw(0, 3) > 0
            prompt = torch.randint(0, 1000, (draw(1, 30),), generator=g).tolist()
            for _ in range(draw(1, 6)):
                own = prompt if shared else torch.randint(0, 1000, (draw(1, 30),), generator=g).tolist()
                rows.append(((group, tuple(own)), own, torch.randint(0, 1000, (draw(1, 40),), generator=g).tolist()))
        order = torch.randperm(len(rows), generator=g).tolist() if trial % 2 else range(len(rows))
        rows = [rows[i] for i in order]  # a group's rows need not be adjacent
        packed, want = pack(rows, pad_to, max_grids), pack_token_by_token(rows, pad_to, max_grids)
        layout = packed.layout
        got = {
            "input_ids": packed.input_ids,
            "position_ids": packed.position_ids,
            "group": layout.group,
            "branch": layout.branch,
            "unpack": layout.unpack,
            "prompt_index": layout.prompt_index,
            "prompt_lengths": layout.prompt_lengths,
            "predictor": packed.predictor,
            "targets": packed.targets,
            "slot": packed.slot,
            "loss_mask": packed.loss_mask,
        }
        for k, grid in enumerate(layout.grids):
            got.update(
                {f"grid{k}.rows": grid.rows, f"grid{k}.prompts": grid.prompts, f"grid{k}.query_index": grid.query_index}
            )
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), (trial, name)
        real = sum(len(p) for p in {key: p for key, p, _ in rows}.values()) + len(packed.targets)
        assert packed.padding_tokens == -real % pad_to == want["input_ids"].shape[1] - real
        assert [grid.prompt_len for grid in layout.grids] == [
            max(len(rows[r][1]) for r in grid.rows.tolist()) for grid in layout.grids
        ]


def test_the_flex_path_copies_to_the_device_only_what_flex_attention_reads():
    """A micro-batch for flex attention leaves the SDPA path's indices (prompt, grid and output indices) on the host:
    no pinned copy of what no kernel reads; everything else goes to the device (here ``meta``), as on the SDPA path."""
    (mb,) = make_micro_batches(grouped_samples(), max_tokens=10_000, pad_to=attention.FLEX_BLOCK)
    meta = torch.device("meta")
    flex, sdpa = (packing.to_device(mb, meta, attention.host_only(kind)) for kind in ("flex", "sdpa"))
    for moved in (flex, sdpa):
        packed = moved.packed
        assert all(
            t.is_meta
            for t in (
                packed.input_ids,
                packed.position_ids,
                packed.predictor,
                packed.targets,
                packed.slot,
                packed.loss_mask,
                packed.layout.group,
                packed.layout.branch,
                moved.inference_logprobs,
                moved.advantages,
            )
        )

    def sdpa_only(layout):
        return [
            layout.prompt_index,
            layout.prompt_lengths,
            layout.unpack,
            *(t for grid in layout.grids for t in (grid.rows, grid.prompts, grid.query_index)),
        ]

    assert not any(t.is_meta for t in sdpa_only(flex.packed.layout))
    assert all(t.is_meta for t in sdpa_only(sdpa.packed.layout))


def test_completions_of_mixed_lengths_go_in_grids_of_similar_lengths(monkeypatch):
    """The SDPA path pads each grid's completions to its longest: long ones, middling ones and short ones each
    get a grid of their own; equal lengths one grid; and the split is the cheapest of all splits into consecutive
    runs of lengths (checked against every one of them)."""
    monkeypatch.setattr(packing, "GRID_OVERHEAD_PAIRS", DEFAULT_GRID_OVERHEAD)
    lengths = [40] * 5 + [256] * 3 + [3] * 3 + [40] * 5
    assert completion_grids(lengths, 200) == [[5, 6, 7], [0, 1, 2, 3, 4, 11, 12, 13, 14, 15], [8, 9, 10]]
    assert completion_grids(lengths, 200, max_grids=1) == [[5, 6, 7, 0, 1, 2, 3, 4, 11, 12, 13, 14, 15, 8, 9, 10]]
    assert completion_grids([7] * 5, 100) == [[0, 1, 2, 3, 4]]

    def cost(grid, prompt_len):
        width = max(lengths[r] for r in grid)
        return len(grid) * width * (prompt_len + width) + packing.GRID_OVERHEAD_PAIRS

    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        lengths = torch.randint(1, 60, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
        prompt_len = int(torch.randint(1, 100, (1,), generator=g))
        monkeypatch.setattr(packing, "GRID_OVERHEAD_PAIRS", int(torch.randint(0, 3000, (1,), generator=g)))
        grids = completion_grids(lengths, prompt_len)
        assert sorted(r for grid in grids for r in grid) == list(range(len(lengths)))
        assert 1 <= len(grids) <= packing.MAX_GRIDS
        widths = sorted(set(lengths), reverse=True)
        runs = [[r for r in range(len(lengths)) if lengths[r] == w] for w in widths]
        best = min(
            sum(cost([r for run in runs[i:j] for r in run], prompt_len) for i, j in zip((0, *cuts), (*cuts, len(runs))))
            for k in range(min(packing.MAX_GRIDS, len(runs)))
            for cuts in itertools.combinations(range(1, len(runs)), k)
        )
        assert sum(cost(grid, prompt_len) for grid in grids) == best, (lengths, prompt_len, grids)


SYNC_OPS = (
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::item",
    "aten::masked_select",
    "aten::repeat_interleave",
)


class CountSyncs(TorchDispatchMode):
    """Records the ops that make a CUDA host wait for the device (a tensor's value read back, or an output whose
    size depends on values)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNC_OPS or name.startswith("aten::_local_scalar"):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "sdpo"])
def test_a_micro_batch_forward_and_backward_never_wait_for_the_device(tiny_model_dir, algorithm):
    trainer = trainer_for(tiny_model_dir, algorithm)
    batches = [trainer.on_device(mb) for mb in trainer.batches(grouped_samples(teachers=algorithm == "sdpo"))]
    scales = [100.0, 10.0]
    with CountSyncs() as syncs:
        for mb in batches:
            trainer.forward_backward(mb, scales)
    assert syncs.seen == []
    # the check sees a sync where there is one
    with CountSyncs() as syncs:
        float(torch.ones(2).sum())
    assert syncs.seen == ["aten::_local_scalar_dense"]


FSDP_SCRIPT = r"""
import sys, torch
from scirl import algorithms
from scirl.distributed import setup, exit_process, teardown
from scirl.rollouts.contract import Sample
from scirl.run.config import TrainConfig
from scirl.trainer.batching import Batching
from scirl.trainer.model import load_model
from scirl.trainer import Trainer
model_dir, out_file, *cases = sys.argv[1:]
dist, device = setup("cpu")
results = {}
for case in cases:  # one launch: ALGORITHM=SAMPLES_FILE each, a fresh model each
    algorithm, samples_file = case.split("=", 1)
    samples = [Sample(**s) for s in torch.load(samples_file)]
    extra = {"sdpo": {"teacher": "ema", "top_k": 5, "ema_rate": 0.5}} if algorithm == "sdpo" else {}
    cfg = TrainConfig(algorithm=algorithm, **extra)
    model = load_model(model_dir, device, dist, torch.float32)
    trainer = Trainer(model, cfg.optim, algorithms.build(cfg), temperature=0.7, top_p=0.9, device=device, dist=dist,
                      dtype=torch.float32, head_block_tokens=5, batching=Batching(micro_batch_size=4))
    trainer.optimizer = torch.optim.SGD(trainer.trainable, lr=1.0)
    trainer.max_norm = 1e9
    mine = [s for s in samples if s.group % dist.world_size == dist.rank]  # whole groups, uneven on purpose
    stats = trainer.train_step(trainer.batches(mine))
    results[algorithm] = {"stats": stats, "state": trainer.full_state_dict()}
if dist.rank == 0:
    torch.save(results, out_file)
teardown()
exit_process(0)
"""


@pytest.mark.slow
def test_fsdp2_two_ranks_on_packed_rows_equal_whole_sequences(tiny_model_dir, tmp_path):
    """torchrun, 2 gloo ranks, FSDP2, GRPO and SDPO in one launch, each rank its groups in micro-batches of up to 4
    completions (rank 0 two, of its two groups, rank 1 one: a stand-in micro-batch joins the collectives): the update
    equals one process's over whole sequences, and the forward tokens counted are the real micro-batches'."""
    cases, samples = [], {}
    for algorithm in ("grpo", "sdpo"):
        samples[algorithm] = grouped_samples(teachers=algorithm == "sdpo")
        torch.save([vars(s) for s in samples[algorithm]], tmp_path / f"{algorithm}.pt")
        cases.append(f"{algorithm}={tmp_path / f'{algorithm}.pt'}")
    (tmp_path / "fsdp_step.py").write_text(FSDP_SCRIPT)
    torchrun(str(tmp_path / "fsdp_step.py"), str(tiny_model_dir), str(tmp_path / "out.pt"), *cases, timeout=180)
    results = torch.load(tmp_path / "out.pt")
    for algorithm, got in results.items():
        reference = trainer_for(tiny_model_dir, algorithm, reference=True)
        want_stats, _, want_weights = run_step(reference, samples[algorithm])
        assert got["stats"]["loss_tokens"] == want_stats["loss_tokens"], algorithm
        assert got["stats"]["unique_tokens"] == want_stats["unique_tokens"], algorithm  # each group's prompt once
        assert got["stats"]["forward_tokens"] == want_stats["forward_tokens"], algorithm  # without the stand-in's
        for key in ("loss", "entropy", "mismatch_kl", "grad_norm"):
            assert got["stats"][key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-6), (algorithm, key)
        for name, value in want_weights.items():
            torch.testing.assert_close(got["state"][name], value, rtol=0, atol=1e-6, msg=f"{algorithm} {name}")
    assert set(results) == {"grpo", "sdpo"}


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_decoder_layers_take_the_eager_step(tiny_model_dir, checkpointing):
    """``kernels = "compile"``: the decoder layers' forwards traced by dynamo, all layers one graph, through two
    steps of different shapes; with activation checkpointing the backward's recompute runs the compiled forward
    too (a recompute that ran other code would save other tensors and fail). Traced with ``aot_eager`` (no code
    generated: inductor's kernels are what the GPU check measures); the weights equal the eager step's."""
    from torch._dynamo.utils import counters

    from scirl.trainer.kernels import Kernels

    weights = {}
    for kernels in ("eager", "compile"):
        torch._dynamo.reset()
        counters.clear()
        model = load_model(str(tiny_model_dir), CPU, Dist(), torch.float32, activation_checkpointing=checkpointing)
        cfg = TrainConfig()
        trainer = Trainer(
            model,
            cfg.optim,
            algorithms.build(cfg),
            temperature=0.7,
            top_p=0.9,
            device=CPU,
            dist=Dist(),
            dtype=torch.float32,
        )
        trainer.kernels = Kernels(trainer.compute_model, kernels, backend="aot_eager")
        trainer.optimizer = torch.optim.SGD(trainer.trainable, lr=1.0)
        for seed in (0, 1):
            trainer.train_step(trainer.batches(grouped_samples(seed=seed)[: 6 + 4 * seed]))
        weights[kernels] = trainer.full_state_dict()
        if kernels == "compile":
            assert counters["stats"]["unique_graphs"] >= 1 and counters["stats"]["calls_captured"] > 0
            # outside a step the layers run their class's forward again (a sampler sharing the module is unaffected)
            assert trainer.kernels.compiled and all(
                "forward" not in vars(layer) for layer, _ in trainer.kernels.compiled
            )
    for name, value in weights["eager"].items():
        torch.testing.assert_close(weights["compile"][name], value, rtol=0, atol=1e-6, msg=name)


class LigerStandIn:
    """What scirl calls of Liger-Kernel (read from liger-kernel 0.8.5's ``transformers/monkey_patch.py``): its
    registry of model types and ``_apply_liger_kernel_to_instance(model, **kwargs)``, which dispatches on the
    config's model type."""

    def __init__(self):
        self.calls = []
        self.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen3": object(), "llama": object()}

    def _apply_liger_kernel_to_instance(self, model, **kwargs):
        self.calls.append((model, kwargs))


def test_liger_kernels_are_applied_without_their_loss_and_refused_where_they_cannot_run(tiny_model_dir, monkeypatch):
    from scirl.errors import TrainError
    from scirl.trainer.kernels import Kernels

    model = load_model(str(tiny_model_dir), CPU, Dist(), torch.float32)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not installed
    with pytest.raises(TrainError, match=r"pip install 'scirl\[gpu\]'"):
        Kernels(model, "liger")
    liger = LigerStandIn()
    package = types.ModuleType("liger_kernel")
    transformers_part = types.ModuleType("liger_kernel.transformers")
    transformers_part._apply_liger_kernel_to_instance = liger._apply_liger_kernel_to_instance
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = liger.MODEL_TYPE_TO_APPLY_LIGER_FN
    for name, module in (
        ("liger_kernel", package),
        ("liger_kernel.transformers", transformers_part),
        ("liger_kernel.transformers.monkey_patch", monkey_patch),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    Kernels(model, "liger")
    ((called, kwargs),) = liger.calls
    assert called is model
    # the norms, the rotary embedding and SwiGLU; never its losses, which would replace the model's forward
    assert kwargs == {
        "rope": True,
        "rms_norm": True,
        "swiglu": True,
        "cross_entropy": False,
        "fused_linear_cross_entropy": False,
    }
    del liger.MODEL_TYPE_TO_APPLY_LIGER_FN["qwen3"]
    with pytest.raises(TrainError, match="qwen3"):
        Kernels(model, "liger")
