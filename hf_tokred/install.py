"""``install()`` / ``uninstall()``: every change hf_tokred makes to transformers, recorded and reversible.

``import hf_tokred`` calls :func:`install`.  It checks the transformers release, then replaces (recording each
``(owner, attribute, original)``):

* ``forward`` of the supported backbone and causal-LM classes, and ``generate`` of the causal-LM classes
  (:mod:`hf_tokred.forwards`);
* ``PreTrainedModel.from_pretrained``, each Auto class's ``from_pretrained`` and ``AutoConfig.from_pretrained``
  (:mod:`hf_tokred.loading`);
* a ``token_reduction`` property on the supported config classes (:func:`hf_tokred.settings.settings_property`);
* the settings-only variant's registration with ``AutoConfig`` / ``AutoModelForCausalLM``;
* ``preprocess`` / ``_forward`` of ``TextGenerationPipeline``, for its ``question=`` argument
  (:mod:`hf_tokred.question`);
* on hf_tokred's own ``TokenReductionConfig``: while uninstalled, a config handed to transformers
  (``from_pretrained(..., token_reduction=TokenReductionConfig(...))``) is refused with "hf_tokred is uninstalled"
  (:func:`_refuse_while_uninstalled`) instead of transformers' unrelated errors;
* with ``fast_kernels`` (default; :func:`set_fast_kernels` switches them on their own): the Mamba-1 scan and
  convolution functions of ``modeling_mamba`` and ``modeling_falcon_mamba`` (:mod:`hf_tokred.fastpath`; the
  families table names them), and a log filter that drops
  transformers' "install mamba_ssm / causal_conv1d" advice on machines without CUDA.

:func:`uninstall` undoes all of it in reverse order, so transformers is exactly as it was before.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, TextGenerationPipeline
from transformers.models.auto import modeling_auto
from transformers.models.auto.auto_factory import _BaseAutoModelClass
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from . import fastpath
from .compat import check_transformers_version
from .config import TokenReductionConfig
from .families import FAMILIES
from .forwards import backbone_forward, generate, lm_forward
from .loading import auto_config_from_pretrained, auto_model_from_pretrained, model_from_pretrained
from .question import pipeline_forward, pipeline_preprocess
from .settings import settings_property
from .variant import VARIANT_MODEL_TYPE, TokenReductionVariant, TokenReductionVariantConfig

__all__ = ["install", "installed", "set_fast_kernels", "uninstall"]

_MISSING = object()


class _Patches:
    """A stack of undo actions; each patch records what it replaced."""

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        original = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)

        def restore() -> None:
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

        setattr(owner, name, value)
        self.undo.append(restore)

    def wrap_classmethod(self, owner: type, name: str, wrapper: Callable) -> None:
        """Replace ``owner.name`` (a classmethod defined on ``owner`` or inherited) by ``wrapper(function)``."""
        function = getattr(owner, name).__func__
        self.setattr(owner, name, classmethod(wrapper(function)))

    def call(self, do: Callable[[], None], undo: Callable[[], None]) -> None:
        do()
        self.undo.append(undo)

    def revert(self) -> None:
        while self.undo:
            self.undo.pop()()


_CORE = _Patches()
_FAST = _Patches()


def _auto_classes() -> list[type]:
    found = [_BaseAutoModelClass]
    for obj in vars(modeling_auto).values():
        if isinstance(obj, type) and issubclass(obj, _BaseAutoModelClass) and "from_pretrained" in obj.__dict__:
            found.append(obj)
    return found


def _register_variant() -> None:
    mapping = AutoModelForCausalLM._model_mapping
    _CORE.call(lambda: AutoConfig.register(VARIANT_MODEL_TYPE, TokenReductionVariantConfig, exist_ok=True),
               lambda: CONFIG_MAPPING._extra_content.pop(VARIANT_MODEL_TYPE, None))
    _CORE.call(lambda: AutoModelForCausalLM.register(TokenReductionVariantConfig, TokenReductionVariant,
                                                     exist_ok=True),
               lambda: mapping._extra_content.pop(TokenReductionVariantConfig, None))


UNINSTALLED = ("token_reduction= was given to transformers while hf_tokred is uninstalled (hf_tokred.uninstall() was "
               "called), so stock transformers does not know it: call hf_tokred.install() first, or drop "
               "token_reduction=")


def _refuse_while_uninstalled(self: TokenReductionConfig, memo: dict) -> TokenReductionConfig:
    """``TokenReductionConfig.__deepcopy__`` while hf_tokred is uninstalled.  transformers deep-copies the keyword
    arguments of ``from_pretrained`` before it uses them, so a config handed to stock transformers stops here with the
    reason (not transformers' "unexpected keyword argument" or "not JSON serializable"); any other deep copy is the
    config itself (it is frozen)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == "copy":
        frame = frame.f_back
    if frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "transformers":
        raise TypeError(UNINSTALLED)
    return self


def _guard_settings(on: bool) -> None:
    if on:
        TokenReductionConfig.__deepcopy__ = _refuse_while_uninstalled
    elif "__deepcopy__" in TokenReductionConfig.__dict__:
        del TokenReductionConfig.__deepcopy__


def installed() -> bool:
    return bool(_CORE.undo)


def set_fast_kernels(enabled: bool) -> None:
    """Use hf_tokred's Mamba-1 CPU kernels (and its CUDA Triton scan without mamba_ssm) in every Mamba model of
    the process, or transformers' own code paths.  Independent of token reduction."""
    if not enabled:
        _FAST.revert()
        return
    if _FAST.undo:
        return
    for module, replacements in fastpath.REPLACEMENTS.items():
        for name, fn in replacements.items():
            _FAST.setattr(module, name, fn)
    logger = logging.getLogger(fastpath.HUB_KERNELS_LOGGER)
    _FAST.call(lambda: logger.addFilter(fastpath.CUDA_ADVICE_FILTER),
               lambda: logger.removeFilter(fastpath.CUDA_ADVICE_FILTER))


def install(fast_kernels: bool | None = None) -> None:
    """Install the hooks (``import hf_tokred`` does; safe to call again).

    ``fast_kernels``: also install the fast Mamba-1 kernels (default: yes, unless ``HF_TOKRED_FAST_KERNELS=0``).
    """
    if fast_kernels is None:
        fast_kernels = os.environ.get("HF_TOKRED_FAST_KERNELS", "1") != "0"
    if not _CORE.undo:
        check_transformers_version(transformers.__version__)
        for family in FAMILIES.values():
            lm, backbone = getattr(transformers, family.lm_class), getattr(transformers, family.backbone_class)
            _CORE.setattr(getattr(transformers, family.config_class), "token_reduction", settings_property())
            _CORE.setattr(backbone, "forward", backbone_forward(backbone.forward))
            _CORE.setattr(lm, "forward", lm_forward(lm.forward))
            _CORE.setattr(lm, "generate", generate(lm.generate))
        _CORE.wrap_classmethod(PreTrainedModel, "from_pretrained", model_from_pretrained)
        _CORE.wrap_classmethod(AutoConfig, "from_pretrained", auto_config_from_pretrained)
        for auto_class in _auto_classes():
            _CORE.wrap_classmethod(auto_class, "from_pretrained", auto_model_from_pretrained)
        _register_variant()
        _CORE.setattr(TextGenerationPipeline, "preprocess", pipeline_preprocess(TextGenerationPipeline.preprocess))
        _CORE.setattr(TextGenerationPipeline, "_forward", pipeline_forward(TextGenerationPipeline._forward))
        _CORE.call(lambda: _guard_settings(False), lambda: _guard_settings(True))
    set_fast_kernels(fast_kernels)


def uninstall() -> None:
    """Undo :func:`install`: transformers' classes, loaders, registries and kernels are as they were."""
    _FAST.revert()
    _CORE.revert()
