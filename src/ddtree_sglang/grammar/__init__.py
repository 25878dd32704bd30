"""Structured output on a draft tree, engine-agnostic: the grammar's masks at the nodes the
acceptance walk can reach, by xgrammar's native tree traversal or along the accepted path only
(masks.py), and the tokens the grammar forces, put into the tree as a spine at the root or as
a node's only child (forcing.py).  Every method leaves the output what plain masked decoding
gives; they differ in host cost and in what the tree proposes."""
