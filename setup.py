from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron-rl",
    version="0.1.0",
    description="RL post-training for Mixture-of-Experts language models on Megatron-Core and SGLang",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    install_requires=[
        # torch: any 2.x from 2.4 on; CPU machines install the CPU build first (see README).
        "torch>=2.4",
        # The CPU compatibility layer is verified on 0.16.1; GPU clusters use 0.15-0.17.
        "megatron-core>=0.15,<0.18",
        "omegaconf>=2.3",
        "numpy",
        "safetensors",
        "transformers>=4.51",
        "tqdm",
        "psutil",
        "pyarrow",
        "aiohttp",
        "matplotlib",  # megatron-rl plot
    ],
    extras_require={
        # sglang: the weight-update protocol of 0.5.9 to 0.5.x (the session of 0.5.21+ is feature-detected);
        # README "Tested versions"
        "gpu": ["transformer-engine[pytorch]", "sglang>=0.5.9,<0.6", "sglang-router"],
        # sglang-router: tests/test_router.py runs the real router (a Rust binary wheel) in front of local engines;
        # pytest-randomly: the fast tier runs in a shuffled order (the seed is in the header; --randomly-seed=N repeats one)
        # pytest-xdist: both tiers run on two workers, a test module per unit (tests/conftest.py)
        # openai: tests/test_gateway.py drives the agent gateway with the real OpenAI client
        # peft: tests/test_lora.py loads the exported RUN_DIR/hf_adapter/ with peft.PeftModel on the base
        "test": [
            "pytest>=8",
            "pytest-randomly>=3.15",
            "pytest-xdist>=3.6",
            "ruff",
            "msgspec",
            "math-verify>=0.9",
            "sglang-router",
            "openai>=1.40",
            "peft>=0.17",
            # tests/test_trackers.py: W&B offline and MLflow's client on a local store, the real packages
            "wandb",
            "mlflow-skinny",
        ],
        # reward.type=math_verify
        "math": ["math-verify>=0.9"],
        # the trackers of logging.backends (tensorboard by default; without its package a warning and no curves)
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        "mlflow": ["mlflow"],
        # model.lora with rollout.lora_sync=adapter: the local engine serves the adapters through peft
        "lora": ["peft>=0.17"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:entry"]},
)
