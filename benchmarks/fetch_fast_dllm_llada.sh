#!/usr/bin/env bash
# Copy Fast-dLLM's LLaDA code (NVlabs/Fast-dLLM, llada/) into a git-ignored folder for
# `benchmarks/bench_generate.py --cpu --reference DIR`. Their code is Apache-2.0 and is never committed to hf_dllm.
#
#   benchmarks/fetch_fast_dllm_llada.sh [DEST] [SOURCE]
#
# DEST defaults to .ref/fast_dllm_llada (`.ref/` is git-ignored). SOURCE is a Fast-dLLM checkout or bare git
# directory (read at HEAD); without it the repository is cloned from GitHub into a temporary folder.
# The files: generate.py (generate, generate_with_prefix_cache, generate_with_dual_cache) and the model package
# it imports (model/modeling_llada.py, model/configuration_llada.py, model/__init__.py).
set -euo pipefail

DEST=${1:-.ref/fast_dllm_llada}
SOURCE=${2:-}
FILES=(generate.py model/__init__.py model/configuration_llada.py model/modeling_llada.py)

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

mkdir -p "$DEST/model"
for name in "${FILES[@]}"; do
    "${GIT[@]}" show "HEAD:llada/$name" > "$DEST/$name"
done
echo "NVlabs/Fast-dLLM $COMMIT llada/{$(IFS=,; echo "${FILES[*]}")}" > "$DEST/SOURCE"
echo "copied ${#FILES[@]} files of NVlabs/Fast-dLLM@$COMMIT into $DEST"
