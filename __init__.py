"""ttr: pretraining toolkit for language models whose mixers are test-time regressors.

Importing ``ttr`` registers its model classes with transformers' ``AutoConfig``,
``AutoModel`` and ``AutoModelForCausalLM``.
"""

__version__ = "0.1.0"

from . import models  # noqa: E402,F401  (registers the Auto classes)
