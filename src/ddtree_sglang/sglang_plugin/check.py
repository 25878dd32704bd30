"""`ddtree-check`: prove that SGLang finds the DDTREE plugin, the way a server does.

SGLang's `--help` lists only its built-in speculative algorithms, so an installed plugin does
not show there; this loads SGLang's plugins as `sglang serve` does and resolves the name.
Exit 0 with one line naming the versions, or 1 with the reason.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError, version


def plugin_status() -> tuple[bool, str]:
    """(registered, the line to print)."""
    try:
        sglang_version = version("sglang")
    except PackageNotFoundError:
        return False, "sglang is not installed in this environment (pip install sglang==0.5.17)"
    allowed = {x.strip() for x in os.environ.get("SGLANG_PLUGINS", "").split(",") if x.strip()}
    if allowed and "ddtree" not in allowed:
        return False, (f"SGLANG_PLUGINS={os.environ['SGLANG_PLUGINS']!r} leaves out this plugin "
                       "(its entry point is named 'ddtree'), so SGLang skips it; add ddtree to "
                       "SGLANG_PLUGINS or unset it")
    from ddtree_sglang.sglang_plugin import sglang_api as sg

    sg.load_plugins()
    try:
        sg.SpeculativeAlgorithm.from_string("DDTREE")
    except (ValueError, KeyError) as exc:
        return False, (f"SGLang {sglang_version} does not know DDTREE after loading its plugins "
                       f"({exc}); is ddtree-sglang installed in the same environment as sglang?")
    return True, (f"DDTREE is registered: --speculative-algorithm DDTREE works with SGLang "
                  f"{sglang_version} (ddtree-sglang {version('ddtree-sglang')})")


def main() -> int:
    ok, line = plugin_status()
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
