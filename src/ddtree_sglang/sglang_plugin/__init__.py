"""The SGLang 0.5.17 adapter: the entry point that registers `--speculative-algorithm DDTREE`
(plugin.py), argument validation and settings (server_args.py, settings.py, check.py), the
worker SGLang instantiates (worker.py) and its decode step (decode_step.py over model_io.py,
graphed_stages.py, grammar_stage.py, serving_budget.py), and the boundary with SGLang: every
internal relied on, checked at startup (contract.py), every SGLang name (sglang_api.py) and
every write into SGLang's objects (patches.py)."""
