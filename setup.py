"""Installs lingvo_gpipe.

CPU installs take `tensorflow-cpu==2.21.0`. For the GPU build, set the TensorFlow
requirement before installing:

  LINGVO_GPIPE_TF_REQUIREMENT='tensorflow[and-cuda]==2.21.0' pip install -e .
"""

import os

from setuptools import setup

TF_REQUIREMENT = os.environ.get("LINGVO_GPIPE_TF_REQUIREMENT", "tensorflow-cpu==2.21.0")

setup(
    name="lingvo_gpipe",
    version="0.1.0",
    description="GPipe pipeline parallelism for TensorFlow 2, with Lingvo-style params.",
    python_requires=">=3.10",
    packages=[
        "lingvo_gpipe",
        "lingvo_gpipe.core",
        "lingvo_gpipe.inputs",
        "lingvo_gpipe.models",
        "lingvo_gpipe.pipeline",
        "lingvo_gpipe.runtime",
        "lingvo_gpipe.tasks",
        "lingvo_gpipe.tools",
        "lingvo_gpipe_params",
    ],
    # The repository's params/ directory ships as the package lingvo_gpipe_params, and
    # tools/ as lingvo_gpipe.tools, so that installed copies find them too.
    package_dir={"lingvo_gpipe_params": "params", "lingvo_gpipe.tools": "tools"},
    install_requires=[
        TF_REQUIREMENT,
        "tensorflow-datasets>=4.9",
        "absl-py>=2.0",
        "numpy>=1.26",
        "tensorboard>=2.20",
        "sacrebleu>=2.4",  # BLEU of translation evals
        "matplotlib>=3.8",  # the schedule chart in TensorBoard
    ],
    # pytest-xdist: `make test` runs two test processes (most tests wait on subprocesses
    # or trace Python on one core; the 2-core CI machine finishes in ~10 instead of ~15 min).
    extras_require={"test": ["pytest>=8", "pytest-xdist>=3.5", "ruff>=0.5"]},
    entry_points={
        "console_scripts": ["lingvo_gpipe_trainer=lingvo_gpipe.tools.trainer:run"],
    },
)
