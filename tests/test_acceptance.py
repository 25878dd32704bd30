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
    commit length, the bonus being the target's choice at its last node."""
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


def test_a_forced_acceptance_commits_the_drawn_length_on_a_bushy_tree():
    """Random weights draft bushy trees (every node a child of the root): the forced walk still
    commits the drawn length (the chain first, then the next nodes in the builder's order), at
    most the tree's nodes and the depth + 1, so a simulated step costs what the drawn length
    costs."""
    from ddtree_sglang.tree.acceptance import best_path_acceptance

    # root 0 -> {1, 2, 4}; 2 -> {3}; node 5 under 4: chain 0-1, then 2, 3, 4, 5 by index
    parents = torch.tensor([[-1, 0, 0, 2, 0, 4]] * 4)
    depths = torch.tensor([[0, 1, 1, 2, 1, 2]] * 4)
    choice = torch.arange(6).expand(4, 6) + 10
    acc = best_path_acceptance(parents, depths, choice, 4, torch.tensor([1, 2, 4, 9]))
    assert acc.accept_len.tolist() == [1, 2, 4, 5]  # 9 capped at depth 4 + 1
    assert acc.accept_path.tolist() == [[0, -1, -1, -1, -1], [0, 1, -1, -1, -1],
                                        [0, 1, 2, 3, -1], [0, 1, 2, 3, 4]]
    assert acc.bonus.tolist() == [10, 11, 13, 14]
    # a tree of 3 nodes commits at most 3 tokens, whatever was drawn
    small = best_path_acceptance(torch.tensor([[-1, 0, 0]]), torch.tensor([[0, 1, 1]]),
                                 torch.tensor([[7, 8, 9]]), 15, torch.tensor([12]))
    assert small.accept_len.tolist() == [3] and small.accept_path[0, :4].tolist() == [0, 1, 2, -1]
