"""The batch-aware tree budget's engine-agnostic logic (controller.py): each candidate budget's
expected accepted tokens from the drafter's own prefix probabilities, calibrated per depth
against what the target accepts, its cost from measured step times, and per decode batch the
budget that commits the most tokens per millisecond (the SGLang side:
sglang_plugin/serving_budget.py)."""
