"""What the tests share, imported as ``kvattn_testing.<module>`` (pytest.ini puts tests/ on the
path); test modules import from here, never from each other.

- ``util``: paged decode batches over NaN-poisoned pools (``Batch``), the backends under test and
  what each claims, tolerances, ``raises``.
- ``build``: the instantiation table, the last build's record, the compiled harness modules.
- ``extend``: extend batches (``Extend``), the dense float64 oracle, prefix-page scenarios.
- ``variants``: the attention variants' definition (``dense``), foreign pages, switch cases, fp8
  pools, and the check that every backend claiming a call gives the definition's result.
- ``exactness``: decode and extend run alike (``validated``, ``run``), agreement with the reference.
- ``scenarios``: docs/ownership.md section 6 as decode batches (incident, shared prefix, ...).
- ``mla``: MLA latent batches, their definition and scenarios.
- ``page_model``, ``traces``: the plain-Python model of page states and traces run against it.
- ``transformers``: the transformers adapter tests' batch and generation.
- ``engines``: engine environments, processes and servers for the vLLM and SGLang suites.
"""
