"""DDTree (block-diffusion draft trees) speculative decoding for SGLang, as a plugin:
`--speculative-algorithm DDTREE`."""

__version__ = "0.1.0"
