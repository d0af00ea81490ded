"""Side-by-side benchmark of rtkernels vs its peers (BENCHMARK.md); run ``python -m bench.run``.

A script directory of the source checkout, not part of the installed package; ``rtkernels bench``
finds it beside the ``rtkernels`` package directory.
"""
