"""Evaluation of token-reduced Mamba / Mamba-2 models.

* :mod:`.data` -- the offline validation splits (``hf-tokred data``) and the held-out BoolQ split rule;
* :mod:`.runner` -- :func:`~.runner.evaluate_model`: lm-eval tasks with position-correct scoring
  (:mod:`.lm`), held-out fidelity (:mod:`.fidelity`) and the FLOPs of what ran (:mod:`.meter`);
* :mod:`.results` -- the result schema, the paper-style row, result files (no torch, no lm-eval);
* :mod:`.report` -- markdown table + plot from result files (``hf-tokred report``);
* :mod:`.mqar` -- the multi-query associative recall benchmark; :mod:`.context` -- context benefit.

lm-eval and matplotlib are optional dependencies (``pip install 'hf-tokred[eval]'``).
"""
