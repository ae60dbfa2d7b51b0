"""transformers models in one call: ``revlib_xla.hf.memory_efficient(model, strategy="plan")`` (the optional
``[hf]`` extra: ``pip install 'revlib_xla[hf]'``).

* :func:`memory_efficient`: plan (exact planned checkpointing), reversible (two-stream layers from each layer's own
  attention and MLP) or momentum (MomentumNet) over a model's layer stack, with ``fewbit=`` composed; the model
  keeps its state-dict keys, ``generate()`` with the KV cache, ``output_hidden_states`` and ``save_pretrained``.
* :func:`from_pretrained`: load what a converted model's ``save_pretrained`` wrote, converted again where the
  conversion changes the function (its saved config is marked so that plain transformers refuses or warns);
  :func:`unconvert`: the plain layer list back where that keeps the function.
* :func:`chunked_loss`: a causal LM's loss in chunks of tokens, with no float32 tensor of the vocabulary's size kept
  for the backward (:func:`memory_efficient` applies it; alone, it serves transformers' own checkpointing too).
* :func:`model_from_config`: a transformers model with random weights from a built-in config name
  (``"llama-tiny"``, ``"gpt2-124m"``, ``"llama-3.2-1b"``, ...) or a local ``config.json``; nothing is downloaded.
"""

from .configs import CONFIGS, config_names, model_from_config
from .convert import DEFAULT_BETA, STRATEGIES, Conversion, ConvertedLayers, memory_efficient
from .head import ChunkedLoss, chunked_loss
from .layers import HFConversionError
from .loading import from_pretrained, unconvert

__all__ = [
    "memory_efficient",
    "from_pretrained",
    "unconvert",
    "chunked_loss",
    "ChunkedLoss",
    "model_from_config",
    "config_names",
    "CONFIGS",
    "STRATEGIES",
    "DEFAULT_BETA",
    "Conversion",
    "ConvertedLayers",
    "HFConversionError",
]
