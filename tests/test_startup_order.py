"""DDTREE's worker started as SGLang 0.5.17 starts a server, on the CPU, then serving.

SGLang builds the draft worker before the target's request pool exists (Scheduler.
init_model_worker: the target worker, the draft worker, the memory pools, the attention
backends, the CUDA graphs), so a worker that reads the pool in its constructor stops every
server, which tests that hand the worker a ready pool never see.  Here SGLang's own Scheduler
steps run, in its order: its create_worker picks DDTreeWorker through the plugin (the contract
check included), whose constructor runs DFlashWorkerV2.__init__ and SGLang's
build_draft_tp_worker; the target's and the drafter's ModelRunners are phased: what a startup
phase makes raises, naming that phase, until the phase ran.  A prefill and a decode step then go
through worker.forward_batch_generation, at a batch as large as the request pool.

Stubbed, each because it loads weights, needs a GPU or needs other processes: the ModelRunners
(weights; their phases make what SGLang makes on a GPU: SGLang's own ReqToTokenPool on the CPU,
stand-ins for the KV pool, the attention backend and the graphs), the rest of
TpModelWorker.__init__ and Scheduler.__init__ (process groups, sockets, the tokenizer), the
tensor-parallel group (torch.distributed; SGLang's get_parallel().override gives the topology),
the prefill's Triton position kernel (SGLang's torch twin runs instead), the target's forward
pass, the drafter's KV write, and the decode step's model I/O (tests/test_decode_step.FakeIO).
The kernel choice needs no stub: off CUDA it keeps the PyTorch references.
"""
import ast
import functools
import inspect
import os
import textwrap
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from test_decode_step import FakeIO, make_batch, plain_request  # noqa: E402
from test_sglang_plugin import make_args, plugin_loaded  # noqa: E402, F401

from sglang.srt.distributed.parallel_state_wrapper import ParallelState  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.tp_worker import TpModelWorker  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor import forward_batch_info  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.model_executor.runner.base_cuda_graph_runner import (  # noqa: E402
    get_batch_sizes_to_capture)
from sglang.srt.runtime_context import get_context, get_exec, get_parallel  # noqa: E402
from sglang.srt.speculative import draft_worker_common  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from ddtree_sglang.sglang_plugin import sglang_api as sg  # noqa: E402
from ddtree_sglang.sglang_plugin.model_io import DFlashModelIO, draft_logits  # noqa: E402
from ddtree_sglang.tree.builder import build_draft_tree  # noqa: E402
from ddtree_sglang.tree.stages import (StepCommit, accept_stage, tree_stage,  # noqa: E402
                                       unpack_tree_stage)

BUDGET, BLOCK = 8, 4  # --speculative-num-draft-tokens 9, --speculative-dflash-block-size 4
POOL_ROWS = 21  # requests the pool holds (as a small GPU's memory sizes it): below SGLang's
# largest decode graph (160), and not one of its configured sizes
KV_SLOTS = 8192  # tokens the KV pool holds
# Scheduler.init_model_worker's steps after init_tp_model_worker (which loads the target).
STARTUP = ("maybe_init_draft_worker", "init_memory_pools", "init_all_attention_backends",
           "init_all_cuda_graphs")
# What a ModelRunner has only from a startup phase on (None or absent before).
PHASE_OF = {**dict.fromkeys(("req_to_token_pool", "token_to_kv_pool", "token_to_kv_pool_allocator",
                             "max_total_num_tokens", "max_running_requests"), "alloc_memory_pool"),
            "attn_backend": "init_attention_backends",
            "decode_cuda_graph_runner": "init_cuda_graphs"}


class PhasedRunner:
    """SGLang's ModelRunner as its __init__ leaves it (configs, weights, capture tail hooks),
    whose pools, backend and graphs raise, naming the phase that makes them, until it ran: a
    read made too early fails here as it fails on a GPU, instead of finding a stand-in that
    SGLang would not have made yet.  `events` records the phases in the order they ran."""

    decode_num_tokens_per_req = ModelRunner.decode_num_tokens_per_req  # SGLang's own
    effective_max_total_num_tokens = ModelRunner.effective_max_total_num_tokens

    def __init__(self, server_args, model_config, model, is_draft_worker: bool,
                 events: list[str]) -> None:
        self.server_args, self.model_config, self.model = server_args, model_config, model
        self.is_draft_worker, self.is_hybrid_swa = is_draft_worker, model_config.is_hybrid_swa
        self.spec_algorithm = SpeculativeAlgorithm.from_string(server_args.speculative_algorithm)
        self.dcp_size, self.device = server_args.dcp_size, "cpu"  # server_args.device: cuda
        self.capture_tail_hooks: list = []
        self.memory_pool_config = None
        self.name, self.events = "draft" if is_draft_worker else "target", events

    def __getattr__(self, name: str):
        if name in PHASE_OF:
            raise AttributeError(f"the {self.name} ModelRunner's {name} read before "
                                 f"{PHASE_OF[name]} (SGLang makes it there)")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def alloc_memory_pool(self, memory_pool_config=None) -> None:
        """The target's request pool (SGLang's own class) and KV pool; a draft runner is
        handed the target's by its TpModelWorker, as DFLASH aliases them."""
        self.events.append(f"{self.name}.alloc_memory_pool")
        if "req_to_token_pool" not in vars(self):
            self.req_to_token_pool = ReqToTokenPool(
                size=POOL_ROWS, max_context_len=self.model_config.context_len, device="cpu",
                enable_memory_saver=False)
        if "token_to_kv_pool_allocator" not in vars(self):
            self.token_to_kv_pool_allocator = "the target's KV allocator"
        self.token_to_kv_pool = f"the {self.name}'s KV pool"
        self.max_running_requests, self.max_total_num_tokens = POOL_ROWS, KV_SLOTS
        self.memory_pool_config = memory_pool_config

    def init_attention_backends(self) -> None:
        self.events.append(f"{self.name}.init_attention_backends")
        self.attn_backend = TritonAttnBackend.__new__(TritonAttnBackend)  # --attention-backend

    def init_cuda_graphs(self, capture_decode_cuda_graph: bool = True) -> None:
        self.events.append(f"{self.name}.init_cuda_graphs")
        self.decode_cuda_graph_runner = f"the {self.name}'s decode graphs"


def tp_worker(server_args, gpu_id: int, ps, nccl_port: int, is_draft_worker: bool = False, *,
              events: list[str]) -> TpModelWorker:
    """SGLang's TpModelWorker as its __init__ leaves it, its model config SGLang's (read from
    the testbed's config.json), its ModelRunner phased, the weights random: the target's
    lm_head, the drafter's one matrix (what DDTREE reads of either)."""
    worker = object.__new__(TpModelWorker)
    worker.server_args, worker.ps, worker.gpu_id = server_args, ps, gpu_id
    worker.nccl_port, worker.is_draft_worker = nccl_port, is_draft_worker
    worker.req_to_token_pool = worker.token_to_kv_pool_allocator = None
    worker.memory_pool_config = worker.context_length = worker.tokenizer = None
    worker.model_runner_list = []
    worker._init_model_config()
    cfg = worker.model_config
    model = torch.nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=cfg.dtype) \
        if is_draft_worker else SimpleNamespace(lm_head=torch.nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=cfg.dtype))
    worker._model_runner = PhasedRunner(server_args, cfg, model, is_draft_worker, events)
    worker.device = worker.model_runner.device
    return worker


def scheduler(server_args, events: list[str]) -> Scheduler:
    """SGLang's Scheduler holding what its model-worker steps read, the target worker made as
    its init_tp_model_worker makes it."""
    sched = object.__new__(Scheduler)
    sched.server_args, sched.ps, sched.nccl_port = server_args, ParallelState.trivial(), 0
    sched.spec_algorithm = SpeculativeAlgorithm.from_string(server_args.speculative_algorithm)
    sched.tp_worker = tp_worker(server_args, 0, sched.ps, 0, events=events)
    return sched


@pytest.fixture(scope="module")
def started(plugin_loaded):
    """(SGLang's Scheduler after its startup steps, the phases in the order they ran), for a
    DDTREE server of the testbed (B = 8, draft block 4), no DDTREE environment settings."""
    events: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(draft_worker_common, "TpModelWorker",  # the drafter's, in build_draft_tp_worker
                   functools.partial(tp_worker, events=events))
        mp.setattr(sg, "get_tp_group", lambda: SimpleNamespace(world_size=1))  # tp = 1
        mp.setattr(sg, "compute_position", lambda backend, *args:  # SGLang's, without Triton
                   forward_batch_info.compute_position("torch_native", *args))
        for name in [n for n in os.environ if n.startswith("SGLANG_DDTREE_")]:
            mp.delenv(name)
        server_args = make_args(speculative_num_draft_tokens=BUDGET + 1,
                                speculative_dflash_block_size=BLOCK)
        with get_context().preserve_config(), get_parallel().override(attn_tp_size=1,
                                                                      attn_cp_size=1):
            get_context().set_server_args(server_args)
            sched = scheduler(server_args, events)
            for step in STARTUP:
                getattr(sched, step)()
            yield sched, events


def test_the_steps_driven_here_are_sglang_s_in_its_order():
    """Scheduler.init_model_worker runs the target worker's init, then exactly STARTUP."""
    fn = ast.parse(textwrap.dedent(inspect.getsource(Scheduler.init_model_worker))).body[0]
    calls = [s.value.func.attr for s in fn.body if isinstance(s, ast.Expr)
             and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Attribute)]
    assert calls[:len(STARTUP) + 1] == ["init_tp_model_worker", *STARTUP]


def test_a_phased_runner_refuses_what_its_phase_has_not_made(plugin_loaded):
    """Each pool, backend or graph read before its phase fails, naming it; after, it is there."""
    runner = PhasedRunner(make_args(), SimpleNamespace(is_hybrid_swa=False, context_len=64),
                          None, False, [])
    for name, phase in PHASE_OF.items():
        with pytest.raises(AttributeError, match=f"{name} read before {phase}"):
            getattr(runner, name)
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()
    assert all(getattr(runner, name) is not None for name in PHASE_OF)
    assert runner.req_to_token_pool.req_to_token.shape == (POOL_ROWS + 1, 64)  # + padding row


def test_ddtree_starts_in_sglang_s_order_and_sizes_its_step_by_the_pool(started):
    """The worker reads nothing before SGLang made it (the phased runners raise otherwise);
    its tree and accept stages and its decode step are sized by the request pool's rows."""
    from ddtree_sglang.sglang_plugin.worker import DDTreeWorker  # after the contract check

    sched, events = started
    worker, target = sched.draft_worker, sched.tp_worker.model_runner
    assert type(worker) is DDTreeWorker
    assert events == [f"{w}.{phase}" for phase in ("alloc_memory_pool", "init_attention_backends",
                                                   "init_cuda_graphs") for w in ("target", "draft")]
    pool = target.req_to_token_pool
    assert worker.draft_model_runner.req_to_token_pool is pool  # DFLASH shares it
    rows = pool.req_to_token.shape[0]
    stages, step = worker.ddtree_stages, worker.ddtree_step
    assert stages.tree.out.max_bs == rows  # a batch as large as the pool fits
    assert stages.accept.choice.shape[0] == rows * max(stages.widths)
    assert type(step.io) is DFlashModelIO and step.io.req_to_token is pool.req_to_token
    assert step.penalties.rows == rows


def captured_sizes(worker, monkeypatch) -> list[int]:
    """The batch sizes worker._capture_tree_graphs captures the tree and accept stages at on a
    GPU: CUDA reported present (the tree stage then runs eagerly on the CPU tensors at each
    size), the accept stage's capture recorded instead of made."""
    sizes: list[int] = []
    with monkeypatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "synchronize", lambda: None)
        mp.setattr(worker.ddtree_stages.accept, "capture", sizes.extend)
        worker._capture_tree_graphs()
    return sizes


def test_the_stages_are_captured_at_sglang_s_decode_sizes_clamped_to_the_pool(started,
                                                                              monkeypatch):
    """SGLang captures the target's decode graphs at its configured sizes up to the request
    pool's size, that size added; DDTREE's stages are captured at the same, largest first."""
    sched, _ = started
    target = sched.tp_worker.model_runner
    configured = get_exec().graph.cuda_graph_config.decode.bs
    sglang_sizes, _ = get_batch_sizes_to_capture(target, target.decode_num_tokens_per_req())
    assert max(configured) > POOL_ROWS and POOL_ROWS not in configured
    assert sglang_sizes == [b for b in configured if b <= POOL_ROWS] + [POOL_ROWS]
    assert sg.decode_capture_sizes(target) == sglang_sizes
    assert captured_sizes(sched.draft_worker, monkeypatch) == sglang_sizes[::-1]


def prefill(sched, lens: list[int], monkeypatch) -> tuple[sg.GenerationBatchResult, list[dict]]:
    """A prefill of one request per entry of `lens` through the worker: the target's pass (its
    result made here: each prompt token's hidden state, a first token each) and DFLASH's
    draft-KV write (recorded) stand in for the models; returns (result, the write's kwargs)."""
    worker, target = sched.draft_worker, sched.tp_worker.model_runner
    result = sg.GenerationBatchResult(
        logits_output=LogitsProcessorOutput(
            next_token_logits=torch.zeros(len(lens), worker.ddtree_vocab_size),
            hidden_states=torch.randn(sum(lens), target.model_config.hidden_size)),
        next_token_ids=torch.randint(worker.ddtree_vocab_size, (len(lens),)))
    monkeypatch.setattr(sched.tp_worker, "forward_batch_generation",
                        lambda batch, capture_hidden_mode: result)
    written: list[dict] = []
    monkeypatch.setattr(worker, "_append_target_hidden_to_draft_kv_by_loc",
                        lambda **kw: written.append(kw))
    batch = SimpleNamespace(forward_mode=sg.ForwardMode.EXTEND, is_extend_in_batch=True,
                            prefix_lens=[0] * len(lens), extend_lens=lens,
                            reqs=[plain_request() for _ in lens], seq_lens=torch.tensor(lens),
                            out_cache_loc=torch.arange(sum(lens)))
    assert worker.forward_batch_generation(batch) is result
    return result, written


def stand_in_models(worker, bs: int, monkeypatch) -> FakeIO:
    """The decode step's model I/O calls that run the models (draft block, target verify, KV
    move, draft-KV write) answered by test_decode_step's FakeIO, with random drafter states and
    verify logits of the started models' sizes; the rest of the worker's DFlashModelIO stays."""
    io, n = worker.ddtree_step.io, worker.ddtree_settings.verify_width
    fake = FakeIO()
    fake.target_runner = io.target_runner
    fake.hidden = torch.randn(bs, BLOCK, worker.draft_model_runner.model_config.hidden_size)
    fake.verify_out = SimpleNamespace(
        next_token_logits=torch.randn(bs * n, worker.ddtree_vocab_size), customized_info=None,
        hidden_states=torch.randn(bs * n, io.target_runner.model_config.hidden_size))
    for name in ("draft_block", "target_verify", "move_accepted_kv", "append_committed_features"):
        monkeypatch.setattr(io, name, getattr(fake, name))
    return fake


def reference_commit(worker, hidden: torch.Tensor, roots: torch.Tensor, seq_lens: torch.Tensor,
                     logits: torch.Tensor) -> StepCommit:
    """What the core commits (tree/stages.py): the B-best tree of the drafter's states through
    the target's lm_head, walked along the target's argmax at every node."""
    s, candidates = worker.ddtree_settings, worker.ddtree_stages.tree.candidates
    bs, n = len(seq_lens), s.verify_width
    draft = draft_logits(worker.target_worker.model_runner.model.lm_head, hidden[:, 1:],
                         worker.ddtree_vocab_size)
    lay = unpack_tree_stage(tree_stage(draft, roots, seq_lens, s.budget, s.depth,
                                       build_draft_tree, candidates),
                            s.budget, candidates).layouts[n]
    return StepCommit(*accept_stage(lay.draft_tokens.view(bs, n), lay.tree_parents,
                                    lay.tree_depths, logits.argmax(-1).view(bs, n), s.depth,
                                    s.block_size))


def test_a_started_worker_prefills_and_decodes_a_batch_as_large_as_the_pool(started,
                                                                            monkeypatch):
    """POOL_ROWS requests: the prefill hands the target's features to the draft KV at each
    prompt position and relays the first tokens; the decode step built at startup commits what
    the core commits, verifying through the backend and graphs SGLang made for the target."""
    sched, _ = started
    worker, target = sched.draft_worker, sched.tp_worker.model_runner
    torch.manual_seed(0)
    lens = [5 + i for i in range(POOL_ROWS)]
    prefilled, written = prefill(sched, lens, monkeypatch)
    assert written[0]["positions"].tolist() == [p for n in lens for p in range(n)]
    relay = prefilled.next_draft_input
    assert torch.equal(relay.bonus_tokens, prefilled.next_token_ids)

    fake = stand_in_models(worker, POOL_ROWS, monkeypatch)
    logits = fake.verify_out.next_token_logits.clone()
    decode = make_batch(POOL_ROWS, lens, forward_mode=sg.ForwardMode.DECODE,
                        is_extend_in_batch=False, spec_info=relay,
                        req_pool_indices=torch.arange(1, POOL_ROWS + 1))  # row 0: padding
    out = worker.forward_batch_generation(decode)
    ref = reference_commit(worker, fake.hidden, relay.bonus_tokens, torch.tensor(lens), logits)
    assert torch.equal(out.next_token_ids, ref.tokens.reshape(-1))
    assert torch.equal(out.accept_lens, ref.commit_lens)
    assert torch.equal(out.new_seq_lens, torch.tensor(lens) + ref.commit_lens)
    assert torch.equal(out.next_draft_input.bonus_tokens, ref.bonus)
    assert [c[0] for c in fake.calls] == ["draft", "verify", "move", "features"]
    assert fake.calls[1][1] == (target.attn_backend, "the target's decode graphs")
