"""`ddtree-check`: prove that SGLang finds the DDTREE plugin, the way a server does, and that
the SGLANG_DDTREE_* settings of this environment would be accepted.

SGLang's `--help` lists only its built-in speculative algorithms, so an installed plugin does
not show there; this loads SGLang's plugins as `sglang serve` does and resolves the name.  A
misspelt or invalid setting stops a server at startup (settings.environment_problems); this
reports it before a GPU is needed.  Exit 0 with one line naming the versions, or 1 with every
problem on a line of its own.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

from ddtree_sglang.sglang_plugin.settings import environment_problems


@contextmanager
def quiet_sglang_import() -> Iterator[None]:
    """Hold back the warnings and log records below ERROR that importing SGLang emits (on a
    machine without a GPU: AWQ, GGUF, Triton, CUDA_HOME), so that the check's answer is its
    first line; exceptions and errors still show."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


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
    with quiet_sglang_import():
        from ddtree_sglang.sglang_plugin import sglang_api as sg

        sg.load_plugins()
    try:
        sg.SpeculativeAlgorithm.from_string("DDTREE")
    except (ValueError, KeyError) as exc:
        return False, (f"SGLang {sglang_version} does not know DDTREE after loading its plugins "
                       f"({exc}); install ddtree-sglang into the environment sglang runs from "
                       f"(its python: {sys.executable})")
    return True, (f"DDTREE is registered: --speculative-algorithm DDTREE works with SGLang "
                  f"{sglang_version} (ddtree-sglang {version('ddtree-sglang')})")


def main() -> int:
    """Print the plugin's status and every problem with this environment's SGLANG_DDTREE_*
    settings (the budget list judged against the largest budget, 1023: the server judges it
    against its own B); 0 only where the plugin is registered and no setting is refused."""
    ok, line = plugin_status()
    problems = environment_problems()
    print(line, file=sys.stdout if ok and not problems else sys.stderr)
    if problems:
        print("A DDTREE server started from this environment would refuse its settings:",
              file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
    return 0 if ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
