"""The pure-PyTorch reference: a generation loop for autoregressive, DFlash-chain and DDTree
decoding (loop.py) over a DFlash drafter (drafter.py), with constrained requests
(constrained.py) and the paper's best-first heap (heap.py).  It is the oracle the SGLang
worker and the batched tree builders are checked against, and the CPU demo's engine (the
shipped testbed: testbed.py; random pairs that need no weights: tiny.py)."""
