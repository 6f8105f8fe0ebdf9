"""Megatron distributed checkpoint -> Hugging Face folder (sharded safetensors, config.json, tokenizer).

    python tools/convert_megatron_to_hf.py --ckpt DIR --out HF [--hf-config-from HF] [--dtype bf16|fp32]
    torchrun --nproc-per-node 4 tools/convert_megatron_to_hf.py --ckpt DIR --out HF --pp 2 --ep 2

Same as `megatron-rl convert megatron-to-hf`; see megatron_rl/commands/convert.py.
"""

import sys

from megatron_rl.commands.convert import main

if __name__ == "__main__":
    sys.exit(main("megatron-to-hf"))
