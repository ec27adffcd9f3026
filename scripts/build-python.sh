#!/usr/bin/env bash
# Builds the Python wheels into dist/: the pure-Python package in python/ with the release
# libstreamalloc.so bundled (it loads libcuda at run time), tagged
# py3-none-manylinux_2_N_<arch>, where 2.N is the newest glibc symbol version the library
# references (read from its ELF version needs), so pip installs a wheel only on its
# architecture with glibc >= 2.N. The version is Cargo's (python/setup.py reads Cargo.toml).
# The x86-64 wheel also carries the torch backend compiled for each torch release of
# python/torch-versions.txt (scripts/build_torch_backends.py downloads those torch wheels'
# headers from PyPI; TORCH_BACKENDS=0 leaves the backend out, to be compiled on first use).
#   bash scripts/build-python.sh            # the wheel of this machine (x86-64)
#   bash scripts/build-python.sh aarch64    # and an aarch64 wheel, cross-compiled; needs
#       rustup target add aarch64-unknown-linux-gnu
#       apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu   (the library has a C++ shim)
# pip fetches setuptools for the build. A wheel installs without a registry:
#   python3 -m pip install --no-index --no-deps dist/streamalloc-*x86_64.whl
set -euo pipefail
cd "$(dirname "$0")/.."

# manylinux tag of a shared library (and of the other binaries given): its architecture and
# the newest GLIBC_2.N any of them needs.
platform_tag() {
  local lib=$1 arch glibc
  case "$(readelf -h "$lib" | sed -n 's/^ *Machine: *//p')" in
    *X86-64*) arch=x86_64 ;;
    *AArch64*) arch=aarch64 ;;
    *) echo "build-python.sh: unknown architecture of $lib" >&2; return 1 ;;
  esac
  glibc=$(readelf -V --wide "$@" | grep -o 'GLIBC_2\.[0-9]*' | cut -d. -f2 | sort -n | tail -1)
  # The oldest manylinux of each architecture: glibc 2.5 (x86-64), 2.17 (aarch64).
  local floor=5; [ "$arch" = aarch64 ] && floor=17
  echo "manylinux_2_$(( glibc > floor ? glibc : floor ))_$arch"
}

# bundle_cli TARGET STRIP: builds the `streamalloc` command for the Rust TARGET (empty: this
# machine's) and strips it into the package (python/streamalloc/bin/), which the console script
# `streamalloc` (streamalloc/_cli.py) runs: pip install gives the CLI without Rust.
bundle_cli() {
  local target=$1 strip=$2 dir=target/release
  if [ -n "$target" ]; then
    CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
      CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
      cargo build --release -p streamalloc-cli --target "$target"
    dir=target/$target/release
  else
    cargo build --release -p streamalloc-cli
  fi
  mkdir -p python/streamalloc/bin
  "$strip" --strip-debug -o python/streamalloc/bin/streamalloc "$dir/streamalloc"
  chmod 755 python/streamalloc/bin/streamalloc
}

# wheel LIB STRIP: strips LIB into the package and builds its wheel into dist/.
wheel() {
  local lib=$1 strip=$2 tag
  "$strip" --strip-debug -o python/streamalloc/libstreamalloc.so "$lib" # symbols kept, debug info not
  tag=$(platform_tag python/streamalloc/libstreamalloc.so python/streamalloc/bin/streamalloc)
  rm -rf python/build python/streamalloc.egg-info
  python3 -m pip wheel -q --no-deps -w dist --config-settings=--build-option=--plat-name="$tag" python/
  rm -rf python/build python/streamalloc.egg-info
}

rm -f dist/streamalloc-*.whl
rm -rf python/streamalloc/_torch_backend/prebuilt # x86-64's, compiled below
for arch in "$@"; do
  case "$arch" in
    aarch64)
      CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
        cargo build --release -p streamalloc-capi --target aarch64-unknown-linux-gnu
      bundle_cli aarch64-unknown-linux-gnu aarch64-linux-gnu-strip
      wheel target/aarch64-unknown-linux-gnu/release/libstreamalloc.so aarch64-linux-gnu-strip ;;
    *) echo "build-python.sh: unknown architecture '$arch' (aarch64 is the one cross-built)" >&2; exit 2 ;;
  esac
done
# The torch backend, compiled for each torch release of python/torch-versions.txt (x86-64 only;
# other architectures compile it on first use). TORCH_BACKENDS=0 leaves it out.
if [ "${TORCH_BACKENDS:-1}" != 0 ]; then
  python3 scripts/build_torch_backends.py
else
  rm -rf python/streamalloc/_torch_backend/prebuilt
fi
# This machine's wheel last, so python/streamalloc/ keeps this machine's library.
cargo build --release -p streamalloc-capi
bundle_cli "" strip
wheel target/release/libstreamalloc.so strip
ls -l dist/streamalloc-*.whl
