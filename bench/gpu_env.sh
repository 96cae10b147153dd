# Sourced by bench/gpu_check.sh and bench/gpu_probe.sh on the GPU machine, from the repository
# root: NVRTC and cuBLAS (CUDA 13) on the library path wherever the machine has them, the
# prepared binary in place, and the checkout where the test binaries (built elsewhere) look.
nvidia-smi -L
LIBS=$(find /usr/local /usr/lib /opt -name 'libnvrtc.so.13*' -o -name 'libcublas.so.13*' 2>/dev/null \
  | grep -v -e builtins -e stub | xargs -r -n1 dirname | sort -u | paste -sd:)
echo "libraries: $LIBS"
export LD_LIBRARY_PATH=$LIBS:${LD_LIBRARY_PATH:-}
mkdir -p target/release && cp .gpu/tumble target/release/tumble
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
