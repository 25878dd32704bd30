import torch

from ddtree_sglang.tree.acceptance import accept_tree, committed_tokens


def _hand_tree():
    # root 0 -> {1: tok 10, 2: tok 11}; 1 -> {3: tok 12, 4: tok 13}; 3 -> {5: tok 14}
    tokens = torch.tensor([[99, 10, 11, 12, 13, 14]])
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]])
    depths = torch.tensor([[0, 1, 1, 2, 2, 3]])
    return tokens, parents, depths


def test_walk_follows_target_choices():
    tokens, parents, depths = _hand_tree()
    # target: at root picks 10 (node 1), at 1 picks 12 (node 3), at 3 picks 77 (no child).
    choice = torch.tensor([[10, 12, 0, 77, 0, 0]])
    acc = accept_tree(tokens, parents, depths, choice, max_depth=3)
    assert acc.accept_len.tolist() == [3]
    assert acc.accept_path.tolist() == [[0, 1, 3, -1]]
    assert acc.bonus.tolist() == [77]
    assert committed_tokens(tokens, acc).tolist() == [[10, 12, 77, -1]]


def test_sibling_branch_and_full_path_and_batch():
    tokens, parents, depths = _hand_tree()
    tokens = tokens.repeat(3, 1)
    parents, depths = parents.repeat(3, 1), depths.repeat(3, 1)
    choice = torch.tensor([
        [11, 0, 5, 0, 0, 0],      # second child of the root, then 5 (not a child of 2)
        [10, 12, 0, 14, 0, 8],    # the whole deepest path, bonus at the leaf
        [42, 10, 11, 12, 13, 14],  # nothing accepted; the root's choice is the bonus
    ])
    acc = accept_tree(tokens, parents, depths, choice, max_depth=3)
    assert acc.accept_len.tolist() == [2, 4, 1]
    assert acc.bonus.tolist() == [5, 8, 42]
    assert acc.accept_path[1].tolist() == [0, 1, 3, 5]
    assert committed_tokens(tokens, acc).tolist() == [
        [11, 5, -1, -1], [10, 12, 14, 8], [42, -1, -1, -1]]


def test_token_zero_is_a_real_token():
    tokens = torch.tensor([[5, 0, 0]])
    parents = torch.tensor([[-1, 0, 1]])
    depths = torch.tensor([[0, 1, 2]])
    acc = accept_tree(tokens, parents, depths, torch.tensor([[0, 0, 3]]), max_depth=2)
    assert acc.accept_len.tolist() == [3] and acc.bonus.tolist() == [3]


def test_a_forced_acceptance_takes_the_tree_s_best_path():
    """SGLANG_SIMULATE_ACC_LEN's walk: the first-child chain from the root, cut at the forced
    commit length or at the path's end, the bonus being the target's choice at its last node."""
    from ddtree_sglang.tree.acceptance import best_path_acceptance

    # root 0 -> {1, 2}; 1 -> {3, 4}; 3 -> {5}; the choices would accept nothing
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]] * 3)
    depths = torch.tensor([[0, 1, 1, 2, 2, 3]] * 3)
    choice = torch.tensor([[7, 8, 9, 6, 5, 4]] * 3)
    acc = best_path_acceptance(parents, depths, choice, 3, torch.tensor([1, 3, 9]))
    assert acc.accept_len.tolist() == [1, 3, 4]
    assert acc.accept_path.tolist() == [[0, -1, -1, -1], [0, 1, 3, -1], [0, 1, 3, 5]]
    assert acc.bonus.tolist() == [7, 6, 4]
    assert acc.accepted[1].tolist() == [True, True, False, True, False, False]
