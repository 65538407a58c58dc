#!/usr/bin/env bash
# Copy Fast-dLLM's Dream code (NVlabs/Fast-dLLM, dream/model/) into a git-ignored folder for
# benchmarks/bench_dream.py --reference-code. Their code is Apache-2.0 and is never committed to hf_dllm.
#
#   benchmarks/fetch_fast_dllm_dream.sh [DEST] [SOURCE]
#
# DEST defaults to .ref/fast_dllm_dream (`.ref/` is git-ignored). SOURCE is a Fast-dLLM checkout or bare git
# directory (read at HEAD); without it the repository is cloned from GitHub into a temporary folder.
# The files: the model (modeling_dream.py, which imports generation_utils.py), its config, and
# generation_utils_block.py, the block / prefix- and dual-cache sampler with the confidence threshold that
# Fast-dLLM's Dream evaluation binds as `diffusion_generate` (dream/eval.py).
set -euo pipefail

DEST=${1:-.ref/fast_dllm_dream}
SOURCE=${2:-}
FILES=(__init__.py configuration_dream.py modeling_dream.py generation_utils.py generation_utils_block.py)

if [[ -z "$SOURCE" ]]; then
    SOURCE=$(mktemp -d)
    trap 'rm -rf "$SOURCE"' EXIT
    git clone --quiet --depth 1 https://github.com/NVlabs/Fast-dLLM.git "$SOURCE"
fi
if git --git-dir="$SOURCE" rev-parse --verify --quiet HEAD >/dev/null 2>&1; then
    GIT=(git --git-dir="$SOURCE")          # a bare git directory
else
    GIT=(git -C "$SOURCE")                 # a checkout
fi
COMMIT=$("${GIT[@]}" rev-parse HEAD)

mkdir -p "$DEST"
for name in "${FILES[@]}"; do
    "${GIT[@]}" show "HEAD:dream/model/$name" > "$DEST/$name"
done
echo "NVlabs/Fast-dLLM $COMMIT dream/model/{$(IFS=,; echo "${FILES[*]}")}" > "$DEST/SOURCE"
echo "copied ${#FILES[@]} files of NVlabs/Fast-dLLM@$COMMIT into $DEST"
