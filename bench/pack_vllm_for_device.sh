#!/usr/bin/env bash
# Pack what `--kernels vllm` / `--scheduler vllm` need on a GPU machine whose image has torch and
# Triton but no vLLM (and whose torch vLLM's compiled extension was not built for): vLLM's Python
# files from the installed wheel (.peer-venv, bench/peer_setup.sh) as .gpu-carry/vllm_py.tgz, and
# Python 3.12 wheels of the packages its import pulls in that the image lacks, in .whl/. Both are
# ignored by git (never commit vLLM's files); carry them (`.whl`, `.gpu-carry`) and start the
# device command with `bash bench/gpu_session.sh vllm` or the unpacking lines in it.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=$(.peer-venv/bin/python -c "import vllm, os; print(os.path.dirname(os.path.dirname(vllm.__file__)))")
mkdir -p .gpu-carry .whl
grep -qx '/.gpu-carry/' .git/info/exclude 2>/dev/null || echo /.gpu-carry/ >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
(cd "$SITE" && find vllm -type f \( -name '*.py' -o -name '*.json' -o -name '*.jinja' \) ! -path '*__pycache__*' \
   | tar -czf - -T - vllm-*.dist-info) > .gpu-carry/vllm_py.tgz
# (found by importing vLLM's kernel modules with every package the device image lacks blocked)
PKGS="pydantic pydantic_core typing-inspection annotated-types cbor2 pyzmq httpx2 httpcore2 truststore
      openai-harmony openai sniffio pybase64 cachetools msgspec xgrammar apache-tvm-ffi fastapi starlette
      opentelemetry-api partial-json-parser llguidance jiter"
for p in $PKGS; do
  v=$(.peer-venv/bin/python -c "import importlib.metadata as m; print(m.version('$p'))")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64 -d .whl "$p==$v"
done
du -sh .gpu-carry .whl
