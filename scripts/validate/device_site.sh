#!/usr/bin/env bash
# Make .site/: the Python packages the GPU machine lacks, unpacked for PYTHONPATH, small enough to
# travel with the working tree (the device tool carries at most 64 MiB in all; the tracked tree is
# about 14 MiB). The versions are this project's test environment's, so the device runs what CI tests:
# transformers (only the model families gpu_all builds, those peft imports and those its auto
# classes import), peft, bitsandbytes (its CPU and CUDA 13.0 libraries: the machine's torch is cu130),
# datasets, pydantic. Run once here, from the repository root, then name ".site" in the run's carry
# and begin the command with `export PYTHONPATH=$PWD/.site:$PWD` (scripts/validate/gpu_all.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.site/' .git/info/exclude 2>/dev/null || echo /.site/ >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl bitsandbytes==0.50.2 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  transformers==5.23.0 peft==0.21.2
rm -rf .site && mkdir .site
for w in .whl/*.whl; do unzip -q -o "$w" -d .site; done
find .site/bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete
# the families gpu_all builds (llama, olmoe, gemma3 with siglip, qwen3_5, falcon_h1), what peft imports (bloom,
# bart, gpt2) and what transformers' auto classes import (encoder_decoder); the rest is 50 MB the device never reads
keep='^(auto|llama|olmoe|gemma|gemma3|siglip|mistral|qwen2|qwen3_5|falcon_h1|bloom|bart|gpt2|encoder_decoder|__init__\.py)$'
for d in .site/transformers/models/*; do
  basename "$d" | grep -qE "$keep" || rm -rf "$d"
done
find .site -name __pycache__ -prune -exec rm -rf {} +
du -sh .site
