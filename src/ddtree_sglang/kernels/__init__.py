"""The decode step's Triton kernels, each with a PyTorch reference it is tested against and
checked against on the GPU at startup: the fused tree builder, the draft top-k and logsumexp,
the acceptance walk, the KV move and the tree-verify attention.  choice.py decides once which
of them a step runs (a kernel that fails its check is replaced by its reference), graphed.py
replays fixed-shape stages from CUDA graphs, aot.py compiles for GPUs that are not here."""
