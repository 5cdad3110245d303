"""hf_tokred: post-training token reduction for Hugging Face Mamba and Mamba-2 language models.

    import hf_tokred
    from hf_tokred import TokenReductionConfig
    model = MambaForCausalLM.from_pretrained(path, token_reduction=TokenReductionConfig(flops_reduction=0.2))

Importing the package installs the hooks that make ``token_reduction=`` work on transformers' own classes
(:func:`install`; :func:`uninstall` removes them, :func:`set_fast_kernels` switches the fast Mamba-1 kernels).
"""

from .config import METHODS, METRICS, STRATEGIES, ResolvedSchedule, TokenReductionConfig, default_anchors
from .install import install, installed, set_fast_kernels, uninstall
from .models import load_bundled, load_model
from .question import encode_document_question
from .outputs import ReductionRecord, TokenReductionCausalLMOutput, TokenReductionModelOutput, record_reduction
from .settings import apply_token_reduction, get_token_reduction
from .version import __version__

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
    "encode_document_question",
    "get_token_reduction",
    "install",
    "installed",
    "load_bundled",
    "load_model",
    "record_reduction",
    "set_fast_kernels",
    "uninstall",
]
