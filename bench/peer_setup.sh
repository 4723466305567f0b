#!/usr/bin/env bash
# Make .peer-venv: vLLM 0.33 (the issue-2 peer) beside the project's own venv, for
# bench/peer_vllm.py and `hybridsim run --scheduler vllm`. CPU only: torch 2.13 (the project's),
# vLLM without its CUDA kernel dependencies (the scheduler needs none of them), the pure-Python
# packages its scheduler modules import, and hybridsim itself (editable, with its runtime and test
# dependencies: `pytest -m peer` runs here). Downloads ~0.7 GB; not part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PEER_VENV:-.peer-venv}
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet torch==2.13.0 numpy
"$VENV/bin/pip" install --quiet --no-deps vllm==0.33.0
"$VENV/bin/pip" install --quiet packaging regex cachetools psutil requests tqdm blake3 py-cpuinfo \
    "transformers>=5.16.1,<5.21" huggingface_hub tokenizers safetensors pydantic msgspec pyzmq cloudpickle \
    pyyaml einops cbor2 pybase64 prometheus_client orjson aiohttp openai-harmony openai pillow uvloop \
    xgrammar fastapi partial_json_parser llguidance
# hybridsim in process beside vLLM: its dependencies and test dependencies, torch held where it is
TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
"$VENV/bin/pip" install --quiet -e ".[test]" --constraint <(echo "torch==$TORCH")
"$VENV/bin/python" -c "import vllm.v1.core.sched.scheduler, vllm, hybridsim, torch; print('vLLM', vllm.__version__, \
    'and hybridsim', hybridsim.__version__, '(torch', torch.__version__ + ') ready in $VENV')"
