"""The target's choice at every tree node as plain decoding would make it there: argmax or a
draw under SGLang's filters (sample.py), exact per-node penalties over each node's own path
(penalties.py), and the committed tokens' log-probabilities from the verify logits
(logprobs.py)."""
