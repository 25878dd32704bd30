"""The SGLang adapter on CPU: entry-point registration, startup errors, hooks, request checks.

These run against the real sglang 0.5.17 package (its ServerArgs resolution pipeline runs on a
machine without a GPU when device='cuda' is passed explicitly)."""
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import server_args

sglang = pytest.importorskip("sglang")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFTER = ROOT / "testbed" / "target", ROOT / "testbed" / "drafter"


@pytest.fixture(scope="module")
def plugin_loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # discovers ddtree through the installed entry point
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm


def make_args(**overrides):
    from sglang.srt.server_args import ServerArgs

    kw = dict(model_path=str(TARGET), speculative_algorithm="DDTREE",
              speculative_draft_model_path=str(DRAFTER), attention_backend="triton",
              device="cuda")
    kw.update(overrides)
    return ServerArgs(**kw)


def test_entry_point_registers_ddtree(plugin_loaded):
    from importlib.metadata import entry_points

    assert "ddtree" in {ep.name for ep in entry_points(group="sglang.srt.plugins")}
    algo = plugin_loaded.from_string("ddtree")
    assert type(algo).__name__ == "DDTreeSpecAlgo"
    assert algo.is_dflash_family() and not algo.is_dflash() and algo.is_speculative()
    assert algo.need_topk() is False and algo.carries_draft_hidden_states() is False
    assert algo.supports_target_verify_for_draft()


def test_every_method_sglang_calls_on_an_algorithm_exists(plugin_loaded):
    """Scan SGLang's source for spec_algorithm.<name>( calls: a missing one crashes a server."""
    algo = plugin_loaded.from_string("DDTREE")
    src = Path(sglang.__file__).parent / "srt"
    pattern = re.compile(r"spec_algo(?:rithm)?\)?\.((?:is|supports|need|has|create|carries|get|"
                         r"handle|build|resolve)_\w+)\(")
    called = set()
    for f in src.rglob("*.py"):
        called |= set(pattern.findall(f.read_text(errors="ignore")))
    missing = sorted(n for n in called if not hasattr(algo, n))
    assert not missing, f"DDTreeSpecAlgo lacks {missing}"


def test_valid_arguments_resolve(plugin_loaded):
    sa = make_args()
    assert sa.speculative_num_draft_tokens == 33  # default budget 32 + root
    assert sa.speculative_dflash_block_size == 16  # from the drafter config
    assert sa.speculative_eagle_topk == 1 and sa.speculative_num_steps == 1
    assert sa.max_running_requests == 48
    sa = make_args(speculative_num_draft_tokens=65, attention_backend="flashinfer")
    assert sa.speculative_num_draft_tokens == 65


def test_unset_attention_backend_gets_a_tree_capable_one(plugin_loaded, caplog, monkeypatch):
    """SGLang fills the attention backend by itself (fa3 on Hopper, which cannot verify a
    tree); with none given, DDTREE declares triton and says so."""
    import logging

    from sglang.srt.server_args import ServerArgs

    # what SGLang picks on an H100/H200 (this CPU machine would get triton anyway)
    monkeypatch.setattr(ServerArgs, "_get_default_attn_backend",
                        lambda self, *a, **k: "fa3", raising=True)
    assert make_args(attention_backend=None, speculative_algorithm=None,
                     speculative_draft_model_path=None).attention_backend == "fa3"
    with caplog.at_level(logging.INFO):
        sa = make_args(attention_backend=None)
    assert sa.attention_backend == "triton"
    assert "no --attention-backend given; using triton" in caplog.text
    assert make_args(attention_backend="flashinfer").attention_backend == "flashinfer"


@pytest.mark.parametrize("overrides,needle", [
    (dict(speculative_num_draft_tokens=8), "accepted: B in 15..1023"),
    (dict(speculative_num_draft_tokens=5000), "--speculative-num-draft-tokens 16..1024"),
    (dict(attention_backend="fa3"), "accepted: triton, flashinfer"),
    (dict(page_size=8), "--page-size 8 is not accepted; accepted: 1, 16 (checked on a GPU "
                        "against plain SGLang); sizes up to 64 are implemented"),
    (dict(speculative_dflash_block_size=32), "accepted: 2..16"),
    (dict(speculative_draft_window_size=64), "--speculative-draft-window-size"),
    (dict(speculative_draft_model_path=None), "needs --speculative-draft-model-path"),
])
def test_startup_errors_name_the_problem(plugin_loaded, overrides, needle):
    with pytest.raises(ValueError) as err:
        make_args(**overrides)
    assert needle in str(err.value)


def test_drafter_that_is_not_dflash(plugin_loaded, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "model_type": "llama"}))
    with pytest.raises(ValueError, match="not a DFlash checkpoint"):
        make_args(speculative_draft_model_path=str(tmp_path))


def test_gated_delta_hybrids_start_only_for_their_gpu_check(tmp_path, monkeypatch):
    """A Qwen3-Next / Qwen3.5 target is implemented (sglang_plugin/hybrid.py) and refused until
    its GPU check; SGLANG_DDTREE_DEBUG=unchecked starts it, without the state-pool options whose
    verify is chain-only; other recurrent layers stay refused."""
    from ddtree_sglang.sglang_plugin.server_args import DDTreeConfigError, validate

    gdn = tmp_path / "gdn"
    gdn.mkdir()
    (gdn / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    mamba = tmp_path / "mamba"
    mamba.mkdir()
    (mamba / "config.json").write_text(json.dumps({"model_type": "nemotron_h"}))
    base = dict(device="cuda", speculative_draft_model_path=str(DRAFTER),
                speculative_num_draft_tokens=33, attention_backend="triton", page_size=1,
                model_path=str(gdn))
    with pytest.raises(DDTreeConfigError, match="awaits its GPU check.*DEBUG=unchecked"):
        validate(server_args(**base))
    monkeypatch.setenv("SGLANG_DDTREE_DEBUG", "unchecked")
    validate(server_args(**base))
    with pytest.raises(DDTreeConfigError, match="--enable-linear-replayssm-spec verifies chains"):
        validate(server_args(**base, enable_linear_replayssm_spec=True))
    with pytest.raises(DDTreeConfigError, match="does not support this hybrid target"):
        validate(server_args(**{**base, "model_path": str(mamba)}))


def test_text_only_qwen3_5_targets_are_refused_with_sglang_s_reason(tmp_path, monkeypatch):
    """A text-only Qwen3.5 checkpoint (Qwen3_5ForCausalLM) is a gated-delta hybrid SGLang 0.5.17
    serves without capturing the drafter's target features, so DFLASH and DDTREE cannot run on
    it: refused even under SGLANG_DDTREE_DEBUG=unchecked, naming the checkpoints that work.
    The reason is SGLang's: its classes still lack set_dflash_layers_to_capture."""
    import importlib

    from ddtree_sglang.sglang_plugin.server_args import (NO_FEATURE_CAPTURE, DDTreeConfigError,
                                                         validate)

    for arch, path in NO_FEATURE_CAPTURE.items():
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert not hasattr(getattr(module, arch), "set_dflash_layers_to_capture"), arch
    text = tmp_path / "qwen3_5_text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"],
                                                  "model_type": "qwen3_5_text"}))
    monkeypatch.setenv("SGLANG_DDTREE_DEBUG", "unchecked")
    with pytest.raises(DDTreeConfigError, match="serves Qwen3_5ForCausalLM without capturing.*"
                                                "accepted: the Qwen3.5 / 3.6 vision-language"):
        validate(server_args(device="cuda", speculative_draft_model_path=str(DRAFTER),
                             speculative_num_draft_tokens=33, attention_backend="triton",
                             page_size=1, model_path=str(text)))


def test_validation_rules_without_sglang_pipeline(tmp_path):
    """dp-attention, tp>1 and hybrid targets (the pipeline rejects some of these earlier)."""
    from ddtree_sglang.sglang_plugin.server_args import DDTreeConfigError, validate

    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "layer_types": ["linear_attention", "full_attention"]}))
    shallow = tmp_path / "shallow"  # the drafter taps layers 0, 1: layer 1 is this target's last
    shallow.mkdir()
    (shallow / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2}))
    base = dict(device="cuda", speculative_draft_model_path=str(DRAFTER),
                speculative_num_draft_tokens=33, attention_backend="triton", page_size=1)
    for extra, needle in [(dict(enable_dp_attention=True), "--enable-dp-attention"),
                          (dict(tp_size=2), "tensor parallelism is implemented and starts with "
                                           "SGLANG_DDTREE_DEBUG=unchecked"),
                          (dict(model_path=str(hybrid)), "does not support this hybrid target"),
                          (dict(model_path=str(shallow)), "names layers [1] of a 2-layer target; "
                                                          "accepted: 0..0"),
                          (dict(device="cpu"), "CUDA GPUs only"),
                          (dict(decode_attention_backend="fa4"), "accepted: triton, flashinfer"),
                          (dict(attention_backend="trtllm_mha"), "does not run on sm_120"),
                          (dict(speculative_draft_model_path="/nonexistent"),
                           "neither a local directory nor a Hugging Face repo id")]:
        with pytest.raises(DDTreeConfigError, match=re.escape(needle)):
            validate(server_args(**{**base, **extra}))
    validate(server_args(**base))  # and the base itself is fine




WAY_FORWARD = ("accepted", "accepts", "pip install", "starts with")


def test_every_refusal_of_the_arguments_names_the_way_forward(tmp_path, monkeypatch):
    """Each problem of a refused launch names the accepted values, the flag or setting that
    starts it, or what to install: a set of arguments wrong in every way DDTREE checks, each
    line of the refusal checked."""
    from ddtree_sglang.sglang_plugin.server_args import DDTreeConfigError, validate

    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "layer_types": ["linear_attention", "sliding_attention"]}))
    not_dflash = tmp_path / "llama"
    not_dflash.mkdir()
    (not_dflash / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    monkeypatch.setenv("SGLANG_DDTREE_GRAMMAR", "fast")
    monkeypatch.setenv("SGLANG_DDTREE_BUDGET", "8")
    wrong = dict(device="cpu", model_path=str(hybrid), speculative_num_draft_tokens=2,
                 attention_backend="fa3", decode_attention_backend="fa4", page_size=8,
                 enable_dp_attention=True, tp_size=2, pp_size=2,
                 speculative_draft_window_size=64, speculative_use_rejection_sampling=True,
                 speculative_adaptive=True, enable_lora=True)
    for drafter in (str(not_dflash), "/nonexistent", None):
        with pytest.raises(DDTreeConfigError) as err:
            validate(server_args(**wrong, speculative_draft_model_path=drafter))
        lines = str(err.value).splitlines()
        assert lines[0] == "DDTREE cannot start:" and len(lines) >= 17, lines
        silent = [line for line in lines[1:] if not any(w in line for w in WAY_FORWARD)]
        assert silent == []
    assert "got --device cpu (accepted: cuda)" in str(err.value)


def test_a_drafter_refusal_names_what_the_flag_accepts(tmp_path):
    from ddtree_sglang.sglang_plugin.server_args import DDTreeConfigError, drafter_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for path in (str(tmp_path), "/nonexistent", None):
        with pytest.raises(DDTreeConfigError, match="a DFlash drafter for this target, by hub "
                                                    "ID .e.g. z-lab/Qwen3-8B-DFlash-b16. or "
                                                    "local directory"):
            drafter_config(server_args(speculative_draft_model_path=path))


def test_benchmark_ddtree_arms_pin_their_budget_unless_asked():
    from ddtree_bench.config import Arm
    from ddtree_bench.run import arm_env

    assert arm_env(Arm(name="b32", algorithm="DDTREE", budget=32)) == {
        "SGLANG_DDTREE_BUDGETS": "off"}
    auto = Arm(name="ddtree-auto", algorithm="DDTREE", budget=64,
               env={"SGLANG_DDTREE_BUDGETS": "auto"})
    assert arm_env(auto) == {"SGLANG_DDTREE_BUDGETS": "auto"}
    assert arm_env(Arm(name="dflash", algorithm="DFLASH")) == {}


def test_target_verify_graph_gets_the_tree_mask(plugin_loaded):
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.eagle_info import EagleVerifyInput
    import torch

    algo = plugin_loaded.from_string("DDTREE")
    mask = torch.ones(10, dtype=torch.bool)
    runner = SimpleNamespace(
        model_runner=SimpleNamespace(spec_algorithm=algo, is_draft_worker=False,
                                     server_args=SimpleNamespace(speculative_dflash_block_size=16)),
        buffers=SimpleNamespace(custom_mask=mask), captured_req_width=33)
    info = DecodeCudaGraphRunner.get_spec_info(runner, 33 * 4)
    assert isinstance(info, EagleVerifyInput)
    assert info.custom_mask is mask and info.draft_token_num == 33 and info.max_tree_depth == 16


def test_ddtree_serves_logprobs_and_grammars_and_keeps_dflash_s_other_checks(plugin_loaded,
                                                                            monkeypatch):
    """The request hook lets logprobs and constrained decoding through under DDTREE (DFLASH
    refuses logprobs), still refuses what DFLASH's own check refuses (hidden states under
    overlap), and leaves DFLASH's behaviour alone."""
    from ddtree_sglang.sglang_plugin import plugin, sglang_api as sg
    from sglang.srt.speculative import dflash_utils

    req = SimpleNamespace(return_logprob=True, return_hidden_states=False,
                          origin_input_ids=[1, 2], vocab_size=10,
                          sampling_params=SimpleNamespace(json_schema='{"type": "object"}',
                                                          regex=None, ebnf=None,
                                                          structural_tag=None))
    monkeypatch.setattr(sg, "runtime_spec",
                        lambda: SimpleNamespace(speculative_algorithm="DDTREE"))
    assert dflash_utils.validate_dflash_request(req, True) is None
    assert req.return_logprob is True  # the request itself is untouched
    req.sampling_params.regex = "[0-9]+"
    assert dflash_utils.validate_dflash_request(req, False) is None
    req.return_hidden_states = True
    assert "return_hidden_states" in dflash_utils.validate_dflash_request(req, True)
    req.return_hidden_states, req.origin_input_ids = False, [1, 12]
    assert "token id 12 at position 1" in dflash_utils.validate_dflash_request(req, True)
    monkeypatch.setattr(sg, "runtime_spec",
                        lambda: SimpleNamespace(speculative_algorithm="DFLASH"))
    assert "DFLASH" in dflash_utils.validate_dflash_request(req, True)  # DFLASH's own refusal
    # The scheduler's own binding is the hooked one.
    from sglang.srt.managers import scheduler

    assert scheduler.validate_dflash_request is dflash_utils.validate_dflash_request
    assert plugin.request_error(SimpleNamespace(return_logprob=True)) is None
    wide = SimpleNamespace(return_logprob=True, vocab_size=10, origin_input_ids=[1],
                           logprob=SimpleNamespace(top_logprobs_num=11))
    assert plugin.request_error(wide) == ("top_logprobs_num 11 exceeds the vocabulary; "
                                          "accepted: 0..10")
    wide.logprob.top_logprobs_num = 10
    assert plugin.request_error(wide) is None


def test_sglang_contract(monkeypatch):
    """Every private name, parameter and instance attribute the plugin reads is in the
    installed SGLang; a missing one is named."""
    from ddtree_sglang.sglang_plugin import contract

    assert contract.contract_violations() == []
    monkeypatch.setitem(contract.ATTRIBUTES, "sglang.srt.managers.schedule_batch.Req",
                        ("kv_committed_len", "kv_commited_len"))
    monkeypatch.setitem(contract.CONTRACT, "sglang.srt.speculative.spec_utils.GrammarTree."
                                           "from_device", ("retrieve_next_token", "tree"))
    problems = contract.contract_violations()
    assert any("Req: attributes ['kv_commited_len'] not found" in p for p in problems)
    assert any("from_device: parameters ['tree']" in p for p in problems)
    with pytest.raises(RuntimeError, match=r"lacks internals the plugin relies on \(pip install "
                                           r"sglang==0.5.17\)"):
        contract.check_contract()


def test_instance_attributes_are_read_from_the_source():
    from ddtree_sglang.sglang_plugin.contract import instance_attributes

    class Base:
        def __init__(self):
            self.a = 1

    class Child(Base):
        b: int

        def grow(self):
            other = 2
            self.c = other

    assert {"a", "b", "c"} <= instance_attributes(Child)
    assert "other" not in instance_attributes(Child)


def _imports(path: Path) -> set[str]:
    """The modules a source file imports from (`from m import ...` and `import m`)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_the_step_reaches_sglang_and_the_core_through_one_seam():
    """The decode step (decode_step.py) imports the core only through its step modules; only
    sglang_api.py imports SGLang, and each name it imports from SGLang is vouched for by the
    contract (an entry of its own, or the class of one)."""
    import ast

    from ddtree_sglang.sglang_plugin import contract

    plugin_dir = ROOT / "src" / "ddtree_sglang" / "sglang_plugin"
    modules = _imports(plugin_dir / "decode_step.py")
    core = {m for m in modules if m.startswith("ddtree_sglang") and
            not m.startswith("ddtree_sglang.sglang_plugin")}
    assert core == {"ddtree_sglang.tree.stages", "ddtree_sglang.sampling.sample",
                    "ddtree_sglang.sampling.logprobs"}
    assert not {m for m in modules if m.startswith(("sglang", "sgl_kernel"))}
    api = plugin_dir / "sglang_api.py"
    vouched = set(contract.CONTRACT) | set(contract.OVERRIDES) | set(contract.ATTRIBUTES)
    vouched |= {p.rsplit(".", 1)[0] for p in contract.CONTRACT}  # a method's or value's class
    imported = [f"{n.module}.{a.name}" for n in ast.walk(ast.parse(api.read_text()))
                if isinstance(n, ast.ImportFrom) and n.module.startswith("sglang")
                for a in n.names]
    assert len(imported) > 30 and [p for p in imported if p not in vouched] == []
    # no other module of the package imports SGLang itself
    direct = [str(f.relative_to(ROOT)) for f in (ROOT / "src" / "ddtree_sglang").rglob("*.py")
              if f.name != "sglang_api.py" and re.search(
                  r"^\s*(from|import) (sglang|sgl_kernel)\b", f.read_text(), re.M)]
    assert direct == []
    assert not hasattr(contract, "__getattr__")  # nothing resolved by string at run time


# The package's layers, lowest first: a module imports only from its own layer's packages or
# from lower layers, so the engine-agnostic core never reaches the SGLang plugin and nothing
# reaches the benchmark harness (ddtree_bench, a distribution of its own).
LAYERS = [
    {"cli", "dflash", "sampling", "budget"},  # leaves: no other package of ours
    {"tree"},                                 # the B-best tree, its verify layout, the walk
    {"grammar", "kernels"},                   # structured output on the tree; Triton kernels
    {"reference"},                            # the pure PyTorch loop (the oracle, the demo)
    {"sglang_plugin"},                        # the SGLang adapter on top of the core
    {"demo"},
]


def _layer_of(module: str) -> int:
    part = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_imports_run_one_way_through_the_layers():
    """Every import of ours goes to the importer's own layer or below (LAYERS); the Triton
    kernels import only the tree's types; the package never imports the benchmark harness."""
    pkg = ROOT / "src" / "ddtree_sglang"
    upward = []
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(ROOT / "src").with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if len(parts) < 2:
            continue  # the package's own __init__
        me = ".".join(parts)
        for m in _imports(f):
            assert not m.startswith("ddtree_bench"), (me, m)
            if m.startswith("ddtree_sglang.") and _layer_of(m) > _layer_of(me):
                upward.append((me, m))
        if parts[1] == "kernels" and parts[-1] not in ("choice", "graphed", "__init__"):
            own = {m for m in _imports(f) if m.startswith("ddtree_sglang")}
            assert own <= {"ddtree_sglang.tree.draft_tree"}, (me, own)
    assert upward == []
    assert {p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()} \
        == set().union(*LAYERS) - {"cli", "demo"}


def test_the_package_root_holds_few_modules():
    """At most 8 modules at the package root: the rest live in the package of their concept."""
    root = sorted(p.name for p in (ROOT / "src" / "ddtree_sglang").glob("*.py"))
    assert len(root) <= 8, root


@pytest.mark.parametrize("change, split", [
    ({}, True),
    ({"custom_mask": None}, False),                 # no tree: nothing to split
    ({"lse_extend": object()}, False),              # the caller wants the LSE itself
    ({"skip_prefix_custom_mask": False}, False),    # the prefix is masked too
    ({"sliding_window_size": 128}, False),          # a window hides part of the prefix
    ({"sliding_window_size": -1}, True),
    ({"sinks": object()}, False),
    ({"score_mod": object()}, False),
    ({"skip_prefix": True}, False),
])
def test_split_verify_attention_only_where_it_is_exact(change, split):
    from ddtree_sglang.sglang_plugin.verify_attention import splittable

    base = dict(custom_mask=object(), lse_extend=None, skip_prefix=False, skip_extend=False,
                skip_prefix_custom_mask=True, sinks=None, score_mod=None,
                window_kv_offsets=None, sliding_window_size=None)
    assert splittable({**base, **change}) is split


@pytest.mark.parametrize("change, computes", [
    ({}, True),
    ({"custom_mask": None}, False),                 # not a tree verify
    ({"logit_cap": 30.0}, False),                   # a capped score: SGLang's kernel only
    ({"xai_temperature_len": 8}, False),
    ({"page_size": 16}, False),
    ({"k_scale": 0.5}, False),                      # an fp8 KV scale
    ({"v_scale": 2.0}, False),
    ({"aux_tensors": object()}, False),
])
def test_tree_attention_kernel_only_where_it_computes_what_sglang_would(change, computes):
    import torch

    from ddtree_sglang.sglang_plugin.verify_attention import kernel_computes

    base = dict(custom_mask=object(), lse_extend=None, skip_prefix=False, skip_extend=False,
                skip_prefix_custom_mask=True, sinks=None, score_mod=None,
                window_kv_offsets=None, sliding_window_size=-1, logit_cap=0.0,
                xai_temperature_len=-1, page_size=1, aux_tensors=None, k_scale=1.0,
                v_scale=1.0, q_extend=torch.zeros(1, dtype=torch.bfloat16),
                k_buffer=torch.zeros(1, dtype=torch.bfloat16))
    assert kernel_computes({**base, **change}) is computes
    assert not kernel_computes({**base, "k_buffer": torch.zeros(1, dtype=torch.float8_e4m3fn)})


def test_every_startup_problem_listed_together(plugin_loaded, capsys, monkeypatch):
    """A bad budget does not hide a bad knob or a bad backend; the list is printed to stderr,
    and the refusal is a ValueError to a program and a SystemExit(2) to a launch."""
    from ddtree_sglang.sglang_plugin.server_args import DDTreeConfigError

    monkeypatch.setenv("SGLANG_DDTREE_BUDGETS", "bogus")
    with pytest.raises(ValueError) as err:
        make_args(speculative_num_draft_tokens=5000, attention_backend="fa3")
    printed = capsys.readouterr().err
    for needle in ("B = --speculative-num-draft-tokens - 1 = 4999 is out of range",
                   "SGLANG_DDTREE_BUDGETS='bogus' is not accepted",
                   "--attention-backend fa3 cannot verify a draft tree"):
        assert needle in str(err.value) and needle in printed
    assert printed.lstrip().startswith("DDTREE cannot start:")
    assert isinstance(err.value, DDTreeConfigError) and isinstance(err.value, SystemExit)
    assert err.value.code == 2


def test_a_refused_launch_prints_the_list_and_exits_2_without_a_traceback(background_launches):
    """`python -m sglang.launch_server` as a user runs it (conftest.refused_launch_command,
    started with the session): SGLang lets the refusal through uncaught, so the process ends
    with status 2 and the output holds the list, not a traceback."""
    proc = background_launches.get("refused")
    if proc is None:
        pytest.skip("the launch needs SGLang")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    listed = output[output.index("DDTREE cannot start:"):].splitlines()
    assert sum(line.startswith("  - ") for line in listed) == 3, listed
    for needle in ("--page-size 8 is not accepted; accepted: 1, 16",
                   "--attention-backend fa3 cannot verify a draft tree",
                   "SGLANG_DDTREE_GRAMMAR='fast' is not accepted; accepted: tree, path, auto"):
        assert needle in output
    assert output.count("DDTREE cannot start:") == 1


def test_contract_covers_overrides_and_copied_source(monkeypatch):
    """Every method DDTREE overrides is listed under its parent (so the table stays complete),
    and an SGLang whose overridden method was renamed, or whose copied method changed, is
    refused when SGLang asks for the worker, before the worker module is imported."""
    from ddtree_sglang.sglang_plugin import (contract, draft_input, plugin, sglang_api as sg,
                                             spec_algo, worker)

    def overridden(sub, *parents):
        return {n for n, v in vars(sub).items() if callable(v) and not n.startswith("__")
                and any(hasattr(p, n) for p in parents)}

    table = {k.rsplit(".", 1)[1]: set(v) for k, v in contract.OVERRIDES.items()}
    assert overridden(spec_algo.DDTreeSpecAlgo, sg.CustomSpecAlgo, sg.SpeculativeAlgorithm) \
        == table["CustomSpecAlgo"] | table["SpeculativeAlgorithm"]
    assert overridden(worker.DDTreeWorker, sg.DFlashWorkerV2) == table["DFlashWorkerV2"]
    assert overridden(draft_input.DDTreeDraftInput, sg.DFlashDraftInputV2) \
        == table["DFlashDraftInputV2"]
    assert contract.contract_violations() == []
    assert plugin._worker_factory(None) is worker.DDTreeWorker

    # an SGLang that renamed a method DDTREE overrides, and changed the one it copies
    renamed = sg.DFlashWorkerV2._make_next_draft_input_prefill
    monkeypatch.delattr(sg.DFlashWorkerV2, "_make_next_draft_input_prefill")
    monkeypatch.setattr(sg.DFlashWorkerV2, "_make_next_draft_input_prefil", renamed,
                        raising=False)

    def prepare_for_decode(self, batch):  # different bodies than the ones copied
        return None

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        return None

    monkeypatch.setattr(sg.DFlashDraftInputV2, "prepare_for_decode", prepare_for_decode)
    monkeypatch.setattr(sg.DFlashWorkerV2, "forward_batch_generation", forward_batch_generation)
    problems = contract.contract_violations()
    assert any("methods ['_make_next_draft_input_prefill'] that DDTREE overrides are gone" in p
               for p in problems)
    # each changed parent body is named with the copy to review
    for method, copy in (("DFlashDraftInputV2.prepare_for_decode", ["draft_input.py"]),
                         ("DFlashWorkerV2.forward_batch_generation",
                          ["model_io.py DFlashModelIO.draft_block",
                           "worker.py DDTreeWorker._prefill_or_idle"])):
        assert any(method in p and "changed since DDTREE copied it" in p
                   and all(c in p for c in copy) for p in problems), method
    with pytest.raises(RuntimeError, match="lacks internals"):
        plugin._worker_factory(None)


def test_a_renamed_server_argument_is_refused_not_ignored(monkeypatch):
    """Every ServerArgs field DDTREE reads is in the contract and read without a default: an
    SGLang whose ServerArgs renamed one (here the field behind the --speculative-adaptive
    refusal) is refused by the worker factory and by the argument check, naming the field."""
    import ast
    import dataclasses

    import sglang.srt.server_args as sa

    from ddtree_sglang.sglang_plugin import contract, plugin, server_args as ddargs

    listed = contract.ATTRIBUTES["sglang.srt.server_args.ServerArgs"]
    assert set(listed) == set(ddargs.READ_FIELDS) | {"_resolved_overrides"}
    source = ast.parse((ROOT / "src/ddtree_sglang/sglang_plugin/server_args.py").read_text())
    literals = {n.args[1].value for n in ast.walk(source) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "_get" and isinstance(n.args[1], ast.Constant)}
    assert literals and literals <= set(ddargs.READ_FIELDS)

    renamed = [("speculative_adaptive_mode" if f.name == "speculative_adaptive" else f.name,
                object, dataclasses.field(default=None)) for f in dataclasses.fields(sa.ServerArgs)]
    monkeypatch.setattr(sa, "ServerArgs", dataclasses.make_dataclass(
        "ServerArgs", renamed + [("_resolved_overrides", object, dataclasses.field(default=None))]))
    assert any("ServerArgs: attributes ['speculative_adaptive'] not found" in p
               for p in contract.contract_violations())
    with pytest.raises(RuntimeError, match="speculative_adaptive"):
        plugin._worker_factory(None)
    args = server_args(speculative_adaptive=True)
    del args.speculative_adaptive
    with pytest.raises(ddargs.DDTreeConfigError, match="no field.s. speculative_adaptive, which DDTREE "
                                                "reads.*pip install sglang==0.5.17"):
        ddargs.validate(args)
    assert ddargs.backend_to_default(args) is None  # leaves the refusal to validate()


def test_ddtree_s_own_worker_attributes_are_never_forwarded_to_the_target():
    """DFlashWorkerV2 forwards unknown attributes to the target worker; DDTreeWorker's own
    (ddtree_*) raise instead, so a misspelling fails where it is made."""
    import ast
    import inspect
    import textwrap
    from types import SimpleNamespace

    from ddtree_sglang.sglang_plugin.worker import DDTreeWorker

    target = SimpleNamespace(ddtree_step="the target's", device="cuda:0")
    fake = SimpleNamespace(target_worker=target)
    with pytest.raises(AttributeError, match="'ddtree_stpe'.*not forwarded"):
        DDTreeWorker.__getattr__(fake, "ddtree_stpe")
    with pytest.raises(AttributeError, match="ddtree_step"):
        DDTreeWorker.__getattr__(fake, "ddtree_step")  # even where the target has one
    assert DDTreeWorker.__getattr__(fake, "device") == "cuda:0"  # SGLang's own still forward
    tree = ast.parse(textwrap.dedent(inspect.getsource(DDTreeWorker)))
    written = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Name) and n.value.id == "self"
               and isinstance(n.ctx, ast.Store)}
    from ddtree_sglang.sglang_plugin import contract

    parents = set(contract.ATTRIBUTES["sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2"])
    assert written - parents and all(a.startswith("ddtree_") for a in written - parents)


def test_the_package_s_imports_have_no_cycle():
    """Imports flow one way (kernels, then core, then plugin): the graph of the package's own
    module imports, lazy ones included, has no cycle."""
    import ast
    import graphlib

    pkg = ROOT / "src"
    files = {".".join(f.relative_to(pkg).with_suffix("").parts).removesuffix(".__init__"): f
             for f in (pkg / "ddtree_sglang").rglob("*.py")}
    graph = {}
    for name, f in files.items():
        edges = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddtree_sglang"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(files)
                edges |= subs or {node.module}  # `from pkg import module` names the module
        graph[name] = edges - {name}
    assert len(graph["ddtree_sglang.sglang_plugin.worker"]) > 10
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def test_every_parent_attribute_the_worker_writes_is_in_the_contract():
    """DDTreeWorker writes some of DFlashWorkerV2's own attributes for the parent's methods to
    read (its draft block among them); each such write is listed in contract.ATTRIBUTES, so a
    renamed parent attribute stops the server instead of leaving the write unread."""
    import ast
    import inspect
    import textwrap

    from ddtree_sglang.sglang_plugin import contract, sglang_api as sg, worker

    tree = ast.parse(textwrap.dedent(inspect.getsource(worker.DDTreeWorker)))
    written = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Name) and n.value.id == "self"
               and isinstance(n.ctx, ast.Store)}
    parents = contract.instance_attributes(sg.DFlashWorkerV2)
    listed = set(contract.ATTRIBUTES["sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2"])
    assert {"block_size", "speculative_num_draft_tokens"} <= written & parents
    assert written & parents <= listed


def test_conv_windows_stay_one_per_node_only_under_ddtree(monkeypatch):
    """SGLang shares a hybrid's verify conv windows between consecutive steps when its EAGLE
    topk is 1 (a chain); under DDTREE (a tree, topk 1 too) the hook keeps them dense."""
    from ddtree_sglang.sglang_plugin import plugin

    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return True

    monkeypatch.setattr(plugin, "_serving_ddtree", lambda: True)
    assert plugin._conv_window_dedup_hook(original, False, False, 1, False) is False
    monkeypatch.setattr(plugin, "_serving_ddtree", lambda: False)
    assert plugin._conv_window_dedup_hook(original, False, False, 1, is_kda=False) is True
    assert calls == [((False, False, 1), {"is_kda": False})]
