"""tree/hybrid.py on the CPU: the links and parents a hybrid target's recurrent layers get from a
DDTree layout, and the state index committed after the accept.

SGLang's tree builder and its conv kernel are Triton / CUDA code; their documented semantics are
ported here as small loops (eagle_links: kernels/ops/speculative/spec_tree.py:59-106;
kernel_parents: kernels/ops/mamba/causal_conv1d_triton.py:806-827).  test_hybrid_sglang.py runs
the real kernels under the Triton interpreter.  The recurrent state is a toy one, an exact
modular linear recurrence over token ids, scanned over the tree as SGLang's verify scans it."""

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ddtree_sglang.tree.acceptance import accept_tree
from ddtree_sglang.tree.builder import build_draft_tree
from ddtree_sglang.tree.draft_tree import DraftTree
from ddtree_sglang.tree.hybrid import (commit_steps, commit_steps_from_acceptance,
                                       retrieve_parent_token, scan_order_ok, track_steps)
from ddtree_sglang.tree.stages import StepCommit, accept_stage, forced_accept_stage
from ddtree_sglang.tree.verify_layout import VerifyLayout, build_verify_layout, truncate_layout

P, A = 2**31 - 1, 48271  # the toy state: h <- (A * h + token + 1) mod P


def step(h: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    return (A * h + tok + 1) % P


def eagle_links(parents: list[int]) -> tuple[list[int], list[int]]:
    """EAGLE's builder (spec_tree.py:59-99): i = N-1..1 goes to the head of its parent's
    child list, the old head becoming i's next sibling."""
    n = len(parents)
    nxt, sib = [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):
        p = parents[i]
        if nxt[p] != -1:
            sib[i] = nxt[p]
        nxt[p] = i
    return nxt, sib


def kernel_parents(nxt: torch.Tensor, sib: torch.Tensor) -> torch.Tensor:
    """The conv kernel's one pass (causal_conv1d_triton.py:806-827), per request: at token i,
    parent[next_token[i]] = i and parent[next_sibling[i]] = parent[i]; zeros to start."""
    bs, n = nxt.shape
    par = torch.zeros(bs, n, dtype=torch.long)
    for b in range(bs):
        for i in range(n):
            c = int(nxt[b, i])
            if c != -1:
                par[b, c] = i
            s = int(sib[b, i])
            if s != -1:
                par[b, s] = par[b, i]
    return par


def tree_states(tokens: torch.Tensor, parents: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """[bs, N] state after every node, as the verify computes it: token 0 from the committed
    state h0, token i > 0 from the state already written for parents[:, i]."""
    bs, n = tokens.shape
    states = torch.zeros(bs, n, dtype=torch.long)
    states[:, 0] = step(h0, tokens[:, 0])
    for i in range(1, n):
        states[:, i] = step(states.gather(1, parents[:, i:i + 1]).view(bs), tokens[:, i])
    return states


def fed(h0: int, tokens: list[int]) -> int:
    """The state after feeding `tokens` one by one (plain decoding)."""
    h = torch.tensor(h0)
    for t in tokens:
        h = step(h, torch.tensor(t))
    return int(h)


def random_tree(bs: int, budget: int, vocab: int, seed: int) -> DraftTree:
    """Random parents-first trees (any shape, not only the builder's), siblings' tokens
    distinct (as a draft tree's are)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((bs, budget), -1, dtype=torch.long)
    depths = torch.ones(bs, budget, dtype=torch.long)
    tokens = torch.zeros(bs, budget, dtype=torch.long)
    for b in range(bs):
        used: dict[int, set] = {}
        for i in range(budget):
            p = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
            parents[b, i] = p
            depths[b, i] = 1 if p < 0 else int(depths[b, p]) + 1
            taken = used.setdefault(p, set())
            free = [t for t in range(vocab) if t not in taken]
            tokens[b, i] = free[int(torch.randint(len(free), (1,), generator=g))]
            taken.add(int(tokens[b, i]))
    return DraftTree(tokens=tokens, parents=parents, depths=depths,
                     scores=torch.zeros(bs, budget))


def layout_of(tree: DraftTree, seed: int, vocab: int) -> VerifyLayout:
    g = torch.Generator().manual_seed(seed + 1)
    bs = tree.batch_size
    return build_verify_layout(tree, torch.randint(0, vocab, (bs,), generator=g),
                               torch.randint(0, 40, (bs,), generator=g))


def trees(seed: int, kind: str, bs: int, budget: int) -> VerifyLayout:
    if kind == "builder":
        g = torch.Generator().manual_seed(seed)
        tree = build_draft_tree(torch.randn(bs, 6, 9, generator=g) * 2, budget)
    else:
        tree = random_tree(bs, budget, 50, seed)
    return layout_of(tree, seed, 50)


def choices_along_children(lay: VerifyLayout, seed: int, follow: float = 0.8) -> torch.Tensor:
    """Target choices [bs, N] that pick a random child of each node most of the time."""
    g = torch.Generator().manual_seed(seed + 7)
    bs, n = lay.tree_parents.shape
    tokens = lay.draft_tokens.view(bs, n)
    choice = torch.randint(0, 60, (bs, n), generator=g)
    for b in range(bs):
        for i in range(n):
            kids = [c for c in range(n) if int(lay.tree_parents[b, c]) == i]
            if kids and float(torch.rand(1, generator=g)) < follow:
                choice[b, i] = tokens[b, kids[int(torch.randint(len(kids), (1,), generator=g))]]
    return choice


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["builder", "random"]), bs=st.integers(1, 3),
       budget=st.integers(1, 30), seed=st.integers(0, 999))
def test_links_are_eagles_and_parents_are_the_conv_kernels(kind, bs, budget, seed):
    lay = trees(seed, kind, bs, budget)
    for b in range(bs):
        nxt, sib = eagle_links(lay.tree_parents[b].tolist())
        assert lay.retrieve_next_token[b].tolist() == nxt
        assert lay.retrieve_next_sibling[b].tolist() == sib
    derived = kernel_parents(lay.retrieve_next_token, lay.retrieve_next_sibling)
    assert torch.equal(retrieve_parent_token(lay.tree_parents), derived)
    assert bool(scan_order_ok(lay.tree_parents).all())
    for width in range(1, budget + 2):  # every candidate width's layout, cut from this one
        cut = truncate_layout(lay, width)
        assert torch.equal(kernel_parents(cut.retrieve_next_token, cut.retrieve_next_sibling),
                           retrieve_parent_token(cut.tree_parents))


def test_retrieve_parent_token_values_and_dtype():
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2]])
    out = retrieve_parent_token(parents, torch.int32)
    assert out.tolist() == [[0, 0, 0, 1, 2, 2]] and out.dtype == torch.int32


def test_a_node_before_its_parent_breaks_the_kernels_pass_and_is_flagged():
    # node 3 (a child of the root) is the parent of nodes 1 and 2: the pass sees 1's next
    # sibling before 1's parent is known, and gives node 2 the root as its parent
    parents = torch.tensor([[-1, 3, 3, 0], [-1, 0, 0, 1]])
    tree = DraftTree(tokens=torch.tensor([[5, 6, 7], [5, 6, 7]]), parents=parents[:, 1:] - 1,
                     depths=torch.tensor([[2, 2, 1], [1, 1, 2]]), scores=torch.zeros(2, 3))
    lay = build_verify_layout(tree, torch.tensor([1, 1]), torch.tensor([4, 4]))
    assert torch.equal(lay.tree_parents, parents)
    derived = kernel_parents(lay.retrieve_next_token, lay.retrieve_next_sibling)
    assert derived[0].tolist() != retrieve_parent_token(parents)[0].tolist()
    assert derived[1].tolist() == retrieve_parent_token(parents)[1].tolist()
    assert scan_order_ok(parents).tolist() == [False, True]


def commit_of(lay: VerifyLayout, choice: torch.Tensor, depth: int) -> StepCommit:
    bs, n = lay.tree_parents.shape
    return StepCommit(*accept_stage(lay.draft_tokens.view(bs, n), lay.tree_parents,
                                    lay.tree_depths, choice, depth, depth + 1))


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["builder", "random"]), bs=st.integers(1, 4),
       budget=st.integers(1, 24), seed=st.integers(0, 999))
def test_committed_state_is_the_token_by_token_state(kind, bs, budget, seed):
    lay = trees(seed, kind, bs, budget)
    n = lay.num_tokens_per_req
    depth = int(lay.tree_depths.max())
    tokens = lay.draft_tokens.view(bs, n)
    h0 = torch.randint(0, P, (bs,), generator=torch.Generator().manual_seed(seed))
    states = tree_states(tokens, kernel_parents(lay.retrieve_next_token,
                                                lay.retrieve_next_sibling), h0)
    choice = choices_along_children(lay, seed)
    commit = commit_of(lay, choice, depth)
    steps = commit_steps(commit.accept_index, commit.commit_lens, n)
    acc = accept_tree(tokens, lay.tree_parents, lay.tree_depths, choice, max_depth=depth)
    assert torch.equal(steps, commit_steps_from_acceptance(acc))
    for b in range(bs):
        k = int(commit.commit_lens[b])
        # the root (the previous bonus) and the accepted draft tokens, fed one by one
        kept = [int(tokens[b, 0])] + commit.tokens[b, :k - 1].tolist()
        assert int(states[b, steps[b]]) == fed(int(h0[b]), kept)


def test_the_committed_index_is_the_nodes_not_a_chain_row():
    # root -> 1 (token 10), 2 (token 11); the target chooses 11 at the root, then 99
    tree = DraftTree(tokens=torch.tensor([[10, 11]]), parents=torch.tensor([[-1, -1]]),
                     depths=torch.tensor([[1, 1]]), scores=torch.zeros(1, 2))
    lay = build_verify_layout(tree, torch.tensor([3]), torch.tensor([5]))
    commit = commit_of(lay, torch.tensor([[11, 99, 99]]), 1)
    assert commit.commit_lens.tolist() == [2]
    steps = commit_steps(commit.accept_index, commit.commit_lens, 3)
    assert steps.tolist() == [2]  # node 2, where a chain's row commit_lens - 1 is node 1
    states = tree_states(lay.draft_tokens.view(1, 3), lay.tree_parents.clamp(min=0),
                         torch.tensor([7]))
    assert int(states[0, 2]) == fed(7, [3, 11]) != int(states[0, 1])


def first_child_chain_lengths(parents: torch.Tensor) -> torch.Tensor:
    """Nodes on each tree's first-child chain from the root, the root included."""
    out = []
    for row in parents.tolist():
        node, length = 0, 1
        while node in row:
            node, length = row.index(node), length + 1
        out.append(length)
    return torch.tensor(out)


@pytest.mark.parametrize("seed", range(6))
def test_forced_best_path_commits_its_own_state(seed):
    lay = trees(seed, "builder", 3, 20)
    bs, n = lay.tree_parents.shape
    depth = int(lay.tree_depths.max())
    # within the best path (past its end the forced walk takes nodes off any path)
    forced = torch.minimum(torch.tensor([1, 3, 6]), first_child_chain_lengths(lay.tree_parents))
    stage = forced_accept_stage(forced)
    tokens = lay.draft_tokens.view(bs, n)
    commit = StepCommit(*stage(tokens, lay.tree_parents, lay.tree_depths,
                               torch.zeros(bs, n, dtype=torch.long), depth, depth + 1))
    states = tree_states(tokens, lay.tree_parents.clamp(min=0), torch.zeros(bs, dtype=torch.long))
    steps = commit_steps(commit.accept_index, commit.commit_lens, n)
    for b in range(bs):
        path = commit.feature_rows[b, :int(commit.commit_lens[b])] - b * n
        assert int(steps[b]) == int(path[-1])
        assert int(states[b, steps[b]]) == fed(0, tokens[b, path].tolist())


@settings(max_examples=40, deadline=None)
@given(bs=st.integers(1, 4), budget=st.integers(1, 20), seed=st.integers(0, 999),
       extra=st.integers(0, 5))
def test_track_steps_give_the_prefix_state_at_the_interval(bs, budget, seed, extra):
    lay = trees(seed, "builder", bs, budget)
    n = lay.num_tokens_per_req
    depth = int(lay.tree_depths.max())
    interval = n + extra  # SGLang asserts mamba_track_interval >= the verify width
    tokens = lay.draft_tokens.view(bs, n)
    seq_lens = lay.positions.view(bs, n)[:, 0]
    states = tree_states(tokens, lay.tree_parents.clamp(min=0), torch.zeros(bs, dtype=torch.long))
    commit = commit_of(lay, choices_along_children(lay, seed, 0.95), depth)
    got = track_steps(commit.accept_index, commit.commit_lens, n, seq_lens, interval)
    for b in range(bs):
        k, pre = int(commit.commit_lens[b]), int(seq_lens[b])
        kept = [int(tokens[b, 0])] + commit.tokens[b, :k - 1].tolist()  # positions pre, pre + 1..
        crossing = [p for p in range(pre + 1, pre + k + 1) if p % interval == 0]
        if not crossing:
            assert int(got[b]) == -1
        else:  # the state after every token below the multiple
            assert int(states[b, got[b]]) == fed(0, kept[:crossing[0] - pre])


def test_no_host_synchronisation():
    """Meta tensors have no values: any read of one on the host would raise."""
    bs, n, w = 3, 9, 5
    meta = torch.device("meta")
    parents = torch.empty(bs, n, dtype=torch.long, device=meta)
    accept_index = torch.empty(bs, w, dtype=torch.int32, device=meta)
    lens = torch.empty(bs, dtype=torch.int32, device=meta)
    seq_lens = torch.empty(bs, dtype=torch.int64, device=meta)
    assert retrieve_parent_token(parents, torch.int32).shape == (bs, n)
    assert scan_order_ok(parents).shape == (bs,)
    assert commit_steps(accept_index, lens, n).shape == (bs,)
    assert track_steps(accept_index, lens, n, seq_lens, 16).shape == (bs,)


@pytest.mark.parametrize("seq_len, expected", [(5, 3), (6, 2), (7, 0), (8, -1), (2, -1)])
def test_track_step_is_the_node_below_the_multiple(seq_len, expected):
    # root -> 1 (10), 2 (11); 2 -> 3 (12); the walk accepts 11, 12: root, node 2, node 3 sit
    # at positions seq_len, seq_len + 1, seq_len + 2 and the commit ends at seq_len + 3
    tree = DraftTree(tokens=torch.tensor([[10, 11, 12]]), parents=torch.tensor([[-1, -1, 1]]),
                     depths=torch.tensor([[1, 1, 2]]), scores=torch.zeros(1, 3))
    lay = build_verify_layout(tree, torch.tensor([3]), torch.tensor([seq_len]))
    commit = commit_of(lay, torch.tensor([[11, 0, 12, 0]]), 2)
    assert commit.commit_lens.tolist() == [3]
    got = track_steps(commit.accept_index, commit.commit_lens, 4, torch.tensor([seq_len]), 8)
    assert got.tolist() == [expected]


# -- the hybrid testbed (scripts/make_hybrid_testbed.py, testbed_hybrid/) ------------------------
# the fixtures make_hybrid (the script as a module) and hybrid_testbed (built once a session,
# checked against the recorded sha256) are conftest.py's
ROOT = Path(__file__).resolve().parents[1]
HYBRID = ROOT / "testbed_hybrid"


def script_errors(argv: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """The script run as a command: its exit code and the lines it wrote to stderr."""
    path = ROOT / "scripts" / "make_hybrid_testbed.py"
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    return exit_.value.code, [line for line in capsys.readouterr().err.strip().splitlines()
                              if line.strip()]


def test_greedy_acceptance_of_the_script_is_the_reference_loops(make_hybrid):
    """The script's acceptance (walk the tree along the target's greedy continuation) against
    the reference loop's (tree-masked verify passes), on the attention-only pair where both
    run: the same tokens committed at every step but the last (the script's walk stops at the
    continuation's end, the loop's output is cut there)."""
    from ddtree_sglang.reference.testbed import DEFAULT_TESTBED, load_testbed

    tb = load_testbed(DEFAULT_TESTBED)
    spec = tb.speculator
    steps = 0
    for row in tb.prompts[:3]:
        prompt = tb.encode(row)
        cont = spec.generate(prompt, 24, mode="ar").tokens
        for budget in (None, 8):
            ref = spec.generate(prompt, 24, mode="chain" if budget is None else "ddtree",
                                budget=budget or 1)
            got = make_hybrid.greedy_tau(spec.target, spec.drafter, prompt, cont, budget)
            assert got[:-1] == ref.accept_lens[:-1], (budget, got, ref.accept_lens)
            # the prefill's token, then each step's; the last bonus may lie past the end
            assert len(cont) <= 1 + sum(got) <= len(cont) + 1 <= 1 + sum(ref.accept_lens) + 1
            steps += len(got)
    assert steps > 12


def test_the_hybrid_testbed_is_what_the_script_writes(make_hybrid, hybrid_testbed):
    """The session's build (the fixture refuses bytes unlike made_with.json's sha256) holds
    every file the record names and no other, and its links; the tracked files in
    testbed_hybrid/ (and the generated ones, where written) are those bytes; the layers sit
    where the drafter taps them."""
    recorded = json.loads((HYBRID / "made_with.json").read_text())["sha256"]
    assert make_hybrid.digests(hybrid_testbed) == recorded
    here = {name: make_hybrid.sha256(HYBRID / name) for name in recorded
            if (HYBRID / name).is_file()}
    assert here == {name: recorded[name] for name in here}
    assert set(recorded) - set(here) <= {"target/model.safetensors", "target/tokenizer.json"}
    cfg = json.loads((hybrid_testbed / "target" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"] and cfg["model_type"] == "qwen3_next"
    kinds = cfg["layer_types"]
    assert {"linear_attention", "full_attention"} == set(kinds)
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == \
        [i for i in range(len(kinds)) if (i + 1) % cfg["full_attention_interval"] == 0]
    drafter = json.loads((hybrid_testbed / "drafter" / "config.json").read_text())
    assert all(kinds[t] == "full_attention" for t in drafter["dflash_config"]["target_layer_ids"])
    assert drafter["num_target_layers"] == len(kinds)
    assert all((hybrid_testbed / name).is_file() for name in make_hybrid.LINKS)


def test_restore_refuses_files_unlike_the_record_in_one_line(hybrid_testbed, monkeypatch,
                                                             capsys, tmp_path):
    """--restore (what a GPU run calls first) writes nothing over present files and refuses,
    in one line, a file whose bytes differ from the recorded sha256."""
    out = tmp_path / "out"
    shutil.copytree(hybrid_testbed, out)  # the links as files: all present, nothing rebuilt
    record = json.loads((out / "made_with.json").read_text())
    record["sha256"]["drafter/config.json"] = "0" * 64
    (out / "made_with.json").write_text(json.dumps(record))
    code, err = script_errors(["--source", str(ROOT / "testbed"), "--out", str(out),
                               "--restore"], monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert "drafter/config.json not the bytes" in err[0] and "delete them to rebuild" in err[0]


def test_e2e_serves_a_gated_delta_target_in_bfloat16():
    """SGLang 0.5.17's conv kernel does not compile in float16 (tests/gpu/e2e_server.py says
    why): the hybrid testbed is served in bfloat16, the attention-only pair in float16."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from e2e_server import serving_dtype

    assert serving_dtype(HYBRID / "target") == "bfloat16"
    assert serving_dtype(ROOT / "testbed" / "target") == "float16"


@pytest.mark.parametrize("argv, needle", [
    (["--linear-heads", "2"], "--linear-heads and --linear-dims take two numbers each"),
    (["--source", "/nonexistent"], "--source /nonexistent: no target/config.json"),
    (["--arch", "mamba"], "argument --arch: invalid choice"),
    (["--restore"], "--restore: no "),
])
def test_the_script_refuses_bad_input_in_one_line(argv, needle, monkeypatch, capsys, tmp_path):
    code, err = script_errors(["--out", str(tmp_path / "out"), *argv], monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()
