"""The draft tree, engine-agnostic: its types (draft_tree.py), the B-best tree builder
(builder.py), the layout a tree-verify target pass consumes (verify_layout.py), the acceptance
walk (acceptance.py), the decode step's fixed-shape stages (stages.py) and the draft top-K over
a vocabulary split across tensor-parallel ranks (sharded_topk.py)."""
