"""The split tree-verify attention (sglang_plugin/verify_attention.py) with SGLang's own Triton
extend kernel and LSE merge, run by the Triton interpreter on the CPU (set TRITON_INTERPRET=1
before importing triton; used by test_kernels.py): the split equals the single masked call and
the float32 reference on random trees, and calls it must not split go to the single kernel."""
import inspect

import torch

from ddtree_sglang.sglang_plugin import sglang_api as sg
from ddtree_sglang.sglang_plugin.verify_attention import (check_verify_attention,
                                                          reference_attention, split_attention,
                                                          verify_case)


def main() -> None:
    single = sg.extend_attention_fwd
    merge = sg.merge_state_triton
    signature = inspect.signature(single)
    # the worker's startup check, in float32 on the CPU
    assert check_verify_attention(single, merge, signature, "cpu", torch.float32) is None
    split = split_attention(single, merge, signature, min_requests=1)
    cases = 0
    for bs, n, prefix in [(1, 5, 3), (2, 17, 9), (3, 8, 1)]:
        args, rows = verify_case(bs, n, prefix, 4, 2, 16, "cpu", torch.float32)
        split(**args)
        got = args["o_extend"].clone()
        assert (got - reference_attention(args, rows, bs, prefix)).abs().max() < 1e-4, (bs, n)
        args["o_extend"].zero_()
        single(**args)
        assert (got - args["o_extend"]).abs().max() < 1e-4, (bs, n)
        cases += 1
    # not a tree verify the split can compute exactly -> the single call, untouched arguments
    calls = []

    def recording(*a, **k):
        calls.append(k)

    args, _ = verify_case(1, 4, 2, 2, 1, 16, "cpu", torch.float32)
    lse = torch.zeros(4, 2)
    split_attention(recording, merge, signature, min_requests=1)(**{**args, "lse_extend": lse})
    split_attention(recording, merge, signature, min_requests=1)(**{**args, "custom_mask": None})
    # a tree verify of fewer requests than the split's minimum (small batches: one call)
    split_attention(recording, merge, signature, min_requests=2)(**args)
    assert len(calls) == 3 and calls[0]["lse_extend"] is lse and "skip_extend" not in calls[0]
    assert all("skip_extend" not in c and "skip_prefix" not in c for c in calls)
    print("VERIFY ATTENTION OK", cases)


if __name__ == "__main__":
    main()
