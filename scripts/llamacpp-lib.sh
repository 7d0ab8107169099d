# Shared by the scripts that compare with llama.cpp: the llama.cpp vendored in the PyPI sdist
# of llama-cpp-python, built once (GGML_NATIVE on) into ~/.cache/ferrite/llamacpp. Sourced,
# not run. `need_llamacpp TARGET...` builds whichever of the targets are missing.
LLAMA_VERSION=0.3.36
LLAMA_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/ferrite/llamacpp"
LLAMA_DIR="$LLAMA_CACHE/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
LLAMA_BIN="$LLAMA_DIR/build/bin"

need_llamacpp() {
  local missing=()
  for t in "$@"; do [ -x "$LLAMA_BIN/$t" ] || missing+=("$t"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ ! -f "$LLAMA_DIR/CMakeLists.txt" ]; then
    mkdir -p "$LLAMA_CACHE"
    (cd "$LLAMA_CACHE" &&
      python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d . &&
      tar xzf "llama_cpp_python-$LLAMA_VERSION.tar.gz")
  fi
  cmake -S "$LLAMA_DIR" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF > /dev/null 2>&1
  cmake --build "$LLAMA_DIR/build" --target "${missing[@]}" -j "$(nproc)" > /dev/null
}
