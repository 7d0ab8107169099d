# Shared by the scripts that compare with llama.cpp: the llama.cpp vendored in the PyPI sdist
# of llama-cpp-python, built once (GGML_NATIVE on) into ~/.cache/ferrite/llamacpp. Sourced,
# not run. `need_llamacpp TARGET...` builds whichever of the targets are missing;
# `need_llamacpp_vec_dot TARGET...` builds them a second time, into LLAMA_VEC_DOT_BIN, without
# llamafile's sgemm (GGML_LLAMAFILE=OFF): with GGML_CPU_TILED_MM=0 in its environment as
# well, that llama.cpp multiplies batches of every format with its one-row vec_dot
# arithmetic, the one Ferrite reproduces at every batch size.
LLAMA_VERSION=0.3.36
LLAMA_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/ferrite/llamacpp"
LLAMA_DIR="$LLAMA_CACHE/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
LLAMA_BIN="$LLAMA_DIR/build/bin"
LLAMA_VEC_DOT_BIN="$LLAMA_DIR/build-vec_dot/bin"

need_llamacpp() { llamacpp_targets build "" "$@"; }

need_llamacpp_vec_dot() { llamacpp_targets build-vec_dot -DGGML_LLAMAFILE=OFF "$@"; }

# `llamacpp_targets DIR OPTION TARGET...`: builds whichever of the targets DIR lacks, with the
# cmake OPTION (or none if empty) beside the common ones.
llamacpp_targets() {
  local dir="$1" option="$2"; shift 2
  local missing=()
  for t in "$@"; do [ -x "$LLAMA_DIR/$dir/bin/$t" ] || missing+=("$t"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ ! -f "$LLAMA_DIR/CMakeLists.txt" ]; then
    mkdir -p "$LLAMA_CACHE"
    (cd "$LLAMA_CACHE" &&
      python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d . &&
      tar xzf "llama_cpp_python-$LLAMA_VERSION.tar.gz")
  fi
  cmake -S "$LLAMA_DIR" -B "$LLAMA_DIR/$dir" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF ${option:+"$option"} > /dev/null 2>&1
  cmake --build "$LLAMA_DIR/$dir" --target "${missing[@]}" -j "$(nproc)" > /dev/null
}
