from setuptools import find_packages, setup

setup(
    name="isoloco_kernels",
    version="0.1.0",
    packages=find_packages(include=["isoloco_kernels", "isoloco_kernels.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
)
