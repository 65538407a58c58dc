"""The names of hf_dllm's FP8 weight quantizations (`--quantization` of the command lines, `fp8.fp8_config_for`).

Imports neither torch nor transformers, so that `hf-dllm COMMAND --help` lists them without either
(docs/decisions/cli-startup.md). This file is exported verbatim as Hub remote code.
"""

# The FP8 values of `--quantization` (cli/loading.py), each a `FineGrainedFP8Config` setting: "fp8" transformers'
# default, one scale per 128 x 128 block (the Hub's layout); "fp8-tensor" one scale per matrix, run as row-scaled
# products (faster at many rows; `benchmarks/bench_generate.py --quantization fp8,fp8-tensor`).
FP8_SCHEMES = {"fp8": {}, "fp8-tensor": {"weight_block_size": None}}

# A scheme's name with this suffix quantizes the output head too (`fp8_quantization_config(quantize_head=True)`).
HEAD_SUFFIX = "+head"
FP8_QUANTIZATIONS = (*FP8_SCHEMES, *(scheme + HEAD_SUFFIX for scheme in FP8_SCHEMES))

__all__ = ["FP8_QUANTIZATIONS", "FP8_SCHEMES", "HEAD_SUFFIX"]
