"""The figures: the training FLOPs and MFU of a step (useful tokens only), and every stage's printed report.

MFU counts the work a step cannot avoid, so that computing less cannot make it look better and sharing a prompt
cannot inflate it:

    FLOPs = 6 D U + 6 V H L

with D the parameters every token's matmuls use (the decoder layers; N minus the embedding, and minus the LM head
when it is not tied), U the useful tokens (``train/unique_tokens``: each group's prompt once, plus every
completion token), V H the LM head, which runs at the L loss tokens only (``train/loss_tokens``). Padding (on CUDA
a packed row is rounded up to flex attention's 128-token blocks) and a prompt computed again (a group split between
micro-batches, or ``share_prompts = false``) are not counted; ``train/forward_tokens`` (positions the forwards
computed) and ``train/padding_tokens`` are reported beside it, so the work the trainer did is in view too.
Attention's own FLOPs (the query-key products, which grow with the context) are left out, as in the earlier figures.
MFU = FLOPs / train seconds / the device's peak (989 TFLOP/s, H200 bf16 dense, the datasheet's; ``--peak-tflops``
for another GPU; none on a CPU).
"""

from __future__ import annotations

from .common import say

FLOP_FORMULA = (
    "6 D U + 6 V H L; D the decoder's parameters (N less the embedding and an untied head), U useful "
    "tokens (train/unique_tokens: each group's prompt once, plus the completions), V H the LM head, L loss "
    "tokens (the head runs at those only); padding, repeated prompts and attention's own FLOPs not counted"
)
TOKEN_KEYS = ("forward_tokens", "unique_tokens", "loss_tokens", "padding_tokens")
# issue 41's targets: MFU with the default kernels by shape, the training peak at 0.6B, scirl's training half / TRL's
MFU_TARGETS = {"0.6b": 0.25, "1.7b": 0.40}
PEAK_TARGET_GB = {"0.6b": 20}
TRAIN_HALF_TARGET = 0.5


def train_flops(dense_parameters: int, head_parameters: int, unique_tokens: int, loss_tokens: int) -> float:
    return 6 * dense_parameters * unique_tokens + 6 * head_parameters * loss_tokens


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    return flops / seconds / (peak_tflops * 1e12) if peak_tflops and seconds > 0 else None


def step_work(m: dict, ctx: dict, seconds: float) -> dict:
    """A metrics row's token counts (the trainer's: every rank, padding included or not) and what they make of
    ``seconds`` of training: FLOPs, useful tokens/s, MFU. A step with no trainable token has zeros."""
    tokens = {key: m.get(f"train/{key}", 0) for key in TOKEN_KEYS}
    flops = train_flops(ctx["dense_parameters"], ctx["head_parameters"], tokens["unique_tokens"], tokens["loss_tokens"])
    return {
        **tokens,
        "train_flops": flops,
        "useful_tokens_per_s": tokens["unique_tokens"] / seconds if seconds else None,
        "mfu": mfu(flops, seconds, ctx["peak_tflops"]),
    }


def percent(value: float | None, digits: int = 1) -> str:
    return f"{100 * value:.{digits}f}%" if value is not None else "n/a"


def number(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
    return f"{value / scale:.{digits}f}" if value is not None else "n/a"


def print_split(m: dict) -> None:
    """The mean step of steps 2+ and its parts' shares."""
    total = m["generate_s"] + m["train_s"] + m["weight_sync_s"]
    say(
        f"mean of steps 2+: step {m['step_s']:.3f}s = generate {m['generate_s']:.3f}s "
        f"({100 * m['generate_s'] / total:.0f}%) + train {m['train_s']:.3f}s ({100 * m['train_s'] / total:.0f}%) + "
        f"weight sync {m['weight_sync_s']:.3f}s ({100 * m['weight_sync_s'] / total:.0f}%)"
    )


def print_peak(allocator_mb: float, device_mb: float | None, device: str) -> None:
    # scirl's memory/peak_mb: the allocator's on CUDA, the process's max RSS on a CPU
    what = "torch allocator, training process" if device == "cuda" else "the training process's max RSS"
    say(
        f"peak memory: {allocator_mb:.0f} MB ({what})"
        + (f"; device {device_mb:.0f} MB (nvidia-smi)" if device_mb is not None else "")
    )


def print_tokens(f: dict) -> None:
    """A run's or a step's token counts: what the forwards computed against the useful work."""
    say(
        f"tokens a step: {f['forward_tokens']:.0f} computed by the forwards ({f['padding_tokens']:.0f} of them "
        f"padding), {f['unique_tokens']:.0f} useful (each group's prompt once + the completions), "
        f"{f['loss_tokens']:.0f} loss tokens"
    )


def print_a_train(f: dict, ctx: dict) -> None:
    say("\n" + "=" * 78)
    say(
        f"stage A: transformers backend, {ctx['shape']} shapes ({ctx['parameters'] / 1e9:.3f}B), {ctx['device']}, "
        f"{ctx['dtype']}, {ctx['questions']} questions x {ctx['group_size']} completions x <= {ctx['max_tokens']} "
        f"tokens a step, micro-batches of {f['micro_batch_tokens']} tokens"
    )
    say(
        f"{'step':>4} {'generate s':>11} {'train s':>9} {'sync s':>8} {'ckpt s':>7} {'step s':>8} {'gen tok/s':>10} "
        f"{'useful':>7} {'forward':>8} {'useful tok/s':>13} {'MFU':>6} {'train MB':>9} {'graphs':>6} {'breaks':>6}"
    )
    for s in f["steps"]:
        c = s["compiles"]
        say(
            f"{s['step']:>4} {s['generate_s']:>11.3f} {s['train_s']:>9.3f} {s['weight_sync_s']:>8.3f} "
            f"{s['checkpoint_s'] or 0:>7.2f} {s['step_s']:>8.3f} {s['generation_tokens_per_s']:>10.0f} "
            f"{s['unique_tokens']:>7} {s['forward_tokens']:>8} {s['useful_tokens_per_s']:>13.0f} "
            f"{percent(s['mfu']):>6} "
            f"{number(s['train_peak_mb'], 0):>9} {number(c['graphs'], 0):>6} {number(c['graph_breaks'], 0):>6}"
        )
    say(
        "(ckpt s: time/checkpoint, the seconds the step waited on the checkpoint before it; train MB: the allocator's "
        "peak in the step's training; graphs, breaks: torch.compile's so far in the run)"
    )
    print_split(f["mean_after_first"])
    p, c, e = f["prompts"], f["completions"], f["expected_completions"]
    say(
        f"prompts: {p['count']} of {p['min']}-{p['max']} tokens, mean {p['mean']:.0f}; completions: mean "
        f"{c['mean']:.1f} tokens, median {c['median']:.0f}, {percent(c['at_limit'])} at the limit (designed: mean "
        f"{e['mean']:.1f}, median {e['median']}, {percent(e['at_limit'])}; EOS {percent(f['eos_rate'], 2)} a token as "
        "built)"
    )
    print_tokens(f["tokens_mean_after_first"])
    ck = f["checkpoint"]
    blocked = f"; training blocked {ck['blocked_s']:.2f}s" if ck.get("blocked_s") is not None else ""
    if ck["seconds"]:
        say(
            f"checkpoint (step {ck['step']}, at the end): {ck['bytes'] / 1e6:.0f} MB in {ck['seconds']:.1f}s in the "
            f"background = {ck['mb_per_s']:.0f} MB/s (staged to the host, files, sha256, fsync, commits){blocked}"
        )
    elif ck["seconds"] is not None:  # the run's line rounds to 0.1 s: too fast a write to give a rate
        say(
            f"checkpoint (step {ck['step']}, at the end): {ck['bytes'] / 1e6:.0f} MB in under 0.05s in the background "
            f"(no rate: the run's line rounds to 0.1s){blocked}"
        )
    rate = (
        f"MFU {percent(f['mfu'])} of {f['peak_tflops']:.0f} TFLOP/s"
        if f["mfu"] is not None
        else "MFU n/a (a CPU: no peak given, --peak-tflops)"
    )
    say(
        f"training: {f['useful_tokens_per_s']:.0f} useful tokens/s, {f['train_flops_per_step'] / 1e12:.2f} TFLOP a "
        f"step, {rate}{' (the deterministic settings: a_sweep has the default ones)' if f['deterministic'] else ''}; "
        f"FLOPs = {f['flop_formula']}"
    )
    say(f"generation: {f['generation_tokens_per_s']:.0f} tokens/s (completion tokens / generate time)")
    blocked = ck["blocked"]
    say(
        f"checkpoints every {ck['interval']} step(s): "
        + (
            ", ".join(f"step {b['step']} blocked {b['seconds']:.2f}s" for b in blocked)
            if blocked
            else "no step waited on one"
        )
        + " (time/checkpoint in the metrics row)"
        + "".join(
            f"; written in {b['seconds']:.1f}s in the background (step {b['step']}'s row)" for b in ck["background"]
        )
    )
    if f["train_peak_mb"] is not None:
        say(
            f"training peak: {f['train_peak_mb']:.0f} MB (the allocator's, reset before each step's training) against "
            f"the plan's {f['plan_allocated_mb']:.0f} MB in tensors ({f['plan_allocated_moment']}; "
            f"{f['plan_allocated_mb'] / f['train_peak_mb']:.2f}x); the whole process {f['process_peak_mb']:.0f} MB "
            "(generation's KV cache included)"
        )
    trainer = {k: v for s in f["steps"] for k, v in s["trainer"].items() if v is not None}
    say(
        "the trainer's own figures (last step): "
        + (
            ", ".join(f"{k} {v:g}" for k, v in trainer.items())
            if trainer
            else "none (train/compiles, train/graph_breaks, memory/alloc_retries "
            "are not in this trainer's metrics rows)"
        )
    )
    print_peak(f["process_peak_mb"] or f["memory_peak_mb"], f.get("device_peak_mb"), ctx["device"])
    if f["deterministic"]:
        say("deterministic: " + ", ".join(f"{k} {v}" for k, v in f["deterministic"].items()))


def print_a_resume(f: dict) -> None:
    c = f["compare"]
    verdict = (
        "bit-equal"
        if c["bit_equal"]
        else f"NOT bit-equal: {c['tensors_differing']} of {c['tensors']} tensors, {c['elements_differing']} elements "
        f"differ, max |diff| {c['max_abs_diff']:.3e} (allowed {c['atol']:g})"
    )
    say(
        f"resume: kill -9 in checkpoint {f['killed_in_checkpoint']}'s write, resumed from step {f['resumed_from']}: "
        f"the final weights are {verdict} against the uninterrupted run's -> {'PASS' if c['pass'] else 'FAIL'}"
    )
    same = [step for step, equal in f["same_completions"].items() if not equal]
    say("completions: the same at every step" if not same else f"completions differ at steps {', '.join(same)}")


def sweep_setting(row: dict) -> str:
    return (
        f"{row['kernels']} kernels, {row['attention']} attention, {row['micro_batch_tokens']} tokens a micro-batch, "
        f"checkpointing {'on' if row['activation_checkpointing'] else 'off'}"
        + (", deterministic" if row["deterministic"] else "")
        + (f" [{row['role']}]" if row.get("role") else "")
    )


def compiled(row: dict) -> tuple[str, int, int]:
    """Graphs made in the row's warm-up / timed steps / unseen batches' steps; graph breaks and recompile-limit hits
    in all three."""
    c = row["compiles"]
    return (
        f"{c['warmup']['graphs']}/{c['timed']['graphs']}/{c['fresh']['graphs']}",
        sum(part["graph_breaks"] for part in c.values()),
        sum(part["recompile_limit_hits"] for part in c.values()),
    )


def sweep_line(row: dict) -> str:
    if row.get("error"):
        return f"failed: {row['error']}"
    if row.get("out_of_memory"):
        return f"out of memory (the plan said {row['plan_peak_mb'] / 1e3:.1f} GB)"
    graphs, breaks, hits = compiled(row)
    plan = f"plan {row['plan_allocated_mb'] / 1e3:.1f} GB in tensors, {row['plan_peak_mb'] / 1e3:.1f} GB in all"
    if row["peak_mb"]:
        plan = (
            f"allocator peak {row['peak_mb'] / 1e3:.1f} GB vs plan {row['plan_allocated_mb'] / 1e3:.1f} GB in "
            f"tensors, device {row['device_used_mb'] / 1e3:.1f} GB vs plan {row['plan_peak_mb'] / 1e3:.1f} GB"
        )
    fresh = f", unseen batches {row['fresh_step_s']:.3f}s" if row.get("fresh_step_s") is not None else ""
    return (
        f"{row['step_s']:.3f}s a step{fresh} ({row['micro_batches']} micro-batches), "
        f"{row['useful_tokens_per_s']:.0f} useful tokens/s, MFU {percent(row['mfu'])}, graphs {graphs} "
        f"(warm-up/timed/unseen), {breaks} breaks" + (f", RECOMPILE LIMIT HIT {hits}x" if hits else "") + f"; {plan}"
    )


def print_sweep_table(rows: list[dict]) -> None:
    say(
        f"{'role':>12} {'kernels':>7} {'attn':>4} {'tokens':>6} {'ckpt':>4} {'det':>3} {'mbs':>3} {'forward':>7} "
        f"{'pad':>4} {'step s':>6} {'unseen':>6} {'useful/s':>8} {'MFU':>6} {'graphs':>6} {'brk':>3} {'peak':>5} "
        f"{'plan':>5} {'device':>6} {'plan':>5} {'retry':>5}"
    )
    for r in rows:
        head = (
            f"{r.get('role') or '':>12} {r['kernels']:>7} {r['attention']:>4} {r['micro_batch_tokens']:>6} "
            f"{'on' if r['activation_checkpointing'] else 'off':>4} {'yes' if r['deterministic'] else 'no':>3}"
        )
        if r.get("error") or r.get("out_of_memory"):
            say(f"{head} {sweep_line(r)}")
            continue
        graphs, breaks, hits = compiled(r)
        say(
            f"{head} {r['micro_batches']:>3} {r['forward_tokens']:>7} {r['padding_tokens']:>4} {r['step_s']:>6.3f} "
            f"{number(r['fresh_step_s'], 3):>6} {r['useful_tokens_per_s']:>8.0f} {percent(r['mfu']):>6} {graphs:>6} "
            f"{breaks:>3} {number(r['peak_mb'], 1, 1e3):>5} {r['plan_allocated_mb'] / 1e3:>5.1f} "
            f"{number(r['device_used_mb'], 1, 1e3):>6} {r['plan_peak_mb'] / 1e3:>5.1f} "
            f"{number(r['alloc_retries'], 0):>5}" + (f"  recompile limit hit {hits}x" if hits else "")
        )
    say(
        "(step s: on the warm-up's batch; unseen: a step on each batch no step had seen; graphs: torch.compile's in "
        "the warm-up/timed/unseen steps, brk: graph breaks; GB: peak the allocator's peak, plan its bytes in tensors; "
        "device the GPU's used memory, plan its total; retry: the allocator's retries)"
    )


def print_targets(f: dict) -> None:
    """Issue 41's targets at this shape, from the rows that have them."""
    rows = {r.get("role"): r for r in f["settings"] if r.get("role") and not (r.get("error") or r.get("out_of_memory"))}
    default, shape = rows.get("default"), f["shape"]
    if default is None:
        say(f"targets at {shape}: no default row measured")
        return
    target = MFU_TARGETS.get(shape)
    say(
        f"targets at {shape}: MFU {percent(default['mfu'])} with the default kernels at "
        f"{default['micro_batch_tokens']} tokens (unseen batches {percent(default['fresh_mfu'])})"
        + (f", target >= {percent(target, 0)}" if target else "")
    )
    if shape not in PEAK_TARGET_GB or default["peak_mb"] is None or not default["mfu"]:
        return
    limit = PEAK_TARGET_GB[shape]
    for r in [default, *(r for r in f["settings"] if r.get("role") in ("checkpointed", "smaller") and "step_s" in r)]:
        name = "the 20 GB row" if r.get("role") == "checkpointed" else r["role"]
        checkpointing = "on" if r["activation_checkpointing"] else "off"
        say(
            f"  {name} ({r['micro_batch_tokens']} tokens, checkpointing {checkpointing}):"
            f" allocator peak {r['peak_mb'] / 1e3:.1f} GB ({'within' if r['peak_mb'] <= 1e3 * limit else 'over'} "
            f"{limit} GB), device {r['device_used_mb'] / 1e3:.1f} GB; MFU {percent(r['mfu'])}, "
            f"{r['mfu'] / default['mfu']:.2f}x the default row's"
        )


def print_a_sweep(f: dict, ctx: dict) -> None:
    say("\n" + "=" * 78)
    b = f["batch"]
    say(
        f"stage A, the training step alone ({f['shape']} shapes, {b['completions']} completions of "
        f"{b['completion_mean']:.0f} tokens on average after prompts of {b['prompt_mean']:.0f}; "
        f"{b['unique_tokens']} useful tokens a step; unseen batches: "
        + ", ".join(str(x["unique_tokens"]) for x in f["fresh_batches"])
        + "): kernels x attention x micro-batch tokens x activation checkpointing"
    )
    print_sweep_table(f["settings"])
    if f.get("not_run"):
        say("not run: " + "; ".join(f["not_run"]))
    p = f.get("profile")
    if p and "error" in p:
        say(f"profile: not taken ({p['error']})")
    elif p:
        busy = (
            f", GPU busy {p['gpu_busy_s']:.3f}s ({100 * p['gpu_busy_share']:.0f}%)"
            if p["gpu_busy_s"] is not None
            else ""
        )
        say(
            f"profile of one step ({p['setting']}): wall {p['wall_s']:.3f}s{busy}; most {p['time']} time: "
            + ", ".join(f"{o['name']} {o['seconds']:.3f}s" for o in p["top_ops"][:6])
            + f" (table: {p['table']})"
        )
    print_targets(f)


def print_a_peer(f: dict) -> None:
    s, t, r = f["scirl"], f["trl"], f["ratios"]
    say("\n" + "=" * 78)
    c = f["config"]
    say(
        f"stage A, the peer (bench_trl.py, transformers pair, {c['device']}, {c['dtype']}): {c['questions']} x "
        f"{c['group']} completions x {c['tokens']} tokens, {f['timed_steps']} timed step(s) a side"
    )
    say(f"{'':8}{'s/step':>8}{'generate s':>12}{'train s':>9}{'peak MB':>9}")
    for name, side in (("scirl", s), ("TRL", t)):
        say(
            f"{name:8}{side['s_per_step']:>8.2f}{side['generate_s']:>12.2f}{side['train_s']:>9.2f}"
            f"{number(side.get('peak_allocated_mb'), 0):>9}"
        )
    target = f" (target <= {TRAIN_HALF_TARGET})" if c["device"] == "cuda" else ""
    say(
        f"scirl's training half {f['train_half']:.2f}x TRL's{target}; its whole step "
        + (f"{1 / r['s_per_step']:.2f}x TRL's" if r.get("s_per_step") else "n/a")
    )


def print_b_colocated(f: dict, ctx: dict) -> None:
    g = f["generation"]
    say("\n" + "=" * 78)
    if "summary" not in f:
        say(
            f"stage B, {ctx['shape']}: generation only: adapter {g['adapter']['tokens_per_s']:.0f} tokens/s | raw "
            f"vllm.LLM.generate {g['raw']['tokens_per_s']:.0f} (adapter/raw "
            f"{g['adapter']['tokens_per_s'] / g['raw']['tokens_per_s']:.2f})"
        )
        return
    s = f["summary"]
    say(
        f"stage B: vLLM colocated, {ctx['shape']} shapes ({ctx['parameters'] / 1e9:.3f}B), {ctx['device']}, "
        f"{ctx['dtype']}, {ctx['questions'] * ctx['group_size']} completions x <= {ctx['max_tokens']} tokens per step"
    )
    say(
        f"{'step':>4} {'generate s':>11} {'train s':>9} {'sync s':>8} {'step s':>8} {'tokens':>7} {'gen tok/s':>10} "
        f"{'MFU':>6} {'mismatch KL':>12} {'peak MB':>9}"
    )
    for r in s["steps"]:
        say(
            f"{r['step']:>4} {r['generate_s']:>11.3f} {r['train_s']:>9.3f} {r['weight_sync_s']:>8.3f} "
            f"{r['step_s']:>8.3f} {r['completion_tokens']:>7} {r['completion_tokens'] / r['generate_s']:>10.0f} "
            f"{percent(r['mfu']):>6} {r['mismatch_kl']:>12.2e} {r['peak_mb']:>9.0f}"
        )
    print_split(s["mean_after_first"])
    raw = g["raw"]["tokens_per_s"]
    say(
        f"generation tokens/s: training {s['training_generation_tokens_per_s']:.0f} | adapter "
        f"{g['adapter']['tokens_per_s']:.0f} | raw vllm.LLM.generate {raw:.0f}  (adapter/raw "
        f"{g['adapter']['tokens_per_s'] / raw:.2f}, training/raw {s['training_generation_tokens_per_s'] / raw:.2f})"
    )
    say(f"mismatch KL: max {s['mismatch_kl_max']:.2e}")
    checks = [(r["step"], r["weight_check_s"]) for r in s["steps"] if r.get("weight_check_s") is not None]
    if checks:
        say(f"push check (probe logprobs vs the trainer's): {checks[0][1]:.3f}s after step {checks[0][0]}'s push")
    print_peak(s["memory_peak_mb"], f.get("device_peak_mb"), ctx["device"])


def print_b_disaggregated(d: dict) -> None:
    say(
        f"disaggregated ({'server and trainer on separate GPUs' if d['split_gpus'] else 'server and trainer sharing'}, "
        f"weights through {d['weight_sync']}), server up in {d['server_start_s']:.0f}s:"
    )
    say(f"{'step':>4} {'generate s':>11} {'waited s':>9} {'train s':>9} {'sync s':>8} {'step s':>8} {'lag':>4}")
    for r in d["steps"]:
        say(
            f"{r['step']:>4} {r['generate_s']:>11.3f} {r['wait_for_batch_s']:>9.3f} {r['train_s']:>9.3f} "
            f"{r['weight_sync_s']:>8.3f} {r['step_s']:>8.3f} {r['lag_max']:>4}"
        )
    m = d["mean_after_first"]
    say(
        f"disaggregated mean of steps 2+: step {m['step_s']:.3f}s = waited for batch {m['wait_for_batch_s']:.3f}s + "
        f"train {m['train_s']:.3f}s + weight sync {m['weight_sync_s']:.3f}s; generation {m['generate_s']:.3f}s, "
        f"overlap {100 * d['overlap']:.0f}%"
    )


def print_b_eval(e: dict) -> None:
    say(
        f"b_eval: scirl eval of {e['checkpoint']} through the server: {e['questions']} questions in "
        f"{e['wall_s']:.1f}s, {e['requests_per_s']:.1f} requests/s, {e['reply_tokens_per_s']:.0f} reply tokens/s"
    )
