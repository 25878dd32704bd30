"""Benchmark settings (configs/*.yaml): one file per setup, validated with pydantic."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A benchmark config that cannot be used; the message names the file and the problem."""


def positive_entries(v: list[int]) -> list[int]:
    """A list validator: every entry a positive count."""
    if any(x < 1 for x in v):
        raise ValueError("every entry must be >= 1")
    return v


class _Strict(BaseModel):
    """Unknown keys are refused by name: a misspelt key must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid")


class Arm(_Strict):
    """One server configuration to compare: no speculation, DFLASH, or DDTREE(B).

    A DDTREE arm without a budget runs the package's shipped defaults (no
    --speculative-num-draft-tokens, no budget knob): what a user gets who names only the
    models."""

    name: str
    algorithm: Optional[Literal["DFLASH", "DDTREE"]] = None
    budget: Optional[int] = Field(None, ge=1, description="DDTREE tree budget B (verify width "
                                  "B + 1); unset: the shipped defaults")
    attention_backend: Optional[Literal["triton", "flashinfer"]] = Field(
        None, description="this arm's attention backend (unset: the config's)")
    env: dict[str, str] = Field({}, description="DDTREE environment knobs for this arm's server "
                                "(SGLANG_DDTREE_*, checked against their accepted values)")
    tp: int = Field(1, ge=1, description="tensor-parallel GPUs per replica: the config's gpus "
                    "are taken in groups of tp, one replica per group")
    page_size: Optional[int] = Field(None, ge=1, description="this arm's KV page size (unset: "
                                     "the config's)")
    simulate_accept: Optional[Union[float, dict[int, float]]] = Field(
        None, description="a speculative arm's forced mean committed tokens per step, for "
        "serving random weights at a published acceptance: one number (SGLang's "
        "SGLANG_SIMULATE_ACC_LEN, which DFLASH and DDTREE honour), or for DDTREE a curve "
        "{budget: tau} (SGLANG_DDTREE_SIMULATE_ACC: each step drawn at its own budget)")

    @model_validator(mode="after")
    def _budget_only_for_ddtree(self) -> "Arm":
        if self.algorithm != "DDTREE" and self.budget is not None:
            raise ValueError(f"arm {self.name}: budget applies to DDTREE only")
        if self.algorithm is None and self.simulate_accept is not None:
            raise ValueError(f"arm {self.name}: simulate_accept applies to DFLASH and DDTREE "
                             "arms only")
        if isinstance(self.simulate_accept, dict) and self.algorithm != "DDTREE":
            raise ValueError(f"arm {self.name}: a simulate_accept curve {{budget: tau}} applies "
                             "to DDTREE arms only (DFLASH takes one number)")
        if isinstance(self.simulate_accept, dict):
            from ddtree_sglang.sglang_plugin.settings import parse_curve

            try:
                parse_curve(",".join(f"{b}:{t}" for b, t in self.simulate_accept.items()))
            except ValueError as exc:  # DDTreeConfigError
                raise ValueError(f"arm {self.name}: {exc}") from None
        if isinstance(self.simulate_accept, float) and self.simulate_accept < 1:
            raise ValueError(f"arm {self.name}: simulate_accept must be >= 1 (tokens a step "
                             "commits)")
        from ddtree_sglang.sglang_plugin.settings import check_env

        for key, value in self.env.items():
            if self.algorithm != "DDTREE":
                raise ValueError(f"arm {self.name}: env applies to DDTREE arms only")
            try:
                check_env(key, value)
            except ValueError as exc:  # DDTreeConfigError
                raise ValueError(f"arm {self.name}: {exc}") from None
        return self


def replica_gpus(gpus: list[int], tp: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each replica: the GPUs in consecutive groups of `tp`."""
    return [",".join(map(str, gpus[i:i + tp])) for i in range(0, len(gpus) - tp + 1, tp)]


class Prompts(_Strict):
    """Local JSONL (testbed format: plain `prompt` or chat `messages`), or a datasets name."""

    source: str = "testbed/prompts.jsonl"
    limit: int = Field(64, ge=1)

    @field_validator("source")
    @classmethod
    def _known(cls, v: str) -> str:
        if v.endswith(".jsonl") or v in DATASETS:
            return v
        raise ValueError(f"prompts.source must be a .jsonl path or one of {sorted(DATASETS)}; got {v!r}")


DATASETS = {"gsm8k": ("openai/gsm8k", "main", "test", "question"),
            "humaneval": ("openai/openai_humaneval", None, "test", "prompt"),
            "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem"),
            "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt")}


class CostMode(_Strict):
    """Random-weight Qwen3-8B-shaped target + 8B-DFlash-b16-shaped drafter: per-step cost."""

    enabled: bool = False
    ddtree_default: bool = Field(False, description="also measure DDTREE with its shipped "
                                 "defaults (arm ddtree-default: no budget, the batch-aware choice)")
    batch_sizes: list[int] = [1, 2, 4, 8, 16, 32, 64]
    budgets: list[int] = [16, 32, 64, 128, 256]
    prompt_len: int = 512
    new_tokens: int = 128
    workdir: str = "/tmp/ddtree_cost_models"
    env: dict[str, str] = Field({}, description="DDTREE environment knobs for every DDTREE "
                                "arm of the cost mode (e.g. SGLANG_DDTREE_DEBUG: torch_tree); "
                                "an attention variant arm's own knob wins")
    single_attention_budgets: list[int] = Field([], description="budgets also measured with "
                                                "SGLang's single masked verify call (arm "
                                                "ddtree-b<B>-single; the default is the kernel)")
    dflash_attention_backends: list[Literal["triton", "flashinfer"]] = Field(
        [], description="DFLASH also measured on these attention backends (arm "
        "dflash-<backend>); the projection takes the fastest DFLASH per batch size")
    repeats: int = Field(1, ge=1, description="measure each (arm, batch) cell this many times; "
                         "the table shows the median and every run (one cell moved 8.5% between "
                         "two device calls, more than the 3% the overhead goal asks about)")

    @field_validator("env")
    @classmethod
    def _known_knobs(cls, v: dict[str, str]) -> dict[str, str]:
        from ddtree_sglang.sglang_plugin.settings import check_env

        for key, value in v.items():
            check_env(key, value)  # DDTreeConfigError is a ValueError: a config error
        return v

    @field_validator("batch_sizes", "budgets", "single_attention_budgets")
    @classmethod
    def _positive_sizes(cls, v: list[int]) -> list[int]:
        return positive_entries(v)


class Profile(_Strict):
    """Per-step GPU profiles of every arm under a steady load of `batches[i]` requests, through
    SGLang's /start_profile (bench/profile.py), in cost mode or on a serving config."""

    batches: list[int] = Field([], description="batch sizes at which each arm's decode steps "
                               "are profiled (none: no profile)")
    steps: int = Field(20, ge=1, description="decode steps recorded per profile")
    new_tokens: int = Field(384, ge=16, description="tokens per request while profiling "
                            "(long enough that the batch stays full through the profiled steps)")
    launches: bool = Field(True, description="a second profile per cell that records the host "
                           "too (CPU activity), for the CUDA runtime calls: kernel launches "
                           "outside CUDA graphs, graph replays, copies and sets per step; its "
                           "timings are not used (recording the host slows the step)")
    host_samples: bool = Field(False, description="a third recording per cell, without the "
                               "torch profiler: the scheduler's Python stack sampled every ~1 ms "
                               "(ddtree_bench/host_sampler.py), for ms per step by function and "
                               "by stage; the servers start with DDTREE_BENCH_HOST_SAMPLES=1 and "
                               "need the bench's SGLang entry point (pip install -e benchmarks, "
                               "or source scripts/checkout_env.sh)")
    host_steps: int = Field(100, ge=1, description="decode steps sampled per host recording (a "
                            "sample is ~1 ms of a step of a few ms: more steps than `steps`; "
                            "new_tokens must outlast them)")

    @field_validator("batches")
    @classmethod
    def _positive_batches(cls, v: list[int]) -> list[int]:
        return positive_entries(v)


class BenchConfig(_Strict):
    name: str
    model_path: str = "testbed/target"
    draft_model_path: str = "testbed/drafter"
    endpoint: Literal["openai", "native"] = Field(
        "openai", description="openai: /v1/completions (what users call; accept length from the "
        "server's running mean); native: SGLang's /generate (per-request accept length)")
    dtype: Literal["float16", "bfloat16"] = "float16"
    attention_backend: Literal["triton", "flashinfer"] = "triton"
    mem_fraction_static: float = Field(0.3, gt=0, lt=1)
    cuda_graph_max_bs: int = Field(64, ge=1)
    page_size: int = 1
    disable_overlap_schedule: bool = False
    gpus: list[int] = Field([0], min_length=1, description="one replica per entry")
    arms: list[Arm]
    concurrency: list[int] = [1, 2, 4, 8, 16, 32, 64]
    prompts: Prompts = Prompts()
    max_new_tokens: int = Field(128, ge=2)
    temperature: float = Field(0.0, ge=0)
    max_total_tokens: Optional[int] = Field(None, ge=1024, description="fixed KV pool size (tokens)")
    startup_group: int = Field(1, ge=1, description="arms whose servers start together (one "
                               "wait for JIT and graph capture instead of one per arm); they are "
                               "measured one at a time (in rounds with interleave); > 1 needs "
                               "max_total_tokens")
    requests_per_level: int = Field(0, ge=0, description="0 = max(2 x concurrency, 8) per replica")
    cell_seconds: Optional[float] = Field(None, gt=0, description="fixed work: every arm of a "
                                          "cell serves the same request list, sized from a "
                                          "probe so that a measurement takes about this long "
                                          "(bench/cells.py: 4-8 s)")
    min_cell_seconds: float = Field(0.0, ge=0, description="sustained load (arms measured one "
                                    "after another only): a cell runs at least this long ...")
    min_cell_requests: int = Field(0, ge=0, description="... and sends at least this many "
                                   "requests (a count extends a cell, never ends it early; "
                                   "0 and 0 = one round of requests_per_level)")
    repeats: int = Field(1, ge=1, description="measure each cell this many times; the table "
                         "shows the median and the spread")
    warmup_per_cell: bool = Field(False, description="a warm-up round before every (arm, "
                                  "concurrency) cell, not only once per arm")
    interleave: bool = Field(False, description="measure the arms of a startup group in "
                             "rounds, one measurement of each per round (bench/cells.py), so a "
                             "machine that drifts slows every arm alike; with warmup_per_cell "
                             "each measurement gets its own warm-up round")
    startup_timeout_s: float = 900
    startup_seconds: float = Field(180, ge=0, description="a startup group's expected time to "
                                   "healthy on a cold machine (kernel compilation, graph "
                                   "capture): the plan's duration estimate only")
    launcher_module: str = Field("sglang.launch_server",
                                 description="module run with -m to start a server")
    cost_mode: CostMode = CostMode()
    random_weights: bool = Field(False, description="serve the cost mode's random "
                                 "Qwen3-8B-shaped pair (written on the GPU machine, "
                                 "cost_mode.workdir) with random prompts of cost_mode.prompt_len "
                                 "tokens and no tokenizer, instead of model_path / prompts: the "
                                 "whole server at real shapes (set simulate_accept per arm)")
    profile: Profile = Profile()

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if v and min(v) < 1:
            raise ValueError("concurrency levels must be >= 1")
        return sorted(set(v))

    @model_validator(mode="after")
    def _unique_arms(self) -> "BenchConfig":
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique; got {names}")
        if not self.arms:
            raise ValueError("at least one arm is needed")
        odd = [a.name for a in self.arms if len(self.gpus) % a.tp]
        if odd:
            raise ValueError(f"arms {odd}: their tp does not divide the {len(self.gpus)} gpus "
                             "into whole replicas")
        if not self.concurrency and not self.profile.batches and not self.cost_mode.enabled:
            raise ValueError("concurrency: at least one level is needed (or profile.batches for "
                             "a profile-only run)")
        self._check_cells()
        if self.startup_group > 1 and not self.max_total_tokens:
            raise ValueError("startup_group > 1 needs max_total_tokens (a fixed KV pool per server, "
                             "so servers starting together on one GPU do not starve), e.g. 262144")
        return self


    def _check_cells(self) -> None:
        """Interleaved arms are compared on fixed work (cell_seconds or a request count), never
        on a time-bounded load where a faster arm serves more, and other, requests."""
        sustained = self.min_cell_seconds or self.min_cell_requests
        if self.interleave and sustained:
            raise ValueError("interleaved arms serve one fixed request list per cell: set "
                             "cell_seconds (a measurement's time, 4-8 s) instead of "
                             "min_cell_seconds / min_cell_requests")
        if self.cell_seconds and sustained:
            raise ValueError("cell_seconds (fixed work) and min_cell_seconds / "
                             "min_cell_requests (sustained load) exclude each other")


_SECTIONS = {"arms": Arm, "prompts": Prompts, "cost_mode": CostMode, "profile": Profile}


def describe_errors(exc: ValidationError) -> str:
    """pydantic's errors as `key.path: message (got value)`, one per problem, '; '-joined."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            section = next((_SECTIONS[x] for x in reversed(err["loc"][:-1]) if x in _SECTIONS),
                           BenchConfig)
            parts.append(f"unknown key {where!r}; accepted here: "
                         f"{', '.join(section.model_fields)}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = f" (got {err['input']!r})" if "input" in err and not isinstance(
                err["input"], dict) else ""
            parts.append(f"{where}: {msg}{got}")
    return "; ".join(parts)


def load_config(path: str | Path) -> BenchConfig:
    """Read and validate a config; every problem raises ConfigError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config {p} not found; see configs/*.yaml")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config {p}{where}: not valid YAML ({problem})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config {p}: cannot be read ({exc})") from None
    if data is None:
        raise ConfigError(f"config {p} is empty; see configs/*.yaml for the keys")
    if not isinstance(data, dict):
        raise ConfigError(f"config {p}: expected a mapping of keys (name:, arms:, ...), got a "
                          f"{type(data).__name__}")
    try:
        return BenchConfig(**data)
    except ValidationError as exc:
        raise ConfigError(f"config {p}: {describe_errors(exc)}") from None
