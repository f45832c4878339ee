from setuptools import find_packages, setup

setup(
    name="kvattn",
    version="0.1.0",
    description="Ownership-checked paged attention kernels (Triton, CUDA) for LLM serving",
    packages=find_packages(include=["kvattn", "kvattn.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "triton>=3.4"],
)
