"""hf_tokred: post-training token reduction for Hugging Face Mamba and Mamba-2 language models.

    import hf_tokred
    from hf_tokred import TokenReductionConfig
    model = MambaForCausalLM.from_pretrained(path, token_reduction=TokenReductionConfig(flops_reduction=0.2))

Importing the package installs the hooks that make ``token_reduction=`` work on transformers' own classes.
"""

from .models import load_bundled, load_model
from .config import METHODS, METRICS, STRATEGIES, ResolvedSchedule, TokenReductionConfig, default_anchors
from .patch import (
    ReductionRecord,
    TokenReductionCausalLMOutput,
    TokenReductionModelOutput,
    apply_token_reduction,
    get_token_reduction,
    install,
    record_reduction,
)

__version__ = "0.1.0"

install()

__all__ = [
    "METHODS",
    "METRICS",
    "STRATEGIES",
    "ReductionRecord",
    "ResolvedSchedule",
    "TokenReductionCausalLMOutput",
    "TokenReductionConfig",
    "TokenReductionModelOutput",
    "__version__",
    "apply_token_reduction",
    "default_anchors",
    "get_token_reduction",
    "install",
    "load_bundled",
    "load_model",
    "record_reduction",
]
