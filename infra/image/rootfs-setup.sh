#!/bin/bash
# Runs INSIDE the chroot (started by build.sh with a clean environment).
# Installs the Python stack into /opt/venv and arranges tritonserver so that
# python-backend models can import it. Expects /tmp/stoker-build/versions.env
# and the torch CPU wheel next to it.
set -euo pipefail
. /tmp/stoker-build/versions.env

py="python${PYTHON_VERSION}"
site="/opt/venv/lib/${py}/site-packages"

echo "[chroot] creating /opt/venv"
"$py" -m venv /opt/venv

pkgs=("/tmp/stoker-build/${TORCH_WHEEL}" "nvidia-pytriton==${PYTRITON_VERSION}" "numpy==${NUMPY_VERSION}"
      "safetensors==${SAFETENSORS_VERSION}" "tokenizers==${TOKENIZERS_VERSION}"
      "transformers==${TRANSFORMERS_VERSION}" "fastapi==${FASTAPI_VERSION}" "starlette==${STARLETTE_VERSION}"
      "uvicorn==${UVICORN_VERSION}")
# The torch wheel is given as a file so pip can never resolve a CUDA build;
# --only-binary keeps sdists (and their build toolchains) out of the image.
# /tmp/stoker-wheels is build.sh's wheelhouse: a rebuild installs from it
# without the network (pip's HTTP cache does not survive the proxy here).
wheels=/tmp/stoker-wheels
pip_install() {
    /opt/venv/bin/pip install --quiet --no-input --only-binary=:all: --no-index \
        --find-links="$wheels" "${pkgs[@]}"
}
if pip_install 2>/dev/null; then
    echo "[chroot] installed torch (local CPU wheel), nvidia-pytriton==${PYTRITON_VERSION}, numpy, safetensors, tokenizers, transformers, fastapi, uvicorn from the wheelhouse"
else
    echo "[chroot] downloading torch's dependencies, nvidia-pytriton==${PYTRITON_VERSION}, numpy, safetensors, tokenizers, transformers==${TRANSFORMERS_VERSION}, fastapi, uvicorn"
    /opt/venv/bin/pip download --quiet --no-input --only-binary=:all: -d "$wheels" "${pkgs[@]}"
    rm -f "$wheels"/torch-*.whl   # the host keeps that one; no second copy in the cache
    echo "[chroot] installing them + torch (local CPU wheel)"
    pip_install
fi

# xgrammar (guided decoding, stoker/runtime/guided.py) goes in without its dependencies: it requires `triton`, the
# GPU kernel compiler (a 285 MB wheel) that it uses only to apply token masks to CUDA logits; on CPU it applies them
# with its own kernel and imports without triton (checked with 0.2.8). Its other requirements (numpy, pydantic via
# fastapi, torch, transformers, typing-extensions) are installed above; apache-tvm-ffi is its FFI layer.
guided=("xgrammar==${XGRAMMAR_VERSION}" "apache-tvm-ffi==${APACHE_TVM_FFI_VERSION}")
guided_install() {
    /opt/venv/bin/pip install --quiet --no-input --only-binary=:all: --no-index --no-deps \
        --find-links="$wheels" "${guided[@]}"
}
if ! guided_install 2>/dev/null; then
    echo "[chroot] downloading xgrammar==${XGRAMMAR_VERSION}, apache-tvm-ffi==${APACHE_TVM_FFI_VERSION} (no dependencies)"
    /opt/venv/bin/pip download --quiet --no-input --only-binary=:all: --no-deps -d "$wheels" "${guided[@]}"
    guided_install
fi

# A CUDA torch would drag nvidia-* runtime wheels in; refuse to ship that.
if /opt/venv/bin/pip list --format=freeze | grep -i '^nvidia-' | grep -v -i '^nvidia-pytriton=='; then
    echo "[chroot] ERROR: CUDA packages were installed" >&2
    exit 1
fi

echo "[chroot] arranging tritonserver ${TRITON_VERSION} + python backend (stub ${PYTHON_VERSION})"
tri="${site}/pytriton/tritonserver"
cp "${tri}/python_backend_stubs/${PYTHON_VERSION}/triton_python_backend_stub" "${tri}/backends/python/"
# Stubs for other Python versions are dead weight in this image.
rm -rf "${tri}/python_backend_stubs"
# /opt/tritonserver/backends is tritonserver's default --backend-directory.
ln -sfn "$tri" /opt/tritonserver

# The stub embeds the system libpython, whose sys.path does not include the
# venv; a .pth file in the system dist-packages adds it for every interpreter
# that uses /usr (the stub and /usr/bin/python3), without PYTHONPATH games.
echo "$site" > "/usr/lib/python3/dist-packages/stoker-venv.pth"

echo "[chroot] verifying the system interpreter (what the stub embeds) sees the venv"
/usr/bin/python3 -c '
import importlib.metadata, torch, numpy, safetensors, tokenizers, transformers, fastapi, uvicorn, xgrammar
print("[chroot] torch", torch.__version__, "numpy", numpy.__version__, "xgrammar", importlib.metadata.version("xgrammar"),
      "safetensors", safetensors.__version__, "tokenizers", tokenizers.__version__,
      "transformers", transformers.__version__, "fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__)'
# --help exits 1 by design; the usage text proves the binary and its libraries load.
usage=$(LD_LIBRARY_PATH="${site}/nvidia_pytriton.libs" /opt/tritonserver/bin/tritonserver --help 2>&1 || true)
grep -q '^Usage: tritonserver' <<<"$usage" || { echo "[chroot] ERROR: tritonserver does not load" >&2; exit 1; }

echo "[chroot] trimming docs, caches, torch C++ tests and headers (no compiler in this image)"
tdir="${site}/torch"
rm -rf "${tdir}/test" "${tdir}/include" "${tdir}"/bin/test_* "${tdir}"/bin/*Test
rm -rf /usr/share/doc/* /usr/share/man/* /usr/share/info/* /usr/share/locale/* \
    /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb \
    /var/cache/debconf/*-old /var/log/*.log /root/.cache /tmp/stoker-build
