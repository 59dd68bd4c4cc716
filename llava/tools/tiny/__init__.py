"""Build random-weight llava-hf checkpoints offline that load like the real repositories.

A checkpoint is a plain ``save_pretrained`` directory: weights (safetensors), a processor with a
torchvision-free image processor (``CLIPImageProcessorPil``, ``SiglipImageProcessorPil``), a
tokenizer trained here on a built-in corpus, the real repository's chat template and a
generation config. Each profile (`PROFILES`) mirrors one llava-hf repository scaled down; the
weights are noise, so the model answers gibberish, but its files, token layout and loading path
are those of the real model.
"""

from llava.tools.tiny.build import build_checkpoint, main
from llava.tools.tiny.profiles import PROFILES, TinySpec

__all__ = ["PROFILES", "TinySpec", "build_checkpoint", "main"]
