"""The ``llmsession`` command, outside the runtime: chat (``cli``), set-up (``installer``,
``setup_llama``, ``setup_models``, ``paths``), ``doctor`` and the benchmarks (``bench``)."""
