"""The training config, ``TrainConfig``: one pydantic model per section of the TOML file, every field with its
default, bounds and meaning (reading and writing it: ``config_io.py``). Unknown keys are errors, so a typo names
its field instead of being silently ignored. Each part of a run gets the slice it reads: a section (``Trainer``
takes ``optim``), or a record built here (``rollout_settings``).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator

from scirl import algorithms
from scirl.algorithms.sections import CispoConfig, DapoConfig, DrGrpoConfig, GspoConfig, LossConfig, SdpoConfig, Section
from scirl.rollouts.contract import RolloutSettings
from scirl.task.data import DEFAULT_EVAL_PER_DOMAIN, DEFAULT_SPLIT_METHOD, DEFAULT_SPLIT_SEED, DataSplits, load_splits
from scirl.task.formats import known_format, parse_columns
from scirl.trainer.batching import DEFAULT_MICRO_BATCH_TOKENS
from scirl.weights.base import DEFAULT_BUCKET_MIB

# bounds refuse values that can only be mistakes (a typo'd exponent, a NaN from a script): here, naming the field,
# not as NaN losses or a crash inside AdamW mid-run
MAX_TEMPERATURE = 10.0  # at T=10 a 150k-token softmax is near uniform: samples are noise; useful RL sampling is T <= ~2
MAX_SEED = 2**63 - 1  # what torch, numpy and random all accept


class OptimConfig(Section):
    # AdamW moves every weight by about lr per step: lr >= 1 wipes out any pretrained model
    lr: float = Field(1e-6, gt=0, lt=1, description="AdamW's learning rate")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="AdamW's moving-average rates of the gradient and its square"
    )
    max_norm: float = Field(1.0, gt=0, description="gradient-norm clipping threshold")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        # AdamW's averages need 0 <= beta < 1 (1 never forgets; torch would raise mid-setup)
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        return betas

    @model_validator(mode="after")
    def _decay_below_one(self) -> OptimConfig:
        # decoupled weight decay multiplies every weight by (1 - lr * weight_decay) each step
        if self.lr * self.weight_decay >= 1:
            raise ValueError(
                f"lr * weight_decay must be below 1 (each step scales weights by 1 - lr*wd), "
                f"got {self.lr} * {self.weight_decay}"
            )
        return self


class AdvantageConfig(Section):
    # prime-rl's GRPO: A = r - mean(group), no std normalisation; this is the opt-in
    std_normalize: bool = Field(False, description="divide each group's advantages by their standard deviation")
    eps: float = Field(1e-6, gt=0, description="added to that standard deviation")


class GibberishFilterConfig(Section):
    enforce: bool = Field(True, description="drop a flagged rollout from the update (false: flag it only)")
    token_id_threshold: int = Field(100_000, ge=0, description="flag a rollout that sampled a token id above this...")
    logprob_offset: float = Field(2.0, description="...at a logprob below -log(vocabulary size) minus this")


class RepetitionFilterConfig(Section):
    enforce: bool = Field(True, description="drop a flagged rollout from the update (false: flag it only)")
    window: int = Field(3000, ge=1, description="flag a rollout with this many consecutive sampled tokens...")
    prob_threshold: float = Field(0.99, gt=0, le=1, description="...each sampled with a probability above this")


class ZeroAdvantageFilterConfig(Section):
    enforce: bool = Field(
        True,
        description="drop a rollout whose advantage is 0 (its group's rewards all equal) "
        "from the update (false: flag it only)",
    )


class FiltersConfig(Section):
    """prime-rl's post-batch filters; ``enforce=false`` means monitor only (the rollout is still trained on)."""

    gibberish: GibberishFilterConfig = GibberishFilterConfig()
    repetition: RepetitionFilterConfig = RepetitionFilterConfig()
    zero_advantage: ZeroAdvantageFilterConfig = ZeroAdvantageFilterConfig()


class CkptConfig(Section):
    """Checkpoints, written beside training (``scirl/run/checkpointer.py``; layout: ``scirl/run/checkpoint.py``)."""

    interval: int | None = Field(None, ge=1, description="save every N steps (None: only at the end)")
    keep: int | None = Field(
        None,
        ge=1,
        description="keep the newest N checkpoints (None: all); the newest one a resume can take is never deleted",
    )
    # "full" by default: a finished run goes on with `scirl train --resume RUN --max-steps M`, as its docs say, and
    # the trainer state is written after the serving weights, beside no training, so it costs the run no step time
    final: Literal["full", "weights"] = Field(
        "full",
        description="the last step's checkpoint: full (the serving weights and the trainer state, so a "
        "finished run can be continued with --resume and a larger --max-steps) or weights (the serving weights "
        "alone: 12 bytes a parameter less on disk, and the run ends sooner)",
    )
    staging: Literal["auto", "full", "chunks"] = Field(
        "auto",
        description="how a checkpoint hands the trainer state to its writer: full (copied into host "
        "buffers allocated once; training waits only for that copy, which overlaps the next step's generation), "
        "chunks (no copy: the writer reads the live state a chunk at a time and the next update waits for the "
        "write; for a host that cannot hold the copy), auto (full where the host's memory holds it)",
    )


class DataConfig(Section):
    source: str = Field(
        "hicai-zju/SciKnowEval",
        min_length=1,
        description="hub id (a known set's: "
        "REPO[:CONFIG][@SPLIT]), hf:<dataset dir or id>, a raw_data directory or one "
        ".jsonl/.json/.parquet file",
    )
    split: Literal["train", "eval"] = Field("train", description="the split trained on (the other is held out)")
    eval_per_domain: int = Field(
        DEFAULT_EVAL_PER_DOMAIN, ge=0, description="questions per domain held out for evaluation"
    )
    split_method: Literal["content", "guide"] = Field(
        DEFAULT_SPLIT_METHOD,
        description="content: deterministic from row content, twins share a split; guide: the "
        "run guide's seeded permutation over rows in hub order",
    )
    # the holdout's own seed, so reseeding a run never moves eval questions into train; named as `scirl eval` and
    # `scirl data` name it (before: `seed`, still read from a file)
    split_seed: int = Field(
        DEFAULT_SPLIT_SEED,
        ge=0,
        le=MAX_SEED,
        description="seed of the train/held-out split (scirl eval's --split-seed), apart from the training seed",
    )
    format: str = Field(
        "auto",
        description="schema of the source's rows: auto (the set a hub id names, else the one "
        "the rows' columns fit) or one of scirl.task.formats.FORMAT_NAMES",
    )
    columns: dict[str, str] | None = Field(
        None,
        description="a column mapping instead of a format, as a table or as "
        "text: question=Q,options=A+B+C+D,answer=ans",
    )
    shuffle_options: Literal["none", "epoch", "rollout"] = Field(
        "none",
        description="permute each question's options (the gold label follows its text): none (the row's "
        "order, as the guide trained); epoch (one order per question per epoch, shared by its group); rollout "
        "(one order per completion); seeded from the run's seed, so a resume shows the same orders",
    )

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        return known_format(value)

    @field_validator("columns", mode="before")
    @classmethod
    def _column_mapping(cls, value):
        # checked here so a bad mapping fails with the config, not after the data is read
        if value is None:
            return None
        return parse_columns(value).as_dict()  # a ValueError names the problem

    @model_validator(mode="after")
    def _format_or_columns(self) -> DataConfig:
        if self.columns is not None and self.format != "auto":
            raise ValueError(f"data.format = {self.format!r} and data.columns contradict each other: give one of them")
        return self

    def load_splits(self) -> DataSplits:
        """The source's questions, split as this section says (what the run trains on, and what it holds out)."""
        return load_splits(
            self.source,
            eval_per_domain=self.eval_per_domain,
            split_method=self.split_method,
            seed=self.split_seed,
            data_format=self.format,
            columns=self.columns,
        )


class RewardConfig(Section):
    mode: Literal["strict", "lenient", "random", "format"] = Field(
        "strict",
        description="strict / lenient: 1 for the gold letter under that parser; the controls, independent "
        "of correctness: random (1 with probability 1/2, seeded per completion), format (1 when the strict parser "
        "reads any letter)",
    )


class EvalConfig(Section):
    """Greedy accuracy on a fixed subset of the held-out split while training (``scirl/run/eval_hook.py``)."""

    interval: int | None = Field(None, ge=0, description="evaluate every N steps and at the last step (None or 0: off)")
    questions: int = Field(200, ge=1, description="held-out questions evaluated, the same ones every time")

    @field_validator("interval")
    @classmethod
    def _zero_is_off(cls, interval: int | None) -> int | None:
        # one spelling of "off", while `--eval.interval 0` still turns a resumed run's eval off
        return interval or None


class WandbConfig(Section):
    enabled: bool = Field(False, description="log each step's metrics to Weights & Biases (the wandb extra)")
    project: str = Field("scirl", description="the W&B project")
    name: str | None = Field(None, description="the W&B run's name (None: W&B picks one)")


class InferenceConfig(Section):
    """The engine that samples the rollouts."""

    backend: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="hf: transformers in-process; vllm: an in-process vLLM engine; auto: vllm where installed"
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vllm: fraction of the GPU for weights + KV cache (None: 0.5 beside the "
        "trainer, 0.9 on a server's own GPUs)",
    )
    max_model_len: int | None = Field(None, ge=2, description="vllm: longest prompt + completion (None: seq_len)")
    enforce_eager: bool = Field(False, description="vllm: no CUDA graphs / compilation (faster start, slower decode)")
    sleep_level: Literal[0, 1, 2] = Field(
        2,
        description="vllm on one GPU: free its memory during the train step "
        "(0: never, 1: offload weights, 2: drop them)",
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="vllm on CPU: KV-cache size in GiB (allocated up front)")
    urls: list[str] = Field(
        default_factory=list,
        description="vLLM OpenAI servers started elsewhere (multi-node): "
        "the run generates on them instead of starting its own; they must serve `model`",
    )

    @field_validator("urls", mode="before")
    @classmethod
    def _split_urls(cls, value):
        # a command-line value arrives as one "url1,url2" string (or a JSON list)
        return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value

    @field_validator("urls")
    @classmethod
    def _server_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
                raise ValueError(f"{url!r} is not a server URL like http://HOST:PORT")
        if len(set(urls)) != len(urls):
            raise ValueError("a server is listed twice")
        return [url.rstrip("/").removesuffix("/v1") for url in urls]

    @field_validator("sleep_level", mode="before")
    @classmethod
    def _level_from_flag(cls, value):
        # a command-line value arrives as text, and a Literal of ints does not take "1"
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value


COLOCATED_GPU_SHARE = 0.5  # vLLM beside the trainer on one GPU: the trainer takes the rest while the engine sleeps
DEDICATED_GPU_SHARE = 0.9  # a server on GPUs of its own: vLLM's default


class DeploymentConfig(Section):
    """Where generation runs. ``num_infer_gpus = 0``: in the trainer's processes (colocated, synchronous).
    ``num_infer_gpus = N``: vLLM servers on N GPUs of their own (on a machine without GPUs: N server
    processes), fed by the orchestrator over HTTP, with the trainer under torchrun on ``num_train_gpus``."""

    num_train_gpus: int = Field(1, ge=1, description="trainer ranks (torchrun --nproc-per-node)")
    num_infer_gpus: int = Field(0, ge=0, description="GPUs for vLLM servers; 0: generate in the trainer (colocated)")
    host: str = Field("127.0.0.1", min_length=1, description="address the servers listen on and the trainer reaches")
    port: int = Field(0, ge=0, le=65535, description="first server's port (the next ones follow); 0: free ports")
    weight_sync: Literal["auto", "filesystem", "nccl"] = Field(
        "auto", description="how new weights reach the servers: auto = nccl on GPUs, filesystem elsewhere"
    )
    nccl_port: int = Field(0, ge=0, le=65535, description="the NCCL weight broadcast's rendezvous port; 0: a free one")
    nccl_address: str | None = Field(
        None,
        min_length=1,
        description="the address the servers reach trainer rank 0 at "
        "for the NCCL weight broadcast (None: loopback when every server is local, else "
        "this machine's address on the interface that routes to them)",
    )
    verify_interval: int = Field(
        10,
        ge=0,
        description="check that the sampler holds the trainer's weights (logprobs "
        "of a fixed sequence, and checksums where offered) on the first push and every N "
        "steps; 0: never (servers still confirm every push's version)",
    )
    startup_timeout_s: float = Field(900, gt=0, description="longest wait for a server to become healthy")
    request_timeout_s: float = Field(600, gt=0, description="longest wait for one generation request")
    weight_sync_timeout_s: float = Field(600, gt=0, description="longest wait for servers to take new weights")
    weight_bucket_mib: float = Field(
        DEFAULT_BUCKET_MIB,
        gt=0,
        description="a push gathers the weights (in the "
        "compute dtype), sends them and drops them a bucket of about this many MiB at a "
        "time: it adds about one bucket to a GPU, never the whole model (with NCCL, "
        "also the servers' receive buffers)",
    )
    gpu_memory_gb: float | None = Field(
        None,
        gt=0,
        description="each GPU's memory in GiB, for the memory plan where "
        "there is no GPU to ask (a login node, --dry-run on a laptop); a GPU's own "
        "size wins where there is one (None: the plan only prints)",
    )
    host_memory_gb: float | None = Field(
        None,
        gt=0,
        description="each node's host memory in GiB that checkpoints "
        "may stage into, where this machine cannot say (a login node, --dry-run on a "
        "laptop); None: what this machine has available",
    )

    def weight_sync_on(self, cuda: bool) -> str:
        """``weight_sync`` with ``auto`` resolved: NCCL between GPUs, the filesystem elsewhere."""
        return self.weight_sync if self.weight_sync != "auto" else ("nccl" if cuda else "filesystem")


LORA_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]  # every linear of a Qwen3 layer


class LoraSettings(Section):
    """A low-rank adapter (peft's LoRA) over a frozen base: only the adapter trains (``scirl/trainer/lora.py``).
    Single process only; the sampler gets the merged weights W + B@A * alpha/rank."""

    enabled: bool = Field(False, description="train a LoRA adapter instead of the full model (the lora extra)")
    rank: int = Field(16, ge=1, description="r: the adapter's inner dimension")
    alpha: float = Field(32, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input, in the train forward only")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="names of the linear layers that get an adapter",
    )

    @field_validator("target_modules")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        if any(not name.strip() for name in names):
            raise ValueError("target module names must be non-empty")
        return names


class TrainConfig(Section):
    """The run's config: every section. The algorithms' own sections come last, one field per registered
    algorithm (``scirl.algorithms``; ``tests/run/test_config.py`` checks they match the registry)."""

    max_steps: int = Field(30, ge=1, description="optimizer steps of the run")
    seq_len: int = Field(4096, ge=2, description="longest prompt + completion the trainer sees")
    model: str = Field("PrimeIntellect/Qwen3-8B", min_length=1, description="hub name or local HF model directory")
    batch_size: int = Field(128, ge=1, description="completions per step")
    group_size: int = Field(16, ge=2, description="completions per question (advantages need at least 2)")
    micro_batch_tokens: int = Field(
        DEFAULT_MICRO_BATCH_TOKENS,
        ge=0,
        description="tokens per forward/backward pass: "
        "whole groups packed into one row without padding, each prompt counted once (a "
        "group that does not fit is split, its prompt in each part); 0: no token bound",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="completions per forward/backward pass at most (None: as many as micro_batch_tokens holds)",
    )
    head_block_tokens: int = Field(
        0,
        ge=0,
        description="the LM head, its softmax and their backward run over "
        "blocks of this many tokens: the step's largest tensors are [block, vocabulary]; "
        "0: on a GPU the largest of 512-4096 the memory plan fits, 512 elsewhere",
    )
    max_completion_tokens: int = Field(256, ge=1, description="longest completion sampled")
    temperature: float = Field(1.0, gt=0, le=MAX_TEMPERATURE, description="sampling temperature of the rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of the rollouts (1: off)")
    seed: int = Field(
        42, ge=0, le=MAX_SEED, description="seed of the data order, the sampling and the weights' random parts"
    )
    max_async_level: int = Field(
        1,
        ge=0,
        le=8,
        description="servers only: how many steps generation may run ahead "
        "of training (1: batch n+1 is sampled while step n trains; 0: synchronous)",
    )
    output_dir: str = Field(
        "outputs/run", min_length=1, description="run directory ('' would be the current directory)"
    )
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto, cpu, cuda, cuda:N")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="compute dtype over float32 master weights; auto: float32 on CPU, bfloat16 on GPU "
        "(bfloat16 on a CPU pays off where it has AMX/AVX512-BF16 matrix units)",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each layer's activations in backward (big models)"
    )
    attention: Literal["auto", "flex", "sdpa"] = Field(
        "auto",
        description="the training forward's attention over packed rows: flex (torch's flex attention with a "
        "block mask; CUDA), sdpa (per-group gathers and torch's SDPA; any device); auto: flex on CUDA, sdpa elsewhere",
    )
    kernels: Literal["auto", "eager", "compile", "liger"] = Field(
        "auto",
        description="the decoder layers in the training forward: eager (transformers' modules), compile "
        "(each layer compiled by torch.compile, and the LM head's elementwise work), "
        "liger (Liger-Kernel's RMSNorm, RoPE, SwiGLU; CUDA, the gpu extra); "
        "auto: compile on CUDA, eager elsewhere",
    )
    # a Literal of the registry's names, built at import: pydantic checks it, a type checker cannot read it
    algorithm: Literal[algorithms.names()] = Field(  # type: ignore[valid-type]
        algorithms.DEFAULT,
        description="the policy loss and advantages: "
        + "; ".join(f"{name}: {summary}" for name, summary in algorithms.summaries().items())
        + " (each with its own section)",
    )
    share_prompts: bool = Field(
        True,
        description="train forward: each group's prompt once per micro-batch, its "
        "completions attending to it (false: every completion with its own copy of the prompt)",
    )
    optim: OptimConfig = OptimConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    filters: FiltersConfig = FiltersConfig()
    ckpt: CkptConfig = CkptConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    eval: EvalConfig = EvalConfig()
    wandb: WandbConfig = WandbConfig()
    inference: InferenceConfig = InferenceConfig()
    lora: LoraSettings = LoraSettings()
    deployment: DeploymentConfig = DeploymentConfig()
    # each algorithm's section, validated by its own model; all present whatever the algorithm, so a run can be
    # resumed under another one
    loss: LossConfig = LossConfig()  # grpo's (and SDPO's GRPO term)
    dr_grpo: DrGrpoConfig = DrGrpoConfig()
    dapo: DapoConfig = DapoConfig()
    gspo: GspoConfig = GspoConfig()
    cispo: CispoConfig = CispoConfig()
    sdpo: SdpoConfig = SdpoConfig()

    @model_validator(mode="after")
    def _check_batch(self) -> TrainConfig:
        if self.batch_size % self.group_size != 0:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by group_size ({self.group_size}): "
                "a step is batch_size/group_size questions with group_size completions each"
            )
        if not self.micro_batch_tokens and self.micro_batch_size is None:
            raise ValueError(
                "micro_batch_tokens = 0 leaves micro-batches unbounded: set micro_batch_tokens, or "
                "micro_batch_size (completions per forward)"
            )
        if self.eval.interval and self.data.split == "eval":
            raise ValueError(
                "eval.interval evaluates on the held-out split, which data.split = 'eval' trains on: "
                "train on data.split = 'train', or set eval.interval = 0"
            )
        if self.eval.interval and self.data.eval_per_domain == 0:
            raise ValueError("eval.interval needs held-out questions, and data.eval_per_domain = 0 holds out none")
        if self.max_completion_tokens >= self.seq_len:
            raise ValueError(
                f"max_completion_tokens ({self.max_completion_tokens}) must be below seq_len ({self.seq_len})"
            )
        problem = algorithms.config_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def questions_per_step(self) -> int:
        return self.batch_size // self.group_size

    def rollout_settings(self, algorithm=None) -> RolloutSettings:
        """The slice the orchestrator's half reads, with the run's algorithm (built when not given)."""
        return RolloutSettings(
            questions_per_step=self.questions_per_step,
            group_size=self.group_size,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_completion_tokens,
            seq_len=self.seq_len,
            seed=self.seed,
            shuffle_options=self.data.shuffle_options,
            reward_mode=self.reward.mode,
            filters=self.filters,
            algorithm=algorithm if algorithm is not None else algorithms.build(self),
        )
