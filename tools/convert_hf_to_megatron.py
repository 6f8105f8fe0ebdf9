"""Hugging Face folder -> Megatron distributed checkpoint (loads under any TP/PP/EP layout).

    python tools/convert_hf_to_megatron.py --hf-dir HF --out DIR [--tp N --pp N --ep N --etp N] [--dtype bf16|fp32]
    torchrun --nproc-per-node 8 tools/convert_hf_to_megatron.py --hf-dir HF --out DIR --tp 2 --ep 4

Same as `megatron-rl convert hf-to-megatron`; see megatron_rl/commands/convert.py.
"""

import sys

from megatron_rl.commands.convert import main

if __name__ == "__main__":
    sys.exit(main("hf-to-megatron"))
