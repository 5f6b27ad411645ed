"""Install llamagym: `pip install -e .` (see scripts/bootstrap.py for the pinned, one-command set-up)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"', (here / "llamagym" / "__init__.py").read_text()).group(1)

setup(
    name="llamagym",
    version=version,
    description="Fine-tune LLM agents with online reinforcement learning in any Gymnasium environment",
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    packages=find_packages(include=["llamagym", "llamagym.*"]),
    python_requires=">=3.11",  # transformers 5 and numpy 2.4 (the tested set) need 3.11
    install_requires=[
        "torch>=2.3",
        "transformers>=4.51",
        "peft>=0.14",
        "gymnasium>=1.0",
        "accelerate>=1.0",
        "gguf>=0.10",
        "tqdm>=4.60",
        "numpy>=1.24",
    ],
    extras_require={
        "textworld": ["textworld>=1.6"],
        "quantization": ["bitsandbytes>=0.43; platform_system == 'Linux'"],
        "wandb": ["wandb>=0.17"],
        "plots": ["matplotlib>=3.7"],
        "trl": ["trl==1.16.0"],  # llamagym.integrations.trl: rollout_func is experimental in TRL, one tested release
        "dev": ["pytest>=8", "ruff>=0.5"],
    },
    entry_points={"console_scripts": ["llamagym=llamagym.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: MIT License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
