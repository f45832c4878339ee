"""Benchmarks of kvattn: what the ownership check costs against the unchecked kernel, how close the
kernels come to the copy bandwidth, and how they compare with the kernels users run today.

``python -m benchmarks.decode --help`` for the command line; ``benchmarks/results/README.md`` says
how every figure is obtained.
"""
