"""Reading a z-lab DFlash drafter: its config.json (config.py: the tapped target layers, the
mask token, the block size, with an error naming what is missing where a checkpoint is not a
DFlash drafter) and where a model's config.json lives, for a local directory or a Hugging Face
hub ID, as SGLang would resolve it (files.py)."""
