"""Hugging Face model classes for ttr's decoders.

Importing this package registers ``TTRConfig`` (model_type ``"ttr"``), ``TTRModel`` and
``TTRForCausalLM`` with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import TTRCache
from .configuration import TTRConfig
from .modeling import TTRForCausalLM, TTRModel, TTRPreTrainedModel
from .presets import get_preset, list_presets

AutoConfig.register(TTRConfig.model_type, TTRConfig, exist_ok=True)
AutoModel.register(TTRConfig, TTRModel, exist_ok=True)
AutoModelForCausalLM.register(TTRConfig, TTRForCausalLM, exist_ok=True)

__all__ = [
    "TTRCache",
    "TTRConfig",
    "TTRForCausalLM",
    "TTRModel",
    "TTRPreTrainedModel",
    "get_preset",
    "list_presets",
]
