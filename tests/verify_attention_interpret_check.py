"""The tree-verify attention wrapper (sglang_plugin/verify_attention.py) around SGLang's own
Triton extend kernel, run by the Triton interpreter on the CPU (set TRITON_INTERPRET=1 before
importing triton; used by test_kernels.py): a tree verify goes to DDTREE's kernel and equals
SGLang's masked call and the float32 reference; every call the kernel must not compute goes to
SGLang's kernel with its arguments untouched."""
import inspect

import torch

from ddtree_sglang.sglang_plugin import sglang_api as sg
from ddtree_sglang.sglang_plugin.verify_attention import (kernel_attention, reference_attention,
                                                          verify_case)


def main() -> None:
    single = sg.extend_attention_fwd
    merge = sg.merge_state_triton
    signature = inspect.signature(single)
    attend = kernel_attention(single, merge, signature)
    cases = 0
    for bs, n, prefix in [(1, 5, 3), (2, 9, 7)]:
        args, rows = verify_case(bs, n, prefix, 4, 2, 16, "cpu", torch.float32)
        attend(**args)
        got = args["o_extend"].clone()
        assert (got - reference_attention(args, rows, bs, prefix)).abs().max() < 1e-4, (bs, n)
        args["o_extend"].zero_()
        single(**args)
        assert (got - args["o_extend"]).abs().max() < 1e-4, (bs, n)
        cases += 1
    # not a tree verify the kernel computes as SGLang's would -> SGLang's call, untouched
    calls = []

    def recording(*a, **k):
        calls.append(k)

    args, _ = verify_case(1, 4, 2, 2, 1, 16, "cpu", torch.float32)
    lse = torch.zeros(4, 2)
    routed = kernel_attention(recording, merge, signature)
    routed(**{**args, "lse_extend": lse})       # the caller wants the LSE
    routed(**{**args, "custom_mask": None})     # no tree: a causal extend
    routed(**{**args, "logit_cap": 30.0})       # a capped score: SGLang's kernel only
    kernel_attention(recording, merge, signature, min_requests=2)(**args)  # too few requests
    assert len(calls) == 4 and calls[0]["lse_extend"] is lse and calls[1]["custom_mask"] is None
    assert calls[2]["logit_cap"] == 30.0
    print("VERIFY ATTENTION OK", cases)


if __name__ == "__main__":
    main()
