#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at ${PRISM_VENV:-.venv} and install
# prism_plugin with the Megatron-core, DeepSpeed and dev extras, pinned by
# constraints/cpu-py311.txt. Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${PRISM_VENV:-.venv}
C=constraints/cpu-py311.txt
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp="$V/.prism-installed"
want="$(cat "$C" pyproject.toml | sha1sum | cut -c1-12)"
# The startup hook (prism_plugin/startup.py): stock DeepSpeed in this environment reads a ds_config's "prism"
# section with no edit to the script. One line in a .pth file, (re)written on every run.
startup_hook() {
  site="$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import prism_plugin.startup" > "$site/prism_plugin_startup.pth"
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  startup_hook
  exit 0
fi
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
P="$V/bin/pip"
"$P" install -q --upgrade "pip>=24"
# 1. torch first, so no later requirement can pull a CUDA build.
"$P" install -q -c "$C" torch "numpy<2.5" "packaging>=24.2"
# 2. megatron-core's wheel declares Python >= 3.12 but runs on 3.11.
"$P" install -q -c "$C" --ignore-requires-python megatron-core
# 3. deepspeed builds from sdist with its ops disabled and keeps our torch; triton for megatron-core.
"$P" install -q -c "$C" deepspeed triton
# 4. the project itself, editable, with every extra this machine can run (not the GPU extra).
"$P" install -q -c "$C" --ignore-requires-python -e ".[megatron,deepspeed,dev,trace,cluster,hf]"
# 5. TransformerEngine's pure-Python layer for virtual GPUs, in a private folder that only virtual-GPU processes
#    put on sys.path (prism_plugin/device/te): no CUDA extension, none of TE's GPU libraries, and not
#    onnxscript (TE's ONNX export, which virtual GPUs refuse: a stand-in module answers TE's import of it).
"$P" install -q -c "$C" --no-deps --upgrade --target "$V/share/prism_plugin/te" transformer-engine
# 6. flash-attn's Python layer beside it, for TE's flash backend on virtual GPUs (--attention-backend flash): built
#    from its sdist with its CUDA build skipped (flash-attn's own switches; FORCE_BUILD skips its download of a
#    prebuilt CUDA wheel). Its kernels are custom operators with fake implementations (prism_plugin/device/te/flash.py).
"$P" install -q -c "$C" "setuptools>=70.1" wheel  # what its setup.py imports, besides torch and packaging
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
  "$P" install -q -c "$C" --no-deps --no-build-isolation --upgrade --target "$V/share/prism_plugin/te" flash-attn
# 7. NVIDIA's emerging-optimizers (megatron-core's Muon) for virtual GPUs, in a private folder beside TE's: it declares
#    Python >= 3.12 and cannot sit in this 3.11 environment's site-packages (prism_plugin/device/gpu_packages.py).
"$P" install -q -c "$C" --no-deps --ignore-requires-python --upgrade --target "$V/share/prism_plugin/gpu-packages" \
  emerging-optimizers
startup_hook
echo "$want" > "$stamp"
