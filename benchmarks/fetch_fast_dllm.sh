#!/usr/bin/env bash
# Copy Fast-dLLM's reference code (NVlabs/Fast-dLLM) into a git-ignored folder for the benchmarks that compare
# against it. Their code is Apache-2.0 and is never committed to hf_dllm.
#
#   benchmarks/fetch_fast_dllm.sh llada|dream [DEST] [SOURCE]
#
# llada: their llada/ folder for `benchmarks/bench_generate.py --cpu --reference DIR`: generate.py (generate,
#   generate_with_prefix_cache, generate_with_dual_cache) and the model package it imports. DEST defaults to
#   .ref/fast_dllm_llada.
# dream: their dream/model/ folder for `benchmarks/bench_dream.py --reference-code DIR`: the model
#   (modeling_dream.py, which imports generation_utils.py), its config, and generation_utils_block.py, the block /
#   prefix- and dual-cache sampler with the confidence threshold that their Dream evaluation binds as
#   `diffusion_generate` (dream/eval.py). DEST defaults to .ref/fast_dllm_dream.
# `.ref/` is git-ignored. SOURCE is a Fast-dLLM checkout or bare git directory (read at HEAD); without it the
# repository is cloned from GitHub into a temporary folder.
set -euo pipefail

case "${1:-}" in
    llada)
        FOLDER=llada
        FILES=(generate.py model/__init__.py model/configuration_llada.py model/modeling_llada.py)
        ;;
    dream)
        FOLDER=dream/model
        FILES=(__init__.py configuration_dream.py modeling_dream.py generation_utils.py generation_utils_block.py)
        ;;
    *)
        echo "usage: $0 llada|dream [DEST] [SOURCE]" >&2
        exit 2
        ;;
esac
DEST=${2:-.ref/fast_dllm_$1}
SOURCE=${3:-}

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

for name in "${FILES[@]}"; do
    mkdir -p "$(dirname "$DEST/$name")"
    "${GIT[@]}" show "HEAD:$FOLDER/$name" > "$DEST/$name"
done
echo "NVlabs/Fast-dLLM $COMMIT $FOLDER/{$(IFS=,; echo "${FILES[*]}")}" > "$DEST/SOURCE"
echo "copied ${#FILES[@]} files of NVlabs/Fast-dLLM@$COMMIT into $DEST"
